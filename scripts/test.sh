#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite (what CI runs). Extra arguments go to pytest.
#   bash scripts/test.sh --fast [pytest arguments]: only the ops, modules and models layers, without the
#   tests marked slow (under 2 minutes on 2 CPU cores: the check to run while editing).
# The whole suite runs in TEST_WORKERS pytest-xdist processes (default: the number of CPU cores, at most 4;
# 0: in this process), a test file per worker at a time; --fast runs in this process.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cores="$(nproc 2>/dev/null || echo 2)"
workers="${TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
[[ "$workers" =~ ^[0-9]+$ ]] || { echo "test.sh: TEST_WORKERS=$workers is invalid: must be a whole number (0: no worker processes)" >&2; exit 2; }
selection=(tests -n "$workers" --dist loadfile --no-loadscope-reorder)  # files in tests/conftest.py's order
pass=()
for arg in "$@"; do
  if [[ "$arg" == "--fast" ]]; then
    selection=(tests/ops tests/modules tests/models -m "not slow")
  else
    pass+=("$arg")
  fi
done
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest --strict-markers "${selection[@]}" "${pass[@]}"
