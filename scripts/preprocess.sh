#!/usr/bin/env bash
# Binarise a sentencepiece-encoded corpus for fairseq:
#   bash scripts/preprocess.sh <text-dir> <dest-dir>
# <text-dir> holds train.bpe, valid.bpe, test.bpe (space-separated pieces, one line
# per sentence), e.g. data/sample. Skips the work if <dest-dir>/dict.txt exists.
# Knobs are environment variables (defaults in brackets): FORCE [0] (1 redoes an existing
# <dest-dir>), WORKERS [2] (fairseq-preprocess --workers), FAIRSEQ_BIN [<repo>/.venv/bin]
# (runs $FAIRSEQ_BIN/fairseq-preprocess), SRCDICT [] (a fixed dictionary, fairseq-preprocess --srcdict, e.g.
# GPT-2's dict.txt; empty: built from train.bpe).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib.sh
source "$ROOT/scripts/lib.sh"
usage="usage: bash scripts/preprocess.sh <text-dir> <dest-dir>"
[[ $# -eq 2 ]] || usage_error
SRC="$1"; DEST="$2"
fairseq_env
srcdict=()
if [[ -n "${SRCDICT:-}" ]]; then
  [[ -f "$SRCDICT" ]] || die "SRCDICT=$SRCDICT is not a file (a fairseq dict.txt)" 2
  srcdict=(--srcdict "$SRCDICT")
fi
for split in train valid test; do
  [[ -f "$SRC/$split.bpe" ]] || usage_error "preprocess.sh: error: missing $SRC/$split.bpe"
done
if [[ -f "$DEST/dict.txt" ]]; then
  if [[ "${FORCE:-0}" != 1 ]]; then
    echo "preprocess: $DEST already binarised (FORCE=1 to redo)"
    exit 0
  fi
  # fairseq-preprocess refuses an existing dict.txt: remove just the files it writes
  for f in dict.txt preprocess.log {train,valid,test}.{bin,idx}; do rm -f "$DEST/$f"; done
fi
"$FAIRSEQ_BIN/fairseq-preprocess" --only-source "${srcdict[@]}" \
  --trainpref "$SRC/train.bpe" --validpref "$SRC/valid.bpe" --testpref "$SRC/test.bpe" \
  --destdir "$DEST" --workers "${WORKERS:-2}"
