#!/usr/bin/env bash
# Your own plain text to fairseq data in one command: check it, split it, train a tokenizer on the train split,
# encode every split and binarise it (scripts/prepare_corpus.py does the work):
#   bash scripts/prepare-corpus.sh <text-dir | text-file> [dest]
# e.g.
#   bash scripts/prepare-corpus.sh ~/corpus.txt                 # -> data-bin/corpus (text in data/corpus)
#   bash scripts/prepare-corpus.sh ~/mytext data-bin/mytext     # ~/mytext holds train.txt valid.txt test.txt
#
# Input: a directory with train.txt, valid.txt and test.txt, or one UTF-8 text file, split by lines, in order:
# train = the first lines, valid = the next VALID_PERCENT, test = the last TEST_PERCENT (the sizes are printed).
# dest defaults to <repo>/data-bin/<name>, <name> the input's name without its extension.
# Steps (each skipped when a run with the same input and settings completed it; outputs are written under a
# temporary name and moved into place when complete):
#   1. read every input file: a missing, empty, binary (NUL byte) or non-UTF-8 file is an error naming the file,
#      the line and the byte offset; so is a train split of fewer words than TOKENS_PER_SAMPLE (one training
#      block), a VOCAB_SIZE the train split cannot make, and a TEXT_DIR or dest that holds something else
#      (never overwritten without FORCE=1). All before anything is written.
#   2. (one file) write the split to TEXT_DIR/{train,valid,test}.txt
#   3. train the tokenizer on the train split only: sentencepiece BPE (TEXT_DIR/spm.model, spm.vocab;
#      deterministic: the first SPM_SENTENCES lines, no sampling, identity normalization, one thread), or with
#      BPE=gpt2 the paper's GPT-2 BPE from GPT2_DIR (nothing to train)
#   4. encode every split on WORKERS cores -> TEXT_DIR/{train,valid,test}.bpe, with progress (lines, tokens,
#      tokens/s)
#   5. binarise (scripts/preprocess.sh: fairseq-preprocess --only-source; --srcdict GPT2_DIR/dict.txt with
#      BPE=gpt2) into a temporary folder beside dest, copy the tokenizer beside the data (spm.model, spm.vocab
#      or encoder.json, vocab.bpe), move it to dest, and print the commands that train, evaluate and generate
#      (fairseq-interactive, fairseq-generate and the hub need --bpe and the tokenizer's path).
# The default vocabulary: 6 x sqrt(training words), rounded to a multiple of 500, within [500, 32000]
# (109,466 words of the bundled sample give 2,000; 1M words 6,000; Wikitext-103's 101M words 32,000).
#
# Knobs are environment variables (defaults in brackets; an empty value is the default):
#   BPE [sentencepiece]   sentencepiece | gpt2 (needs encoder.json, vocab.bpe, dict.txt in GPT2_DIR)
#   VOCAB_SIZE [the rule above]   sentencepiece pieces (sentencepiece only)
#   GPT2_DIR [<repo>/data/wikitext-103/gpt2_bpe]   where scripts/prepare-wikitext-103.sh puts them
#   TEXT_DIR [<repo>/data/<name>]   the split text (one input file), the encoded splits, the sentencepiece model
#   VALID_PERCENT [5]  TEST_PERCENT [5]   of the lines of one input file
#   TOKENS_PER_SAMPLE [512, scripts/train.sh's]   the training block the train split must hold
#   SPM_SENTENCES [1000000]   sentencepiece trains on at most this many lines (the first) of the train split
#   WORKERS [the CPUs this process may use]   encoding threads (GPT-2: processes) and fairseq-preprocess workers
#   FORCE [0]   1 redoes every step and replaces the files this command writes (nothing else) in TEXT_DIR and dest
#   FAIRSEQ_BIN [<repo>/.venv/bin]   PYTHON [$FAIRSEQ_BIN/python]
# Outputs: dest/{dict.txt,{train,valid,test}.{bin,idx},preprocess.log}, the tokenizer files, prepare-corpus.json
# (the input's sha256 and the settings, what a rerun compares); TEXT_DIR/{train,valid,test}.bpe (and .txt for
# one input file), spm.model, spm.vocab, prepare-corpus.json.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib.sh
source "$ROOT/scripts/lib.sh"
usage="usage: bash scripts/prepare-corpus.sh <text-dir | text-file> [dest-data-bin]"
[[ $# -ge 1 && $# -le 2 && "$1" != -* && "${2:-}" != -* ]] || usage_error
fairseq_env
command -v "$PYTHON" > /dev/null 2>&1 \
  || die "PYTHON=$PYTHON is not an executable (set up .venv with scripts/setup.sh, or set PYTHON and FAIRSEQ_BIN)" 2

INPUT="${1%/}"
name="$(basename "$INPUT")"; [[ -d "$INPUT" ]] || name="${name%.*}"
[[ "$name" =~ ^[A-Za-z0-9._+-]+$ ]] || die "cannot name the output after '$INPUT': give dest explicitly" 2
DEST="${2:-$ROOT/data-bin/$name}"
FORCE="${FORCE:-0}"
[[ "$FORCE" == 0 || "$FORCE" == 1 ]] || die "FORCE must be 0 or 1, not '$FORCE'" 2
force=(); [[ "$FORCE" == 1 ]] && force=(--force)

# the knobs are checked (their names in the errors) by prepare_corpus.py, before any work
PROG="$(lib_prog)" exec "$PYTHON" "$ROOT/scripts/prepare_corpus.py" --input "$INPUT" --dest "$DEST" \
  --text-dir "${TEXT_DIR:-$ROOT/data/$name}" --bpe "${BPE:-sentencepiece}" --vocab-size "${VOCAB_SIZE:-0}" \
  --gpt2-dir "${GPT2_DIR:-$ROOT/data/wikitext-103/gpt2_bpe}" --valid-percent "${VALID_PERCENT:-5}" \
  --test-percent "${TEST_PERCENT:-5}" --tokens-per-sample "${TOKENS_PER_SAMPLE:-512}" \
  --spm-sentences "${SPM_SENTENCES:-1000000}" --workers "${WORKERS:-0}" --fairseq-bin "$FAIRSEQ_BIN" "${force[@]}"
