"""``traceml summary --plot``: step time per rank over steps and the phase breakdown.

matplotlib is optional (the ``plot`` extra) and imported only here, with the Agg
backend, so the plot works without a display.
"""

from __future__ import annotations

import os
from typing import Any

from traceml_ai.analysis._figures import step_series
from traceml_ai.analysis._model import RunSummary
from traceml_ai.analysis._summarize import summarize_run

_MAX_LABELLED_RANKS = 16
"""Above this many ranks the legend would hide the plot; the title says the count."""


class PlotUnavailable(Exception):
    """The plot cannot be drawn (no matplotlib, no step times, a format matplotlib
    cannot write); one line of text."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'traceml-ai[plot]'") from None
    return plt


def plot_target(out: str | os.PathLike[str]) -> tuple[str, str]:
    """(the path the image will have, its format) for ``--plot OUT``.

    The format is the name's suffix (``.png``, ``.svg``, ``.pdf``...). A name without
    one gets ``.png`` added, as matplotlib itself would do, so that the path said is
    the path written. A suffix matplotlib cannot write raises :class:`PlotUnavailable`
    before anything is read or drawn.
    """
    _pyplot()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    name = os.fspath(out)
    base, ext = os.path.splitext(name)
    fmt = ext[1:].lower()
    if not fmt:
        return (base if ext == "." else name) + ".png", "png"
    supported = sorted(FigureCanvasAgg.get_supported_filetypes())
    if fmt not in supported:
        raise PlotUnavailable(
            f"{name}: matplotlib cannot write .{fmt} images (use one of: "
            f"{', '.join('.' + s for s in supported)})"
        )
    return name, fmt


def plot_summary(
    path: str | os.PathLike[str], out: str | os.PathLike[str], summary: RunSummary | None = None
) -> str:
    """Draw the run at ``path`` into the image ``out`` (its format from its suffix, see
    :func:`plot_target`); returns the path written."""
    plt = _pyplot()
    target, fmt = plot_target(out)
    if summary is None:
        summary = summarize_run(path)
    series = step_series(summary)
    if not series:
        raise PlotUnavailable(
            "nothing to plot: no step times (step_time not exported, or no step yet)"
        )
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), constrained_layout=True)
    try:
        stragglers = set(summary.straggler.named_ranks if summary.straggler else ())
        for rank, points in series.items():
            steps = [p[0] for p in points]
            ms = [p[1] for p in points]
            label = f"rank {rank}" + (" (straggler)" if rank in stragglers else "")
            top.plot(steps, ms, linewidth=2.0 if rank in stragglers else 1.0, label=label)
        top.set_xlabel("step")
        top.set_ylabel("step time (ms)")
        top.set_title(f"Step time per rank ({len(series)} rank(s))")
        if len(series) <= _MAX_LABELLED_RANKS:
            top.legend(loc="upper right", fontsize="small")
        top.grid(alpha=0.3)

        phases = summary.phases or {}
        names = [n for n in summary.phase_names if n]
        ranks = sorted(phases, key=int)
        x = list(range(len(ranks)))
        base = [0.0] * len(ranks)
        for name in names:
            heights = [phases[r][name].mean_ms for r in ranks]
            bottom.bar(x, heights, bottom=base, label=name)
            base = [b + h for b, h in zip(base, heights, strict=True)]
        bottom.set_xticks(x, [f"rank {r}" for r in ranks] if len(ranks) <= 32 else ranks)
        bottom.set_ylabel("mean time per step (ms)")
        bottom.set_title("Phase breakdown per rank")
        bottom.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
        bottom.grid(axis="y", alpha=0.3)
        fig.savefig(target, format=fmt, dpi=100)
    finally:
        plt.close(fig)
    return target
