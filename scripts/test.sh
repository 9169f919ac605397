#!/usr/bin/env bash
# The test command: set up the environment if needed, then run the tests.
#
#   bash scripts/test.sh [--fast | --e2e | --slow] [pytest arguments...]
#
# Without a lane flag: every test (what CI runs). --fast: the unit lane, every test
# marked neither e2e nor slow (a few minutes on 2 cores); --e2e and --slow: those
# lanes alone. docs/testing.md says what each lane holds and how long it takes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lane=()
case "${1:-}" in
  --fast) lane=(-m "unit"); shift ;;
  --e2e) lane=(-m "e2e"); shift ;;
  --slow) lane=(-m "slow"); shift ;;
esac
bash "$root/scripts/bootstrap.sh"
venv="${VENV:-$root/.venv}"
cd "$root"
if [ "${#lane[@]}" -gt 0 ]; then
  # The unit lane takes the quick hypothesis profile unless one is named.
  [ "${lane[1]}" = "unit" ] && export FAST="${FAST:-1}"
  exec "$venv/bin/python" -m pytest -q "${lane[@]}" "$@"
fi
# The full run names its slowest tests, so the 25-minute budget is watched where it is spent.
exec "$venv/bin/python" -m pytest -q --durations=25 "$@"
