"""The scan's C core (``_fastcheck``, ``_speedups.Checker``) against the full path.

The fast check may leave any line to the full path, but must never accept a line the
full path rejects: it is run on valid lines and on lines mutated to break a type, a
bound, a key, a rule, the JSON itself or its bytes, and whatever it accepts must pass
``validate_line``. Whole files then give the very same report with the fast path,
without it, and without the C extension (the full path and the pure-Python keys).
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from bench.bigfile import write_step_time
from tests.e2e_helpers import REPO
from tests.strategies import as_written, consistent_json
from traceml_records import STREAMS, _fastcheck, _scan, _scan_py, validate_line, validate_paths
from traceml_records._extensions import load as load_extension
from traceml_records._fastcheck import plan_for
from traceml_records._generated.checks import CHECKS
from traceml_records._scan_py import KeysAndSeqs as PyKeysAndSeqs

_speedups = load_extension()
FAST_STREAMS = [s.name for s in STREAMS if plan_for(s.name) is not None]
pytestmark = pytest.mark.skipif(_speedups is None, reason="traceml_records._speedups is not built")


def checker(stream: str) -> Any:
    plan = plan_for(stream)
    assert plan is not None and _speedups is not None
    return _speedups.Checker(plan)


def accepts(stream: str, raw: bytes, hostname: int) -> bool:
    assert _speedups is not None
    keys = _speedups.KeysAndSeqs(CHECKS[stream].key_shape)
    pos, lines = checker(stream).scan(raw, 0, len(raw), keys, hostname)
    assert (pos, lines) in ((0, 0), (len(raw), 1))
    return lines == 1


def test_the_per_step_streams_have_a_fast_check() -> None:
    assert {"step_time", "step_memory", "collectives"} <= set(FAST_STREAMS)
    # system's snapshot rule is checked across files: its lines all go the full way.
    assert plan_for("system") is None and plan_for("system_gpu") is None


def test_a_realistic_export_is_accepted_line_by_line(tmp_path: Path) -> None:
    path = tmp_path / "step_time.jsonl"
    write_step_time(path, 2000, world=64)
    data = path.read_bytes()
    end = data.rindex(b"\n", 0, len(data) - 1) + 1  # the closing line is the full path's
    plan = plan_for("step_time")
    assert plan is not None
    assert _speedups is not None
    pos, lines = checker("step_time").scan(data, 0, end, _speedups.KeysAndSeqs("ii"), 0)
    assert (pos, lines) == (end, 2000)


_LINE = (
    b'{"stream":"step_time","schema_version":1,"observed_timestamp_unix_ns":1796073447753758073,'
    b'"rank":3,"global_rank":3,"local_rank":3,"world_size":64,"local_world_size":8,"node_rank":0,'
    b'"timestamp_unix_ns":1796073447513688073,"seq":0,"step":1,"events":{'
    b'"_traceml_internal:dataloader_next":{"cpu":{"cpu_ms":3.65929,"duration_ms":3.65929,'
    b'"gpu_ms":null,"is_gpu":false,"n_calls":1}},'
    b'"_traceml_internal:forward_time":{"cuda:3":{"cpu_ms":15.036944,"duration_ms":14.823493957519531,'
    b'"gpu_ms":14.823493957519531,"is_gpu":true,"n_calls":1}},'
    b'"_traceml_internal:step_time":{"cuda:3":{"cpu_ms":30.5,"duration_ms":30.25,"gpu_ms":30.25,'
    b'"is_gpu":true,"n_calls":2}},'
    b'"loss":{"cuda:3":{"cpu_ms":1.5,"duration_ms":1.25,"gpu_ms":1.25,"is_gpu":true,"n_calls":1}}}}\n'
)
"""A realistic step_time line (GPU phases, a CPU phase, a user phase)."""

BROKEN: list[tuple[str, bytes, bytes]] = [
    ("schema_version_2", b'"schema_version":1', b'"schema_version":2'),
    ("stream_other", b'"stream":"step_time"', b'"stream":"step_memory"'),
    ("rank_not_global", b'"rank":3,', b'"rank":2,'),
    ("rank_beyond_world", b'"world_size":64', b'"world_size":3'),
    ("local_rank_beyond", b'"local_world_size":8', b'"local_world_size":3'),
    ("local_world_beyond_world", b'"world_size":64', b'"world_size":7'),
    ("rank_negative", b'"node_rank":0', b'"node_rank":-1'),
    ("int_as_float", b'"seq":0', b'"seq":0.0'),
    ("int_exponent", b'"seq":0', b'"seq":0e0'),
    ("int_past_int64", b'"seq":0', b'"seq":9223372036854775808'),
    ("int_leading_zero", b'"seq":0', b'"seq":00'),
    ("step_0", b'"step":1', b'"step":0'),
    ("n_calls_0", b'"n_calls":2', b'"n_calls":0'),
    ("n_calls_float", b'"n_calls":2', b'"n_calls":2.0'),
    ("n_calls_string", b'"n_calls":2', b'"n_calls":"2"'),
    ("cpu_ms_negative", b'"cpu_ms":1.5', b'"cpu_ms":-1.5'),
    ("cpu_ms_nan", b'"cpu_ms":1.5', b'"cpu_ms":NaN'),
    ("cpu_ms_infinity", b'"cpu_ms":1.5', b'"cpu_ms":Infinity'),
    ("cpu_ms_null", b'"cpu_ms":1.5', b'"cpu_ms":null'),
    ("cpu_ms_huge", b'"cpu_ms":1.5', b'"cpu_ms":1e400'),
    ("cpu_duration_differs", b'"cpu_ms":3.65929,"duration_ms":3.65929', b'"cpu_ms":3.65929,"duration_ms":3.6593'),
    ("gpu_duration_differs", b'"duration_ms":30.25,"gpu_ms":30.25', b'"duration_ms":30.25,"gpu_ms":30.5'),
    ("is_gpu_without_gpu_ms", b'"gpu_ms":1.25,"is_gpu":true', b'"gpu_ms":null,"is_gpu":true'),
    ("is_gpu_string", b'"gpu_ms":1.25,"is_gpu":true', b'"gpu_ms":1.25,"is_gpu":"true"'),
    ("timing_key_missing", b'"gpu_ms":null,"is_gpu":false,"n_calls":1', b'"gpu_ms":null,"is_gpu":false'),
    ("timing_key_extra", b'"n_calls":2}', b'"n_calls":2,"x":1}'),
    ("no_device", b'"loss":{"cuda:3":{"cpu_ms":1.5,"duration_ms":1.25,"gpu_ms":1.25,"is_gpu":true,"n_calls":1}}', b'"loss":{}'),
    ("bad_device", b'"loss":{"cuda:3"', b'"loss":{"CUDA:3"'),
    ("no_step_event", b'"_traceml_internal:step_time"', b'"_traceml_internal:step_tim"'),
    ("reserved_name", b'"_traceml_internal:forward_time"', b'"_traceml_internal:forward"'),
    ("empty_name", b'"loss"', b'""'),
    ("events_unsorted", b'"loss"', b'"_a"'),
    ("events_empty", _LINE[_LINE.index(b'"events":') : -2], b'"events":{}'),
    ("events_null", _LINE[_LINE.index(b'"events":') : -2], b'"events":null'),
    ("key_missing", b'"node_rank":0,', b""),
    ("key_unknown", b'"node_rank":0,', b'"node_rank":0,"x":0,'),
    ("closing_key", b'"node_rank":0,', b'"node_rank":0,"closing":true,'),
    ("keys_out_of_order", b'"rank":3,"global_rank":3,', b'"global_rank":3,"rank":3,'),
    ("hostname_null_kind", b'"node_rank":0,', b'"node_rank":0,"hostname":5,'),
    ("not_json", b'"seq":0', b'"seq":'),
    ("trailing_bytes", b"}}}}\n", b"}}}}x\n"),
    ("invalid_utf8", b'"loss"', b'"lo\xffss"'),
    ("surrogate", b'"loss"', b'"lo\xed\xa0\x80ss"'),
]  # fmt: skip
"""One thing wrong with :data:`_LINE` each: what the full path reports."""


def test_the_realistic_line_is_accepted() -> None:
    assert validate_line(_LINE) == []
    assert accepts("step_time", _LINE, 0)


@pytest.mark.parametrize(("old", "new"), [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN])
def test_each_broken_line_is_left_to_the_full_path(old: bytes, new: bytes) -> None:
    assert _LINE.count(old) >= 1
    raw = _LINE.replace(old, new, 1)
    assert validate_line(raw) != []
    for hostname in (0, 1):
        assert not accepts("step_time", raw, hostname)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"seq":0', b'"seq":0 '),  # white space
        (b'"step":1,', b'"step":1,"step":1,'),  # a repeated key (the parser keeps one)
        (b'"loss"', b'"lo\\u0073s"'),  # an escape
        # another spelling of the number a rule compares
        (b'"cpu_ms":1.5,"duration_ms":1.25,"gpu_ms":1.25', b'"cpu_ms":1.5,"duration_ms":1.25,"gpu_ms":125e-2'),
        (b'"cpu_ms":3.65929,"duration_ms":3.65929,"gpu_ms":null,"is_gpu":false,"n_calls":1', b'"duration_ms":3.65929,"cpu_ms":3.65929,"gpu_ms":null,"is_gpu":false,"n_calls":1'),
    ],
)  # fmt: skip
def test_a_valid_line_written_otherwise_goes_the_full_way(old: bytes, new: bytes) -> None:
    raw = _LINE.replace(old, new, 1)
    assert validate_line(raw) == []
    assert not accepts("step_time", raw, 0)


# ------------------------------------------------------------------ mutations

HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 3),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(st.characters(exclude_categories=("Cs",)), max_size=4),
    st.sampled_from(
        [2**63 - 1, 2**63, 0.0, -0.0, 1.0, 1.5, -1e-9, 1e300, 5e-324, "", "cpu", "cuda:0",
         "CPU", "_traceml_internal:step_time", "_traceml_internal:x", "step_time", [], {},
         {"cpu": {}}, {"": 1}]
    ),
)  # fmt: skip
"""Values of every JSON type, at and past the schemas' bounds."""

NUMBER_TOKENS = [
    b"NaN", b"Infinity", b"-Infinity", b"-0", b"-0.0", b"0.0", b"1.0", b"1E2", b"1e-7", b"1e400",
    b"01", b"1.", b".5", b"+1", b"9223372036854775807", b"9223372036854775808",
    b"18446744073709551616", b"99999999999999999999", b"true", b"null", b'"1"', b"[]",
]  # fmt: skip
"""What a number's bytes may be replaced with: other spellings, NaN-likes, non-JSON."""

BAD_BYTES = [b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x01", b"\\u0041", b"\\n", b"\xc3\xa9"]  # fmt: skip
"""Put inside a string: invalid UTF-8 (a stray byte, an overlong, a surrogate, past
U+10FFFF), a control character, escapes, and valid UTF-8."""

_NUMBER = re.compile(rb"(?<=[:\[,])-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?=[,}\]])")


def _places(d: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """Every (object, key) inside ``d``, nested ones included."""
    found = [(d, key) for key in d]
    for value in d.values():
        if isinstance(value, dict):
            found += _places(value)
    return found


def _objects(d: dict[str, Any]) -> list[dict[str, Any]]:
    found = [d]
    for value in d.values():
        if isinstance(value, dict):
            found += _objects(value)
    return found


@st.composite
def valid_line(draw: st.DrawFn, stream: str) -> dict[str, Any]:
    """A valid line of ``stream``: any, or (mostly) one the fast check takes."""
    d = draw(consistent_json(stream))
    if draw(st.integers(0, 3)) == 0:
        return d
    plain = as_written(d)
    return plain if validate_line(orjson.dumps(plain)) == [] else d


@st.composite
def mutated_line(draw: st.DrawFn, stream: str) -> bytes:
    """A valid line of ``stream``, maybe broken in its values, its keys or its bytes."""
    d = draw(valid_line(stream))
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["replace", "replace", "drop", "add", "reorder", "flip"]))
        places = _places(d)
        if action == "replace" and places:
            target, key = draw(st.sampled_from(places))
            target[key] = copy.deepcopy(draw(HOSTILE))
        elif action == "drop" and places:
            target, key = draw(st.sampled_from(places))
            del target[key]
        elif action == "add":
            target = draw(st.sampled_from(_objects(d)))
            names = [*sorted(target), "x", "closing", "hostname", ""]
            target[draw(st.sampled_from(names))] = copy.deepcopy(draw(HOSTILE))
        elif action == "reorder":
            target = draw(st.sampled_from(_objects(d)))
            items = list(target.items())
            if len(items) > 1:
                i = draw(st.integers(0, len(items) - 2))
                items[i], items[i + 1] = items[i + 1], items[i]
                target.clear()
                target.update(items)
        elif action == "flip":
            timings = [o for o in _objects(d) if "is_gpu" in o]
            if timings:
                timing = draw(st.sampled_from(timings))
                timing["is_gpu"] = not timing["is_gpu"]
    raw = orjson.dumps(d)
    for _ in range(draw(st.integers(0, 2))):
        action = draw(st.sampled_from(["number", "space", "string", "duplicate", "tail"]))
        if action == "number":
            spans = [m.span() for m in _NUMBER.finditer(raw)]
            if spans:
                a, b = draw(st.sampled_from(spans))
                raw = raw[:a] + draw(st.sampled_from(NUMBER_TOKENS)) + raw[b:]
        elif action == "space":
            at = draw(st.integers(0, len(raw)))
            raw = raw[:at] + draw(st.sampled_from([b" ", b"\t", b"\r"])) + raw[at:]
        elif action == "string":
            quotes = [m.start() for m in re.finditer(rb'"', raw)]
            at = draw(st.sampled_from(quotes)) + 1 if quotes else 0
            raw = raw[:at] + draw(st.sampled_from(BAD_BYTES)) + raw[at:]
        elif action == "duplicate":
            first = raw[1 : raw.index(b",") + 1] if b"," in raw else b""
            raw = raw[:-1] + b"," + first[:-1] + b"}" if first else raw
        else:
            raw += draw(st.sampled_from([b"x", b"}", b" ", b"{}"]))
    assume(b"\n" not in raw)
    return raw + b"\n"


@pytest.mark.parametrize("stream", FAST_STREAMS)
@given(data=st.data())
def test_the_fast_check_never_accepts_a_line_the_full_path_rejects(
    stream: str, data: st.DataObject
) -> None:
    raw = data.draw(mutated_line(stream))
    for hostname in (0, 1):
        if accepts(stream, raw, hostname):
            assert [str(p) for p in validate_line(raw)] == []


@pytest.mark.parametrize("stream", FAST_STREAMS)
@given(data=st.data())
def test_valid_lines_are_mostly_accepted(stream: str, data: st.DataObject) -> None:
    # Not all: a string with an escape or an event name the line's order puts first
    # may go the full way. A plain one is taken.
    d = data.draw(valid_line(stream))
    raw = orjson.dumps(d) + b"\n"
    assert validate_line(raw) == []
    plain = raw.isascii() and b"\\" not in raw and b"e" not in _numbers(raw)
    if plain:
        assert accepts(stream, raw, int("hostname" in d))


def _numbers(raw: bytes) -> bytes:
    return b"".join(m.group() for m in _NUMBER.finditer(raw))


# ------------------------------------------------------------------ whole files


@contextmanager
def path_taken(how: str) -> Iterator[None]:
    """validate_paths with the C core ("c"), without it ("none"), or as without the C
    extension ("pure": the full path, the pure-Python keys)."""
    with pytest.MonkeyPatch.context() as mp:
        if how in ("none", "pure"):
            mp.setattr(_scan, "core_for", lambda stream, layout=None: _scan_py.Checker(stream))
        if how == "pure":
            mp.setattr(_scan, "keys_for", lambda stream: PyKeysAndSeqs(CHECKS[stream].key_shape))
        yield


def _step_line(d: dict[str, Any], rank: int, step: int, seq: int) -> dict[str, Any]:
    d = dict(d)
    d.update(rank=rank, global_rank=rank, local_rank=rank, world_size=3, local_world_size=3)
    d["step"], d["seq"] = step, seq
    return d


@st.composite
def export_file(draw: st.DrawFn, stream: str) -> list[bytes]:
    """Lines of one file: valid lines of a few ranks (keys and seqs that may repeat or
    go back), some broken ones, and a closing line (maybe wrong, maybe missing)."""
    lines: list[bytes] = []
    for _ in range(draw(st.integers(0, 25))):
        if draw(st.integers(0, 5)) == 0:
            lines.append(draw(mutated_line(stream)))
            continue
        d = draw(valid_line(stream))
        if "step" in d:
            d = _step_line(
                d, draw(st.integers(0, 2)), draw(st.integers(1, 6)), draw(st.integers(0, 6))
            )
        else:
            d.update(seq=draw(st.integers(0, 6)))
        lines.append(orjson.dumps(d) + b"\n")
    if draw(st.booleans()):
        count = len(lines) + draw(st.sampled_from([0, 0, 0, 1]))
        closing = {"stream": stream, "closing": True, "schema_version": 1,
                   "written_records": count, "dropped_batches": 0}  # fmt: skip
        lines.append(orjson.dumps(closing) + b"\n")
    return lines


@pytest.mark.slow
@pytest.mark.parametrize("stream", FAST_STREAMS)
@settings(max_examples=60)
@given(data=st.data())
def test_a_file_gets_the_same_report_either_way(
    stream: str, data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    lines = data.draw(export_file(stream))
    cap = data.draw(st.sampled_from([None, 1, 3]))
    path = tmp_path_factory.mktemp("export") / f"{stream}.jsonl"
    path.write_bytes(b"".join(lines))
    reports = {}
    for how in ("c", "pure", "none"):
        with path_taken(how):
            reports[how] = validate_paths([path], max_problems_per_file=cap)
    full = reports.pop("none")
    for how, report in reports.items():
        assert report == full, how


def test_a_repeat_of_a_fast_line_names_its_first_line(tmp_path: Path) -> None:
    path = tmp_path / "step_time.jsonl"
    write_step_time(path, 300, world=8)
    lines = path.read_bytes().splitlines(keepends=True)
    repeat = lines[123]  # far from the start: accepted by the fast check
    body = [*lines[:200], repeat, *lines[200:-1]]
    closing = orjson.loads(lines[-1])
    closing["written_records"] = len(body)
    path.write_bytes(b"".join(body) + orjson.dumps(closing) + b"\n")
    d = orjson.loads(repeat)
    expected = (
        f"{path}:201: /: duplicate key global_rank={d['global_rank']}, step={d['step']} "
        f"(first on line 124)"
    )
    for how in ("c", "pure", "none"):
        with path_taken(how):
            report = validate_paths([path])
            capped = validate_paths([path], max_problems_per_file=1)
        # the repeat's seq also goes back: reported after the key, on the same line
        assert str(report.problems[0]) == expected, how
        assert [str(p) for p in capped.problems] == [expected], how
        assert report.files[0].problems == capped.files[0].problems == 2


# ------------------------------------------------------------------ keys and seqs


@given(
    shape=st.sampled_from(["i", "ii", "is", "si", "isi", "iiss"]),
    ops=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 5), min_size=4, max_size=4)),
        max_size=60,
    ),
)
def test_both_keys_and_seqs_keep_the_same_keys_and_seqs(
    shape: str, ops: list[tuple[bool, list[int]]]
) -> None:
    assert _speedups is not None
    c, py = _speedups.KeysAndSeqs(shape), PyKeysAndSeqs(shape)
    c.watch([_key(shape, [1, 2, 3, 4])])
    py.watch([_key(shape, [1, 2, 3, 4])])
    for line, (is_seq, values) in enumerate(ops, 1):
        if is_seq:
            seq: Callable[[Any, Any], Any] = c.seq
            assert seq(values[0], values[1]) == py.seq(values[0], values[1])
        else:
            key = _key(shape, values)
            assert c.add(key, line) == py.add(key, line)
    assert c.found() == py.found()


def _key(shape: str, values: list[int]) -> tuple[Any, ...]:
    return tuple(f"cuda:{v}" if kind == "s" else v for kind, v in zip(shape, values, strict=False))


def test_a_float_seq_is_remembered_as_written() -> None:
    assert _speedups is not None
    for t in (_speedups.KeysAndSeqs("ii"), PyKeysAndSeqs("ii")):
        assert t.seq(0, 5.0) is None
        assert t.seq(0.0, 4) == 5.0 and repr(t.seq(0, 6)) == "4"
        assert t.add((1, 2.0), 1) and not t.add((1.0, 2), 2)


def test_keys_out_of_order_are_still_found() -> None:
    assert _speedups is not None
    for t in (_speedups.KeysAndSeqs("ii"), PyKeysAndSeqs("ii")):
        steps = [5, 9, 3, 7, 1, 9, 3, 100, 2]
        assert [t.add((0, s), i) for i, s in enumerate(steps)] == [
            True, True, True, True, True, False, False, True, True,
        ]  # fmt: skip
        assert t.add((1, 3), 0)


def test_keys_in_runs_find_every_repeat_and_take_little_memory() -> None:
    """In-order keys are kept as runs of consecutive steps: a repeat inside a run, at
    its ends, in a gap or out of order is found as the Python twin finds it, over more
    runs than one chunk holds; a rank's steps 1..N take a run, not N keys."""
    assert _speedups is not None
    rnd = random.Random(3)
    c, py = _speedups.KeysAndSeqs("ii"), PyKeysAndSeqs("ii")
    step, line = 0, 0
    for _ in range(6000):  # runs of 1-4 steps with gaps: past one chunk of runs
        step += rnd.randrange(2, 4)
        for s in range(step, step + rnd.randrange(1, 5)):
            line += 1
            assert c.add((0, s), line) == py.add((0, s), line)
        step = s
        probe = rnd.randrange(0, step + 3)  # anywhere: inside a run, a gap, the end
        line += 1
        assert c.add((0, probe), line) == py.add((0, probe), line)
    assert c.found() == py.found()
    long = _speedups.KeysAndSeqs("ii")
    for s in range(1, 100_001):
        for rank in range(4):
            assert long.add((rank, s), s)
    assert long.nbytes < 20_000  # 400,000 keys, four runs
    assert not long.add((2, 50_000), 0) and not long.add((3, 1), 0)
    assert not long.add((0, 100_000), 0) and long.add((0, 100_002), 0)


def test_system_gpu_keys_run_along_seq_per_node_and_gpu() -> None:
    """system_gpu's key (node_rank, seq, gpu_index) runs along seq (its shape marks it),
    so a long file keeps a group per node and GPU, not one per snapshot: memory stays
    flat, and a repeat is still found, in the C core as in the Python twin."""
    assert _speedups is not None
    marked = _fastcheck._run_marked(CHECKS["system_gpu"].key_fields, CHECKS["system_gpu"].key_shape)
    assert marked == "iIi"
    sizes, py_sizes = [], []
    for snapshots in (1_000, 10_000):
        c, py = _speedups.KeysAndSeqs(marked), PyKeysAndSeqs(marked)
        for seq in range(snapshots):
            for node in range(4):
                for gpu in range(8):
                    key = (node, seq, gpu)
                    assert c.add(key, seq) and py.add(key, seq)
        for repeat in ((0, 5, 3), (3, snapshots - 1, 7), (2, 0, 0)):
            assert not c.add(repeat, 0) and not py.add(repeat, 0)
        assert c.add((1, snapshots + 1, 2), 0) and py.add((1, snapshots + 1, 2), 0)
        sizes.append(c.nbytes)
        py_sizes.append(py.nbytes)
    assert sizes[1] == sizes[0] < 20_000, sizes  # 32 runs, at 32,000 and 320,000 keys
    assert py_sizes[1] == py_sizes[0] < 20_000, py_sizes
    unmarked, py_unmarked = _speedups.KeysAndSeqs("iii"), PyKeysAndSeqs("iii")
    for seq in range(1_000):
        for node in range(4):
            for gpu in range(8):
                unmarked.add((node, seq, gpu), seq)
                py_unmarked.add((node, seq, gpu), seq)
    # A group per snapshot: what the mark avoids.
    assert unmarked.nbytes > 2 * sizes[0] and py_unmarked.nbytes > 2 * py_sizes[0]
    with pytest.raises(ValueError):
        _speedups.KeysAndSeqs("iII")
    with pytest.raises(ValueError):
        PyKeysAndSeqs("iII")


def test_a_keyword_the_check_plans_do_not_know_is_refused(tmp_path: Path) -> None:
    # The check plans come from codegen, which refuses any keyword it does not read:
    # a plan is never looser than its schema.
    import shutil

    from codegen._model import SchemaError, load_schemas

    shutil.copytree(REPO / "schemas", tmp_path / "schemas")
    path = tmp_path / "schemas" / "step_time.schema.json"
    schema = orjson.loads(path.read_bytes())
    schema["properties"]["step"] = {"type": "integer", "minimum": 1, "multipleOf": 2}
    path.write_bytes(orjson.dumps(schema))
    with pytest.raises(SchemaError, match="multipleOf"):
        load_schemas(tmp_path / "schemas")


def test_a_check_the_fast_check_cannot_compile_means_no_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import attrs

    from traceml_records._checkplan import ValueCheck

    plan = _fastcheck.CHECKS["step_time"]
    fields = tuple(
        attrs.evolve(f, check=ValueCheck(kind="number", has_const=True, const=2.0))
        if f.name == "step"
        else f
        for f in plan.fields
    )
    monkeypatch.setitem(_fastcheck.CHECKS, "step_time", attrs.evolve(plan, fields=fields))
    assert _fastcheck.plan_for.__wrapped__("step_time") is None


@pytest.mark.parametrize("block", [7, 64, 1000])
def test_lines_across_blocks_or_longer_than_one(
    block: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "step_time.jsonl"
    write_step_time(path, 40, world=8)
    lines = path.read_bytes().splitlines(keepends=True)
    broken = lines[5].replace(b'"seq":', b'"seq":-')
    path.write_bytes(b"".join([*lines[:5], broken, *lines[5:-1], lines[-1], lines[3][:50]]))
    expected = validate_paths([path])
    assert [p.line for p in expected.problems] == [6, 42, 43]
    monkeypatch.setattr(_scan, "BLOCK_BYTES", block)
    assert validate_paths([path]) == expected


@pytest.mark.parametrize("where", ["table", "rows"])
def test_a_value_of_another_type_than_its_column_leaves_the_line(where: str) -> None:
    # The layout comes from the same schemas as the plan, so this cannot happen with
    # the shipped tables; the extractor must still never return columns of unequal
    # lengths (or a line it did not read whole).
    from traceml_records._fastcheck import _c_layout, frames_layout

    assert _speedups is not None
    layout = frames_layout("step_time")
    assert layout is not None
    top, (source, keys, map_keys, leaves) = _c_layout("step_time", layout)
    if where == "table":
        from traceml_records._generated.tables import TABLES

        at = [name for name, _, _ in TABLES["step_time"]].index("step")
        top = (*top[:at], (top[at][0], "string"), *top[at + 1 :])  # step: an integer
    else:
        leaves = (*leaves[:-1], (leaves[-1][0], "bool"))  # n_calls: an integer
    extractor = _speedups.Checker(plan_for("step_time"), (top, (source, keys, map_keys, leaves)))
    data = _LINE * 3
    pos, lines, table, rows = extractor.extract(data, 0, len(data), _speedups.KeysAndSeqs("ii"), 0)
    assert (pos, lines) == (0, 0)
    assert {c[3] for c in table} == {0} and {c[3] for c in rows} == {0}
