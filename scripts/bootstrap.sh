#!/usr/bin/env bash
# Create (or reuse) a virtual environment with the project and its test tools.
# Usage: source this file, or run it; VENV picks the folder (default .venv).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$root/.venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
# torch first, pinned to the CPU build, so nothing later pulls a CUDA build.
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  "$venv/bin/python" -m pip install -q "torch==2.13.0"
fi
# The framework extras (hf, lightning) require torch: the constraint keeps the CPU
# build installed above instead of letting pip pick another. The live views' extras
# (prometheus, otel, dashboard) and the trackers' (tensorboard, mlflow, wandb) come too: the
# tests drive them against real receivers
# (the test extra brings mlflow, playwright and opentelemetry-proto; playwright drives
# the system's chromium, so no `playwright install` and no browser download).
"$venv/bin/python" -m pip install -q -c <(echo "torch==2.13.0") \
  -e "$root[test,ray,plot,frames,hf,lightning,prometheus,otel,dashboard,tensorboard,mlflow,wandb]"
# TraceML 0.5.0's published source distribution: its examples/ are real user scripts
# that tests/e2e/test_compat_examples_050.py runs unmodified (kept out of this repo).
compat="$venv/compat050"
if [ ! -f "$compat/traceml_ai-0.5.0.tar.gz" ]; then
  "$venv/bin/python" -m pip download -q --no-deps --no-binary :all: "traceml-ai==0.5.0" -d "$compat"
fi
