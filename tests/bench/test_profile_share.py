"""The sampled share of TraceML in a training loop (bench/overhead/profile_share.py, read
by ``python -m bench.overhead.sampled``): which samples are TraceML's own, which only pass
through its wrappers, and which of its threads' samples are work."""

from __future__ import annotations

from pathlib import Path

from bench.overhead.profile_share import passes_on, shares

LOOP = "advance (lightning/pytorch/loops/training_epoch_loop.py:120)"
RANK = 'process 7:"python -m traceml_ai.launch.bootstrap train.py"'
LAUNCHER = 'process 6:"python -m traceml_ai run train.py"'


def _src(tmp: Path) -> Path:
    wrapper = tmp / "traceml_ai" / "integrations" / "lightning.py"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(
        "def run():\n    count = updates(loop)\n    result = original(*args)\n"
        "    return _timed(timer, lambda: original_to(*args))\n    originals = 1\n"
    )
    gate = tmp / "traceml_ai" / "rank" / "_timing" / "hotpath.c"
    gate.parent.mkdir(parents=True)
    gate.write_text("x;\nx;\nresult = gate_call(gate->original, args);\nx;\nx;\nx;\nx;\n")
    return tmp


def _line(process: str, thread: str, *frames: str, count: int = 1) -> str:
    return ";".join([process, f"thread (7): {thread}", *frames]) + f" {count}\n"


def test_passing_the_call_on_is_told_by_the_source_line(tmp_path: Path) -> None:
    src = _src(tmp_path)
    assert passes_on("run (traceml_ai/integrations/lightning.py:3)", src)
    assert not passes_on("run (traceml_ai/integrations/lightning.py:2)", src)
    assert passes_on("<lambda> (traceml_ai/integrations/lightning.py:4)", src)
    assert not passes_on("run (traceml_ai/integrations/lightning.py:5)", src)
    # A C frame's line is the statement after its call: the lines before count.
    assert passes_on("gate_backward (traceml_ai/rank/_timing/hotpath.c:4)", src)
    assert not passes_on("gate_backward (traceml_ai/rank/_timing/hotpath.c:7)", src)
    assert not passes_on("forward (torch/nn/modules/module.py:10)", src)


def test_only_the_training_loops_own_traceml_samples_count(tmp_path: Path) -> None:
    src = _src(tmp_path)
    wrapper_own = "run (traceml_ai/integrations/lightning.py:2)"
    wrapper_passing = "run (traceml_ai/integrations/lightning.py:3)"
    raw = [
        _line(RANK, "MainThread", "main (train.py:1)", LOOP, wrapper_own, count=3),
        # Lightning's own work under TraceML's wrapper: not TraceML's.
        _line(RANK, "MainThread", LOOP, wrapper_passing, "step (lightning/x.py:5)", count=10),
        # TraceML's frame below the framework's, below the wrapper: TraceML's again.
        _line(
            RANK,
            "MainThread",
            LOOP,
            wrapper_passing,
            "backward (torch/x.py:1)",
            "gate_backward (traceml_ai/rank/_timing/hotpath.c:7)",
            count=2,
        ),
        _line(RANK, "MainThread", LOOP, "step (torch/optim/sgd.py:9)", count=5),
        # Outside the loop (start-up), another process, a thread of torch's.
        _line(RANK, "MainThread", "import (x.py:1)", wrapper_own, count=50),
        _line(LAUNCHER, "MainThread", LOOP, wrapper_own, count=50),
        _line(RANK, "Thread-3", LOOP, wrapper_own, count=50),
        # TraceML's threads: waiting, and working (Python or in a system call).
        _line(
            RANK,
            "traceml-sender",
            "_run (s.py:1)",
            "Event.wait (threading.py:629)",
            "Condition.wait (threading.py:331)",
            "0x1 (libc.so.6)",
            count=100,
        ),
        _line(RANK, "traceml-sender", "_run (s.py:1)", "_flush (s.py:9)", count=4),
        _line(RANK, "traceml-sender", "_flush (s.py:9)", "sock_sendall (socketmodule.c:1)"),
        # Blocked on the interpreter's lock: not work.
        _line(
            RANK,
            "traceml-sender",
            "_flush (s.py:9)",
            "pthread_cond_timedwait (libc.so.6)",
            "0x2 (libc.so.6)",
            count=7,
        ),
        "not a sample line\n",
    ]
    loop, own, threads, by_function = shares(raw, LOOP.split(":")[0], src)
    assert loop == 3 + 10 + 2 + 5
    assert own == 3 + 2
    assert threads == 5
    assert dict(by_function) == {"run": 3, "gate_backward": 2}
