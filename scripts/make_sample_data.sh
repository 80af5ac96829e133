#!/usr/bin/env bash
# Build the small offline English corpus in data/sample/ (KJV Bible, public domain).
#
# Usage:
#   bash scripts/make_sample_data.sh
#   PYTHON=.venv/bin/python OUT_DIR=/tmp/sample bash scripts/make_sample_data.sh
#
# Environment variables (all optional):
#   FAIRSEQ_BIN  the fairseq commands (default: <repo>/.venv/bin); PYTHON
#                interpreter with `sentencepiece` importable (default: $FAIRSEQ_BIN/python)
#   OUT_DIR      where to write the outputs (default: <repo>/data/sample)
#   KJV_VERSION  Debian package version to fetch (default: 4.38, as in Debian
#                bookworm); set to "" to take whatever apt offers (outputs may
#                then differ from the committed ones)
#   TRAIN_BOOKS / VALID_BOOKS / TEST_BOOKS
#                space-separated book abbreviations, as printed by the `bible`
#                program (defaults: "Ge Psa John Rom" / "Dan" / "Rev")
#   VOCAB_SIZE   sentencepiece vocabulary size (default: 2000)
#   FORCE        1 replaces the files of an existing OUT_DIR (without it the
#                script refuses before any work)
#
# What it does:
#   1. `apt-get download bible-kjv-text bible-kjv` into a temp dir (runs
#      `apt-get update` once if the package lists are missing) and unpacks both
#      with `dpkg-deb -x`. bible-kjv-text ships the text only in the compressed
#      random-access format of the Bible Retrieval System (usr/lib/bible.data),
#      so the matching `bible` reader from bible-kjv (same source package and
#      version) is used to dump it: one verse per line.
#   2. scripts/make_sample_data.py splits the verses by book into
#      {train,valid,test}.txt; scripts/prepare-corpus.sh trains a sentencepiece
#      BPE model of VOCAB_SIZE pieces on train.txt and encodes all splits (its
#      binarised output is not kept: scripts/preprocess.sh makes data-bin/sample
#      from data/sample); make_sample_data.py writes README.md with provenance
#      and counts.
#
# Outputs (in OUT_DIR): {train,valid,test}.txt, {train,valid,test}.bpe,
# spm.model, spm.vocab, README.md. The build is deterministic: rerunning it
# with the same package version and sentencepiece version gives byte-identical
# files.
#
# Needs: apt-get and dpkg-deb (Debian/Ubuntu), network access to the apt
# mirror, libreadline8 (a dependency of the `bible` binary), and the venv of
# scripts/setup.sh (sentencepiece, fairseq-preprocess).
set -euo pipefail

export LC_ALL=C
export TZ=UTC

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"
OUT_DIR="${OUT_DIR:-$REPO_ROOT/data/sample}"
KJV_VERSION="${KJV_VERSION-4.38}"
TRAIN_BOOKS="${TRAIN_BOOKS:-Ge Psa John Rom}"
VALID_BOOKS="${VALID_BOOKS:-Dan}"
TEST_BOOKS="${TEST_BOOKS:-Rev}"
VOCAB_SIZE="${VOCAB_SIZE:-2000}"

ROOT="$REPO_ROOT"
# shellcheck source=lib.sh
source "$ROOT/scripts/lib.sh"
usage="usage: bash scripts/make_sample_data.sh   (no arguments; settings are environment variables)"
[[ $# -eq 0 ]] || usage_error
fairseq_env
if [[ -f "$OUT_DIR/train.bpe" && "${FORCE:-0}" != 1 ]]; then
    die "$OUT_DIR already holds a corpus; refusing to overwrite it (FORCE=1 rebuilds it, or set OUT_DIR)" 2
fi

command -v apt-get >/dev/null || die "apt-get not found (needs a Debian/Ubuntu system)"
command -v dpkg-deb >/dev/null || die "dpkg-deb not found"
command -v "$PYTHON" >/dev/null || die "python interpreter '$PYTHON' not found (set PYTHON=...)"
"$PYTHON" -c 'import sentencepiece' 2>/dev/null \
    || die "'$PYTHON' cannot import sentencepiece; install it (pip install sentencepiece==0.2.3) or set PYTHON=/path/to/python"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/make_sample_data.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# --- 1. fetch and unpack the Debian packages ---------------------------------
pkgs=(bible-kjv-text bible-kjv)
if [[ -n "$KJV_VERSION" ]]; then
    pkgs=("bible-kjv-text=$KJV_VERSION" "bible-kjv=$KJV_VERSION")
fi
mkdir -p "$WORK/debs"
if ! (cd "$WORK/debs" && apt-get download "${pkgs[@]}"); then
    say "apt-get download failed; running apt-get update once and retrying"
    apt-get update -qq || die "apt-get update failed (are you root? is the network up?)"
    (cd "$WORK/debs" && apt-get download "${pkgs[@]}") \
        || die "could not download ${pkgs[*]} (set KJV_VERSION= to accept the version apt offers)"
fi
text_deb="$(ls "$WORK"/debs/bible-kjv-text_*.deb)"
reader_deb="$(ls "$WORK"/debs/bible-kjv_*.deb)"
dpkg-deb -x "$text_deb" "$WORK/root"
dpkg-deb -x "$reader_deb" "$WORK/root"

data_file="$(find "$WORK/root" -type f -name bible.data | head -n 1)"
[[ -n "$data_file" ]] || die "bible.data not found in $text_deb"
bible_bin="$WORK/root/usr/bin/bible"
[[ -x "$bible_bin" ]] || die "usr/bin/bible not found in $reader_deb"

# --- 2. dump the whole text, one verse per line ("Ge1:1 In the beginning ...") -
# -f turns pretty-printing off; the reader looks for bible.data in the cwd.
(cd "$(dirname "$data_file")" && "$bible_bin" -f -p . Gen1:1-Rev22:21) > "$WORK/kjv.txt" \
    || die "the bible reader failed (is libreadline8 installed?)"

# --- 3. split by books; train sentencepiece and encode; write README ---------
books=(--kjv "$WORK/kjv.txt" --out-dir "$WORK/out" --train-books "$TRAIN_BOOKS" --valid-books "$VALID_BOOKS"
       --test-books "$TEST_BOOKS")
"$PYTHON" "$SCRIPT_DIR/make_sample_data.py" split "${books[@]}"
VOCAB_SIZE="$VOCAB_SIZE" TEXT_DIR="$WORK/out" FORCE=0 \
    bash "$SCRIPT_DIR/prepare-corpus.sh" "$WORK/out" "$WORK/bin" > "$WORK/prepare-corpus.log" 2>&1 \
    || { cat "$WORK/prepare-corpus.log" >&2; die "prepare-corpus.sh failed"; }
"$PYTHON" "$SCRIPT_DIR/make_sample_data.py" readme "${books[@]}" --text-deb "$text_deb" --reader-deb "$reader_deb"

mkdir -p "$OUT_DIR"
files=(train.txt valid.txt test.txt train.bpe valid.bpe test.bpe spm.model spm.vocab README.md)
for f in "${files[@]}"; do
    cp "$WORK/out/$f" "$OUT_DIR/$f"
done
say "wrote ${files[*]} to $OUT_DIR"
