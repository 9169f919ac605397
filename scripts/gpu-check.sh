#!/usr/bin/env bash
# The GPU check: real-CUDA checks of what TraceML writes (docs/gpu-check.md).
#
#   scripts/gpu-check.sh [WHEELS_DIR] [--only NAME,...] [--lanes default,pure]
#
# Installs the wheels in WHEELS_DIR (default .whl; what the machine lacks) into
# /tmp/gpu-check-site, then runs two lanes, one after the other, each with every check
# in its own process:
#   default  TraceML as a default install runs it: the C extensions compiled first
#            (setup.py build_ext on a copy of src/ in the scratch folder);
#   pure     TRACEML_PURE_PYTHON=1, the pure-Python paths.
# One line per check ([lane] PASS|FAIL|SKIP name: figures), one summary line per lane,
# then `gpu_check: default <n> passed, ...; pure <n> passed, ...`. Both lanes together
# are bounded to 450 s (about 8 minutes with the probe and the wheels). The report
# (gpu-check.{json,txt}, gpu-check-logs.tar.gz) goes under $OUT, else ./gpu-check-out.
# Exit status: 0 none failed, 1 a check failed, 3 no CUDA device, 4 the wheels did not
# install, 5 the C extensions did not build (one line says why; the pure lane still runs).
# GPU_CHECK_PYTHON picks the interpreter (default python3).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wheels="${1:-.whl}"
[ $# -gt 0 ] && shift
wheels="$(cd "$wheels" 2>/dev/null && pwd || echo "$wheels")"
cd "$root" || exit 2
# From the repository root, `-m scripts.gpu_check` puts the root first on sys.path:
# the check and the benches' estimator (bench/overhead/paired.py) import as packages.
export PYTHONUNBUFFERED=1
exec "${GPU_CHECK_PYTHON:-python3}" -m scripts.gpu_check --wheels "$wheels" "$@"
