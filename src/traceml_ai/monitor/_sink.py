"""What every live view shares: a sink's contract, its start failure, the run it serves.

Light and free of the other monitor modules, so that the sinks (``prometheus``,
``otlp``, the trackers, the dashboard), their factories and the service that starts
them all depend on it and never on each other.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import attrs

if TYPE_CHECKING:
    from traceml_ai.monitor._state import StepSeen

__all__ = ["LiveSink", "RunInfo", "SinkStartError", "extra_required", "report_to_stderr"]


class SinkStartError(Exception):
    """A sink could not start; the message is the one line the user sees."""


@attrs.frozen(kw_only=True)
class RunInfo:
    """What the live views know of the run itself."""

    run_dir: Path
    run_name: str
    host: str


class LiveSink(Protocol):
    """One place the live figures go (Prometheus, OTLP, the dashboard, a tracker)."""

    name: str
    """Short name for messages and loss counts (``prometheus``, ``otlp``, ``dashboard``)."""

    def on_steps(self, steps: Sequence[StepSeen]) -> None:
        """New steps (feed thread): must return quickly and never block."""

    def close(self, timeout_s: float) -> Mapping[str, int]:
        """Flush and stop within ``timeout_s``; returns what was lost, by name (empty
        when nothing was)."""
        ...


def report_to_stderr(line: str) -> None:
    """The default place of the live views' one-line notices."""
    with contextlib.suppress(Exception):
        print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def extra_required(extra: str) -> Iterator[None]:
    """Around a sink's imports: a library that cannot be imported becomes the one line
    that names the extra to install (a :class:`SinkStartError`). A module not found
    (``ModuleNotFoundError`` with its name) is said as not installed; any other
    ``ImportError`` (one that names no module, or a name a module does not have) as
    the error itself, on one line."""
    try:
        yield
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            why = f"{exc.name} is not installed"
        else:
            text = " ".join(str(exc).split())
            text = text if len(text) <= 200 else text[:197] + "..."
            why = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        raise SinkStartError(
            f"needs the '{extra}' extra ({why}): pip install 'traceml-ai[{extra}]'"
        ) from None
