"""The rules of the Export Records contract that a JSON Schema cannot state, once.

Everything JSON Schema 2020-12 can say (types, ranges, patterns, required event
names, reserved names, nullness implications) lives in ``schemas/`` and reaches the
generated loaders, jsonschema and jsonschema-rs from there. What is left is here:
equalities between fields, comparisons of one field with another, a value derived
from others, and the cross-line rules of whole files. Each rule has a stable name;
a stream schema lists the names that apply to it (``x-traceml-rules``), codegen
writes each rule's text beside its stream in docs/reference/export-records.md, and
every consumer (builder, ``traceml validate``, strict ``loads_line``/``dumps_line``,
the rank side, the C item encoder) calls the predicates below instead of restating
them.

This module imports nothing from the package: codegen loads it by path to take the
rule texts, so it must work before the generated code exists.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

# (JSON path, message) of one broken rule in one line.
Finding = tuple[tuple[str | int, ...], str]
LineCheck = Callable[[Mapping[str, Any]], Iterator[Finding]]

_PYTHON_VERSION = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+\S*")
_RFC3339_UTC = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?\+00:00")

# ----------------------------------------------------------------------- predicates
# The fast forms, for callers that hold the values already (builder, rank side).


def identity_ok(rank: int, global_rank: int, local_rank: int, world: int, local_world: int) -> bool:
    """All four identity rules at once (the builder's per-batch check)."""
    return rank == global_rank and global_rank < world and local_rank < local_world <= world


def duration_ok(is_gpu: bool, cpu_ms: float, duration_ms: float, gpu_ms: float | None) -> bool:
    """``duration_ms`` is ``gpu_ms`` when ``is_gpu``, else ``cpu_ms``.

    (``is_gpu`` ⇒ ``gpu_ms`` non-null is a schema rule; a null here just fails.)
    """
    return duration_ms == (gpu_ms if is_gpu else cpu_ms)


def topology_of(world_size: int, local_world_size: int) -> str:
    """The runtime_environment ``topology`` the world sizes imply."""
    if world_size == 1:
        return "single_process"
    if local_world_size == world_size:
        return "single_node_multi_process"
    return "multi_node"


def python_version_ok(value: str) -> bool:
    """Looks like ``platform.python_version()`` (kept out of the schema: ``\\S`` is not
    the same class in Python's and ECMA-262's regular expressions)."""
    return _PYTHON_VERSION.fullmatch(value) is not None


def single_line_ok(value: str) -> bool:
    """No newline inside (a schema pattern's ``$`` differs before a final newline)."""
    return "\n" not in value


def parallel_ok(parallel: Mapping[str, Mapping[str, Any]] | None) -> bool:
    """Every coordinate of a ``parallel`` layout (or None) has ``rank < size``."""
    return parallel is None or all(c["rank"] < c["size"] for c in parallel.values())


def parallel_source_ok(parallel: object, parallel_source: object) -> bool:
    """``parallel_source`` is null exactly when ``parallel`` is (absent reads as null)."""
    return (parallel is None) == (parallel_source is None)


# ----------------------------------------------------------------------- line rules


def _rank_equals_global_rank(d: Mapping[str, Any]) -> Iterator[Finding]:
    if d["rank"] != d["global_rank"]:
        yield ("rank",), f"rank {d['rank']} differs from global_rank {d['global_rank']}"


def _global_rank_below_world_size(d: Mapping[str, Any]) -> Iterator[Finding]:
    if d["global_rank"] >= d["world_size"]:
        yield (
            ("global_rank",),
            f"global_rank {d['global_rank']} is not below world_size {d['world_size']}",
        )


def _local_rank_below_local_world_size(d: Mapping[str, Any]) -> Iterator[Finding]:
    if d["local_rank"] >= d["local_world_size"]:
        yield (
            ("local_rank",),
            f"local_rank {d['local_rank']} is not below local_world_size {d['local_world_size']}",
        )


def _local_world_size_within_world_size(d: Mapping[str, Any]) -> Iterator[Finding]:
    if d["local_world_size"] > d["world_size"]:
        yield (
            ("local_world_size",),
            f"local_world_size {d['local_world_size']} exceeds world_size {d['world_size']}",
        )


def _duration_matches_timing(d: Mapping[str, Any]) -> Iterator[Finding]:
    for name, devices in d["events"].items():
        for device, t in devices.items():
            if duration_ok(t["is_gpu"], t["cpu_ms"], t["duration_ms"], t["gpu_ms"]):
                continue
            if t["is_gpu"]:
                used = f"gpu_ms {t['gpu_ms']}"
                text = f"is_gpu is true but duration_ms {t['duration_ms']} != {used}"
            else:
                text = f"is_gpu is false but duration_ms {t['duration_ms']} != cpu_ms {t['cpu_ms']}"
            yield ("events", name, device, "duration_ms"), text


def _topology_from_world_sizes(d: Mapping[str, Any]) -> Iterator[Finding]:
    world, local_world = d["world_size"], d["local_world_size"]
    expected = topology_of(world, local_world)
    if d["topology"] != expected:
        yield (
            ("topology",),
            f"expected {expected!r} for world_size {world}, local_world_size {local_world}",
        )


def _python_version_format(d: Mapping[str, Any]) -> Iterator[Finding]:
    if not python_version_ok(d["python_version"]):
        yield ("python_version",), "expected platform.python_version(), e.g. '3.11.7'"


def _parallel_rank_below_size(d: Mapping[str, Any]) -> Iterator[Finding]:
    parallel = d.get("parallel")
    if parallel is None:
        return
    for name, c in parallel.items():
        if c["rank"] >= c["size"]:
            yield ("parallel", name, "rank"), f"rank {c['rank']} is not below size {c['size']}"


def _parallel_source_with_parallel(d: Mapping[str, Any]) -> Iterator[Finding]:
    source = d.get("parallel_source")
    if not parallel_source_ok(d.get("parallel"), source):
        text = "null" if source is None else repr(source)
        yield (
            ("parallel_source",),
            f"parallel_source {text} but parallel "
            + ("is null" if d.get("parallel") is None else "is not null"),
        )


def _line_without_newline(d: Mapping[str, Any]) -> Iterator[Finding]:
    if not single_line_ok(d["line"]):
        yield ("line",), "one line of output, without its newline"


# finalization_warning.json: what its schema cannot say.


def _warning_ranks_sorted(d: Mapping[str, Any]) -> Iterator[Finding]:
    for key in ("finished_ranks", "missing_ranks"):
        ranks = d.get(key)
        if ranks is not None and list(ranks) != sorted(ranks):
            yield (key,), "ranks are not sorted"


def _warning_ranks_below_world_size(d: Mapping[str, Any]) -> Iterator[Finding]:
    world = d.get("expected_world_size")
    if world is None:
        return
    for key in ("finished_ranks", "missing_ranks"):
        if any(r >= world for r in d.get(key) or ()):
            yield (key,), f"ranks must be below expected_world_size {world}"


def _warning_ranks_disjoint(d: Mapping[str, Any]) -> Iterator[Finding]:
    both = sorted(set(d.get("finished_ranks") or ()) & set(d.get("missing_ranks") or ()))
    if both:
        yield ("missing_ranks",), f"ranks {both} are also in finished_ranks"


def export_shows_loss(
    dropped_batches: int, failed_records: int, skipped_items: int, exporter_failed: bool
) -> bool:
    """Whether an export block counts something lost (else it has no business there)."""
    return dropped_batches > 0 or failed_records > 0 or skipped_items > 0 or exporter_failed


def _warning_export_shows_loss(d: Mapping[str, Any]) -> Iterator[Finding]:
    export = d.get("export")
    if export is not None and not export_shows_loss(
        export["dropped_batches"],
        export["failed_records"],
        export["skipped_items"],
        export["exporter_failed"],
    ):
        yield ("export",), "the export block shows no loss"


def completed_at_ok(value: str) -> bool:
    """``datetime.now(timezone.utc).isoformat()``: RFC 3339 with ``+00:00``."""
    if _RFC3339_UTC.fullmatch(value) is None:
        return False
    try:
        datetime.datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


def _warning_completed_at_utc(d: Mapping[str, Any]) -> Iterator[Finding]:
    if not completed_at_ok(d["completed_at"]):
        yield (
            ("completed_at",),
            "expected datetime.now(timezone.utc).isoformat(), e.g. "
            "'2025-01-31T12:00:00.123456+00:00'",
        )


def _warning_message_not_blank(d: Mapping[str, Any]) -> Iterator[Finding]:
    if not d["message"].strip():
        yield ("message",), "message must not be blank (one human sentence)"


FastForm = tuple[str, ...]
"""A line rule as the scan's C core (compiled by ``_fastcheck``) tests it, as data:
``(op, left, right)`` with op ``==``, ``<`` or ``<=`` compares two integer fields;
``("duration", map_field, is_gpu, cpu_ms, duration_ms, gpu_ms)`` is
duration-matches-timing on every timing of a map of maps; ``("no-newline", field)``
says a string field holds no newline."""


class Rule:
    """One named rule: its text for the docs and, for a line rule, its check (and the
    form the scan's C core tests, when it has one)."""

    __slots__ = ("check", "fast", "name", "text")

    def __init__(
        self, name: str, text: str, check: LineCheck | None, fast: FastForm | None = None
    ) -> None:
        self.name = name
        self.text = text
        self.check = check
        """None for a cross-line rule (``traceml validate`` checks it over a file)."""
        self.fast = fast
        """The same rule as data for the fast check; None: a line under this rule is
        always left to ``check``."""


RULES: dict[str, Rule] = {
    rule.name: rule
    for rule in (
        Rule(
            "rank-equals-global-rank",
            "`rank == global_rank`.",
            _rank_equals_global_rank,
            ("==", "rank", "global_rank"),
        ),
        Rule(
            "global-rank-below-world-size",
            "`global_rank < world_size`.",
            _global_rank_below_world_size,
            ("<", "global_rank", "world_size"),
        ),
        Rule(
            "local-rank-below-local-world-size",
            "`local_rank < local_world_size`.",
            _local_rank_below_local_world_size,
            ("<", "local_rank", "local_world_size"),
        ),
        Rule(
            "local-world-size-within-world-size",
            "`local_world_size <= world_size`.",
            _local_world_size_within_world_size,
            ("<=", "local_world_size", "world_size"),
        ),
        Rule(
            "duration-matches-timing",
            "Every phase timing's `duration_ms` equals its `gpu_ms` when `is_gpu`, "
            "else its `cpu_ms`.",
            _duration_matches_timing,
            ("duration", "events", "is_gpu", "cpu_ms", "duration_ms", "gpu_ms"),
        ),
        Rule(
            "topology-from-world-sizes",
            "`topology` is `single_process` when `world_size == 1`, "
            "`single_node_multi_process` when `local_world_size == world_size > 1`, "
            "else `multi_node`.",
            _topology_from_world_sizes,
        ),
        Rule(
            "python-version-format",
            "`python_version` looks like `platform.python_version()` "
            "(three dot-separated numbers, then any non-space suffix).",
            _python_version_format,
        ),
        Rule(
            "parallel-rank-below-size",
            "Every coordinate of `parallel` has `rank < size`.",
            _parallel_rank_below_size,
        ),
        Rule(
            "parallel-source-with-parallel",
            "`parallel_source` is null exactly when `parallel` is null (an absent key "
            "counts as null).",
            _parallel_source_with_parallel,
        ),
        Rule(
            "line-without-newline",
            "`line` holds no newline (it may be empty or hold `\\r`).",
            _line_without_newline,
            ("no-newline", "line"),
        ),
        Rule(
            "warning-ranks-sorted",
            "`finished_ranks` and `missing_ranks` are sorted.",
            _warning_ranks_sorted,
        ),
        Rule(
            "warning-ranks-below-world-size",
            "Every rank of `finished_ranks` and `missing_ranks` is below `expected_world_size`.",
            _warning_ranks_below_world_size,
        ),
        Rule(
            "warning-ranks-disjoint",
            "No rank is both in `finished_ranks` and in `missing_ranks`.",
            _warning_ranks_disjoint,
        ),
        Rule(
            "warning-export-shows-loss",
            "The `export` block shows a loss: some count > 0 or `exporter_failed` true.",
            _warning_export_shows_loss,
        ),
        Rule(
            "warning-completed-at-utc",
            "`completed_at` is `datetime.now(timezone.utc).isoformat()` (RFC 3339, `+00:00`).",
            _warning_completed_at_utc,
        ),
        Rule(
            "warning-message-not-blank",
            "`message` is one human sentence: not only white space.",
            _warning_message_not_blank,
        ),
        # Cross-line rules: checked by `traceml validate` over a whole file or folder.
        Rule(
            "closing-line-last",
            "A clean file ends with exactly one closing line naming the file's stream, "
            "whose `written_records` equals its data lines; all closing lines of a folder "
            "show the same `dropped_batches`.",
            None,
        ),
        Rule(
            "unique-key",
            "No two data lines share the stream's key.",
            None,
        ),
        Rule(
            "last-line-wins",
            "A later line for a rank replaces the earlier one (keys may repeat).",
            None,
        ),
        Rule(
            "seq-never-decreases",
            "`seq` never decreases per (rank, stream).",
            None,
        ),
        Rule(
            "hostname-all-or-none",
            "`hostname` is on every line of the folder's streams that carry it, or on none.",
            None,
        ),
        Rule(
            "snapshot-gpu-lines",
            "A system snapshot's `system_gpu` lines share its `(node_rank, seq)` and "
            "identity, and there are `gpu_count` of them.",
            None,
        ),
    )
}
"""Every rule by name."""


IDENTITY_RULES = (
    "rank-equals-global-rank",
    "global-rank-below-world-size",
    "local-rank-below-local-world-size",
    "local-world-size-within-world-size",
)
"""The rules of the identity block (what :func:`identity_ok` checks at once)."""


def line_checks(names: tuple[str, ...]) -> tuple[LineCheck, ...]:
    """The checks of the line rules among ``names`` (cross-line rules have none)."""
    checks = []
    for name in names:
        check = RULES[name].check
        if check is not None:
            checks.append(check)
    return tuple(checks)


def line_findings(checks: tuple[LineCheck, ...], d: Mapping[str, Any]) -> list[Finding]:
    """What ``checks`` find in the schema-valid line ``d``."""
    found: list[Finding] = []
    for check in checks:
        found.extend(check(d))
    return found
