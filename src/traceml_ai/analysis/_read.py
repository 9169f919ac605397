"""The run summary's reader of the export files: the one scan of ``traceml_records``
(``FileScan``), per file, as it grows.

A file is opened only when it is a regular file: a FIFO, a folder, a socket or a
symbolic link to nothing is reported as a problem and never read (a FIFO would block
the reader). A regular file is read by the scan from where the last read stopped: a
line is used only when it is a valid line of its stream (what ``traceml validate``
finds nothing wrong with on its own: the types and ranges of its schema, no negative
duration, no step 0, no rank outside the world, which rules out NaN and Infinity
too), its key new and the closing line not yet read. What is left out is counted per
file under the scan's reasons, never averaged:

* ``unreadable_lines`` (``not_json``): not a JSON object (a blank line, broken JSON,
  NaN);
* ``impossible_lines`` (``invalid``): a JSON object with a value no valid line has;
* ``duplicate_keys`` (``repeated_key``): a line whose key (``(global_rank, step)``
  for step_time) an earlier line already had; the first line of a key counts;
* ``lines_after_closing`` (``after_closing``) and ``closing_lines``: data lines after
  the closing line, or a second closing line: two runs in one file; only the first is
  read.

step_time lines come as columns (rank, step, world, node, end of step, tokens; each
event's longest device), made into each rank's step columns in numpy
(:class:`StepLines`), by :func:`~traceml_ai.analysis._phases.step_row`'s rule, a block
at a time; each rank keeps at most its window of steps (:data:`MIN_WINDOW`), then a
sample of them and the exact totals of all (:class:`RankTotals`), so memory does not
grow with the file. The collectives lines' waits are kept for the same steps
(:class:`WaitLines`: past the window, only the steps of step_time's sample), so they
do not grow with the file either. The other streams' lines come as objects.

Light to import: orjson, numpy and the check plans (never pyarrow).
"""

from __future__ import annotations

import os
import stat
from array import array
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from traceml_ai.analysis._columns import (
    STEP_KEY,
    TOKENS_KEY,
    TS_KEY,
    USED_KEY,
    RankColumns,
    RankTotals,
    StepColumns,
    rank_columns,
)
from traceml_ai.analysis._phases import (
    BUILT_IN_PHASES,
    STEP_EVENT,
    op_label,
    phase_name,
    wait_component,
)
from traceml_records.internal import LINE, REASONS, FileScan, FileState, Layout, RowsLayout

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray


class FileRead:
    """What reading one export file found besides its data lines (the scan's state,
    in the summary's words)."""

    def __init__(self, stream: str, path: Path) -> None:
        self.stream = stream
        self.path = path
        self.problem: str | None = None
        """Why the file could not be read at all (not a regular file, an I/O error)."""
        self.size = 0
        self.state = FileState(stream=stream)
        """The scan's state of the file."""

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def data_lines(self) -> int:
        """Data lines before the (first) closing line, used or not."""
        return self.state.data_lines

    @property
    def closing(self) -> dict[str, Any] | None:
        return self.state.closing

    @property
    def closing_lines(self) -> int:
        return self.state.closing_lines

    @property
    def partial_last_line(self) -> bool:
        return self.state.partial_last_line

    @property
    def unreadable_lines(self) -> int:
        return self.state.bad.get("not_json", 0)

    @property
    def impossible_lines(self) -> int:
        return self.state.bad.get("invalid", 0)

    @property
    def duplicate_keys(self) -> int:
        return self.state.bad.get("repeated_key", 0)

    @property
    def lines_after_closing(self) -> int:
        return self.state.bad.get("after_closing", 0)

    @property
    def first_line_after_closing(self) -> int | None:
        lines = [
            self.state.first[r][0]
            for r in ("after_closing", "extra_closing")
            if r in self.state.first
        ]
        return min(lines) if lines else None

    def problems(self) -> list[str]:
        """One line per kind of damage found in this file (empty when none)."""
        out: list[str] = []
        if self.problem is not None:
            return [f"{self.name}: {self.problem}"]
        first = self.state.first
        if self.unreadable_lines:
            out.append(
                f"{self.name}: {self.unreadable_lines} unreadable line(s), not counted "
                f"({REASONS['not_json']}; first on line {first['not_json'][0]})"
            )
        if self.impossible_lines:
            line, message, _ = first["invalid"]
            out.append(
                f"{self.name}: {self.impossible_lines} line(s) with {REASONS['invalid']}, "
                f"not counted (line {line}: {message})"
            )
        if self.duplicate_keys:
            line, key, _ = first["repeated_key"]
            out.append(
                f"{self.name}: {self.duplicate_keys} line(s) {REASONS['repeated_key']}, "
                f"not counted (line {line}: {key})"
            )
        if self.closing_lines > 1 or self.lines_after_closing:
            out.append(
                f"{self.name}: two runs in one file? {self.closing_lines} closing line(s) and "
                f"{self.lines_after_closing} data line(s) {REASONS['after_closing']} "
                f"(line {self.first_line_after_closing}); only the lines before it are counted"
            )
        if self.closing is not None:
            written = self.closing.get("written_records")
            if written != self.data_lines:
                out.append(
                    f"{self.name}: the closing line says {written!r} data line(s), "
                    f"the file has {self.data_lines}"
                )
        return out


# --------------------------------------------------------------------------- opening


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def exists(path: Path) -> bool:
    """Whether anything is at ``path``, a symbolic link to nothing included."""
    try:
        os.lstat(path)
    except OSError:
        return False
    return True


def open_regular(path: Path) -> tuple[BinaryIO | None, str | None]:
    """``(file, None)`` for a regular file; ``(None, why)`` for anything else there.

    Never blocks: a FIFO is opened without waiting for a writer (then refused).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        if os.path.islink(path):
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            return None, f"a symbolic link to {target}, which does not exist; not read"
        return None, "disappeared while being read"
    except OSError as exc:
        return None, f"cannot open it ({exc.strerror or exc}); not read"
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        return None, f"cannot read it ({exc.strerror or exc}); not read"
    if not stat.S_ISREG(mode):
        os.close(fd)
        return None, f"is {_kind(mode)}, not a file; not read"
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb"), None


def read_bytes(path: Path) -> tuple[bytes | None, str | None]:
    """A small regular file's bytes, or why not (see :func:`open_regular`)."""
    fh, problem = open_regular(path)
    if fh is None:
        return None, problem
    try:
        with fh:
            return fh.read(), None
    except OSError as exc:
        return None, f"cannot read it ({exc.strerror or exc})"


# --------------------------------------------------------------------------- growing files


_HEAD_BYTES = 256
"""Bytes at the start of a file remembered to tell a file rewritten in place."""


class Tail:
    """One export file read as it grows: each :meth:`read` reads only the bytes appended
    since the last one (the scan goes on from its offset). A file replaced (another
    inode), truncated (shorter than what was read) or rewritten (its first bytes
    changed) is read again from the start, with a fresh ``info`` and a fresh ``sink``
    (from ``make_sink``): a :class:`StepLines` takes the scan's columns, any other sink
    the objects of the lines taken."""

    def __init__(self, stream: str, path: Path, make_sink: Callable[[], _Sink]) -> None:
        self.stream = stream
        self.path = path
        self._make_sink = make_sink
        self.restarts = 0
        """How many times the file was found replaced or truncated and read again."""
        self._start()

    def _start(self) -> None:
        self.info = FileRead(self.stream, self.path)
        self.sink = self._make_sink()
        layout = getattr(self.sink, "layout", None)
        self._scan = FileScan(self.stream, layout=layout, objects=layout is None)
        self.info.state = self._scan.state
        self._identity: tuple[int, int] | None = None
        self._head = b""
        self.identity: tuple[int, int, int] | None = None
        """(device, inode, size) of the file at the last read (None: not read yet)."""

    def read(self) -> bool:
        """Read what was appended; whether anything new was read (or the file restarted,
        or could not be read)."""
        fh, problem = open_regular(self.path)
        if fh is None:
            changed = self.info.problem != problem
            self._start()
            self.info.problem = problem
            return changed
        previous = self.identity
        with fh:
            try:
                st = os.fstat(fh.fileno())
                identity = (st.st_dev, st.st_ino)
                seen = (st.st_dev, st.st_ino, st.st_size)
                restarted = False
                if self._identity is not None and (
                    identity != self._identity
                    or st.st_size < self._scan.state.offset
                    or (self._head and fh.read(len(self._head)) != self._head)
                ):
                    self.restarts += 1
                    self._start()
                    restarted = True
                self.identity = seen
                if not restarted and previous == seen and self.info.problem is None:
                    return False  # unchanged since the last read
                if self.info.problem is not None:
                    self._start()
                self._identity = identity
                info, sink = self.info, self.sink
                self._scan.read(fh, each=lambda found: sink(found, info))
                self.info.size = max(fh.tell(), self._scan.state.offset)
                offset = self._scan.state.offset
                if len(self._head) < _HEAD_BYTES and offset:
                    fh.seek(0)
                    self._head = fh.read(min(_HEAD_BYTES, offset))
            except OSError as exc:
                self._start()
                self.info.problem = f"cannot read it ({exc.strerror or exc}); not counted"
        return True


_Sink = Callable[[list[Any], FileRead], object]
"""What takes a file's new lines (objects, or a :class:`StepLines`' columns)."""


# --------------------------------------------------------------------------- lines


class DataLines:
    """The usable data lines of one (non step_time) file as it grows, each handed to
    ``keep`` (the scan has checked them and kept the first line of each key)."""

    def __init__(self, stream: str, keep: Callable[[dict[str, Any]], object]) -> None:
        self._keep = keep

    def __call__(self, objs: Iterable[dict[str, Any]], info: FileRead) -> None:
        keep = self._keep
        for obj in objs:
            keep(obj)


# --------------------------------------------------------------------------- collectives


class WaitLines:
    """The collectives lines' waits as they are read, kept for the steps step_time's
    sample keeps: per line, its rank, step, ``(component, operation)`` and wait, as
    columns. Once the step_time reader keeps a sample (``stride``, read from
    ``step_stride`` at each merge), only the waits of the steps :func:`kept_steps`
    keeps at its stride are kept; and whatever step_time does, a rank never keeps the
    waits of more than twice its window of steps (past it, a sample of its own, of the
    same kind, so a step kept by step_time's sample at the same stride is kept here
    too). The join (``merge_waits``) uses the waits of the steps the step columns hold.
    """

    def __init__(self, step_stride: Callable[[], int] | None = None) -> None:
        import numpy as np

        self._step_stride = step_stride
        self.names: dict[tuple[str, str | None], int] = {}
        """(component, operation; None for the component's total) -> its id."""
        self.seen: dict[int, None] = {}
        """Ranks with a collectives line, measured or not (in the order first seen)."""
        self.unmeasured: set[int] = set()
        """Ranks with a line whose wait was not measured."""
        self._ids: dict[tuple[str, str], tuple[int, int]] = {}
        self._rows = STEP_ROWS
        self._min_window = MIN_WINDOW
        self._batch = _BUILD_LINES
        self.stride = 1
        """The waits kept: those of the steps :func:`kept_steps` keeps at this stride."""
        self._rank = np.zeros(0, dtype=np.int64)
        self._step = np.zeros(0, dtype=np.int64)
        self._key = np.zeros(0, dtype=np.int64)
        self._wait = np.zeros(0, dtype=np.float64)
        self._start()

    def _start(self) -> None:
        self._p_rank: array[int] = array("q")
        self._p_step: array[int] = array("q")
        self._p_key: array[int] = array("q")
        self._p_wait: array[float] = array("d")

    @property
    def window(self) -> int:
        """The most steps each rank keeps the waits of: twice step_time's window, so
        that step_time's sample, the same steps, always fits."""
        return 2 * max(self._min_window, self._rows // max(1, len(self.seen)))

    @property
    def held(self) -> int:
        """Waits kept (each a line's), pending ones included."""
        return len(self._rank) + len(self._p_rank)

    def add(self, obj: Mapping[str, Any]) -> None:
        rank = obj["global_rank"]
        if rank not in self.seen:
            self.seen[rank] = None
        wait = obj.get("wait_ms")
        if wait is None:
            self.unmeasured.add(rank)
            return
        component = wait_component(obj["phase"])
        if component is None:
            return
        op = op_label(obj["op"], obj.get("group"))
        ids = self._ids.get((component, op))
        if ids is None:
            ids = self._ids[(component, op)] = (
                self._id((component, None)),
                self._id((component, op)),
            )
        self._p_rank.append(rank)
        self._p_step.append(obj["step"])
        self._p_key.append(ids[1])
        self._p_wait.append(float(wait))
        if len(self._p_rank) >= self._batch:
            self.merge()

    def _id(self, key: tuple[str, str | None]) -> int:
        found = self.names.get(key)
        if found is None:
            found = self.names[key] = len(self.names)
        return found

    def merge(self) -> None:
        """Add the pending waits to those kept (only those of steps kept at the
        stride); thin them to step_time's stride, and further while a rank holds the
        waits of more than its window of steps."""
        import numpy as np

        stride = max(self.stride, self._step_stride() if self._step_stride is not None else 1)
        if stride > self.stride:
            self._keep(kept_steps(self._step, stride))
            self.stride = stride
        if len(self._p_rank):
            rank = np.frombuffer(self._p_rank, np.int64)
            step = np.frombuffer(self._p_step, np.int64)
            key = np.frombuffer(self._p_key, np.int64)
            wait = np.frombuffer(self._p_wait, np.float64)
            if stride > 1:
                keep = kept_steps(step, stride)
                rank, step, key, wait = rank[keep], step[keep], key[keep], wait[keep]
            self._rank = np.concatenate((self._rank, rank))
            self._step = np.concatenate((self._step, step))
            self._key = np.concatenate((self._key, key))
            self._wait = np.concatenate((self._wait, wait))
            self._start()
        window = self.window
        while len(self._rank) > window and _past_window(self._rank, self._step, window):
            self.stride *= 2
            self._keep(kept_steps(self._step, self.stride))

    def _keep(self, keep: NDArray[np.bool_]) -> None:
        if bool(keep.all()):
            return
        self._rank, self._step = self._rank[keep], self._step[keep]
        self._key, self._wait = self._key[keep], self._wait[keep]

    def by_rank(self) -> dict[int, tuple[Any, Any, Any]]:
        """Every rank seen: (steps, ids, waits) of its waits kept, each wait twice: under
        its ``(component, operation)`` and under ``(component, None)``."""
        import numpy as np

        self.merge()
        empty = np.zeros(0, dtype=np.int64)
        out: dict[int, tuple[Any, Any, Any]] = {r: (empty, empty, empty) for r in self.seen}
        if not len(self._rank):
            return out
        total = np.zeros(len(self.names), dtype=np.int64)
        for whole, one in self._ids.values():
            total[one] = whole
        order = np.argsort(self._rank, kind="stable")
        rank = self._rank[order]
        ranks, starts = np.unique(rank, return_index=True)
        ends = [*starts[1:].tolist(), len(rank)]
        for r, a, b in zip(ranks.tolist(), starts.tolist(), ends, strict=True):
            at = order[a:b]
            steps, keys, waits = self._step[at], self._key[at], self._wait[at]
            out[int(r)] = (
                np.concatenate((steps, steps)),
                np.concatenate((keys, total[keys])),
                np.concatenate((waits, waits)),
            )
        return out


def _past_window(rank: NDArray[np.int64], step: NDArray[np.int64], window: int) -> bool:
    """Whether any one rank has the waits of more than ``window`` distinct steps."""
    import numpy as np

    _, counts = np.unique(rank, return_counts=True)
    if int(counts.max()) <= window:
        return False  # not even that many waits
    order = np.lexsort((step, rank))
    r, s = rank[order], step[order]
    new = np.ones(len(r), dtype=np.bool_)
    new[1:] = (r[1:] != r[:-1]) | (s[1:] != s[:-1])
    _, counts = np.unique(r[new], return_counts=True)
    return int(counts.max()) > window


# --------------------------------------------------------------------------- step_time


_STEP_FIELDS = ("global_rank", "step", "world_size", "node_rank", "timestamp_unix_ns", "tokens")
STEP_LAYOUT = Layout(
    top=tuple((name, "int64") for name in _STEP_FIELDS),
    rows=RowsLayout(
        field="events",
        keys=((LINE, "int64"),),
        map_keys=("code", None),
        leaves=(("duration_ms", "float64"),),
    ),
)
"""What the summary reads of a step_time line: its key, world, node, end and tokens,
and per event and device its duration (the event as a code)."""


class StepLines:
    """The step rows of one step_time file as it grows, kept as the scan's columns and
    made into each rank's step columns when asked (:attr:`columns`), and the world
    sizes its lines name."""

    layout = STEP_LAYOUT

    def __init__(self) -> None:
        self.columns = _Steps()
        self.lines = 0
        """Rows taken so far (a caller sees whether anything changed)."""

    @property
    def worlds(self) -> set[int]:
        return self.columns.worlds()

    def __call__(self, chunks: list[Any], info: FileRead) -> None:
        chunks.reverse()
        while chunks:
            # Each chunk let go once taken, and made into step columns a batch at a time:
            # a big file never has its scan's columns and their working arrays all at once.
            self.lines += self.columns.add(chunks.pop())
            if self.columns.pending >= _BUILD_LINES:
                self.columns.merge()


_BUILD_LINES = 1 << 17
"""Lines made into step columns at a time (their working arrays: about 100 MB)."""

STEP_ROWS = 1 << 20
"""The step rows the reader keeps of a step_time file, all ranks together (about 100
bytes each), unless that leaves a rank fewer than :data:`MIN_WINDOW`..."""
MIN_WINDOW = 1024
"""...steps: each rank keeps at most ``max(MIN_WINDOW, STEP_ROWS // ranks)`` steps (its
window). Past it, the reader keeps a sample of the steps, the same step numbers on
every rank (:func:`kept_steps`), halved each time a rank passes its window again, and
the exact figures of every step besides (:class:`RankTotals`)."""


def _mix(steps: NDArray[np.int64]) -> NDArray[np.uint64]:
    """A well-mixed 64-bit hash of each step number (splitmix64's finalizer)."""
    import numpy as np

    z = steps.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    out: NDArray[np.uint64] = z ^ (z >> np.uint64(31))
    return out


def kept_steps(steps: NDArray[np.int64], stride: int) -> NDArray[np.bool_]:
    """Which of ``steps`` a sample of one in ``stride`` (a power of two) keeps: a step
    chosen by its number's hash (so every rank keeps the same steps, none in a pattern a
    periodic slow step could hide in, and a sample of ``2 * stride`` is part of this
    one), and the step before each chosen one (an iteration is the time from one step's
    end to the next's)."""
    import numpy as np

    if stride <= 1:
        return np.ones(len(steps), dtype=np.bool_)
    low = np.uint64(stride - 1)
    zero = np.uint64(0)
    with np.errstate(over="ignore"):
        chosen: NDArray[np.bool_] = ((_mix(steps) & low) == zero) | (
            (_mix(steps + 1) & low) == zero
        )
    return chosen


class _Keyed:
    """One rank's step columns as the reader makes them, keyed: :data:`STEP_KEY` (the
    step event's time), each named event's time under its phase name, :data:`USED_KEY`
    (their sum), :data:`TS_KEY` (the step's end), :data:`TOKENS_KEY` (when the line has
    them); :meth:`typed` is the :class:`RankColumns` every view reads."""

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

    def __len__(self) -> int:
        return int(self.steps.shape[0])

    def typed(self) -> RankColumns:
        return rank_columns(self.steps, self.values, self.present, self.node)


class _Steps:
    """The scan's step_time columns, made into each rank's :class:`RankColumns` with
    :func:`~traceml_ai.analysis._phases.step_row`'s rule: a row is ``step`` (the step
    event's time), each named event's time under its name (``phase_name``; events it
    names None are left out) and ``_used``, their sum in the line's order; each event's
    time is its longest device. The reader's own keys follow: ``_ts`` (the step's end)
    and ``_tokens`` (when the line has them) (:class:`_Keyed`, made typed by
    :func:`~traceml_ai.analysis._columns.rank_columns`).

    Chunks wait until :meth:`build`, which makes only them into columns and appends
    those to each rank's columns of the earlier builds: following a growing file costs
    what its new lines cost."""

    def __init__(self) -> None:
        self._names: dict[bytes, int] = {}
        self._built: dict[int, _Keyed] = {}
        self._worlds: set[int] = set()
        self._lines = 0
        self._rows = STEP_ROWS
        self._min_window = MIN_WINDOW
        self.stride = 1
        """The rows kept: the steps :func:`kept_steps` keeps at this stride."""
        self._totals = _Totals()
        self._start()

    def _start(self) -> None:
        self._top: list[list[Any]] = [[] for _ in _STEP_FIELDS]
        self._tokens_valid: list[Any] = []
        self._line: list[Any] = []
        self._code: list[Any] = []
        self._duration: list[Any] = []
        self._pending = 0

    def __bool__(self) -> bool:
        return self._lines > 0

    def add(self, chunk: Any) -> int:
        """Take one chunk of the scan's columns; the lines it holds."""
        import numpy as np

        top, rows = chunk
        n = top[0][3]
        if n == 0:
            return 0
        for column, out in zip(top, self._top, strict=True):
            out.append(np.frombuffer(column[1], dtype=np.int64))
        self._worlds.update(np.unique(self._top[2][-1]).tolist())
        valid = top[-1][0]
        self._tokens_valid.append(
            np.ones(n, dtype=np.bool_) if valid is None else _unpack(valid, n)
        )
        line, event, duration = rows
        names = event[2]
        remap = np.array([self._code_of(name) for name in names], dtype=np.int64)
        codes = np.frombuffer(event[1], dtype=np.int32)
        self._code.append(remap[codes] if len(codes) else codes.astype(np.int64))
        self._line.append(np.frombuffer(line[1], dtype=np.int64) + self._pending)
        self._duration.append(np.frombuffer(duration[1], dtype=np.float64))
        self._pending += n
        self._lines += n
        return int(n)

    def _code_of(self, name: bytes) -> int:
        code = self._names.get(name)
        if code is None:
            code = self._names[name] = len(self._names)
        return code

    def worlds(self) -> set[int]:
        return set(self._worlds)

    @property
    def pending(self) -> int:
        """Lines taken and not yet made into step columns."""
        return self._pending

    @property
    def window(self) -> int:
        """The most steps each rank keeps (:data:`MIN_WINDOW`)."""
        return max(self._min_window, self._rows // max(1, len(self._totals.index)))

    def build(self) -> StepColumns:
        """Each rank's step columns, of every line taken so far (a sample of them, with
        the exact totals, once a rank passed its window)."""
        self.merge()
        if self.stride == 1:
            return {rank: keyed.typed() for rank, keyed in self._built.items()}
        import numpy as np

        out: StepColumns = {}
        for rank in sorted(self._totals.index):
            totals, node = self._totals.of(rank)
            keyed = self._built.get(rank)
            if keyed is None:
                keyed = _Keyed(np.zeros(0, dtype=np.int64), {}, {}, node)
            out[rank] = rank_columns(keyed.steps, keyed.values, keyed.present, node, totals)
        return out

    def merge(self) -> None:
        """Make the lines taken since the last merge into columns, appended to each
        rank's; past the window, halve the sample."""
        if self._pending:
            fresh = self._build_pending()
            built = dict(self._built)
            for rank, columns in fresh.items():
                earlier = built.get(rank)
                built[rank] = columns if earlier is None else _appended(earlier, columns)
            self._built = {r: built[r] for r in sorted(built)}
            self._start()
            window = self.window
            while self._built and max(map(len, self._built.values())) > window:
                self.stride *= 2
                self._built = {r: _thinned(k, self.stride) for r, k in self._built.items()}

    def _build_pending(self) -> dict[int, _Keyed]:
        import numpy as np

        rank, step, _, node, ts, tokens = (np.concatenate(c) for c in self._top)
        has_tokens = np.concatenate(self._tokens_valid)
        with np.errstate(over="ignore"):  # a sum past the largest float: inf, as in Python
            values, present, order = _rows(
                np.concatenate(self._line),
                np.concatenate(self._code),
                np.concatenate(self._duration),
                [name.decode() for name in self._names],
                self._pending,
            )
        values[TS_KEY] = ts.astype(np.float64)
        present[TS_KEY] = present[USED_KEY]
        values[TOKENS_KEY] = np.where(has_tokens, tokens, 0).astype(np.float64)
        present[TOKENS_KEY] = has_tokens
        order[TS_KEY] = order[USED_KEY] + 1
        order[TOKENS_KEY] = order[USED_KEY] + 2
        with np.errstate(all="ignore"):  # inf sums as above
            self._totals.add(rank, step, node, values, present)
        if self.stride > 1:
            keep = kept_steps(step, self.stride)
            rank, step, node = rank[keep], step[keep], node[keep]
            values = {k: v[keep] for k, v in values.items()}
            present = {k: v[keep] for k, v in present.items()}
            order = {k: v[keep] for k, v in order.items()}
            if not len(rank):
                return {}
        return _by_rank(rank, step, node, values, present, order)


class _Totals:
    """The exact figures of every step_time line taken, per rank, as arrays (one entry
    per rank, in the order ranks first appear), added to a batch of lines at a time."""

    def __init__(self) -> None:
        import numpy as np

        self.index: dict[int, int] = {}
        """rank -> its entry."""
        self._ints = np.zeros((0, 5), dtype=np.int64)
        """steps, first step, last step, steps with an end, the node of the last line"""
        self._floats = np.zeros((0, 6), dtype=np.float64)
        """step sum, longest step, first end, last end, iteration sum, rest sum"""
        self._phases: dict[str, Any] = {}
        """phase -> (its sum per rank, the lines per rank that had it)"""

    def add(
        self,
        rank: NDArray[np.int64],
        step: NDArray[np.int64],
        node: NDArray[np.int64],
        values: dict[str, Any],
        present: dict[str, Any],
    ) -> None:
        import numpy as np

        n = len(rank)
        if not n:
            return
        ranks, inv = np.unique(rank, return_inverse=True)
        k = len(ranks)
        for r in ranks.tolist():
            if r not in self.index:
                self.index[r] = len(self.index)
        grow = len(self.index) - len(self._ints)
        if grow > 0:
            self._ints = np.vstack((self._ints, np.zeros((grow, 5), dtype=np.int64)))
            self._floats = np.vstack((self._floats, np.zeros((grow, 6), dtype=np.float64)))
            for sums, counts in self._phases.values():
                sums.resize(len(self.index), refcheck=False)
                counts.resize(len(self.index), refcheck=False)
        at = np.array([self.index[r] for r in ranks.tolist()], dtype=np.int64)
        zeros = np.zeros(n, dtype=np.float64)
        step_ms = values.get(STEP_KEY, zeros)
        count = np.bincount(inv, minlength=k)
        first = np.full(k, np.iinfo(np.int64).max, dtype=np.int64)
        last = np.full(k, np.iinfo(np.int64).min, dtype=np.int64)
        np.minimum.at(first, inv, step)
        np.maximum.at(last, inv, step)
        longest = np.full(k, -np.inf)
        np.maximum.at(longest, inv, step_ms)
        where = np.full(k, -1, dtype=np.int64)
        np.maximum.at(where, inv, np.arange(n))
        ts = values[TS_KEY]
        has_end = ts > 0
        ends = np.bincount(inv[has_end], minlength=k)
        first_end = np.full(k, np.inf)
        last_end = np.full(k, -np.inf)
        np.minimum.at(first_end, inv[has_end], ts[has_end])
        np.maximum.at(last_end, inv[has_end], ts[has_end])
        # iteration() and rest() of _phases, line by line, as phase_breakdown adds them.
        built_in: Any = 0.0
        for name in BUILT_IN_PHASES:
            built_in = built_in + values.get(name, zeros)
        outside = built_in > step_ms * 1.000001
        iterations = np.where(outside, step_ms + values.get("dataloader_wait", zeros), step_ms)
        rest = np.fmax(0.0, iterations - values[USED_KEY])

        ints, floats = self._ints, self._floats
        old = ints[at, 0] > 0
        ints[at, 1] = np.where(old, np.minimum(ints[at, 1], first), first)
        ints[at, 2] = np.where(old, np.maximum(ints[at, 2], last), last)
        ints[at, 0] += count
        old_end = ints[at, 3] > 0
        new_end = ends > 0
        floats[at, 2] = np.where(
            old_end & new_end,
            np.minimum(floats[at, 2], first_end),
            np.where(old_end, floats[at, 2], first_end),
        )
        floats[at, 3] = np.where(
            old_end & new_end,
            np.maximum(floats[at, 3], last_end),
            np.where(old_end, floats[at, 3], last_end),
        )
        ints[at, 3] += ends
        ints[at, 4] = node[where]
        floats[at, 0] += np.bincount(inv, weights=step_ms, minlength=k)
        floats[at, 1] = np.where(old, np.maximum(floats[at, 1], longest), longest)
        floats[at, 4] += np.bincount(inv, weights=iterations, minlength=k)
        floats[at, 5] += np.bincount(inv, weights=rest, minlength=k)
        for key, column in values.items():
            if key in _FIELD_KEYS:
                continue
            found = self._phases.get(key)
            if found is None:
                found = self._phases[key] = (
                    np.zeros(len(self.index), dtype=np.float64),
                    np.zeros(len(self.index), dtype=np.int64),
                )
            sums, counts = found
            sums[at] += np.bincount(inv, weights=column, minlength=k)
            counts[at] += np.bincount(inv, weights=present[key], minlength=k).astype(np.int64)

    def of(self, rank: int) -> tuple[RankTotals, int]:
        """(the rank's totals, the node of its last line)."""
        i = self.index[rank]
        steps, first, last, ends, node = self._ints[i].tolist()
        step_sum, longest, first_end, last_end, iterations, rest = self._floats[i].tolist()
        t = RankTotals()
        t.steps, t.first_step, t.last_step, t.ends = steps, first, last, ends
        t.step_sum, t.max_ms, t.iteration_sum, t.rest_sum = step_sum, longest, iterations, rest
        if ends:
            t.first_end, t.last_end = first_end, last_end
        t.phase_sums = {
            key: float(sums[i]) for key, (sums, counts) in self._phases.items() if counts[i]
        }
        return t, int(node)


_FIELD_KEYS = frozenset((STEP_KEY, TS_KEY, USED_KEY, TOKENS_KEY))


def _thinned(keyed: _Keyed, stride: int) -> _Keyed:
    """A rank's columns with only the steps a sample of one in ``stride`` keeps."""
    keep = kept_steps(keyed.steps, stride)
    if bool(keep.all()):
        return keyed
    return _Keyed(
        keyed.steps[keep],
        {k: v[keep] for k, v in keyed.values.items()},
        {k: m[keep] for k, m in keyed.present.items()},
        keyed.node,
    )


def _appended(earlier: _Keyed, later: _Keyed) -> _Keyed:
    """One rank's columns of earlier lines and of later ones as one: the keys in the
    order they first appear (the earlier lines' first), steps ascending (a rank's steps
    never repeat: the scan takes the first line of each key), the node of its last
    line."""
    import numpy as np

    n_a, n_b = len(earlier), len(later)
    steps = np.concatenate([earlier.steps, later.steps])
    keys = [*earlier.values, *(k for k in later.values if k not in earlier.values)]
    values: dict[str, Any] = {}
    masks: dict[str, Any] = {}
    for key in keys:
        a, b = earlier.values.get(key), later.values.get(key)
        a_has, b_has = earlier.present.get(key), later.present.get(key)
        if a is not None and b is not None and a_has is None and b_has is None:
            values[key] = np.concatenate((a, b))  # the usual key: on every row of both
            continue
        values[key] = np.concatenate(
            (
                a if a is not None else np.zeros(n_a, dtype=np.float64),
                b if b is not None else np.zeros(n_b, dtype=np.float64),
            )
        )
        masks[key] = np.concatenate(
            (
                _has(a is not None, a_has, n_a),
                _has(b is not None, b_has, n_b),
            )
        )
    if n_a and n_b and not bool(later.steps[0] > earlier.steps[-1]):
        order = np.argsort(steps, kind="stable")
        steps = steps[order]
        values = {k: v[order] for k, v in values.items()}
        masks = {k: m[order] for k, m in masks.items()}
    node = later.node if later.node is not None else earlier.node
    return _Keyed(steps, values, masks, node)


def _has(column: bool, mask: Any, n: int) -> NDArray[np.bool_]:
    """Which of ``n`` rows have a key: its mask, all (a column without one), or none."""
    import numpy as np

    if mask is not None:
        return mask  # type: ignore[no-any-return]
    return np.ones(n, dtype=np.bool_) if column else np.zeros(n, dtype=np.bool_)


def _unpack(bitmap: bytes, n: int) -> NDArray[np.bool_]:
    import numpy as np

    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    return bits[:n].astype(np.bool_)


def _rows(
    line: NDArray[np.int64],
    code: NDArray[np.int64],
    duration: NDArray[np.float64],
    names: list[str],
    lines: int,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Every line's row as columns: key -> values, key -> which lines have it, key ->
    its place in each line's row (for the order of first appearance)."""
    import numpy as np

    values: dict[str, Any] = {}
    present: dict[str, Any] = {}
    order: dict[str, Any] = {}
    used = np.zeros(lines, dtype=np.float64)
    if len(line):
        # Each event's time: its longest device (a line's rows come event by event).
        start = np.ones(len(line), dtype=np.bool_)
        start[1:] = (line[1:] != line[:-1]) | (code[1:] != code[:-1])
        at = np.flatnonzero(start)
        best = np.maximum.reduceat(duration, at)
        g_line, g_code = line[at], code[at]
        # Each event's place in its line, and the lines' events one place at a time:
        # ``_used`` is added up in the line's order, as step_row adds it.
        first = np.ones(len(at), dtype=np.bool_)
        first[1:] = g_line[1:] != g_line[:-1]
        begin = np.maximum.accumulate(np.where(first, np.arange(len(at)), 0))
        place = np.arange(len(at)) - begin
        keys = [STEP_KEY if name == STEP_EVENT else phase_name(name) for name in names]
        for p in range(int(place.max()) + 1):
            here = place == p
            for c in np.unique(g_code[here]).tolist():
                key = keys[c]
                if key is None:
                    continue  # a name the summary does not know: left out
                sel = here & (g_code == c)
                rows, time = g_line[sel], best[sel]
                if key not in values:
                    values[key] = np.zeros(lines, dtype=np.float64)
                    present[key] = np.zeros(lines, dtype=np.bool_)
                    order[key] = np.full(lines, 1 << 30, dtype=np.int64)
                if key == STEP_KEY:
                    values[key][rows] = time
                else:
                    values[key][rows] = values[key][rows] + time
                    used[rows] += time
                fresh = ~present[key][rows]
                order[key][rows[fresh]] = p
                present[key][rows] = True
    values[USED_KEY] = used
    present[USED_KEY] = np.ones(lines, dtype=np.bool_)
    order[USED_KEY] = np.full(lines, 1 << 20, dtype=np.int64)  # after the events
    return values, present, order


def _by_rank(
    rank: NDArray[np.int64],
    step: NDArray[np.int64],
    node: NDArray[np.int64],
    values: dict[str, Any],
    present: dict[str, Any],
    order: dict[str, Any],
) -> dict[int, _Keyed]:
    """Each rank's columns: its lines sorted by step (a rank's steps never
    repeat); its keys in the order they first appear in its rows (file order, then
    their place in the row). Every key is sorted once; a rank's columns are slices."""
    import numpy as np

    n = len(rank)
    by_rank = np.lexsort((step, rank))
    ranks, starts = np.unique(rank[by_rank], return_index=True)
    ends = [*starts[1:].tolist(), n]
    keys = list(present)
    # Per key and rank: the first line that has it (n: none), the key's place in that
    # line's row, and whether every line of the rank has it.
    firsts: list[list[int]] = []
    places: list[list[int]] = []
    everywhere: list[list[bool]] = []
    sorted_values: list[Any] = []
    sorted_present: list[Any] = []
    for key in keys:
        has = present[key][by_rank]
        first = np.minimum.reduceat(np.where(has, by_rank, n), starts)
        firsts.append(first.tolist())
        places.append(order[key][np.minimum(first, n - 1)].tolist())
        everywhere.append(np.logical_and.reduceat(has, starts).tolist())
        sorted_values.append(values[key][by_rank])
        sorted_present.append(has)
    last = np.maximum.reduceat(by_rank, starts)
    nodes = node[last].tolist()
    steps = step[by_rank]
    out: dict[int, _Keyed] = {}
    for i, (r, a, b) in enumerate(zip(ranks.tolist(), starts.tolist(), ends, strict=True)):
        found = sorted(
            (firsts[k][i], places[k][i], key, k) for k, key in enumerate(keys) if firsts[k][i] < n
        )
        cols = {key: sorted_values[k][a:b] for _, _, key, k in found}
        masks = {key: sorted_present[k][a:b] for _, _, key, k in found if not everywhere[k][i]}
        out[int(r)] = _Keyed(steps[a:b], cols, masks, int(nodes[i]))
    return out
