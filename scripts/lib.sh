# shellcheck shell=bash
# Shell helpers shared by every script under scripts/ (source it; it defines functions and runs nothing):
#   ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
#   source "$ROOT/scripts/lib.sh"
#
#   die MESSAGE [EXIT_CODE]   "<script>: error: MESSAGE" on stderr, then exit EXIT_CODE [1]
#   say MESSAGE...            "<script>: MESSAGE" on stderr
#   usage_error [LINE...]     $usage (the caller sets it) and any LINEs on stderr, then exit 2
#   quote_cmd ARG...          the command line, quoted so that it can be pasted into a shell
#   is_pos_int VALUE          true for 1, 2, ... (no sign, no leading zero)
#   refuse_unless_dry DRY MESSAGE   MESSAGE as an error (exit 2), or in a dry run (DRY=1) said with "a real run
#                             stops here" and the script goes on: a dry run prints its commands whatever is on disk
#   abs_path PATH             PATH made absolute (a directory resolved as cd resolves it; a missing one kept as named)
#   count_gpus                the number of GPUs this process may use: those CUDA_VISIBLE_DEVICES lists if it is
#                             set (as SLURM sets it for a job's GPUs), else nvidia-smi's, else 0
#   hand_over COMMAND ARG...  exec "python -m fairseq_tnn COMMAND ARG..." (fairseq_tnn/commands), messages named
#                             after this script, with this repository's package first on the path; the python is
#                             PYTHON [$FAIRSEQ_BIN/python, FAIRSEQ_BIN [<repo>/.venv/bin]]
#   fairseq_env               sets FAIRSEQ_BIN [<repo>/.venv/bin], the directory of the fairseq commands
#                             ($FAIRSEQ_BIN/fairseq-train, fairseq-preprocess, ...), and PYTHON [$FAIRSEQ_BIN/python];
#                             refuses FAIRSEQ_PREPROCESS, which no script reads any more
#
# Knobs: every script takes its settings as environment variables (e.g. CPU=1 bash scripts/train.sh ...), listed with
# their defaults in its header; an empty value is the default. gpu_check.sh's flags are shorthands for its own.
#
# <script> is PROG when set (the SLURM scripts set it: SLURM runs a copy named slurm_script), else the
# name of the script bash is running.

lib_prog() { echo "${PROG:-$(basename "$0")}"; }

die() { echo "$(lib_prog): error: $1" >&2; exit "${2:-1}"; }

say() { echo "$(lib_prog): $*" >&2; }

usage_error() {
  echo "${usage:?usage_error needs \$usage}" >&2
  (( $# == 0 )) || printf '%s\n' "$@" >&2
  exit 2
}

# Quote a command line so that it can be pasted into a shell (and split back with shlex).
quote_cmd() {
  local out="" a
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then out+="$a "; else out+="'${a//\'/\'\\\'\'}' "; fi
  done
  printf '%s\n' "${out% }"
}

is_pos_int() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }

refuse_unless_dry() {
  [[ "$1" == 1 ]] || die "$2" 2
  say "DRY_RUN: $2 (a real run stops here)"
}

abs_path() {
  if [[ -d "$1" ]]; then (cd "$1" && pwd); elif [[ "$1" == /* ]]; then echo "$1"; else echo "$PWD/$1"; fi
}

count_gpus() {
  if [[ -n "${CUDA_VISIBLE_DEVICES+x}" ]]; then
    local ids="${CUDA_VISIBLE_DEVICES//,/ }"; set -- $ids; echo "$#"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true  # grep -c prints 0 itself
  else
    echo 0
  fi
}

fairseq_env() {
  [[ -z "${FAIRSEQ_PREPROCESS+set}" ]] \
    || die "FAIRSEQ_PREPROCESS is set ('$FAIRSEQ_PREPROCESS') but no longer read: set FAIRSEQ_BIN to the directory of the fairseq commands instead (fairseq-preprocess is \$FAIRSEQ_BIN/fairseq-preprocess; default $ROOT/.venv/bin)" 2
  FAIRSEQ_BIN="${FAIRSEQ_BIN:-$ROOT/.venv/bin}"
  PYTHON="${PYTHON:-$FAIRSEQ_BIN/python}"
}

hand_over() {
  local py="${PYTHON:-${FAIRSEQ_BIN:-$ROOT/.venv/bin}/python}"
  command -v "$py" > /dev/null 2>&1 \
    || die "PYTHON=$py is not an executable (set up .venv with scripts/setup.sh, or set PYTHON and FAIRSEQ_BIN)" 2
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m fairseq_tnn --prog "$(lib_prog)" "$@"
}
