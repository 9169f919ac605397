"""The pure-Python twin of the scan's C core (``_speedups.Checker`` and
``_speedups.KeysAndSeqs``; one ``.pyi``, ``_speedups.pyi``, for both).

:class:`Checker` has the C core's protocol: ``scan(data, pos, end, keys, hostname)``
and ``extract(...)`` take the whole lines of ``data[pos:end]`` from ``pos`` on, up to
the first one they do not vouch for, and say where they stopped. The C core vouches
for a line when its bytes are certainly a valid line (and plainly written); this twin
parses each line with orjson and vouches for it when the full path finds nothing wrong
with it (``_linecheck.data_line``). Both
then ask the same of a line before taking it: its key new (where keys are unique) and
not watched, its rank's seq not going back, hostname present as ``hostname`` says (0,
1; -1: the stream has none). A line either stops at is left to the scan's own step
(``_scan``), which says what it is.

:class:`Columns` puts the values of taken lines into the buffers of Arrow arrays, as
the C core does for ``extract`` (``layout``: which columns): the scan's step fills one
for the lines it takes itself, so that the columns are the same whichever took a line.
:class:`KeysAndSeqs` holds the keys and each rank's last seq of one file.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterable
from typing import Any

import attrs
import orjson

from traceml_records._generated.checks import CHECKS
from traceml_records._linecheck import data_line

Column = tuple[bytes | None, bytes, Any, int, int]
"""One column of a chunk: (validity bitmap or None, values, string offsets (a string
column), the names of the codes (a code column) or None, length, nulls): the buffers
of an Arrow array. A code column's values are int32 indexes into its names."""
Chunk = tuple[tuple[Column, ...], tuple[Column, ...] | None]
"""The columns of the lines one call took: the stream table's, and the long table's
(None without one)."""

LINE = None
"""A long table's key column that holds the ordinal of each row's line in its chunk."""


@attrs.frozen(kw_only=True)
class RowsLayout:
    """A long table: one row per inner object of a map of maps of objects."""

    field: str
    """The map (step_time's ``events``: event -> device -> timing)."""
    keys: tuple[tuple[str | None, str], ...]
    """Columns from the line on every row: (field, or :data:`LINE`; kind)."""
    map_keys: tuple[str | None, str | None]
    """Each map level's key as a column: ``string``, ``code`` or None (no column)."""
    leaves: tuple[tuple[str, str], ...]
    """Columns from the inner object: (field, kind)."""


@attrs.frozen(kw_only=True)
class Layout:
    """Which columns a scan fills: (field, kind) each, kinds ``int64``, ``float64``,
    ``bool``, ``string`` and ``code`` (a string as an index into names)."""

    top: tuple[tuple[str, str], ...]
    rows: RowsLayout | None = None


# ---------------------------------------------------------------------- the keys


class KeysAndSeqs:
    """The keys and each rank's last seq of one file's lines (the pure-Python twin of
    ``_speedups.KeysAndSeqs``): per key prefix, the runs of consecutive values of the
    key's running integer component that came in order (a start and an end: 16 bytes a
    run), a set for the rest."""

    def __init__(self, shape: str) -> None:
        if not (
            1 <= len(shape) <= 6
            and set(shape) <= {"i", "n", "s", "I"}
            and ("i" in shape or "I" in shape)
            and shape.count("I") <= 1
        ):
            raise ValueError(
                "the key's shape: 1 to 6 of 'i', 'n' and 's', one 'i' at least; at most "
                "one 'I' (the integer that runs, else the last 'i')"
            )
        self._last = shape.index("I") if "I" in shape else shape.rindex("i")
        self._groups: dict[tuple[Any, ...], tuple[array[int], array[int]]] = {}
        self._extra: set[tuple[tuple[Any, ...], int]] = set()
        self._seqs: dict[Any, Any] = {}
        self._watch: set[tuple[tuple[Any, ...], int]] = set()
        self._found: dict[tuple[Any, ...], int] = {}
        self.keys = 0
        """Keys recorded."""

    def _split(self, key: tuple[Any, ...]) -> tuple[tuple[Any, ...], int]:
        return key[: self._last] + key[self._last + 1 :], int(key[self._last])

    def _in_runs(self, prefix: tuple[Any, ...], last: int) -> bool | None:
        """Whether ``last`` lies in the prefix's runs; None when past their end."""
        runs = self._groups.get(prefix)
        if runs is None or not runs[0] or last > runs[1][-1]:
            return None
        starts, ends = runs
        at = bisect_right(starts, last) - 1
        return at >= 0 and last <= ends[at]

    def seen(self, key: tuple[Any, ...]) -> bool:
        """Whether the key was recorded, or is watched (its first line asked for)."""
        prefix, last = self._split(key)
        if (prefix, last) in self._watch:
            return True
        inside = self._in_runs(prefix, last)
        return inside is not None and (inside or (prefix, last) in self._extra)

    def add(self, key: tuple[Any, ...], line: int) -> bool:
        """True when the key is new (then recorded); ``line`` is where it is."""
        prefix, last = self._split(key)
        inside = self._in_runs(prefix, last)
        if inside is not None and (inside or (prefix, last) in self._extra):
            return False
        if (prefix, last) in self._watch:
            self._found[key] = line
        if inside is None:
            runs = self._groups.get(prefix)
            if runs is None:
                runs = self._groups[prefix] = (array("q"), array("q"))
            starts, ends = runs
            if ends and last == ends[-1] + 1:
                ends[-1] = last
            else:
                starts.append(last)
                ends.append(last)
        else:
            self._extra.add((prefix, last))
        self.keys += 1
        return True

    def last_seq(self, rank: Any) -> Any:
        """The rank's last seq, or None."""
        return self._seqs.get(rank)

    def seq(self, rank: Any, seq: Any) -> Any:
        """The rank's previous seq, or None; ``seq`` becomes its last."""
        previous = self._seqs.get(rank)
        self._seqs[rank] = seq
        return previous

    def watch(self, keys: Iterable[tuple[Any, ...]]) -> None:
        """Note the line where each of these keys is first added."""
        self._watch.update(self._split(k) for k in keys)

    def found(self) -> dict[tuple[Any, ...], int]:
        """Watched key -> the line where it was first added."""
        return dict(self._found)

    @property
    def nbytes(self) -> int:
        return sum(16 * len(starts) for starts, _ in self._groups.values()) + 100 * len(self._extra)


# ---------------------------------------------------------------------- columns


class _Col:
    """One column's buffers while it grows."""

    __slots__ = ("kind", "names", "nulls", "offsets", "valid", "values")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.valid = bytearray()  # one byte a row: 1 when not null
        self.nulls = 0
        self.values: Any = {
            "int64": array("q"),
            "float64": array("d"),
            "bool": bytearray(),
            "string": bytearray(),
            "code": array("i"),
        }[kind]
        self.offsets = array("i", [0]) if kind == "string" else None
        self.names: dict[bytes, int] | None = {} if kind == "code" else None

    def push(self, v: Any) -> None:
        if v is None:
            self.valid.append(0)
            self.nulls += 1
        else:
            self.valid.append(1)
        kind = self.kind
        if kind == "int64":
            self.values.append(0 if v is None else int(v))  # an integer written 1.0 too
        elif kind == "float64":
            self.values.append(0.0 if v is None else float(v))
        elif kind == "bool":
            self.values.append(1 if v else 0)
        elif kind == "string":
            if v is not None:
                self.values += v.encode()
            assert self.offsets is not None
            self.offsets.append(len(self.values))
        else:
            names = self.names
            assert names is not None
            code = 0
            if v is not None:
                data = v.encode()
                code = names.get(data, -1)
                if code < 0:
                    code = names[data] = len(names)
            self.values.append(code)

    def take(self) -> Column:
        rows = len(self.valid)
        valid = _bits(self.valid) if self.nulls else None
        values = _bits(self.values) if self.kind == "bool" else bytes(self.values)
        extra: Any = None
        if self.offsets is not None:
            extra = self.offsets.tobytes()
        elif self.names is not None:
            extra = tuple(self.names)
        return (valid, values, extra, rows, self.nulls)


def _bits(flags: bytearray) -> bytes:
    """One byte a row (0 or 1) as an Arrow bitmap (least significant bit first)."""
    out = bytearray((len(flags) + 7) // 8)
    for i, flag in enumerate(flags):
        if flag:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


class Columns:
    """The values of the lines taken, in the columns of a :class:`Layout`."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.lines = 0
        self._start()

    def _start(self) -> None:
        self.lines = 0
        self._top = [_Col(kind) for _, kind in self.layout.top]
        rows = self.layout.rows
        self._rows: list[_Col] | None = None
        if rows is not None:
            kinds = [k for _, k in rows.keys]
            kinds += [k for k in rows.map_keys if k is not None]
            kinds += [k for _, k in rows.leaves]
            self._rows = [_Col(kind) for kind in kinds]

    def push(self, d: dict[str, Any]) -> None:
        """Add the values of one valid line."""
        for (name, _), col in zip(self.layout.top, self._top, strict=True):
            col.push(d.get(name))
        rows, cols = self.layout.rows, self._rows
        if rows is not None and cols is not None:
            keys = [self.lines if name is LINE else d.get(name) for name, _ in rows.keys]
            at = len(keys)
            key_cols = cols[:at]
            event_col = device_col = None
            if rows.map_keys[0] is not None:
                event_col, at = cols[at], at + 1
            if rows.map_keys[1] is not None:
                device_col, at = cols[at], at + 1
            leaf_cols = cols[at:]
            for event, devices in (d.get(rows.field) or {}).items():
                for device, leaf in devices.items():
                    for value, col in zip(keys, key_cols, strict=True):
                        col.push(value)
                    if event_col is not None:
                        event_col.push(event)
                    if device_col is not None:
                        device_col.push(device)
                    for (name, _), col in zip(rows.leaves, leaf_cols, strict=True):
                        col.push(leaf.get(name))
        self.lines += 1

    def take(self) -> Chunk:
        """The columns so far (a chunk), and a fresh start."""
        top = tuple(c.take() for c in self._top)
        rows = tuple(c.take() for c in self._rows) if self._rows is not None else None
        self._start()
        return top, rows


# ---------------------------------------------------------------------- the twin


class Checker:
    """The pure-Python twin of ``_speedups.Checker`` (see the module's docstring)."""

    def __init__(self, stream: str, layout: Layout | None = None) -> None:
        plan = CHECKS[stream]
        self.stream = stream
        self.layout = layout
        self._key_fields = plan.key_fields
        self._unique = plan.unique_keys

    def _take(self, raw: bytes, keys: KeysAndSeqs, hostname: int) -> dict[str, Any] | None:
        """The line's object when it is taken (its key and seq then recorded)."""
        try:
            d = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        if type(d) is not dict:
            return None
        _, valid, found, _ = data_line(d, self.stream)
        if not valid or found:
            return None
        if hostname >= 0 and ("hostname" in d) != bool(hostname):
            return None
        key = tuple(d.get(f) for f in self._key_fields) if self._unique else None
        if key is not None and keys.seen(key):
            return None
        rank, seq = d["rank"], d["seq"]
        previous = keys.last_seq(rank)
        if previous is not None and seq < previous:
            return None
        if key is not None:
            keys.add(key, 0)
        keys.seq(rank, seq)
        return d

    def _lines(
        self,
        data: bytes | bytearray,
        pos: int,
        end: int,
        keys: KeysAndSeqs,
        hostname: int,
        columns: Columns | None,
    ) -> tuple[int, int]:
        taken = 0
        while pos < end:
            nl = data.find(b"\n", pos, end)
            if nl < 0:
                break
            d = self._take(bytes(data[pos:nl]), keys, hostname)
            if d is None:
                break
            if columns is not None:
                columns.push(d)
            taken += 1
            pos = nl + 1
        return pos, taken

    def scan(
        self, data: bytes | bytearray, pos: int, end: int, keys: KeysAndSeqs, hostname: int, /
    ) -> tuple[int, int]:
        """``(pos, lines)``: the lines taken from ``pos`` on (``pos``: where the first
        line not taken starts, or ``end``)."""
        return self._lines(data, pos, end, keys, hostname, None)

    def extract(
        self, data: bytes | bytearray, pos: int, end: int, keys: KeysAndSeqs, hostname: int, /
    ) -> tuple[int, int, tuple[Column, ...], tuple[Column, ...] | None]:
        """As :meth:`scan`, and the lines' values in the layout's columns."""
        assert self.layout is not None
        columns = Columns(self.layout)
        pos, taken = self._lines(data, pos, end, keys, hostname, columns)
        top, rows = columns.take()
        return pos, taken, top, rows
