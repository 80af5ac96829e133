# shellcheck shell=bash
# The paper's Wikitext-103 training recipe for scripts/train.sh and scripts/slurm/train.sbatch (and through
# train.sh's dry run, scripts/make_experiment_configs.py, which writes configs/experiments/*.yaml). The recipe,
# its presets and its knobs live in fairseq_tnn/recipe.py (standard library only), which this file runs with
# $PYTHON; the run directory is handled here. Source it with ROOT set (it sources scripts/lib.sh, sets
# FAIRSEQ_BIN, PYTHON and the preset lists, defines functions):
#   source "$ROOT/scripts/recipe.sh"
#   recipe_check_preset <preset>                   # unknown: an error listing the presets (exit 2)
#   recipe_init <preset> <data-bin> <world-size>   # validates, sets RECIPE_* variables
#   "${RECIPE_ARGS[@]}"                            # the fairseq-train arguments (data first)
#   recipe_claim_save_dir [dry]                    # refuses, clears or keeps RECIPE_SAVE_DIR (below)
# With DRY_RUN=1 (train.sh's and train.sbatch's dry runs) missing data and an existing run directory are reported
# ("a real run stops here") instead of stopping: a dry run prints the command whatever is on disk.
# Every preset is a registered arch of the plugin (fairseq_tnn/models/tnn_lm.py, tnn_mlm.py), passed as
# --arch <preset>.
#
# Environment knobs (defaults in brackets): the recipe's, documented in fairseq_tnn/recipe.py: MAX_UPDATE,
# TOKENS_PER_SAMPLE, SEQS_PER_UPDATE, BATCH_PER_GPU, LR, WARMUP_UPDATES, SEED, NUM_WORKERS, LOG_INTERVAL,
# VALIDATE_INTERVAL_UPDATES, SAVE_INTERVAL_UPDATES, KEEP_INTERVAL_UPDATES, CPU, PRECISION, TNN_COMPILE,
# OVERSIZED; and the run directory's:
#   SAVE_ROOT [<repo>/checkpoints]  RUN_NAME [<preset>]: checkpoints, train.log and tensorboard/
#                               go to SAVE_ROOT/RUN_NAME
#   FORCE [0]: 1 deletes an existing SAVE_ROOT/RUN_NAME and starts over (not needed when it holds no
#                checkpoint: an attempt that failed before saving one is moved to previous-attempt/)
#   RESUME [0]: 1 continues from SAVE_ROOT/RUN_NAME/checkpoint_last.pt
#   FAIRSEQ_BIN [<repo>/.venv/bin], PYTHON [$FAIRSEQ_BIN/python]: scripts/lib.sh's fairseq_env
# update-freq = SEQS_PER_UPDATE / (BATCH_PER_GPU x world size), so the tokens per update do not
# depend on the number of processes; a remainder is an error.

# shellcheck source=lib.sh
source "$ROOT/scripts/lib.sh"
fairseq_env
command -v "$PYTHON" > /dev/null 2>&1 \
  || die "PYTHON=$PYTHON is not an executable (set up .venv with scripts/setup.sh, or set PYTHON and FAIRSEQ_BIN)" 2
# recipe_py ARG...: fairseq_tnn/recipe.py's bash assignments, evaluated here (its errors exit 2)
recipe_py() {
  local code
  code="$("$PYTHON" "$ROOT/fairseq_tnn/recipe.py" --prog "$(lib_prog)" "$@")" || exit $?
  eval "$code"
}
recipe_py presets  # TNN_CAUSAL_PRESETS, TNN_MASKED_PRESETS

recipe_kind() {  # <preset> -> causal | masked | (empty for an unknown preset)
  local p
  for p in $TNN_CAUSAL_PRESETS; do [[ "$1" == "$p" ]] && { echo causal; return; }; done
  for p in $TNN_MASKED_PRESETS; do [[ "$1" == "$p" ]] && { echo masked; return; }; done
  echo ""
}

recipe_check_preset() {  # <preset>: an error naming it and listing the presets unless it is one
  [[ -n "$(recipe_kind "$1")" ]] || die "unknown preset '$1'; choose one of: $TNN_CAUSAL_PRESETS $TNN_MASKED_PRESETS" 2
}

# recipe_init <preset> <data-bin> <world size>: sets RECIPE_KIND, RECIPE_SAVE_DIR, RECIPE_UPDATE_FREQ, RECIPE_ARGS.
recipe_init() {
  local preset="$1" data="$2" world="$3" save_root="${SAVE_ROOT:-$ROOT/checkpoints}"
  recipe_check_preset "$preset"
  [[ -f "$data/dict.txt" ]] || refuse_unless_dry "${DRY_RUN:-0}" "no binarised data in '$data' (dict.txt missing); run scripts/prepare-wikitext-103.sh first, or scripts/prepare-corpus.sh for your own text"
  data="$(abs_path "$data")"
  [[ "$save_root" == /* ]] || save_root="$PWD/$save_root"
  RECIPE_SAVE_DIR="$save_root/${RUN_NAME:-$preset}"
  recipe_py paper "$preset" "$data" "$RECIPE_SAVE_DIR" "$world" "$ROOT/fairseq_tnn"
}

# recipe_has_checkpoint <dir>: true when <dir> holds a fairseq checkpoint (checkpoint*.pt).
recipe_has_checkpoint() {
  compgen -G "$1/checkpoint*.pt" > /dev/null
}

# recipe_claim_save_dir [dry]: refuse an existing run unless FORCE=1 (start over) or RESUME=1 (continue).
# A run directory without any checkpoint (an attempt that failed before saving one) is not a run to
# protect: its files are moved to <dir>/previous-attempt/ (replacing an older one) and training starts
# there again without FORCE=1.
recipe_claim_save_dir() {
  local dir="$RECIPE_SAVE_DIR" dry="${1:-}"
  if [[ -d "$dir" ]] && [[ -n "$(ls -A "$dir" 2>/dev/null)" ]] && ! recipe_has_checkpoint "$dir" \
      && [[ "${FORCE:-0}" != 1 && "${RESUME:-0}" != 1 ]]; then
    say "$dir holds no checkpoint (an earlier attempt that saved nothing): moving its files to $dir/previous-attempt/ and starting again"
    if [[ -z "$dry" ]]; then
      local prev="$dir/previous-attempt" f
      rm -rf "$prev.new"; mkdir -p "$prev.new"
      for f in "$dir"/* "$dir"/.[!.]*; do
        [[ -e "$f" && "$f" != "$prev" && "$f" != "$prev.new" ]] && mv "$f" "$prev.new/"
      done
      rm -rf "$prev"; mv "$prev.new" "$prev"
    fi
  elif [[ -d "$dir" ]] && [[ -n "$(ls -A "$dir" 2>/dev/null)" ]]; then
    if [[ "${FORCE:-0}" == 1 ]]; then
      say "FORCE=1: deleting $dir"
      [[ -n "$dry" ]] || rm -rf "$dir"
    elif [[ "${RESUME:-0}" == 1 ]]; then
      say "RESUME=1: continuing the run in $dir"
    else
      refuse_unless_dry "${dry:+1}" "$dir already exists; refusing to overwrite it (FORCE=1 deletes it and starts over, RESUME=1 continues from its checkpoint_last.pt)"
    fi
  fi
  [[ -n "$dry" ]] || mkdir -p "$dir"
}
