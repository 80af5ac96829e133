#!/usr/bin/env bash
# Train one of the paper's Wikitext-103 models with its published recipe (fairseq_tnn/recipe.py), on one
# process, all GPUs of this machine, or several machines:
#   bash scripts/train.sh <preset> <data-bin> [extra fairseq-train args...]
# e.g.
#   bash scripts/train.sh fd_tnn_lm_wt103 data-bin/wikitext-103              # all GPUs of this machine
#   NPROC=1 bash scripts/train.sh tnn_lm_wt103 data-bin/wikitext-103         # one GPU
#   CPU=1 MAX_UPDATE=20 TOKENS_PER_SAMPLE=64 SEQS_PER_UPDATE=8 bash scripts/train.sh tnn_lm_tiny data-bin/sample
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash scripts/train.sh fd_tnn_lm_wt103 data-bin/wikitext-103   # and
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash scripts/train.sh fd_tnn_lm_wt103 data-bin/wikitext-103   # on the second
# Extra arguments go last to fairseq-train, so they win over the recipe (e.g. --max-epoch 1); fairseq's
# distributed options are this script's (from NPROC, NNODES and CPU) and refused there.
# Knobs are environment variables (DRY_RUN=1 prints the command; RESUME=1, FORCE=1, NPROC, CPU, MAX_UPDATE, ...):
# their defaults and meaning, the presets and the outputs: python -m fairseq_tnn train --help
# (fairseq_tnn/commands/train.py, which this script hands over to).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/lib.sh"
hand_over train "$@"
