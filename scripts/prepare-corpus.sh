#!/usr/bin/env bash
# Your own plain text to fairseq data in one command: check it, split it, train a tokenizer on the train split,
# encode every split and binarise it:
#   bash scripts/prepare-corpus.sh <text-dir | text-file> [dest]
# e.g.
#   bash scripts/prepare-corpus.sh ~/corpus.txt                 # -> data-bin/corpus (text in data/corpus)
#   bash scripts/prepare-corpus.sh ~/mytext data-bin/mytext     # ~/mytext holds train.txt valid.txt test.txt
# It ends by printing the commands that train, evaluate and generate from the data it made.
# What it does, and its knobs (environment variables, e.g. VOCAB_SIZE=8000) with their defaults:
#   python -m fairseq_tnn prepare-corpus --help        (fairseq_tnn/commands/prepare_corpus.py)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib.sh
source "$ROOT/scripts/lib.sh"
hand_over prepare-corpus "$@"
