#!/usr/bin/env bash
# The main job: a miniature of the paper's causal experiment on the bundled sample corpus, CPU only.
#   bash scripts/demo.sh
# e.g.
#   MAX_UPDATE=100 LENGTHS="128 512" bash scripts/demo.sh     # shorter
#   FORCE=1 bash scripts/demo.sh                                # again from scratch
# Sets up .venv (scripts/setup.sh; skipped when FAIRSEQ_BIN names fairseq installed elsewhere), then trains a
# small TNN and a small FD-TNN side by side with the CPU smoke recipe (fairseq_tnn/recipe.py), evaluates them
# against length, and prints the tables, plots, training curves and a sampled continuation from each.
# Results in WORK [<repo>/demo-run]/results/demo. What it runs, and its knobs (environment variables: MODELS,
# MAX_UPDATE, TOKENS_PER_SAMPLE, BATCH_SIZE, LR, WARMUP_UPDATES, LOG_INTERVAL, LENGTHS, WORK, FORCE):
#   python -m fairseq_tnn demo --help     (fairseq_tnn/commands/demo.py)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib.sh
source "$ROOT/scripts/lib.sh"
[[ -n "${FAIRSEQ_BIN:-}" ]] || bash "$ROOT/scripts/setup.sh"
hand_over demo "$@"
