#!/usr/bin/env bash
# Length extrapolation (the paper's perplexity-vs-length figure) and the validation/test table (its Table 1):
#   bash scripts/eval_extrapolation.sh [label=]<checkpoint.pt>...
# e.g.
#   bash scripts/eval_extrapolation.sh TNN=checkpoints/tnn_lm_wt103_rpe3/checkpoint_best.pt \
#        FD-TNN=checkpoints/fd_tnn_lm_wt103/checkpoint_best.pt
# A label defaults to the checkpoint's directory name (checkpoints/<run>/checkpoint_best.pt -> <run>).
#
# For every checkpoint and every L in LENGTHS it runs
#   fairseq-eval-lm DATA --task tnn_language_modeling --path CKPT --gen-subset SUBSET --sample-break-mode none
#     --context-window CONTEXT_WINDOW --batch-size 1 --tokens-per-sample L --max-tokens L
# (TNNs have no positional limit, and tnn_language_modeling makes a block the model cannot take an error, so
# every block is scored), and for the table the same at TABLE_TOKENS on the valid and the test split.
# Outputs in RESULTS_ROOT/NAME:
#   raw/<label>/<subset>.L<L>.cw<context window>.log   one fairseq-eval-lm log per evaluation
#   extrapolation.json  per model and L: loss (base 2), ppl, evaluated tokens, expected tokens (the split's)
#   extrapolation.md    perplexity table, one row per model, one column per L
#   extrapolation.png   perplexity vs evaluation length, one line per model
#   table.md            rows = models; val ppl, test ppl, params (M), laid out like the paper's Table 1
# (written by scripts/extrapolation_report.py, which fails if any evaluation scored fewer tokens than the split has).
#
# Knobs are environment variables (defaults in brackets):
#   DATA [<repo>/data-bin/wikitext-103]  binarised data the checkpoints were trained on
#   LENGTHS ["512 1024 2048 4096 8192 14336"]   SUBSET [test]   CONTEXT_WINDOW [0]
#   TABLE [1]: 0 skips the valid/test table;  TABLE_TOKENS [the training length], TABLE_CONTEXT_WINDOW [0]: its
#     evaluation
#   TRAIN_TOKENS [the training length]: marked on the plot. The training length is read from the checkpoints
#     (tokens_per_sample in their saved config); checkpoints trained at different lengths are an error unless
#     both are set.
#   NAME [extrapolation]   RESULTS_ROOT [<repo>/results]
#   CPU [0]: 1 adds --cpu.  NUM_WORKERS [1]: data loader workers.  EXTRA_ARGS []: more fairseq-eval-lm flags
#   FAIRSEQ_BIN [<repo>/.venv/bin]   PYTHON [$FAIRSEQ_BIN/python]
#   REPORT [1]: 0 only runs the evaluations (array jobs);  REPORT_ONLY [0]: 1 only writes the report
#   FORCE [0]: without it, existing report files are never overwritten (the script refuses before any
#     work); an evaluation whose log is already complete is reused. FORCE=1 redoes the requested
#     evaluations and rewrites the report.
#   DRY_RUN [0]: 1 prints the commands instead of running them, whatever is on disk (missing data or checkpoints
#     and results a real run would refuse to overwrite are reported, not fatal).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage="usage: bash scripts/eval_extrapolation.sh [label=]<checkpoint.pt>..."
# shellcheck source=lib.sh
source "$ROOT/scripts/lib.sh"
[[ $# -ge 1 && "$1" != -* ]] || usage_error

fairseq_env
DATA="${DATA:-$ROOT/data-bin/wikitext-103}"
LENGTHS="${LENGTHS:-512 1024 2048 4096 8192 14336}"
SUBSET="${SUBSET:-test}"
CONTEXT_WINDOW="${CONTEXT_WINDOW:-0}"
TABLE="${TABLE:-1}"
TABLE_TOKENS="${TABLE_TOKENS:-}"
TABLE_CONTEXT_WINDOW="${TABLE_CONTEXT_WINDOW:-0}"
TRAIN_TOKENS="${TRAIN_TOKENS:-}"
NAME="${NAME:-extrapolation}"
RESULTS_ROOT="${RESULTS_ROOT:-$ROOT/results}"
OUT="$RESULTS_ROOT/$NAME"
[[ "$OUT" == /* ]] || OUT="$PWD/$OUT"
DRY="${DRY_RUN:-0}"

[[ "$NAME" =~ ^[A-Za-z0-9._-]+$ ]] || die "NAME must be letters, digits, '.', '_' or '-' (got '$NAME')" 2
read -r -a lengths <<< "$LENGTHS"
(( ${#lengths[@]} > 0 )) || die "LENGTHS is empty" 2
for L in "${lengths[@]}" ${TABLE_TOKENS:+"$TABLE_TOKENS"} ${TRAIN_TOKENS:+"$TRAIN_TOKENS"}; do
  [[ "$L" =~ ^[1-9][0-9]*$ ]] || die "lengths must be positive integers (got '$L')" 2
done
[[ -f "$DATA/dict.txt" ]] || refuse_unless_dry "$DRY" "no binarised data in '$DATA' (set DATA=<data-bin>)"
DATA="$(abs_path "$DATA")"

labels=(); ckpts=()
for arg in "$@"; do
  if [[ "$arg" == *=* ]]; then label="${arg%%=*}"; ckpt="${arg#*=}"; else ckpt="$arg"; label="$(basename "$(dirname "$ckpt")")"; fi
  [[ "$label" =~ ^[A-Za-z0-9._+-]+$ ]] || die "model label '$label' must be letters, digits, '.', '_', '+' or '-' (use label=path)" 2
  for seen in "${labels[@]}"; do [[ "$seen" != "$label" ]] || die "two checkpoints are labelled '$label'; name them with label=path" 2; done
  [[ -f "$ckpt" || "$DRY" == 1 ]] || die "checkpoint not found: $ckpt" 2
  [[ "$ckpt" == /* ]] || ckpt="$PWD/$ckpt"
  labels+=("$label"); ckpts+=("$ckpt")
done

# Existing results are refused before anything is read or run.
report_files=("$OUT/extrapolation.json" "$OUT/extrapolation.md" "$OUT/extrapolation.png" "$OUT/table.md")
if [[ "${REPORT:-1}" == 1 || "${REPORT_ONLY:-0}" == 1 ]]; then
  for f in "${report_files[@]}"; do
    if [[ -e "$f" && "${FORCE:-0}" != 1 ]]; then
      refuse_unless_dry "$DRY" "$f already exists; refusing to overwrite the results in $OUT (FORCE=1 redoes them, or choose another NAME)"
      break
    fi
  done
fi

# The training length (the task's tokens_per_sample in each checkpoint's saved config) is the default of
# TRAIN_TOKENS and TABLE_TOKENS; checkpoints trained at different lengths need both set by hand.
if [[ -z "$TRAIN_TOKENS" || -z "$TABLE_TOKENS" ]]; then
  found=()
  for c in "${ckpts[@]}"; do [[ -f "$c" ]] && found+=("$c"); done
  if (( ${#found[@]} < ${#ckpts[@]} )); then  # only a dry run gets here with a missing checkpoint
    say "DRY_RUN: a checkpoint is missing, so its training length is unknown; assuming 512"
    trained=512
  else
    trained_lengths="$("$PYTHON" - "${ckpts[@]}" <<'PY'
import sys

import fairseq_tnn
fairseq_tnn.register()  # the models; old-style checkpoints load with weights_only on
from fairseq import checkpoint_utils

for path in sys.argv[1:]:
    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    task = (state.get("cfg") or {}).get("task") or {}
    print(task.get("tokens_per_sample", "?"), path, sep="\t")
PY
)" || die "could not read the training length from the checkpoints (set TRAIN_TOKENS and TABLE_TOKENS)"
    distinct="$(cut -f1 <<< "$trained_lengths" | sort -u)"
    if [[ "$(wc -l <<< "$distinct")" != 1 || ! "$distinct" =~ ^[1-9][0-9]*$ ]]; then
      die "the checkpoints were trained at different lengths (or one has none in its config):
$(sed 's/^/  tokens_per_sample /' <<< "$trained_lengths")
set TRAIN_TOKENS (marked on the plot) and TABLE_TOKENS (the valid/test table's length) explicitly" 2
    fi
    trained="$distinct"
  fi
  TRAIN_TOKENS="${TRAIN_TOKENS:-$trained}"
  TABLE_TOKENS="${TABLE_TOKENS:-$trained}"
  say "trained at $trained tokens (the checkpoints' tokens_per_sample): TRAIN_TOKENS=$TRAIN_TOKENS TABLE_TOKENS=$TABLE_TOKENS"
fi

log_path() { echo "$OUT/raw/$1/$2.L$3.cw$4.log"; }  # label subset length context-window

declare -A evaluated=()  # logs produced by this run (the table's test run may be one of the sweep's)
evaluate() {  # label ckpt subset length context-window
  local log; log="$(log_path "$1" "$3" "$4" "$5")"
  [[ -z "${evaluated[$log]:-}" ]] || return 0
  evaluated[$log]=1
  local -a cmd=("$FAIRSEQ_BIN/fairseq-eval-lm" "$DATA" --user-dir "$ROOT/fairseq_tnn" --task tnn_language_modeling
    --path "$2" --gen-subset "$3" --sample-break-mode none --context-window "$5"
    --batch-size 1 --tokens-per-sample "$4" --max-tokens "$4" --num-workers "${NUM_WORKERS:-1}")
  [[ "${CPU:-0}" == 1 ]] && cmd+=(--cpu)
  local -a extra=(); read -r -a extra <<< "${EXTRA_ARGS:-}"; cmd+=("${extra[@]}")
  if [[ "$DRY" == 1 ]]; then quote_cmd "${cmd[@]}"; echo "  > $log"; return; fi
  if [[ "${FORCE:-0}" != 1 && -f "$log" ]] && grep -q "Perplexity:" "$log"; then
    say "$1 $3 L=$4: reusing $log"; return
  fi
  mkdir -p "$(dirname "$log")"
  say "$1 $3 L=$4 context-window $5"
  if ! "${cmd[@]}" > "$log.part" 2>&1; then
    tail -n 30 "$log.part" >&2
    die "fairseq-eval-lm failed for $1 ($3, L=$4); full log: $log.part"
  fi
  mv "$log.part" "$log"
  grep -E "Evaluated|Perplexity" "$log" | sed 's/^.*eval_lm[:|] *//' >&2
}

if [[ "${REPORT_ONLY:-0}" != 1 ]]; then
  for i in "${!labels[@]}"; do
    for L in "${lengths[@]}"; do evaluate "${labels[$i]}" "${ckpts[$i]}" "$SUBSET" "$L" "$CONTEXT_WINDOW"; done
    if [[ "$TABLE" == 1 ]]; then
      for split in valid test; do evaluate "${labels[$i]}" "${ckpts[$i]}" "$split" "$TABLE_TOKENS" "$TABLE_CONTEXT_WINDOW"; done
    fi
  done
fi

if [[ "${REPORT:-1}" == 1 || "${REPORT_ONLY:-0}" == 1 ]]; then
  models=(); for i in "${!labels[@]}"; do models+=("${labels[$i]}=${ckpts[$i]}"); done
  cmd=("$PYTHON" "$ROOT/scripts/extrapolation_report.py" --out-dir "$OUT" --data "$DATA" --subset "$SUBSET"
    --context-window "$CONTEXT_WINDOW" --lengths "${lengths[@]}" --train-length "$TRAIN_TOKENS" --models "${models[@]}")
  if [[ "$TABLE" == 1 ]]; then cmd+=(--table-tokens "$TABLE_TOKENS" --table-context-window "$TABLE_CONTEXT_WINDOW"); fi
  [[ "${FORCE:-0}" == 1 ]] && cmd+=(--force)
  if [[ "$DRY" == 1 ]]; then quote_cmd "${cmd[@]}"; exit 0; fi
  "${cmd[@]}"
fi
