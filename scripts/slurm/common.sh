# shellcheck shell=bash
# Shared by scripts/slurm/*.sbatch: the repository root, and one training job step through srun.
# SLURM runs a copy of the batch script from its spool directory, so the root cannot come from the
# script's own path there: it is FAIRSEQ_TNN_ROOT if set, else the directory sbatch was called from
# (submit from the repository root), and the script's own ../.. when run with bash outside SLURM.
#
# slurm_train <preset> [extra fairseq-train args...]
#   srun --kill-on-bad-exit=1 <FAIRSEQ_BIN>/fairseq-train <recipe args> \
#        --distributed-world-size <SLURM_NNODES x SLURM_NTASKS_PER_NODE> --distributed-port <PORT> <extra>
#   one task per GPU; fairseq reads its rank and device from SLURM_PROCID / SLURM_LOCALID and the
#   master host from SLURM_JOB_NODELIST (scontrol), so no launcher is needed. The recipe, the
#   environment knobs and update-freq = SEQS_PER_UPDATE / (BATCH_PER_GPU x world size) are
#   scripts/recipe.sh's, exactly as for scripts/train.sh.
# Environment (defaults in brackets): DATA [<repo>/data-bin/wikitext-103], PORT [10000 + job id mod 20000],
#   FAIRSEQ_BIN [<repo>/.venv/bin], DRY_RUN [0] (1 prints the srun command instead of running it;
#   works outside SLURM with SLURM_* variables set by hand), RESUME [1 when SLURM requeued the job,
#   else 0], FORCE [0], and every knob of scripts/recipe.sh.

slurm_die() { echo "${RECIPE_PROG:-sbatch}: error: $1" >&2; exit "${2:-1}"; }

slurm_train() {
  local preset="$1"; shift
  RECIPE_PROG="$preset.sbatch"
  # shellcheck source=../recipe.sh
  source "$ROOT/scripts/recipe.sh"
  local nnodes="${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-}}"
  local per_node="${SLURM_NTASKS_PER_NODE:-}"
  if [[ -z "$per_node" && -n "${SLURM_NTASKS:-}" && -n "$nnodes" ]]; then per_node=$(( SLURM_NTASKS / nnodes )); fi
  if [[ -z "$nnodes" || -z "$per_node" ]]; then
    slurm_die "not inside a SLURM job: submit with 'sbatch scripts/slurm/$preset.sbatch' from the repository root (or set SLURM_NNODES and SLURM_NTASKS_PER_NODE with DRY_RUN=1 to see the command)" 2
  fi
  local world=$(( nnodes * per_node ))
  [[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]] && RESUME="${RESUME:-1}"
  recipe_init "$preset" "${DATA:-$ROOT/data-bin/wikitext-103}" "$world"
  local port="${PORT:-$(( 10000 + ${SLURM_JOB_ID:-0} % 20000 ))}"
  local -a cmd=(srun --kill-on-bad-exit=1 "${FAIRSEQ_BIN:-$ROOT/.venv/bin}/fairseq-train" "${RECIPE_ARGS[@]}"
    --distributed-world-size "$world" --distributed-port "$port" "$@")
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    recipe_claim_save_dir dry
    quote_cmd "${cmd[@]}"
    return 0
  fi
  recipe_claim_save_dir
  quote_cmd "${cmd[@]}" >> "$RECIPE_SAVE_DIR/command.txt"
  echo "$preset: $nnodes node(s) x $per_node task(s), update-freq $RECIPE_UPDATE_FREQ, port $port; logs in $RECIPE_SAVE_DIR" >&2
  "${cmd[@]}"
}
