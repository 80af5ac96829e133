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
#   hand_over COMMAND ARG...  exec "python -m fairseq_tnn COMMAND ARG..." (fairseq_tnn/commands), messages named
#                             after this script, with this repository's package first on the path; the python is
#                             PYTHON [$FAIRSEQ_BIN/python, FAIRSEQ_BIN [<repo>/.venv/bin]]
#   fairseq_env               sets FAIRSEQ_BIN [<repo>/.venv/bin], the directory of the fairseq commands
#                             ($FAIRSEQ_BIN/fairseq-train, fairseq-preprocess, ...), and PYTHON [$FAIRSEQ_BIN/python];
#                             refuses FAIRSEQ_PREPROCESS, which no script reads any more
#
# Knobs: every script takes its settings as environment variables (e.g. CPU=1 bash scripts/train.sh ...), an empty
# value being the default; a script that hands over lists them with `python -m fairseq_tnn <command> --help`, the
# others (setup.sh, slurm/local_cluster.sh) in their header. gpu_check.sh's flags are shorthands for its own.
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
