#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite (what CI runs). Extra arguments go to pytest.
#   bash scripts/test.sh --fast [pytest arguments]: only the ops, modules and models layers, without the
#   tests marked slow (under 2 minutes on 2 CPU cores: the check to run while editing).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
selection=(tests)
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
