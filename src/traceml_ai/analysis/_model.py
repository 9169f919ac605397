"""The run summary as one typed value: what :func:`~traceml_ai.analysis.summarize_run`
returns and every view reads (``traceml summary``'s text, ``--json``, ``--follow``,
``--plot``, ``traceml.summary()``, the dashboard from files, the end of ``traceml run``).

attrs classes, turned into the ``--json`` object and back by the project's one cattrs
converter (:mod:`traceml_ai._converter`): ``to_json()`` is the JSON form, every key
present; ``from_json()`` takes it back, strictly. Per-rank and per-node mappings are
keyed by the rank or node as a string, as in the JSON. The step rows the figures were
made from travel with the value as columns (:attr:`RunSummary.rows`) for the views
that draw steps, never into the JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from traceml_ai.analysis._columns import StepColumns, StepRow
from traceml_ai.analysis._straggler import Coordinate, StragglerView

StepRows = dict[int, dict[int, StepRow]]
"""rank -> step -> its row."""

LossStatus = Literal["complete", "in_progress", "lost", "damaged"]


@attrs.frozen(kw_only=True)
class RankSteps:
    """One rank's step time figures (ms) over the steps read."""

    steps: int
    first_step: int
    last_step: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    steps_per_s: float
    """Over the wall time between the first and last step ends (time between steps
    included); from the mean step time when that is unknown."""


@attrs.frozen(kw_only=True)
class PhaseFigures:
    """One phase of one rank: mean and median ms, and the mean's share of the iteration."""

    mean_ms: float
    p50_ms: float
    share: float


@attrs.frozen(kw_only=True)
class StepFigures:
    """Step and phase figures of a set of step rows (files, the live window, a rank's
    own steps): one engine, :func:`~traceml_ai.analysis.step_figures`."""

    step_time: dict[str, RankSteps]
    phases: dict[str, dict[str, PhaseFigures]]
    phase_names: list[str]


@attrs.frozen(kw_only=True)
class Environment:
    """What the ranks' runtime_environment lines say (the last line of each rank)."""

    training_strategy: str | list[str] | None
    """One strategy, or the sorted list when ranks disagree."""
    distributed_backend: str | None
    topology: str | None
    world_size: int | None
    torch_version: str | None
    parallel: dict[str, int] | None = None
    """The parallel dimensions and their sizes, when every rank said the same ones."""
    parallel_source: str | None = None
    """Where the layout came from (``device_mesh``, ``pipelining``, ``megatron``,
    ``deepspeed``, ``declared``); a list's first when ranks differ."""


@attrs.frozen(kw_only=True)
class DevicePeak:
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None


@attrs.frozen(kw_only=True)
class ProcessFigures:
    """One rank's process samples: CPU (mean, max), the largest RSS and GPU memory."""

    samples: int
    cpu_percent_mean: float | None
    cpu_percent_max: float | None
    cpu_percent_impossible_samples: int
    """Samples above 100 % per logical core of the host, left out of the figures."""
    cpu_logical_cores: int | None
    ram_used_bytes_max: int
    gpu_memory_used_bytes_max: int | None
    gpu_memory_reserved_bytes_max: int | None


@attrs.frozen(kw_only=True)
class GpuFigures:
    utilization_percent_mean: float | None
    memory_used_bytes_max: int | None
    memory_total_bytes: int | None
    temperature_c_max: float | None
    power_usage_w_max: float | None


@attrs.frozen(kw_only=True)
class NodeFigures:
    """One node's system samples and its GPUs (by index, as a string)."""

    samples: int
    cpu_percent_mean: float
    cpu_percent_max: float
    ram_used_bytes_max: int
    ram_total_bytes: int
    gpu_count: int
    gpus: dict[str, GpuFigures]


@attrs.frozen(kw_only=True)
class FileState:
    """What one export file says about its completeness."""

    data_lines: int
    closed: bool
    partial_last_line: bool
    bytes: int | None
    written_records: int | None
    """The closing line's count (None without a closing line)."""
    dropped_batches: int | None
    """The closing line's count (None without a closing line)."""
    mismatch: bool
    """The closing line's count differs from the data lines read."""
    unreadable: str | None
    """Why the file could not be read at all (None: it was read)."""
    unreadable_lines: int
    impossible_lines: int
    duplicate_keys: int
    lines_after_closing: int
    closing_lines: int

    def line(self, name: str) -> str:
        """One sentence on the file: ``step_time.jsonl: 1,200 lines, closed ...``."""
        closed = "closed" if self.closed else "no closing line yet"
        text = f"{name}.jsonl: {self.data_lines:,} lines, {closed}"
        if self.written_records is not None:
            text += f" (closing line: {self.written_records:,} written)"
        if self.dropped_batches:
            text += f", {self.dropped_batches:,} dropped batches"
        return text


@attrs.frozen(kw_only=True)
class LossReport:
    """What the files say about what was lost, with its one sentence (``line``, and
    ``short_line`` for the end of ``traceml run``, which has just printed the warning
    file's path)."""

    status: LossStatus
    dropped_batches: int | None
    files: dict[str, FileState]
    unfinished_files: list[str]
    warning: dict[str, Any] | None
    """finalization_warning.json's object as written (``unreadable`` added when it
    cannot be read); None without one."""
    warning_file: str | None
    line: str
    short_line: str

    @property
    def finished(self) -> bool:
        """Every readable file has its closing line."""
        return not self.unfinished_files


@attrs.frozen(kw_only=True)
class RunSummary:
    """A run's summary from its export files (:func:`summarize_run`)."""

    export_folder: str
    run_folder: str | None
    streams: list[str]
    """The streams with a file, in the registry's order."""
    environment: Environment | None
    ranks: list[int]
    """Ranks with at least one usable step line, ascending."""
    world_size: int | None
    """The largest world size the step lines name (None without one)."""
    step_time: dict[str, RankSteps] | None
    phases: dict[str, dict[str, PhaseFigures]] | None
    phase_names: list[str]
    straggler: StragglerView | None
    memory: dict[str, dict[str, DevicePeak]] | None
    """rank -> device -> peaks; None when step_memory was not exported."""
    process: dict[str, ProcessFigures] | None
    system: dict[str, NodeFigures] | None
    loss: LossReport
    problems: list[str]
    """What could not be read, one line each (the files are then never complete)."""
    notes: list[str]
    coordinates: dict[str, dict[str, Coordinate]] | None = None
    """rank -> its place in the parallel layout, when the ranks said it."""
    rows: StepColumns = attrs.field(factory=dict, eq=False, repr=False)
    """The step rows behind the figures, as columns (not in the JSON)."""

    @property
    def title(self) -> str:
        return self.run_folder or self.export_folder

    def to_json(self) -> dict[str, Any]:
        """The object ``traceml summary --json`` prints."""
        from traceml_ai._converter import CONVERTER

        _register()
        out: dict[str, Any] = CONVERTER.unstructure(self)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunSummary:
        """The summary of its JSON form (strict: unknown keys and wrong types refused)."""
        from traceml_ai._converter import structure

        _register()
        return structure(dict(data), cls, what="run summary")


_registered = False


def _register() -> None:
    """The JSON leaves the step rows out, and takes a strategy or a list of them."""
    global _registered
    if _registered:
        return
    from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

    from traceml_ai._converter import CONVERTER

    CONVERTER.register_unstructure_hook(
        RunSummary, make_dict_unstructure_fn(RunSummary, CONVERTER, rows=override(omit=True))
    )

    def strategy(value: object, _: object) -> str | list[str] | None:
        if value is None or type(value) is str:
            return value
        if type(value) is list and all(type(v) is str for v in value):
            return list(value)
        raise TypeError(f"expected a string, a list of strings or null, got {value!r}")

    CONVERTER.register_structure_hook(str | list[str] | None, strategy)
    # After the hook above: the generated function looks its fields' hooks up now.
    CONVERTER.register_structure_hook(
        RunSummary, make_dict_structure_fn(RunSummary, CONVERTER, rows=override(omit=True))
    )
    _registered = True
