#!/usr/bin/env bash
# Binarise a corpus already encoded into pieces for fairseq (fairseq-preprocess --only-source):
#   bash scripts/preprocess.sh <text-dir> <dest-dir>
# e.g.
#   bash scripts/preprocess.sh data/sample data-bin/sample
# <text-dir> holds train.bpe, valid.bpe, test.bpe (space-separated pieces, one line per sentence). Does nothing
# if <dest-dir>/dict.txt exists (FORCE=1 redoes it).
# What it does, and its knobs (environment variables: FORCE, WORKERS, SRCDICT, FAIRSEQ_BIN) with their defaults:
#   python -m fairseq_tnn preprocess --help        (fairseq_tnn/commands/preprocess.py)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib.sh
source "$ROOT/scripts/lib.sh"
hand_over preprocess "$@"
