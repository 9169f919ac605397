"""A soak of real 2-rank ``traceml run`` jobs with garbage thrown at the aggregator port.

``python -m bench.soak [--runs N] [--steps S] [--sleep-ms MS] [--rate R] [--keep DIR]``

Each run is ``traceml run --nproc-per-node 2 --exporter jsonl examples/train.py``
(gloo DDP on CPU). Rank 0 writes the aggregator's address to a file before training
starts (a small wrapper script), and while the ranks train, a few threads throw
garbage at that port (127.0.0.1 only, bounded in rate and in connections):

- random bytes of random length;
- a valid frame with the run's wire format but a wrong token, cut short;
- a frame header that announces more (or fewer) bytes than follow, then close;
- a header that announces a huge frame, then nothing;
- an HTTP request; 100 kB of zero bytes (25,000 empty frame headers); a whole batch
  frame with a wrong token;
- a connect-and-hang: a connection that sends nothing and stays open until the run
  ends.

(``Garbage`` is also the flood of ``tests/traceml_ai/transport/test_hostile_traffic.py``.)

After each run it checks: exit status 0, no ``Traceback`` in the output, a cleanly
closed ``step_time.jsonl`` (closing line last, ``written_records`` equal to its data
lines, no duplicate ``(global_rank, step)``), and every step of every rank present,
or else the loss reported: ``dropped_batches`` > 0 in the closing lines, or
``finalization_warning.json`` naming an export loss or missing ranks. A run that is
missing lines and reports nothing is ``lost_unreported``; a run that exits non-zero,
prints a traceback or leaves a damaged file is ``failed``.

One line per run, then the last line: ``soak_runs=<n> lost_unreported=<k>
failed=<k>`` (and ``reported=<k>``: runs with a reported loss; ``garbage_conns``:
garbage connections over all runs). With ``--keep DIR`` the folders of runs that were
not clean are kept under DIR. Prints figures only; no timing is judged.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from traceml_ai.transport.wire import FRAME_HEADER, encode_frame, make_batch_message

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"
LOOPBACK = "127.0.0.1"
RUN_TIMEOUT_S = 300.0
HANG_KEEP = 50
"""Connect-and-hang connections kept open at once per thread (the oldest is closed)."""

# Rank 0 publishes the aggregator address; every rank waits for the go file so the
# garbage is already flowing when training starts.
RANK_SCRIPT = """\
import os, pathlib, runpy, sys, time
addr_file, go_file, train = sys.argv[1], sys.argv[2], sys.argv[3]
if os.environ.get("RANK", "0") == "0":
    tmp = addr_file + ".tmp"
    pathlib.Path(tmp).write_text(os.environ["TRACEML_AGGREGATOR_ADDR"])
    os.replace(tmp, addr_file)
end = time.monotonic() + 120
while not os.path.exists(go_file) and time.monotonic() < end:
    time.sleep(0.05)
sys.argv = [train, *sys.argv[4:]]
runpy.run_path(train, run_name="__main__")
"""

KINDS = (
    "random",
    "truncated",
    "wrong_length",
    "huge_length",
    "http",
    "zeros",
    "wrong_token",
    "hang",
)
_HTTP = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: curl/8\r\n\r\n"
_ZEROS = bytes(100 * 1024)


def _identity(rank: int) -> dict[str, object]:
    return {
        "global_rank": rank,
        "local_rank": rank,
        "world_size": 2,
        "local_world_size": 2,
        "node_rank": 0,
        "hostname": None,
        "pid": 1,
    }


def garbage(kind: str, rng: random.Random) -> bytes | None:
    """The bytes one garbage connection sends (None: connect and hang)."""
    if kind == "random":
        return rng.randbytes(rng.randrange(1, 4_000))
    if kind == "truncated":
        frame = encode_frame(
            make_batch_message(
                "x" * 43, _identity(rng.randrange(2)), "step_time", [{"seq": 1, "step": 1}]
            )
        )
        return frame[: rng.randrange(1, len(frame))]
    if kind == "wrong_length":
        body = rng.randbytes(rng.randrange(1, 2_000))
        announced = len(body) + rng.choice((-1, 1)) * rng.randrange(1, len(body) + 1)
        return FRAME_HEADER.pack(max(0, announced)) + body
    if kind == "huge_length":
        return FRAME_HEADER.pack(rng.randrange(1 << 24, 1 << 32))
    if kind == "http":
        return _HTTP
    if kind == "zeros":
        return _ZEROS
    if kind == "wrong_token":
        return encode_frame(
            make_batch_message("not-the-run-token", _identity(0), "step_time", [{"seq": 1}])
        )
    return None


class Garbage:
    """Garbage connections to one loopback port from ``threads`` threads, ``rate`` a
    second in all, until :meth:`stop`, ``max_seconds`` or ``max_connections``."""

    def __init__(
        self,
        port: int,
        *,
        rate: float,
        threads: int,
        seed: int,
        max_connections: int = 20_000,
        max_seconds: float = float("inf"),
    ) -> None:
        self.port = port
        self.connections = 0
        self.by_kind: dict[str, int] = {kind: 0 for kind in KINDS}
        self.max_connections = max_connections
        self.started = self.ended = time.monotonic()
        self._deadline = self.started + max_seconds
        self._interval = threads / rate
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(seed * 1000 + i,), daemon=True)
            for i in range(threads)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        self.ended = time.monotonic()

    def per_second(self) -> float:
        """Connections a second, from the start to :meth:`stop`."""
        return self.connections / max(self.ended - self.started, 1e-3)

    def _claim(self, kind: str) -> bool:
        with self._lock:
            if self.connections >= self.max_connections:
                return False
            self.connections += 1
            self.by_kind[kind] += 1
            return True

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        hanging: list[socket.socket] = []
        due = time.monotonic()
        try:
            while not self._stop.is_set() and time.monotonic() < self._deadline:
                due += self._interval
                self._stop.wait(max(0.0, due - time.monotonic()))
                kind = rng.choice(KINDS)
                if not self._claim(kind):
                    return
                payload = garbage(kind, rng)
                try:
                    sock = socket.create_connection((LOOPBACK, self.port), timeout=1.0)
                except OSError:
                    time.sleep(0.01)
                    continue
                if payload is None:
                    hanging.append(sock)
                    if len(hanging) > HANG_KEEP:
                        hanging.pop(0).close()
                    continue
                with contextlib.suppress(OSError):
                    sock.sendall(payload)
                sock.close()
        finally:
            for sock in hanging:
                sock.close()


@dataclass
class Outcome:
    """What one run left behind, judged."""

    verdict: str  # "ok", "reported", "lost_unreported" or "failed"
    expected: int
    present: int
    dropped_batches: int | None = None
    warning: str | None = None
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    garbage: int = 0


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")) if p
    )
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def judge(
    run_dir: Path, returncode: int | None, output: str, *, steps: int, ranks: int = 2
) -> Outcome:
    """The verdict on one finished run from its exit status, output and files."""
    expected = {(r, s) for r in range(ranks) for s in range(1, steps + 1)}
    out = Outcome(verdict="ok", expected=len(expected), present=0)
    if returncode != 0:
        out.problems.append(f"exit status {returncode}")
    if "Traceback" in output:
        out.problems.append("a traceback in the output")
    warning_path = run_dir / "finalization_warning.json"
    warning: dict[str, Any] | None = None
    if warning_path.exists():
        try:
            loaded = orjson.loads(warning_path.read_bytes())
        except orjson.JSONDecodeError:
            out.problems.append("finalization_warning.json is not JSON")
        else:
            if isinstance(loaded, dict):
                warning = loaded
                out.warning = str(loaded.get("reason"))
    path = run_dir / "aggregator" / "export" / "step_time.jsonl"
    keys: list[tuple[Any, Any]] = []
    closing: dict[str, Any] | None = None
    try:
        raw = path.read_bytes()
    except OSError as exc:
        out.problems.append(f"step_time.jsonl: {exc.strerror}")
        raw = b""
    if raw and not raw.endswith(b"\n"):
        out.problems.append("step_time.jsonl: last line unterminated")
    for line in raw.splitlines():
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            out.problems.append("step_time.jsonl: a line that is not JSON")
            continue
        if obj.get("closing") is True:
            if closing is not None:
                out.problems.append("step_time.jsonl: two closing lines")
            closing = obj
        elif closing is not None:
            out.problems.append("step_time.jsonl: a line after the closing line")
        else:
            keys.append((obj.get("global_rank"), obj.get("step")))
    if raw and closing is None:
        out.problems.append("step_time.jsonl: no closing line")
    if closing is not None:
        if closing.get("written_records") != len(keys):
            out.problems.append(
                f"step_time.jsonl: closing says {closing.get('written_records')} "
                f"written, {len(keys)} data lines"
            )
        dropped = closing.get("dropped_batches")
        out.dropped_batches = dropped if isinstance(dropped, int) else None
    if len(set(keys)) != len(keys):
        out.problems.append(f"step_time.jsonl: {len(keys) - len(set(keys))} duplicate keys")
    unexpected = set(keys) - expected
    if unexpected:
        out.problems.append(f"step_time.jsonl: {len(unexpected)} unexpected keys")
    out.present = len(set(keys) & expected)
    reported = (out.dropped_batches or 0) > 0 or (
        warning is not None
        and warning.get("reason") != "monitoring_incomplete"
        and (warning.get("export") is not None or warning.get("missing_ranks"))
    )
    if out.problems:
        out.verdict = "failed"
    elif out.present < out.expected:
        out.verdict = "reported" if reported else "lost_unreported"
    return out


def run_one(index: int, work: Path, *, steps: int, sleep_ms: float, rate: float) -> Outcome:
    """One ``traceml run`` of 2 ranks with garbage on its aggregator port, judged."""
    folder = work / f"run{index:03d}"
    folder.mkdir()
    logs = folder / "logs"
    script = folder / "rank.py"
    script.write_text(RANK_SCRIPT)
    addr_file, go_file = folder / "addr", folder / "go"
    cmd = [
        sys.executable, "-m", "traceml_ai", "run",
        "--logs-dir", str(logs), "--run-name", "soak", "--interval", "0.2",
        "--nproc-per-node", "2", "--master-port", str(_free_port()),
        "--exporter", "jsonl",
        str(script), str(addr_file), str(go_file), str(TRAIN),
        "--steps", str(steps), "--sleep-ms", str(sleep_ms),
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=folder,
        env=_clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    flood: Garbage | None = None
    output = ""
    try:
        deadline = time.monotonic() + 120
        while not addr_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if addr_file.exists():
            port = int(addr_file.read_text().rsplit(":", 1)[1])
            flood = Garbage(port, rate=rate, threads=3, seed=index)
            flood.start()
            time.sleep(0.5)  # garbage is flowing before the first step
        go_file.write_text("go")
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        output += "\n(soak: killed after the timeout)"
    finally:
        if flood is not None:
            flood.stop()
    outcome = judge(logs / "soak", proc.returncode, output, steps=steps)
    if not addr_file.exists():
        outcome.problems.append("no rank wrote the aggregator address")
        outcome.verdict = "failed"
    outcome.seconds = time.monotonic() - started
    outcome.garbage = flood.connections if flood is not None else 0
    (folder / "output.txt").write_text(output)
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=30, help="training steps per rank")
    parser.add_argument("--sleep-ms", type=float, default=50.0, help="extra work per step")
    parser.add_argument("--rate", type=float, default=150.0, help="garbage connections/s")
    parser.add_argument("--keep", type=Path, default=None, help="keep runs that were not ok")
    args = parser.parse_args(argv)
    counts = {"ok": 0, "reported": 0, "lost_unreported": 0, "failed": 0}
    total_garbage = 0
    with tempfile.TemporaryDirectory(prefix="traceml-soak-") as tmp:
        work = Path(tmp)
        for index in range(args.runs):
            o = run_one(index, work, steps=args.steps, sleep_ms=args.sleep_ms, rate=args.rate)
            counts[o.verdict] += 1
            total_garbage += o.garbage
            print(
                f"run={index} verdict={o.verdict} step_time={o.present}/{o.expected} "
                f"dropped_batches={o.dropped_batches} warning={o.warning} "
                f"garbage_conns={o.garbage} seconds={o.seconds:.1f}"
                + (f" problems={'; '.join(o.problems)}" if o.problems else ""),
                flush=True,
            )
            if o.verdict != "ok" and args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                shutil.copytree(work / f"run{index:03d}", args.keep / f"run{index:03d}")
    print(
        f"soak_runs={args.runs} lost_unreported={counts['lost_unreported']} "
        f"failed={counts['failed']} reported={counts['reported']} "
        f"garbage_conns={total_garbage}"
    )
    return 0 if counts["lost_unreported"] == 0 and counts["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
