"""The experiment-tracker runs a training script has open, as rank 0 tells the
aggregator (docs/trackers.md, "Which run the figures go to").

The aggregator logs TraceML's figures into the user's own run when there is one:

- **MLflow**: the active run (``mlflow.start_run()``, HF's ``MLflowCallback``,
  Lightning's ``MLFlowLogger``...): ``run_id``, ``tracking_uri``. MLflow keeps the
  active run per thread; it is read, from the sampler thread, through MLflow's own
  view of every thread's runs (the training thread's first).
- **W&B**: ``wandb.run``: ``id``, ``project``, ``entity``, ``mode``, ``dir``.
- **TensorBoard**: ``log_dir``, the folder of the last ``SummaryWriter`` the process
  made (``torch.utils.tensorboard``, as HF's ``TensorBoardCallback`` and Lightning's
  ``TensorBoardLogger`` use, or ``tensorboardX``): each ``SummaryWriter`` notes its
  folder as it is made (:func:`watch_summary_writers`, through the process's one
  import hook, ``traceml_ai._after_import``).

Only modules the script imported are read (``sys.modules``): nothing here imports a
tracker library. A run seen once stays the one reported after it ends (HF ends its
MLflow run when training ends; TraceML's last point and summary still belong there).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from traceml_ai._after_import import when_imported

__all__ = ["TrackerRuns", "watch_summary_writers"]

_WRITER_MODULES = {
    "torch.utils.tensorboard.writer": "log_dir",
    "tensorboardX.writer": "logdir",
}
"""The modules of the ``SummaryWriter``s whose folder is noted, and the attribute that
holds it."""

_lock = threading.Lock()
_log_dirs: list[str] = []
"""Folders of the ``SummaryWriter``s made in this process, oldest first."""
_watching = False
_KEEP_LOG_DIRS = 8
_made_before: list[tuple[type, str]] = []
"""``SummaryWriter`` classes imported before watching began (with their folder
attribute): writers made before then are looked for once (:func:`_writers_made_before`)."""


def _note(folder: object) -> None:
    if isinstance(folder, str) and folder:
        with _lock:
            _log_dirs.append(os.path.abspath(folder))
            del _log_dirs[:-_KEEP_LOG_DIRS]  # a writer per epoch must not grow this


def _note_writers(module: types.ModuleType, attribute: str) -> type | None:
    """Wrap ``module.SummaryWriter.__init__`` to note each writer's folder; the class."""
    cls = getattr(module, "SummaryWriter", None)
    init = getattr(cls, "__init__", None)
    if not isinstance(cls, type) or init is None or getattr(init, "_traceml_noted", False):
        return None

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        with contextlib.suppress(Exception):
            _note(getattr(self, attribute, None))

    __init__._traceml_noted = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]
    return cls


def watch_summary_writers() -> None:
    """Note the folder of every ``SummaryWriter`` made from now on in this process
    (once per process; a writer module already imported is wrapped now, and its
    writers made before are looked for once, :func:`_writers_made_before`)."""
    global _watching
    with _lock:
        if _watching:
            return
        _watching = True
    for name, attribute in _WRITER_MODULES.items():
        if name in sys.modules:
            cls = _note_writers(sys.modules[name], attribute)
            if cls is not None:
                _made_before.append((cls, attribute))
        else:
            when_imported(name, functools.partial(_note_writers, attribute=attribute))


def _writers_made_before() -> None:
    """Once, on the sampler thread: the folders of writers made before watching began
    (a script that made its logger before TraceML started, as Lightning does before
    its callbacks' ``on_train_start``). One walk of the collector's objects."""
    with _lock:
        classes = tuple(_made_before)
        _made_before.clear()
    if not classes:
        return
    import gc

    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: that reads __class__, which may warn or raise
        for cls, attribute in classes:
            if issubclass(kind, cls):
                _note(getattr(obj, attribute, None))


def _local_uri(uri: str) -> str:
    """A tracking URI the aggregator can use from another folder: a local path made
    absolute (the aggregator's working directory need not be the script's)."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///") :])
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return "file:" + os.path.abspath(uri[len("file:") :])
    if "://" in uri or uri.startswith("file:") or uri.startswith("databricks"):
        return uri
    return os.path.abspath(uri)


def _mlflow_run() -> dict[str, str] | None:
    fluent = sys.modules.get("mlflow.tracking.fluent")
    if fluent is None:
        return None
    stacks = getattr(fluent, "_active_run_stack", None)
    every = getattr(stacks, "get_all_thread_values", None)
    if every is not None:
        by_thread: dict[int, Any] = every()
        main = threading.main_thread().ident
        order = sorted(by_thread, key=lambda ident: ident != main)
        runs = [by_thread[ident][-1] for ident in order if by_thread[ident]]
    elif isinstance(stacks, list):  # MLflow before its per-thread runs
        runs = stacks[-1:]
    else:
        return None
    if not runs:
        return None
    run_id = runs[0].info.run_id
    mlflow = sys.modules.get("mlflow")
    get_uri: Callable[[], str] | None = getattr(mlflow, "get_tracking_uri", None)
    uri = _local_uri(str(get_uri())) if get_uri is not None else ""
    return {"run_id": str(run_id), "tracking_uri": uri}


def _wandb_run() -> dict[str, str] | None:
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is None:
        return None
    settings = getattr(run, "settings", None)
    mode = str(getattr(settings, "mode", "") or "")
    if mode == "disabled" or getattr(run, "disabled", False):
        return None
    return {
        "id": str(run.id),
        "project": str(getattr(run, "project", "") or ""),
        "entity": str(getattr(run, "entity", "") or ""),
        "mode": mode,
        "dir": os.path.abspath(root) if (root := getattr(settings, "root_dir", "")) else "",
    }


def _tensorboard_run() -> dict[str, str] | None:
    _writers_made_before()
    with _lock:
        return {"log_dir": _log_dirs[-1]} if _log_dirs else None


_FINDERS: dict[str, Callable[[], dict[str, str] | None]] = {
    "mlflow": _mlflow_run,
    "wandb": _wandb_run,
    "tensorboard": _tensorboard_run,
}


class TrackerRuns:
    """The tracker runs seen so far in this process: each tracker's latest (a run that
    ended stays until another one opens)."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, str]] = {}

    def look(self) -> bool:
        """Look for open runs; whether :attr:`runs` changed. A tracker library that
        fails to answer is skipped (its run is looked for again next time)."""
        changed = False
        for name, find in _FINDERS.items():
            try:
                found = find()
            except Exception:
                continue
            if found is not None and self.runs.get(name) != found:
                self.runs[name] = found
                changed = True
        return changed
