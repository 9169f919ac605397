#!/usr/bin/env bash
# Download, here, the wheels the GPU machine lacks (docs/gpu-check.md): orjson,
# jsonschema-rs and cattrs (with the attrs and typing-extensions versions cattrs
# needs, which may be newer than the image's) for CPython 3.12 on x86-64 Linux,
# into .whl/ at the repo root, and keep .whl/ out of git (.git/info/exclude).
# Versions: those of the project's venv (.venv), else the ones below;
# ORJSON_VERSION / JSONSCHEMA_RS_VERSION override.
#
#   bash scripts/gpu_check/fetch_wheels.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"
[ -x "$py" ] || py=python3
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || echo "$2"; }
orjson="${ORJSON_VERSION:-$(version orjson 3.13.0)}"
jsrs="${JSONSCHEMA_RS_VERSION:-$(version jsonschema-rs 0.61.2)}"
cattrs="$(version cattrs 26.2.1)"
attrs="$(version attrs 26.1.0)"
typing_extensions="$(version typing_extensions 4.16.0)"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
rm -rf .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl "orjson==$orjson" "jsonschema-rs==$jsrs" \
  "cattrs==$cattrs" "attrs==$attrs" "typing-extensions==$typing_extensions"
ls -l .whl
