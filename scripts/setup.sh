#!/usr/bin/env bash
# Creates .venv and installs everything fairseq-tnn needs, in the order that works
# (docs/references.md#installing-fairseq): torch (with numpy, which importing torch needs) first, then
# fairseq-fixed built against that torch, then the rest, then this plugin (editable). Never lets pip replace torch.
# Idempotent: a second run with unchanged requirements does nothing.
#
# Environment: PYTHON (default python3), VENV (default <repo>/.venv),
#              TORCH_VERSION (default 2.13.0, at least 2.10: docs/setup.md; a GPU machine gets CUDA from the same line).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib.sh
source "$ROOT/scripts/lib.sh"
usage="usage: bash scripts/setup.sh   (no arguments; settings are environment variables)"
[[ $# -eq 0 ]] || usage_error
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-$ROOT/.venv}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
STAMP="$VENV/.fairseq-tnn-setup"
want="$(cat "$ROOT/requirements.txt" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1) torch=$TORCH_VERSION"

# Up to date: the stamp matches and torch, fairseq and this plugin are installed where .venv finds them (found,
# not imported: importing fairseq takes ~5 s, and demo.sh and test.sh come through here on every run).
installed='import importlib.util as u, os, sys
specs = [u.find_spec(m) for m in ("torch", "fairseq", "fairseq_tnn")]
sys.exit(0 if all(s and s.origin and os.path.exists(s.origin) for s in specs) else 1)'
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] && "$VENV/bin/python" -c "$installed" 2>/dev/null; then
  echo "setup: $VENV is up to date"
  exit 0
fi

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), "Python >= 3.10 is required, found " + sys.version' 
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
req() { grep -E "^$1==" "$ROOT/requirements.txt" | awk '{print $1}'; }

echo "setup: installing torch==$TORCH_VERSION and $(req numpy) into $VENV"
# numpy in the same step: torch imports it when torch itself is imported (the next line, fairseq's build),
# and without it prints "Failed to initialize NumPy" on every import.
pip_install "torch==$TORCH_VERSION" "$(req numpy)"
# From here on torch is pinned to what is installed.
CONSTRAINTS="$VENV/torch-constraint.txt"
"$PY" -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' > "$CONSTRAINTS"
export PIP_CONSTRAINT="$CONSTRAINTS"

echo "setup: building fairseq-fixed against the installed torch (first time: several minutes)"
pip_install "$(req cython)" "$(req wheel)"
pip_install --no-build-isolation "$(req fairseq-fixed)"
pip_install "$(req sentencepiece)" "$(req sacremoses)" "$(req tensorboard)" "$(req tensorboardX)" \
  "$(req matplotlib)" "$(req pytest)" "$(req pytest-xdist)"
# Triton: a CUDA torch brings the version it needs; beside a CPU-only torch, the tests run the plugin's Triton kernels
# (fairseq_tnn/ops/toeplitz_direct.py) in Triton's interpreter, and nothing else imports it.
if ! "$PY" -c 'import triton' 2>/dev/null; then
  pip_install --no-deps "$(req triton)"
fi
pip_install --no-deps --no-build-isolation -e "$ROOT"

"$PY" - <<'PY'
import fairseq, torch, fairseq_tnn
print(f"setup: ok (python {__import__('sys').version.split()[0]}, torch {torch.__version__}, "
      f"fairseq {fairseq.__version__}, fairseq_tnn {fairseq_tnn.__version__})")
PY
echo "$want" > "$STAMP"
