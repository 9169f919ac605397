"""The Weights & Biases tracker (the ``wandb`` extra).

Which run the figures go to:

- **No run of the training script's** (``user_run`` is None, or its mode is
  ``disabled``): a run of TraceML's own, named after the TraceML run, chosen by W&B's
  standard settings exactly as the training script's ``wandb.init()`` would be
  (``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_MODE``, ``WANDB_DIR``,
  ``WANDB_API_KEY``, ``wandb offline``'s settings file ...), in project
  :data:`DEFAULT_PROJECT` when none is set; its files go where W&B puts them
  (``WANDB_DIR``, else ``./wandb`` under the aggregator's working directory, which
  under ``traceml run`` is the directory the command was started in).
- **The training script's run, online or shared**: TraceML writes into that same run
  as a second writer, the way W&B documents for several processes logging to one run
  (``mode="shared"`` with the run's id, ``x_primary=False``, its own ``x_label``, and
  ``x_update_finish_state=False`` so that only the script ends the run).
- **The training script's run, offline**: a shared writer needs the server, which an
  offline run never reaches; TraceML opens an offline run of its own instead, in the
  same project and ``wandb`` folder (one ``wandb sync`` uploads both), its config
  naming the script's run (:data:`USER_RUN_KEY`).

Every run TraceML writes carries the TraceML run folder in its config
(:data:`RUN_DIR_KEY`). TraceML's figures are plotted against their own step metric,
``traceml/step`` (the training step of the point), so that in the script's run they
never collide with the script's own ``_step``.

The terminal (the aggregator's stderr) and the launcher's event pipe (its stdout) see
nothing of W&B's: the runs are silent and capture no console output, and a run that
needs a login without an API key fails at once, as one ``traceml: wandb:`` line,
instead of asking for a key. Unless the user set them, opening a run gives up after
:data:`CLIENT_DEFAULTS`' ``WANDB_INIT_TIMEOUT`` and finishing one after its
``WANDB_FINISH_TIMEOUT`` (what was not uploaded stays on disk for ``wandb sync``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import secrets
import string
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from traceml_ai.monitor.tracker_metrics import SUMMARY_ARTIFACT

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

    from traceml_ai.monitor._sink import RunInfo

__all__ = [
    "CLIENT_DEFAULTS",
    "DEFAULT_PROJECT",
    "LABEL",
    "RUN_DIR_KEY",
    "STEP_METRIC",
    "SUMMARY_ARTIFACT_TYPE",
    "USER_RUN_KEY",
    "WandbTracker",
    "open_wandb",
]

DEFAULT_PROJECT = "traceml"
"""The project of TraceML's own run when ``WANDB_PROJECT`` (or a settings file) names none."""

RUN_DIR_KEY = "traceml.run_dir"
"""The config key that names the TraceML run folder."""

USER_RUN_KEY = "traceml.user_run_id"
"""The config key of TraceML's own run that names the training script's offline run."""

LABEL = "traceml"
"""TraceML's ``x_label`` as a writer of the training script's run (W&B tells writers
apart by it)."""

STEP_METRIC = "traceml/step"
"""The step metric of every ``traceml/`` figure: the training step of the point."""

SUMMARY_ARTIFACT_TYPE = "traceml-summary"

CLIENT_DEFAULTS: Mapping[str, str] = {
    "WANDB_INIT_TIMEOUT": "30",
    "WANDB_FINISH_TIMEOUT": "30",
}
"""W&B's settings the aggregator sets when the user has not: W&B waits 90 s for a run
to open and without end for one to finish by default."""

_QUIET: Mapping[str, object] = {
    "silent": True,
    "console": "off",  # captures nothing: the aggregator's stdout is the launcher's pipe
    # The aggregator's machine and process are not what a training run's charts are about.
    "x_disable_stats": True,
    "x_disable_machine_info": True,
    "save_code": False,
    "x_save_requirements": False,
}
"""Settings of every run TraceML opens."""

_ID_CHARS = string.ascii_lowercase + string.digits


def _settings(**values: object) -> dict[str, Any]:
    """The settings of :data:`_QUIET` and ``values`` (for ``wandb.init``), leaving out a
    private (``x_``) setting this W&B version does not have."""
    import wandb

    known = wandb.Settings.model_fields
    return {k: v for k, v in {**_QUIET, **values}.items() if k in known}


def _need_login(mode: str) -> None:
    """Fail, instead of W&B asking for an API key on the terminal, when a run that
    reaches the server has none."""
    import wandb

    if mode in ("offline", "disabled", "dryrun"):
        return
    # W&B before 0.30 has no ``prompt``: it asks only when stdin and stdout are both
    # terminals, and the aggregator's stdout is the launcher's pipe; wandb.init then
    # fails at once for want of a key (a UsageError, the one line).
    if "prompt" not in inspect.signature(wandb.login).parameters:
        return
    if not wandb.login(prompt=False, verify=False):
        raise RuntimeError(
            "no W&B API key (set WANDB_API_KEY or run `wandb login`; WANDB_MODE=offline "
            "keeps the run on disk)"
        )


def _new_id() -> str:
    """A run id of our own: ``WANDB_RUN_ID``, when set, is the training script's."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(8))


class WandbTracker:
    """One W&B run TraceML logs into (see the module's docstring)."""

    def __init__(self, run: RunInfo, user_run: Mapping[str, str] | None) -> None:
        try:
            self._open(run, user_run)
        except BaseException:
            import wandb

            # W&B's service process stays up after a failed open: not for the rest of
            # the run.
            with contextlib.suppress(Exception):
                wandb.teardown()
            raise

    def _open(self, run: RunInfo, user_run: Mapping[str, str] | None) -> None:
        for key, value in CLIENT_DEFAULTS.items():
            os.environ.setdefault(key, value)
        # W&B reads it when its session starts (the first login or run), before any
        # run's own settings apply: its login lines and warnings go to its log instead.
        os.environ["WANDB_SILENT"] = "true"
        import wandb

        self.joined = False
        """Whether the figures go into the training script's own run."""
        self.notice: str | None = None
        """A line for the user about the run that opened (its files not where asked)."""
        config: dict[str, object] = {RUN_DIR_KEY: str(run.run_dir)}
        mode = (user_run or {}).get("mode", "disabled")
        folder: str | None = None  # where the run's files are asked to go (None: W&B's choice)
        if user_run is not None and mode in ("online", "shared"):
            _need_login("online")
            self.joined = True
            folder = user_run.get("dir") or None
            self._run: Run = wandb.init(
                id=user_run["id"],
                project=user_run.get("project") or None,
                entity=user_run.get("entity") or None,
                dir=folder,
                config=config,
                settings=_settings(
                    mode="shared", x_primary=False, x_label=LABEL, x_update_finish_state=False
                ),
            )
        elif user_run is not None and mode in ("offline", "dryrun"):
            config[USER_RUN_KEY] = user_run["id"]
            folder = user_run.get("dir") or None
            self._run = wandb.init(
                id=_new_id(),
                name=run.run_name,
                project=user_run.get("project") or DEFAULT_PROJECT,
                entity=user_run.get("entity") or None,
                dir=folder,
                config=config,
                resume="never",
                settings=_settings(mode="offline"),
            )
        else:
            # W&B's own resolution of the mode (WANDB_MODE, `wandb offline`'s file ...).
            _need_login(wandb.setup().settings.mode)
            self._run = wandb.init(
                id=_new_id(),
                name=run.run_name,
                project=None if _project_set() else DEFAULT_PROJECT,
                config=config,
                resume="never",
                settings=_settings(),
            )
        self._run.define_metric(STEP_METRIC, hidden=True)
        self._run.define_metric("traceml/*", step_metric=STEP_METRIC)
        with contextlib.suppress(Exception):  # a line about the run, never its failure
            self.notice = _moved(folder, str(self._run.settings.root_dir), self.run_dir)

    @property
    def run_id(self) -> str:
        return str(self._run.id)

    @property
    def run_dir(self) -> str:
        """The local folder of the run's files (``.../wandb/<run>-<id>``)."""
        return str(self._run.settings.sync_dir)

    def log(self, figures: Mapping[str, float], step: int) -> None:
        point: dict[str, Any] = {**figures, STEP_METRIC: step}
        if self.joined:
            # The script's run counts its own steps: TraceML's are in STEP_METRIC.
            self._run.log(point)
        else:
            self._run.log(point, step=step)

    def log_summary(self, fields: Mapping[str, float | str], summary_json: bytes) -> None:
        import wandb

        self._run.summary.update(dict(fields))
        artifact = wandb.Artifact(name=f"traceml-summary-{self.run_id}", type=SUMMARY_ARTIFACT_TYPE)
        with artifact.new_file(SUMMARY_ARTIFACT, mode="wb") as file:
            file.write(summary_json)
        self._run.log_artifact(artifact)

    def close(self) -> None:
        import wandb

        self._run.finish()
        # Ends W&B's service process now, rather than in its exit hook: nothing of
        # W&B's outlives the run.
        wandb.teardown()


def _moved(folder: str | None, root: str, run_dir: str) -> str | None:
    """The line that says W&B put the run's files elsewhere than asked: W&B puts them
    in the system's temporary folder when the folder asked for (``folder``, the
    script's; else ``WANDB_DIR``, a settings file's or the working directory) cannot be
    made or written, and says so only in its own output, which is off. None when
    ``root``, the run's folder, is the one asked for."""
    import wandb

    asked = folder or str(wandb.setup().settings.root_dir or "")
    if not asked or os.path.abspath(asked) == os.path.abspath(root):
        return None
    if root != tempfile.gettempdir():
        return None  # not W&B's fallback: a folder W&B chose itself
    if folder is not None:
        what = f"the training script's W&B folder {asked!r}"
    elif os.environ.get("WANDB_DIR"):
        what = f"WANDB_DIR {asked!r}"
    else:
        what = repr(asked)
    return f"W&B cannot write {what}: the run's files are in {run_dir!r}"


def _project_set() -> bool:
    """Whether W&B's settings (``WANDB_PROJECT``, a settings file) name a project."""
    import wandb

    return bool(wandb.setup().settings.project)


def open_wandb(run: RunInfo, user_run: Mapping[str, str] | None = None) -> WandbTracker:
    return WandbTracker(run, user_run)
