"""TraceML's own work per traced step, in CPU instructions (noise-free, needs valgrind).

    python -m bench.overhead.instructions [--steps 1000,3000]

Runs workloads/instructions_loop.py under ``valgrind --tool=callgrind`` twice
(``--steps`` traced steps each) and reports (instructions of the longer run - the
shorter) / (step difference): the instructions one traced step costs, start-up and
shutdown cancelling out. The loop has no torch (a torch import costs ~5 G
instructions under valgrind): it calls TraceML's forward, backward (the wrapped
``torch.autograd.backward``, through an unwrapped ``Tensor.backward``) and optimizer hooks and the
DataLoader wait the way a training step does, with the items going to a real
``RankSender``. A count moves only when the code does, so it shows a change of a
fraction of a microsecond that the timed benches cannot see on a busy machine.

Last line: ``instructions_per_traced_step=<x> instructions_per_idle_step=<y>
instructions_per_traced_step_inline=<z>`` (idle: the same hooks called outside a step,
as in an untraced step; inline: the step's items built on the training thread, as with
a sink given to ``init``). Figures only.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LOOP = Path(__file__).resolve().parent / "workloads" / "instructions_loop.py"


def _count(kind: str, steps: int, tmp: Path, *extra: str) -> int:
    out = subprocess.run(
        [
            "valgrind", "--tool=callgrind", "--cache-sim=no",
            f"--callgrind-out-file={tmp / 'callgrind.out'}",
            sys.executable, str(LOOP), kind, str(steps), *extra,
        ],
        env={**os.environ, "PYTHONHASHSEED": "0"}, capture_output=True, text=True,
        check=True, timeout=600,
    )  # fmt: skip
    match = re.search(r"Collected : (\d+)", out.stderr)
    if match is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{out.stderr[-2000:]}")
    return int(match.group(1))


def per_step(kind: str, low: int, high: int, tmp: Path, *extra: str) -> float:
    return (_count(kind, high, tmp, *extra) - _count(kind, low, tmp, *extra)) / (high - low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="1000,3000", help="the two run lengths")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    low, high = (int(part) for part in args.steps.split(","))
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        traced = per_step("traced", low, high, tmp)
        idle = per_step("idle", low, high, tmp)
        inline = per_step("traced", low, high, tmp, "inline")
    print(
        f"instructions_per_traced_step={traced:.0f} instructions_per_idle_step={idle:.0f} "
        f"instructions_per_traced_step_inline={inline:.0f}"
    )


if __name__ == "__main__":
    main()
