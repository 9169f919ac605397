#!/usr/bin/env bash
# The GPU check: real-CUDA checks of what TraceML writes (docs/gpu-check.md).
#
#   scripts/gpu-check.sh [WHEELS_DIR] [--only NAME,...]
#
# Installs the wheels in WHEELS_DIR (default .whl; orjson and jsonschema-rs where
# the machine lacks them) into /tmp/gpu-check-site, runs every check in its own
# process with src/ on PYTHONPATH and TraceML in pure Python (TRACEML_PURE_PYTHON=1:
# the C encoder is not built there), and writes gpu-check.{json,txt} and
# gpu-check-logs.tar.gz under $OUT (else ./gpu-check-out). One line per check, then
# `gpu_check: <n> passed, <m> failed, <k> skipped`. Exit status: 0 none failed,
# 1 a check failed, 3 no CUDA device, 4 the wheels did not install.
# GPU_CHECK_PYTHON picks the interpreter (default python3).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wheels="${1:-.whl}"
[ $# -gt 0 ] && shift
wheels="$(cd "$wheels" 2>/dev/null && pwd || echo "$wheels")"
cd "$root" || exit 2
export PYTHONPATH="$root/src:$root/scripts${PYTHONPATH:+:$PYTHONPATH}"
export TRACEML_PURE_PYTHON=1 PYTHONUNBUFFERED=1
exec "${GPU_CHECK_PYTHON:-python3}" -m gpu_check --wheels "$wheels" "$@"
