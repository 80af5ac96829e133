#!/usr/bin/env bash
# Download, GPT-2 BPE-encode and binarise Wikitext-103 as the TNN paper did
# (docs/references.md#published-configurations; Qin et al., ICLR 2023, https://github.com/OpenNLPLab/Tnn):
#   bash scripts/prepare-wikitext-103.sh [dest]          # dest defaults to <repo>/data-bin/wikitext-103
#
# Steps (each skipped when its outputs exist, so a rerun continues where it stopped):
#   1. download wikitext-103-raw-v1.zip and unzip it into RAW_DIR/wikitext-103-raw/wiki.{train,valid,test}.raw
#   2. download GPT-2's encoder.json, vocab.bpe and fairseq's dict.txt into RAW_DIR/gpt2_bpe/
#   3. BPE-encode each split (scripts/gpt2_bpe_encode.py, keeping empty lines) -> RAW_DIR/wikitext-103-raw/wiki.<split>.bpe
#   4. fairseq-preprocess --only-source --srcdict gpt2_bpe/dict.txt --workers WORKERS -> dest
#      (dict.txt, {train,valid,test}.{bin,idx}); the causal and the masked LM both read it.
# Without network access it stops at once and names every file to fetch, from where, and where to put
# it; place them by hand and rerun.
#
# Knobs are environment variables (defaults in brackets):
#   RAW_DIR [<repo>/data/wikitext-103]   downloads, raw text and BPE files
#   WIKITEXT_URL [https://wikitext.smerity.com/wikitext-103-raw-v1.zip]
#                (the original address, https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-raw-v1.zip,
#                 serves the same file where it still works)
#   GPT2_BPE_URL [https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe]  (encoder.json, vocab.bpe, dict.txt)
#   CONNECT_TIMEOUT [10] seconds to reach a server before giving up
#   WORKERS [number of CPUs]  BPE and fairseq-preprocess workers
#   FAIRSEQ_BIN [<repo>/.venv/bin]   PYTHON [$FAIRSEQ_BIN/python]
#   FORCE [0]: 1 redoes steps 3 and 4 even if their outputs exist (downloads are kept)
#   DRY_RUN [0]: 1 prints the commands of the steps that would run, and runs nothing
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage="usage: bash scripts/prepare-wikitext-103.sh [dest-data-bin]"
# shellcheck source=lib.sh
source "$ROOT/scripts/lib.sh"
[[ $# -le 1 && "${1:-}" != -* ]] || usage_error

DEST="${1:-$ROOT/data-bin/wikitext-103}"
RAW_DIR="${RAW_DIR:-$ROOT/data/wikitext-103}"
WIKITEXT_URL="${WIKITEXT_URL:-https://wikitext.smerity.com/wikitext-103-raw-v1.zip}"
GPT2_BPE_URL="${GPT2_BPE_URL:-https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe}"
CONNECT_TIMEOUT="${CONNECT_TIMEOUT:-10}"
WORKERS="${WORKERS:-$(nproc 2>/dev/null || echo 1)}"
fairseq_env
DRY="${DRY_RUN:-0}"
FORCE="${FORCE:-0}"
SPLITS=(train valid test)
ZIP="$RAW_DIR/wikitext-103-raw-v1.zip"
TEXT="$RAW_DIR/wikitext-103-raw"
BPE="$RAW_DIR/gpt2_bpe"

run() {  # print (DRY_RUN) or run a command
  if [[ "$DRY" == 1 ]]; then printf '%q ' "$@" | sed 's/ $//'; echo; else "$@"; fi
}

have_raw() { local s; for s in "${SPLITS[@]}"; do [[ -s "$TEXT/wiki.$s.raw" ]] || return 1; done; }

# url -> destination, for every download still needed
declare -a want_url=() want_dest=()
have_raw || [[ -s "$ZIP" ]] || { want_url+=("$WIKITEXT_URL"); want_dest+=("$ZIP"); }
for f in encoder.json vocab.bpe dict.txt; do
  [[ -s "$BPE/$f" ]] || { want_url+=("$GPT2_BPE_URL/$f"); want_dest+=("$BPE/$f"); }
done

manual_help() {
  say "cannot download $1 (no network access?)."
  echo "Download these files yourself, put them exactly here, and rerun this script:" >&2
  local i
  for i in "${!want_url[@]}"; do
    [[ -s "${want_dest[$i]}" ]] && continue
    echo "  ${want_url[$i]}" >&2
    echo "      -> ${want_dest[$i]}" >&2
  done
  if ! have_raw && [[ ! -s "$ZIP" ]]; then
    echo "  (instead of the zip, its unzipped folder also works: $TEXT/wiki.{train,valid,test}.raw;" >&2
    echo "   the original address of the zip is https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-raw-v1.zip)" >&2
  fi
}

fetch() {  # url dest
  if [[ "$DRY" == 1 ]]; then
    echo "mkdir -p $(printf '%q' "$(dirname "$2")") && curl -fL --connect-timeout $CONNECT_TIMEOUT -o $(printf '%q' "$2.part") $(printf '%q' "$1") && mv $(printf '%q' "$2.part") $(printf '%q' "$2")"
    return 0
  fi
  mkdir -p "$(dirname "$2")"
  say "downloading $1"
  local ok=0
  if command -v curl >/dev/null 2>&1; then
    curl -fL --connect-timeout "$CONNECT_TIMEOUT" -sS -o "$2.part" "$1" && ok=1
  elif command -v wget >/dev/null 2>&1; then
    wget -q --connect-timeout="$CONNECT_TIMEOUT" --tries=1 -O "$2.part" "$1" && ok=1
  else
    "$PYTHON" -c 'import sys, urllib.request, shutil
with urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[3])) as r, open(sys.argv[2], "wb") as f:
    shutil.copyfileobj(r, f)' "$1" "$2.part" "$CONNECT_TIMEOUT" && ok=1
  fi
  if [[ "$ok" != 1 ]]; then
    rm -f "$2.part"
    manual_help "$1"
    exit 1
  fi
  mv "$2.part" "$2"
}

# 1-2. downloads
for i in "${!want_url[@]}"; do fetch "${want_url[$i]}" "${want_dest[$i]}"; done

# 1b. unzip
if have_raw; then
  say "raw text present in $TEXT"
else
  say "unzipping $ZIP"
  run mkdir -p "$RAW_DIR"
  run "$PYTHON" -m zipfile -e "$ZIP" "$RAW_DIR"
  [[ "$DRY" == 1 ]] || have_raw || die "$ZIP did not contain wikitext-103-raw/wiki.{train,valid,test}.raw"
fi

# 3. GPT-2 BPE
todo_in=(); todo_out=()
for s in "${SPLITS[@]}"; do
  if [[ "$FORCE" == 1 || ! -s "$TEXT/wiki.$s.bpe" ]]; then todo_in+=("$TEXT/wiki.$s.raw"); todo_out+=("$TEXT/wiki.$s.bpe"); fi
done
if (( ${#todo_in[@]} )); then
  say "GPT-2 BPE encoding ${#todo_in[@]} split(s) with $WORKERS worker(s)"
  run "$PYTHON" "$ROOT/scripts/gpt2_bpe_encode.py" --encoder-json "$BPE/encoder.json" --vocab-bpe "$BPE/vocab.bpe" \
    --inputs "${todo_in[@]}" --outputs "${todo_out[@]}" --keep-empty --workers "$WORKERS"
else
  say "BPE files present in $TEXT"
fi

# 4. binarise
binarised() { local s; [[ -s "$DEST/dict.txt" ]] || return 1; for s in "${SPLITS[@]}"; do [[ -s "$DEST/$s.bin" && -s "$DEST/$s.idx" ]] || return 1; done; }
if [[ "$FORCE" != 1 ]] && binarised; then
  say "$DEST already binarised (FORCE=1 redoes it)"
else
  say "binarising into $DEST"
  run "$FAIRSEQ_BIN/fairseq-preprocess" --only-source --srcdict "$BPE/dict.txt" \
    --trainpref "$TEXT/wiki.train.bpe" --validpref "$TEXT/wiki.valid.bpe" --testpref "$TEXT/wiki.test.bpe" \
    --destdir "$DEST" --workers "$WORKERS"
fi
[[ "$DRY" == 1 ]] || say "done: $DEST ($(wc -l < "$DEST/dict.txt") dictionary entries)"
