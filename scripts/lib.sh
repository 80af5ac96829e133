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
