#!/usr/bin/env bash
# The test command: set up the environment if needed, then run the whole suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
venv="${VENV:-$root/.venv}"
cd "$root"
exec "$venv/bin/python" -m pytest -q "$@"
