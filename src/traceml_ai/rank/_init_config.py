"""TraceML 0.5.0's ``init`` arguments: the config object, modes, and the warn-once notices.

Scripts written for the published TraceML (traceml-ai 0.5.0) call ``init`` with its
keywords and read the config it returns; this module gives both the same meaning
here. A keyword whose feature this project does not have is accepted with one
``traceml:`` warning, never an exception (docs/compat-0.5.md).
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

import attrs

from traceml_ai import _environ

ENV_DISABLED = _environ.DISABLED
ENV_ON_MISSING_AGGREGATOR = _environ.ON_MISSING_AGGREGATOR
ENV_TRACE_MAX_STEPS = _environ.TRACE_MAX_STEPS

MODES = ("auto", "manual", "selective", "off")
"""``custom`` is accepted too: 0.5.0's alias of ``selective``."""

UI_MODES = ("summary", "cli", "dashboard")


class TraceMLWarning(RuntimeWarning):
    """Category of every warning the rank SDK emits (filterable by users)."""


_warned: set[str] = set()
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Packages whose frames lie between the user's line and TraceML's: torch (a hooked
# call) and the frameworks that call TraceML's hooks (a callback run by
# ``trainer.fit``). Lightning also prints a warning that names one of its own files
# without its category.
_CALLERS = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "transformers",
            "accelerate")  # fmt: skip


def _library_dirs() -> tuple[str, ...]:
    dirs = [_PACKAGE_DIR]
    for name in _CALLERS:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if isinstance(path, str):
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside traceml_ai
    and the libraries that call into it (the user's line); with no such frame, at the
    first outside traceml_ai."""
    skip = _library_dirs()
    frame: FrameType | None = sys._getframe(1)
    level = 1
    outside_traceml: int | None = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if outside_traceml is None and not filename.startswith(_PACKAGE_DIR):
            outside_traceml = level
        if not filename.startswith(skip):
            return level
        frame = frame.f_back
        level += 1
    return outside_traceml if outside_traceml is not None else level


def warn_once(key: str, message: str, stacklevel: int | None = None) -> None:
    """Warn with ``message`` (a :class:`TraceMLWarning`) the first time ``key`` is seen,
    blaming the frame ``stacklevel`` levels above the caller (default: the user's line
    that called into TraceML)."""
    if key in _warned:
        return
    _warned.add(key)
    # Blame the user's line (init/trace_step call or the hooked torch call), not ours.
    level = _user_stacklevel() if stacklevel is None else stacklevel + 1
    warnings.warn(message, TraceMLWarning, stacklevel=level)


def forget_warnings() -> None:
    """Every warning may show again (tests)."""
    _warned.clear()


@attrs.frozen(kw_only=True)
class TraceMLInitConfig:
    """What ``traceml.init()`` set up, as TraceML 0.5.0 returns it.

    ``mode`` is ``auto``, ``manual``, ``selective`` or (this project's own) ``off``;
    each ``patch_*`` says whether that phase is timed automatically (the rest only
    through the ``wrap_*`` helpers). The optimizer step is timed automatically in
    ``auto`` mode only, as in 0.5.0. ``disabled`` is true when TraceML does nothing
    in this process (``disabled=True``, ``TRACEML_DISABLED=1``, ``mode="off"``, or no
    aggregator to send to).
    """

    mode: str
    patch_dataloader: bool
    patch_forward: bool
    patch_backward: bool
    patch_h2d: bool
    source: str = "user"
    disabled: bool = False

    @property
    def patch_optimizer(self) -> bool:
        """Whether ``optimizer.step()`` is timed without ``wrap_optimizer``."""
        return self.mode == "auto" and not self.disabled

    def same_effective_configuration(self, other: TraceMLInitConfig) -> bool:
        """Whether ``other`` sets up the same instrumentation (``source`` aside)."""
        return attrs.evolve(self, source=other.source) == other


def disabled_config(mode: str = "manual", source: str = "user") -> TraceMLInitConfig:
    """The config of a process where TraceML does nothing."""
    return TraceMLInitConfig(
        mode=mode,
        patch_dataloader=False,
        patch_forward=False,
        patch_backward=False,
        patch_h2d=False,
        source=source,
        disabled=True,
    )


def env_disabled() -> bool:
    """``TRACEML_DISABLED=1`` (or true/yes/on) turns TraceML off in this process."""
    return os.environ.get(ENV_DISABLED, "").strip().lower() in ("1", "true", "yes", "on")


def build_config(
    mode: str,
    *,
    patch_dataloader: bool | None,
    patch_forward: bool | None,
    patch_backward: bool | None,
    patch_h2d: bool | None,
) -> TraceMLInitConfig:
    """Validate ``mode`` and the ``patch_*`` choices as 0.5.0 does; ``ValueError`` if bad."""
    if not isinstance(mode, str):
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    canonical = mode.strip().lower()
    if canonical == "custom":
        canonical = "selective"
    if canonical not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    choices = (patch_dataloader, patch_forward, patch_backward, patch_h2d)
    given = any(c is not None for c in choices)
    if given and canonical != "selective":
        raise ValueError(
            "patch_dataloader, patch_forward, patch_backward and patch_h2d may only be "
            f"given with mode='selective'; got mode={canonical!r}"
        )
    if canonical == "off":
        return disabled_config("off")
    if canonical in ("auto", "manual"):
        on = canonical == "auto"
        return TraceMLInitConfig(
            mode=canonical,
            patch_dataloader=on,
            patch_forward=on,
            patch_backward=on,
            patch_h2d=on,
        )
    dl, fwd, bwd, h2d = (bool(c) for c in choices)
    if not (dl or fwd or bwd or h2d):
        raise ValueError(
            "mode='selective' needs at least one patch_* set to True; "
            "use mode='manual' for no automatic timing"
        )
    return TraceMLInitConfig(
        mode="selective",
        patch_dataloader=dl,
        patch_forward=fwd,
        patch_backward=bwd,
        patch_h2d=h2d,
    )


def resolve_on_missing_aggregator(value: str | None) -> str:
    """``warn`` or ``raise``: the argument, else ``TRACEML_ON_MISSING_AGGREGATOR``, else warn."""
    raw = value if value is not None else os.environ.get(ENV_ON_MISSING_AGGREGATOR, "")
    text = str(raw).strip().lower() or "warn"
    if text not in ("warn", "raise"):
        raise ValueError(f"on_missing_aggregator must be 'warn' or 'raise'; got {raw!r}")
    return text


def trace_max_steps_from_env() -> int | None:
    """``TRACEML_TRACE_MAX_STEPS`` (set by ``traceml run --trace-max-steps``); None if unset."""
    raw = os.environ.get(ENV_TRACE_MAX_STEPS, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        warn_once(
            "trace_max_steps",
            f"traceml: {ENV_TRACE_MAX_STEPS}={raw!r} is not a whole number >= 0; "
            "every step is recorded",
        )
        return None
    return value


def notice_unsupported(
    *,
    ui_mode: str | None,
    logs_dir: str | None,
    enable_logging: bool | None,
    session_id: str | None,
) -> None:
    """One warning per 0.5.0 keyword that has no effect here (docs/compat-0.5.md)."""
    mode = str(ui_mode).strip().lower() if ui_mode is not None else None
    if mode == "dashboard":
        warn_once(
            "ui_mode",
            f"traceml: init(ui_mode={ui_mode!r}) is ignored: the live dashboard is served by "
            "the aggregator; start the run with `traceml run --mode dashboard`",
        )
    elif mode is not None and mode != "summary":
        warn_once(
            "ui_mode",
            f"traceml: init(ui_mode={ui_mode!r}) is ignored: there is no terminal view during "
            "the run; traceml.summary() gives the run's figures",
        )
    if logs_dir is not None:
        warn_once(
            "logs_dir",
            f"traceml: init(logs_dir={logs_dir!r}) is ignored: the run folder is set by "
            "`traceml run --logs-dir`",
        )
    if enable_logging:
        warn_once(
            "enable_logging",
            "traceml: init(enable_logging=True) is ignored: TraceML writes no log files; "
            "its messages go to stderr",
        )
    if session_id is not None:
        warn_once(
            "session_id",
            f"traceml: init(session_id={session_id!r}) is ignored: the run name is set by "
            "`traceml run --run-name` (or --session-id)",
        )


def reset_peak_choice(keyword: bool | None) -> bool:
    """``init(reset_peak_memory=...)``, else ``TRACEML_RESET_PEAK_MEMORY`` (0/false/no/off:
    keep CUDA's peak-memory counters)."""
    if keyword is not None:
        return bool(keyword)
    raw = os.environ.get(_environ.RESET_PEAK_MEMORY, "").strip().lower()
    return raw not in ("0", "false", "no", "off")
