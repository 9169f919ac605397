#!/usr/bin/env bash
# The main job: set up the environment if needed, then train the example under
# `traceml run` with every stream exported, and validate the files it wrote.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
venv="${VENV:-$root/.venv}"
cd "$root"
run_name="example-$(date -u +%Y%m%dT%H%M%SZ)"
"$venv/bin/traceml" run --run-name "$run_name" --interval 0.5 --exporter jsonl --export-streams all examples/train.py "$@"
"$venv/bin/traceml" validate "logs/$run_name/aggregator/export"
echo "export files: logs/$run_name/aggregator/export/"
