"""Which samples of a py-spy profile are TraceML's (``bench.overhead.sampled``):
its own frames in a training loop, not those that only pass the call on, and its
threads' samples that are work rather than waiting."""

from __future__ import annotations

import collections
import linecache
import re
from collections.abc import Iterable
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
# A frame of the training loop: samples under it are the updates'.
LOOP_FRAMES = {
    "lightning": "advance (lightning/pytorch/loops/training_epoch_loop.py",
    "hf": "_inner_training_loop (transformers/trainer.py",
}
# Source text of a frame that only passes the call on (its callees are not TraceML's):
# a wrapper calling what it wraps (``original(...)``, ``original_to(...)``), a gate's
# forwarding call.
PASS_ON = re.compile(r"\boriginal\w*\(|\bgate_call\(|PyObject_Vectorcall\(fn")
# The deepest Python frame of a thread waiting for work, and the native frames of one
# blocked (on the interpreter's lock, most often: those samples are not work either).
WAITING = ("Condition.wait (threading.py", "Event.wait (threading.py")
BLOCKED = ("pthread_cond_timedwait ", "pthread_cond_wait ", "pthread_cond_clockwait ", "sem_")
_TRACEML_FRAME = re.compile(r"\((traceml_ai/[^:]+):(\d+)\)")


def passes_on(frame: str, src: Path = SRC) -> bool:
    """Whether ``frame`` (py-spy's ``function (path:line)``) only calls into the framework.

    A C frame's line is its return address's, the statement after the call, so the
    three lines before it are read too."""
    match = _TRACEML_FRAME.search(frame)
    if match is None:
        return False
    path, line = match.group(1), int(match.group(2))
    lines = range(line - 3, line + 1) if path.endswith(".c") else [line]
    text = "".join(linecache.getline(str(src / path), i) for i in lines)
    return PASS_ON.search(text) is not None


def _is_traceml(frame: str) -> bool:
    return "traceml_ai/" in frame and "traceml_ai/launch/bootstrap.py" not in frame


def shares(
    raw: Iterable[str], loop_frame: str, src: Path = SRC
) -> tuple[int, int, int, collections.Counter[str]]:
    """From py-spy's raw lines (``frame;frame;... count``): (the training loop's samples,
    TraceML's own among them, TraceML's threads' working samples, TraceML's own by
    function)."""
    loop = own = threads = 0
    by_function: collections.Counter[str] = collections.Counter()
    for line in raw:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread_at = next((i for i, f in enumerate(frames) if f.startswith("thread (")), None)
        if thread_at is None or not any(
            "traceml_ai.launch.bootstrap" in f for f in frames[:thread_at]
        ):
            continue  # not the rank's process
        thread = frames[thread_at].split(": ", 1)[-1]
        below = frames[thread_at + 1 :]
        if thread.startswith("traceml-"):
            python = [f for f in below if ".py:" in f]
            waiting = python and python[-1].startswith(WAITING)
            if not waiting and not any(f.startswith(BLOCKED) for f in below):
                threads += count
            continue
        if thread != "MainThread":
            continue
        at = next((i for i, f in enumerate(below) if loop_frame in f), None)
        if at is None:
            continue
        loop += count
        ours = [f for f in below[at + 1 :] if _is_traceml(f)]
        if ours and not passes_on(ours[-1], src):
            own += count
            by_function[ours[-1].split(" (")[0]] += count
    return loop, own, threads, by_function
