"""Step rows as columns: what the summary keeps of a step_time file, whatever its size.

A row (:func:`~traceml_ai.run_summary._phases.step_row`: ``{"step": ms, phase: ms,
..., "_used": ms}`` plus the reader's ``_ts``, the step's end in ns) is kept as one
float64 per key in per-rank columns (numpy arrays): about 8 bytes per key per step
line, never a dict per line. A key a row does not have reads 0.0, as ``row.get(key,
0.0)`` did, and ``present`` says which rows had it where that matters (a phase seen
in some steps only).

:class:`ColumnsBuilder` takes rows one by one (the files' reader, appending as a file
grows); :func:`columns_of_rows` turns dict rows (the live views', a rank's own) into
the same columns, so every view runs the one analysis.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

STEP_KEY = "step"
TS_KEY = "_ts"
USED_KEY = "_used"
_BASE = (STEP_KEY, TS_KEY, USED_KEY)


class RankColumns:
    """One rank's steps, ascending, and a float64 column per row key."""

    __slots__ = ("node", "present", "steps", "values")

    def __init__(
        self,
        steps: NDArray[np.int64],
        values: dict[str, NDArray[np.float64]],
        present: dict[str, NDArray[np.bool_]],
        node: int | None,
    ) -> None:
        self.steps = steps
        self.values = values
        """key -> one value per step (0.0 where the row did not have the key)."""
        self.present = present
        """key -> which steps' rows had it; only for keys some row lacked."""
        self.node = node
        """The node the rank ran on (its last line's ``node_rank``), when known."""

    def __len__(self) -> int:
        return int(self.steps.shape[0])

    def column(self, key: str) -> NDArray[np.float64]:
        """The key's values (zeros when no row had it)."""
        import numpy as np

        found = self.values.get(key)
        return found if found is not None else np.zeros(len(self), dtype=np.float64)

    def has(self, key: str) -> NDArray[np.bool_]:
        """Which rows had ``key``."""
        import numpy as np

        if key not in self.values:
            return np.zeros(len(self), dtype=np.bool_)
        mask = self.present.get(key)
        return mask if mask is not None else np.ones(len(self), dtype=np.bool_)

    def row(self, i: int) -> dict[str, float]:
        """Row ``i`` as a dict (the keys it had)."""
        out: dict[str, float] = {}
        for key, col in self.values.items():
            mask = self.present.get(key)
            if mask is None or mask[i]:
                out[key] = float(col[i])
        return out


StepColumns = dict[int, RankColumns]
"""rank -> its step columns."""


_INT64 = struct.Struct("=q")
_FLOAT64 = struct.Struct("=d")


class _RankBuilder:
    """One rank's columns while they grow: native int64 and float64 values in
    ``bytearray``s (8 bytes a value), appended per row.

    ``keys`` and ``key_columns`` (the columns in ``keys``' order) serve the common case
    of a row with every column, in the same order, and a step after the last.
    """

    __slots__ = (
        "absent",
        "columns",
        "key_columns",
        "keys",
        "last",
        "node",
        "ordered",
        "seen",
        "steps",
    )

    def __init__(self) -> None:
        self.steps = bytearray()
        self.columns: dict[str, bytearray] = {}
        self.absent: dict[str, array[int]] = {}
        """key -> the row indices that lacked it (kept only for keys some row lacked)."""
        self.keys: tuple[str, ...] = ()
        """The key order of the last row that had every column (empty: none yet)."""
        self.key_columns: list[bytearray] = []
        self.last = -(1 << 63)
        self.ordered = True
        self.seen: set[int] | None = None
        """The steps, as a set, once a step came out of order (else none is needed)."""
        self.node: int | None = None

    def add(self, step: int, row: Mapping[str, float]) -> bool:
        """Append one row; False (nothing added) when the rank has the step already."""
        if step <= self.last:
            if self.seen is None:
                with memoryview(self.steps) as view, view.cast("q") as steps:
                    self.seen = set(steps)
            if step in self.seen:
                return False
            self.ordered = False
        if self.seen is not None:
            self.seen.add(step)
        self.last = max(self.last, step)
        n = len(self.steps) // 8
        self.steps += _INT64.pack(step)
        columns = self.columns
        pack = _FLOAT64.pack
        keys = tuple(row)
        if keys == self.keys:  # every column, in the same order
            for column, value in zip(self.key_columns, row.values(), strict=True):
                column += pack(value)
            return True
        for key, value in row.items():
            col: bytearray | None = columns.get(key)
            if col is None:
                col = columns[key] = bytearray(8 * n)
                if n:
                    self.absent[key] = array("q", range(n))
            col += pack(value)
        if len(row) < len(columns):
            for key, col in columns.items():
                if len(col) == 8 * n:  # not in this row
                    col += pack(0.0)
                    missing = self.absent.get(key)
                    if missing is None:
                        missing = self.absent[key] = array("q")
                    missing.append(n)
        # The fast path above is for a row with every column.
        if len(keys) == len(columns):
            self.keys, self.key_columns = keys, [columns[k] for k in keys]
        else:
            self.keys, self.key_columns = (), []
        return True

    def build(self, copy: bool) -> RankColumns:
        """The columns; ``copy``: not views of the builder's memory (which may then grow)."""
        import numpy as np

        def ints(b: bytearray) -> NDArray[np.int64]:
            out = np.frombuffer(b, dtype=np.int64)
            return out.copy() if copy else out

        def floats(b: bytearray) -> NDArray[np.float64]:
            out = np.frombuffer(b, dtype=np.float64)
            return out.copy() if copy else out

        steps = ints(self.steps)
        values = {k: floats(c) for k, c in self.columns.items()}
        present: dict[str, NDArray[np.bool_]] = {}
        for key, missing in self.absent.items():
            mask = np.ones(len(steps), dtype=np.bool_)
            if missing:
                mask[np.frombuffer(missing, dtype=np.int64)] = False
            present[key] = mask
        if not self.ordered:
            order = np.argsort(steps, kind="stable")
            steps = steps[order]
            values = {k: v[order] for k, v in values.items()}
            present = {k: m[order] for k, m in present.items()}
        return RankColumns(steps, values, present, self.node)


def _empty_int() -> NDArray[np.int64]:
    import numpy as np

    return np.zeros(0, dtype=np.int64)


def _empty_float() -> NDArray[np.float64]:
    import numpy as np

    return np.zeros(0, dtype=np.float64)


class ColumnsBuilder:
    """Step rows appended one by one (first of each (rank, step) wins), columns out.

    :meth:`build` may be called again after more rows (a growing file): reading costs
    the new rows only.
    """

    def __init__(self) -> None:
        self.ranks: dict[int, _RankBuilder] = {}
        self.worlds: set[int] = set()

    def add(self, rank: int, step: int, row: Mapping[str, float]) -> bool:
        """Append a row; False when the rank has that step already (a repeated key)."""
        mine = self.ranks.get(rank)
        if mine is None:
            mine = self.ranks[rank] = _RankBuilder()
        return mine.add(step, row)

    def set_node(self, rank: int, node: int) -> None:
        self.ranks[rank].node = node

    def __bool__(self) -> bool:
        return bool(self.ranks)

    def build(self, copy: bool = True) -> StepColumns:
        """The columns of every rank. ``copy=False`` hands out views of the builder's
        memory (no copy of a big file's columns), after which it must take no more rows
        (a ``bytearray`` with a view cannot grow)."""
        return {r: self.ranks[r].build(copy) for r in sorted(self.ranks)}


def columns_of_rows(rows: Mapping[int, Mapping[int, Mapping[str, float]]]) -> StepColumns:
    """The columns of dict rows (rank -> step -> row), steps in order."""
    builder = ColumnsBuilder()
    for rank in sorted(rows):
        steps = rows[rank]
        node: Any = None
        for step in sorted(steps):
            row = steps[step]
            shown = {k: float(v) for k, v in row.items() if k != "_node"}
            builder.add(rank, step, shown)
            node = row.get("_node", node)
        if rank in builder.ranks and node is not None:
            builder.set_node(rank, int(node))
    return builder.build()


def is_columns(rows: Mapping[int, Any]) -> bool:
    """Whether ``rows`` are columns (else dict rows)."""
    return all(isinstance(v, RankColumns) for v in rows.values())


__all__ = [
    "STEP_KEY",
    "TS_KEY",
    "USED_KEY",
    "ColumnsBuilder",
    "RankColumns",
    "StepColumns",
    "columns_of_rows",
    "is_columns",
]
