"""A host-timed step's two items encoded in C (``_speedups.encode_host_step``).

The rank's sender thread takes a step off CUDA straight from its phases to the bytes
of its step_memory and step_time items. Those must be the bytes ``wire.encode_item``
gives for the items ``StepTimer`` builds in Python (the oracle here), and the phases
must be left zeroed exactly as the Python path leaves them; whatever the C path does
not handle is handed back (``None``) and built in Python.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.traceml_ai.rank.conftest import needs_c
from traceml_ai.rank._timing import event_names, hotpath_py, step_timer
from traceml_ai.rank._timing.step_recorder import StepHistory, StepRecorder
from traceml_ai.rank.sink import RecordingSink
from traceml_ai.testing import FakeCuda
from traceml_ai.transport.wire import encode_item

encode = step_timer._encode_host_step


@needs_c
def test_the_step_encoder_is_built_and_used() -> None:
    # CI builds the extension: a silent fallback would leave the C path untested.
    assert encode is not None, "traceml_records._speedups was not built or is disabled"


class _Items:
    """A sink keeping each item as wire.encode_item encodes it."""

    def __init__(self) -> None:
        self.data: list[tuple[str, bytes]] = []

    def put(self, stream: str, item: Any) -> None:
        self.data.append((stream, encode_item(item)))


def _python_items(
    acc: dict[str, Any], step: int, ts: int, device: str, seq: tuple[int, int]
) -> list[tuple[str, bytes]]:
    sink = _Items()
    timer = step_timer.StepTimer(sink, FakeCuda(available=False), lambda m: None, lambda e: None)
    timer.continue_counts(0, seq[0], seq[1])
    timer._send_host(step, ts, device, acc)
    return sink.data


def _state(acc: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    return {name: (p.cpu_ns, p.n_calls, p.missing, list(p.pairs)) for name, p in acc.items()}


def _phase(cpu_ns: int, n_calls: int, missing: bool) -> Any:
    phase = hotpath_py.Phase()
    phase.cpu_ns, phase.n_calls, phase.missing = cpu_ns, n_calls, missing
    if not missing:
        phase.pairs = [(object(), object())]  # an earlier CUDA step's events
    return phase


phase_names = st.one_of(
    st.sampled_from([event_names.FORWARD, event_names.BACKWARD, event_names.STEP_TIME, "a", "b\n"]),
    st.text(max_size=12),
)
phases = st.builds(
    _phase,
    st.one_of(st.integers(0, 10**13), st.integers(0, 2**63), st.sampled_from([0, 1, 99, 100])),
    st.one_of(st.integers(0, 3), st.integers(0, 2**40)),
    st.booleans(),
)
ints = st.one_of(st.integers(0, 2**63 - 1), st.integers(-(2**63), 2**64 + 5))


@given(
    acc=st.dictionaries(phase_names, phases, max_size=8),
    step=ints,
    ts=ints,
    device=st.one_of(st.sampled_from(["cpu", "mps", "cuda:1"]), st.text(max_size=6)),
    seq=st.tuples(ints, ints),
)
@needs_c
def test_c_writes_the_bytes_python_writes_and_zeroes_the_phases_alike(
    acc: dict[str, Any], step: int, ts: int, device: str, seq: tuple[int, int]
) -> None:
    assert encode is not None
    python_acc = copy.deepcopy(acc)
    try:
        expected: Any = _python_items(python_acc, step, ts, device, seq)
    except Exception as exc:  # what Python raises, C must leave to it
        expected = type(exc)
    before = _state(acc)
    got = encode(acc, step, ts, device, seq[0], seq[1])
    if got is None:
        # Handed back untouched: the caller builds the items in Python.
        assert _state(acc) == before
        return
    assert [("step_memory", got[0]), ("step_time", got[1])] == expected
    after, python_after = _state(acc), _state(python_acc)
    # Pairs are compared by length (the deep copy made new objects).
    assert {k: (*v[:3], len(v[3])) for k, v in after.items()} == {
        k: (*v[:3], len(v[3])) for k, v in python_after.items()
    }


@needs_c
def test_the_cases_it_hands_back_to_python() -> None:
    assert encode is not None
    good = {event_names.FORWARD: _phase(1_000, 1, True)}
    assert encode(good, 1, 2, "cpu", 0, 0) is not None
    for acc, step, device in [
        ({event_names.FORWARD: object()}, 1, "cpu"),  # not a phase
        ({1: _phase(1, 1, True)}, 1, "cpu"),  # a name that is not a str
        ({event_names.FORWARD: _phase(10**400, 1, True)}, 1, "cpu"),  # beyond a double
        (good, 2**70, "cpu"),  # an int beyond 64 bits
        (good, 1, "\ud800"),  # a lone surrogate
        ({str(i): _phase(1, 1, True) for i in range(70)}, 1, "cpu"),  # many phases
    ]:
        before = {k: (p.cpu_ns, p.n_calls) for k, p in acc.items() if hasattr(p, "cpu_ns")}
        assert encode(acc, step, 0, device, 0, 0) is None
        after = {k: (p.cpu_ns, p.n_calls) for k, p in acc.items() if hasattr(p, "cpu_ns")}
        assert after == before


@needs_c
def test_a_timer_sends_encoded_steps_through_the_recorder_to_the_sender() -> None:
    """The runtime's path: StepTimer -> StepRecorder -> a sink's put_encoded_many, and
    the recorder still counts the steps, keeps their events and applies
    --trace-max-steps."""
    sent: list[tuple[str, bytes]] = []

    class Sender:
        def put(self, stream: str, item: Any) -> None:
            raise AssertionError("a step off CUDA should arrive encoded")

        def put_encoded_many(self, stream: str, items: Sequence[bytes]) -> None:
            sent.extend((stream, data) for data in items)

    sender = Sender()
    recorder = StepRecorder(sender, 2, history=StepHistory(keep_events=True), encoded=sender)
    timer = step_timer.StepTimer(recorder, FakeCuda(available=False), lambda m: None, print)
    timer.defer = True
    timer.encoded_sink = recorder
    for _ in range(3):
        timer.begin(None)
        timer.add_host(event_names.DATALOADER_NEXT, 2_000_000)
        timer.end()
    timer.build_ended()
    # One call per stream for the steps built together; step 3 cut.
    assert [stream for stream, _ in sent] == ["step_memory"] * 2 + ["step_time"] * 2
    recent, total = recorder.history.snapshot()
    assert total == 2
    assert [step for step, _ in recent] == [1, 2]
    assert recent[0][1][event_names.DATALOADER_NEXT]["cpu"]["cpu_ms"] == 2.0
    assert b'"seq":1,"step":2,' in sent[3][1]


class _BatchSink(RecordingSink):
    """A sender's two ways in: dicts (``put``) and encoded items of one stream at once."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def put_encoded_many(self, stream: str, items: list[bytes]) -> None:
        self.calls.append((stream, len(items)))
        for data in items:
            self.put(stream, orjson.loads(data))


def _deferred_timer(sink: Any, max_steps: int | None = None) -> step_timer.StepTimer:
    recorder = StepRecorder(sink, max_steps, history=StepHistory(keep_events=True), encoded=sink)
    timer = step_timer.StepTimer(recorder, FakeCuda(available=False), lambda m: None, print)
    timer.defer = True
    timer.encoded_sink = recorder
    return timer


@needs_c
def test_the_builder_hands_a_flush_of_steps_over_in_one_call_per_stream() -> None:
    """Steps built together reach the sink in one call per stream; a step the encoder
    hands back (too many phases) goes as dicts between them, so seq and step stay in
    order; --trace-max-steps cuts within a batch; the recorder counts what it kept."""
    sink = _BatchSink()
    timer = _deferred_timer(sink, max_steps=4)
    for step in range(1, 6):
        timer.begin(None)
        if step == 2:
            for i in range(70):
                timer.add_host(f"user_phase_{i}", 1_000)
        timer.end()
    timer.build_ended()
    # Step 1, then step 2 as dicts, then steps 3 and 4 (5 is past --trace-max-steps).
    assert sink.calls == [
        ("step_memory", 1),
        ("step_time", 1),
        ("step_memory", 2),
        ("step_time", 2),
    ]
    for stream in ("step_memory", "step_time"):
        items = sink.items(stream)
        assert [item["step"] for item in items] == [1, 2, 3, 4], stream
        assert [item["seq"] for item in items] == [0, 1, 2, 3], stream
    assert len(sink.items("step_time")[1]["events"]) == 71  # its phases and the step's
    recorder = timer.encoded_sink
    assert isinstance(recorder, StepRecorder)
    recent, total = recorder.history.snapshot()
    assert total == 4 and recorder.history.last_step == 4
    assert [step for step, _ in recent] == [1, 2, 3, 4]


@needs_c
def test_steps_built_before_a_failing_one_are_still_handed_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink = _BatchSink()
    timer = _deferred_timer(sink)
    for _ in range(3):
        timer.begin(None)
        timer.end()
    calls: list[int] = []
    real = step_timer._encode_host_step
    assert real is not None

    def failing_second(*args: Any) -> Any:
        calls.append(args[1])
        if len(calls) == 2:
            raise RuntimeError("encoder bug")
        return real(*args)

    monkeypatch.setattr(step_timer, "_encode_host_step", failing_second)
    with pytest.raises(RuntimeError, match="encoder bug"):
        timer.build_ended()
    assert [item["step"] for item in sink.items("step_time")] == [1]
    timer.build_ended()  # what is left goes on
    assert [item["step"] for item in sink.items("step_time")] == [1, 3]


def test_a_sink_without_put_encoded_gets_the_items_decoded() -> None:
    sink = RecordingSink()
    recorder = StepRecorder(sink, history=StepHistory(keep_events=False))
    timer = step_timer.StepTimer(recorder, FakeCuda(available=False), lambda m: None, print)
    timer.encoded_sink = recorder
    timer.begin(None)
    timer.end()
    assert sink.streams() == ["step_memory", "step_time"]
    assert sink.items("step_time")[0]["step"] == 1


@pytest.mark.parametrize("own_sender", [True, False])
def test_the_runtime_encodes_steps_only_for_its_own_sender(
    own_sender: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """init's own sender gets steps encoded; a sink given to init gets dicts, even one
    that takes encoded items too."""
    import traceml_ai as traceml
    from traceml_ai.rank._runtime import sdk
    from traceml_ai.transport.wire import ENV_AGGREGATOR_ADDR

    class Sender(RecordingSink):
        """What the runtime uses of ``RankSender``; encoded items decoded on arrival."""

        pending_items = 0

        def start(self) -> None:
            pass

        def close(self, timeout: float = 0.0) -> None:
            pass

        def set_producer(self, producer: Any) -> None:
            pass

        def wake(self) -> None:
            pass

        def note_tracker_runs(self, runs: Any) -> None:
            pass

    sink = Sender()
    if own_sender:
        monkeypatch.setattr(sdk, "build_sender", lambda *args: sink)
        monkeypatch.setenv(ENV_AGGREGATOR_ADDR, "127.0.0.1:9")
        traceml.init(sampler_interval=60.0)
    else:
        traceml.init(sink=sink, sampler_interval=60.0)
    try:
        runtime = sdk._runtime
        assert runtime is not None
        assert (runtime.timer.encoded_sink is not None) is own_sender
        with traceml.trace_step(None):
            pass
        runtime.timer.build_ended()
    finally:
        traceml.shutdown()
    # Step numbers go on from an earlier init of this process: one step, one item each.
    assert len(sink.items("step_time")) == len(sink.items("step_memory")) == 1


# -- the builder's loop in C (_speedups.encode_host_steps) ------------------------------

encode_run = step_timer._encode_host_steps


def _ended(steps: int) -> tuple[Any, Any]:
    from collections import deque

    accs = deque(
        {event_names.DATALOADER_NEXT: _phase(1_000 * (i + 1), 1, True)} for i in range(steps)
    )
    ats = deque((i + 1, 1_700_000_000_000_000_000 + i, "cpu") for i in range(steps))
    return accs, ats


@needs_c
def test_the_loop_encodes_every_step_in_order_and_hands_the_phases_back() -> None:
    assert encode is not None and encode_run is not None
    accs, ats = _ended(3)
    originals = list(accs)
    spare: list[Any] = []
    steps, memories, times, seq_time, seq_mem, stop = encode_run(encode, accs, ats, spare, 7, 3)
    assert (steps, seq_time, seq_mem, stop) == ([1, 2, 3], 10, 6, None)
    assert not accs and not ats and spare == originals
    assert [orjson.loads(m)["seq"] for m in memories] == [3, 4, 5]
    assert [orjson.loads(t)["seq"] for t in times] == [7, 8, 9]
    assert orjson.loads(times[1])["events"][event_names.DATALOADER_NEXT]["cpu"]["cpu_ms"] == 0.002


@needs_c
def test_the_loop_stops_at_a_step_left_to_python_and_at_an_error() -> None:
    assert encode is not None and encode_run is not None
    accs, ats = _ended(4)
    second = accs[1]
    calls: list[int] = []

    def picky(*args: Any) -> Any:
        calls.append(args[1])
        if args[1] == 2:
            return None
        if args[1] == 3:
            raise RuntimeError("encoder bug")
        return encode(*args)

    spare: list[Any] = []
    steps, _, _, seq_time, _, stop = encode_run(picky, accs, ats, spare, 0, 0)
    # Step 2 is handed back whole, taken off the queues; seq moved for step 1 only.
    assert steps == [1] and seq_time == 1
    assert stop == (2, 1_700_000_000_000_000_001, "cpu", second)
    steps, _, _, seq_time, _, stop = encode_run(picky, accs, ats, spare, seq_time, 1)
    # Step 3 raised: dropped, and the exception handed back; step 4 waits.
    assert steps == [] and seq_time == 1 and isinstance(stop, RuntimeError)
    assert len(accs) == len(ats) == 1 and calls == [1, 2, 3]


@needs_c
def test_the_loop_refuses_what_is_not_an_ended_step() -> None:
    assert encode is not None and encode_run is not None
    accs, _ = _ended(1)
    from collections import deque

    with pytest.raises(TypeError):
        encode_run(encode, accs, deque([(1, 2)]), [], 0, 0)
    with pytest.raises(TypeError):
        encode_run(lambda *a: 42, *_ended(1), [], 0, 0)
