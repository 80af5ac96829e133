#!/usr/bin/env bash
# Length extrapolation (the paper's perplexity-vs-length figure) and the validation/test table (its Table 1):
#   bash scripts/eval_extrapolation.sh [label=]<checkpoint.pt>...
# e.g.
#   bash scripts/eval_extrapolation.sh TNN=checkpoints/tnn_lm_wt103_rpe3/checkpoint_best.pt \
#        FD-TNN=checkpoints/fd_tnn_lm_wt103/checkpoint_best.pt
#   CPU=1 DATA=data-bin/sample LENGTHS="128 256 512" bash scripts/eval_extrapolation.sh checkpoints/tnn_lm_tiny/checkpoint_best.pt
#   DRY_RUN=1 bash scripts/eval_extrapolation.sh ...    # the commands, not run
# Results in RESULTS_ROOT/NAME [<repo>/results/extrapolation]: extrapolation.{json,md,png}, table.md, raw/ (the logs).
# What it runs, and its knobs (environment variables: DATA, LENGTHS, SUBSET, TABLE_TOKENS, NAME, CPU, FORCE, ...):
#   python -m fairseq_tnn evaluate --help     (fairseq_tnn/commands/evaluate.py)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib.sh
source "$ROOT/scripts/lib.sh"
hand_over evaluate "$@"
