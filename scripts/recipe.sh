# shellcheck shell=bash
# The paper's Wikitext-103 training recipe, shared by scripts/train.sh, scripts/slurm/train.sbatch and
# scripts/make_experiment_configs.py (which writes configs/experiments/*.yaml from train.sh's command).
# Source it with ROOT set (it sources scripts/lib.sh, defines functions and the preset lists, runs nothing):
#   source "$ROOT/scripts/recipe.sh"
#   recipe_check_preset <preset>                   # unknown: an error listing the presets (exit 2)
#   recipe_init <preset> <data-bin> <world-size>   # validates, sets RECIPE_* variables
#   "${RECIPE_ARGS[@]}"                            # the fairseq-train arguments (data first)
# Every preset is a registered arch of the plugin (fairseq_tnn/models/tnn_lm.py, tnn_mlm.py), passed as
# --arch <preset>.
#
# Per preset (docs/references.md#published-configurations: Qin et al., "Toeplitz Neural Network for
# Sequence Modeling", ICLR 2023; docs/references.md#ski-tnn-and-fd-tnn: Moreno, Mei, Walters, "SKI to go
# Faster", NeurIPS 2023, whose appendix gives the FD-TNN learning rates):
#   causal (tnn_language_modeling, cross_entropy; tied embeddings come from the preset):
#     adam (0.9, 0.98), weight decay 0.2, clip 1.0, lr 5e-4 (FD-TNN 1e-3), inverse_sqrt,
#     4000 warmup updates from 1e-7, 128 sequences x 512 tokens per update, --sample-break-mode none
#   masked (tnn_masked_lm, masked_lm):
#     adam (0.9, 0.98) eps 1e-6, weight decay 0.2, clip 1.0, lr 5e-4 (FD-TNN 1e-3), polynomial_decay,
#     3000 warmup updates, 512 sequences x 512 tokens per update, --sample-break-mode complete
#     Lines longer than a block (tokens_per_sample - 1 pieces): as in the RoBERTa-style fairseq pipeline
#     the authors trained with, each becomes one oversized block that training drops; the plugin logs how
#     many ("N of M blocks of the train split ... dropped") and logs the metric dropped_blocks with every
#     training line. --skip-invalid-size-inputs-valid-test (passed here) drops them from validation too.
#     OVERSIZED=error refuses such data before any work (--oversized-blocks error).
#   both: 50,000 updates, dropout 0.1 (preset), json logs, tensorboard, checkpoints in SAVE_ROOT/<run>.
#
# Environment knobs (defaults in brackets; "causal/masked" where they differ):
#   MAX_UPDATE [50000]          TOKENS_PER_SAMPLE [512]     SEQS_PER_UPDATE [128/512]
#   BATCH_PER_GPU [8/16]        LR [preset's]               WARMUP_UPDATES [4000/3000]
#   SEED [1]                    NUM_WORKERS [1]             LOG_INTERVAL [100]
#   VALIDATE_INTERVAL_UPDATES [1000]  SAVE_INTERVAL_UPDATES [1000]  KEEP_INTERVAL_UPDATES [2]
#   PRECISION [fp16 on GPU, fp32 with CPU=1]: fp16 (--fp16) | bf16 (--bf16-autocast: fp32 weights,
#                               bf16 autocast; fairseq's own --bf16 means TPU) | fp32      CPU [0]: 1 adds --cpu
#   TNN_COMPILE [1 on GPU, 0 with CPU=1]: 1 adds --tnn-compile (torch.compile per TNN layer; a layer whose
#                               compilation fails runs eagerly, with a warning), strict adds --tnn-compile strict
#                               (that failure stops the run)
#   OVERSIZED [drop] (masked only): drop | error, what happens to a line longer than a block (above)
#   SAVE_ROOT [<repo>/checkpoints]  RUN_NAME [<preset>]: checkpoints, train.log and tensorboard/
#                               go to SAVE_ROOT/RUN_NAME
#   FORCE [0]: 1 deletes an existing SAVE_ROOT/RUN_NAME and starts over (not needed when it holds no
#                checkpoint: an attempt that failed before saving one is moved to previous-attempt/)
#   RESUME [0]: 1 continues from SAVE_ROOT/RUN_NAME/checkpoint_last.pt
# update-freq = SEQS_PER_UPDATE / (BATCH_PER_GPU x world size), so the tokens per update do not
# depend on the number of processes; a remainder is an error.

TNN_CAUSAL_PRESETS="tnn_lm_wt103 tnn_lm_wt103_rpe3 fd_tnn_lm_wt103 tnn_lm_tiny fd_tnn_lm_tiny"
TNN_MASKED_PRESETS="tnn_mlm_wt103 tnn_mlm_wt103_rpe3 fd_tnn_mlm_wt103 ski_tnn_mlm_wt103 tnn_mlm_tiny fd_tnn_mlm_tiny ski_tnn_mlm_tiny"
# shellcheck source=lib.sh
source "$ROOT/scripts/lib.sh"

recipe_kind() {  # <preset> -> causal | masked | (empty for an unknown preset)
  local p
  for p in $TNN_CAUSAL_PRESETS; do [[ "$1" == "$p" ]] && { echo causal; return; }; done
  for p in $TNN_MASKED_PRESETS; do [[ "$1" == "$p" ]] && { echo masked; return; }; done
  echo ""
}

recipe_check_preset() {  # <preset>: an error naming it and listing the presets unless it is one
  [[ -n "$(recipe_kind "$1")" ]] || die "unknown preset '$1'; choose one of: $TNN_CAUSAL_PRESETS $TNN_MASKED_PRESETS" 2
}

# recipe_update_freq <seqs per update> <batch per process> <processes>
recipe_update_freq() {
  local seqs="$1" batch="$2" world="$3"
  is_pos_int "$seqs" && is_pos_int "$batch" && is_pos_int "$world" \
    || die "SEQS_PER_UPDATE ($seqs), BATCH_PER_GPU ($batch) and the number of processes ($world) must be positive integers" 2
  if (( seqs % (batch * world) != 0 )); then
    die "SEQS_PER_UPDATE=$seqs is not divisible by BATCH_PER_GPU=$batch x $world processes = $((batch * world)); change BATCH_PER_GPU or the number of processes" 2
  fi
  echo $(( seqs / (batch * world) ))
}

# recipe_init <preset> <data-bin> <world size>: sets RECIPE_KIND, RECIPE_SAVE_DIR, RECIPE_UPDATE_FREQ, RECIPE_ARGS.
recipe_init() {
  local preset="$1" data="$2" world="$3"
  recipe_check_preset "$preset"
  RECIPE_KIND="$(recipe_kind "$preset")"
  [[ -f "$data/dict.txt" ]] || die "no binarised data in '$data' (dict.txt missing); run scripts/prepare-wikitext-103.sh first" 2
  data="$(cd "$data" && pwd)"
  local fd=0; [[ "$preset" == fd_* ]] && fd=1
  local seqs batch warmup lr tps="${TOKENS_PER_SAMPLE:-512}" max_update="${MAX_UPDATE:-50000}"
  local -a kind_args
  if [[ "$RECIPE_KIND" == causal ]]; then
    seqs="${SEQS_PER_UPDATE:-128}"; batch="${BATCH_PER_GPU:-8}"; warmup="${WARMUP_UPDATES:-4000}"
    lr="${LR:-$([[ $fd == 1 ]] && echo 1e-3 || echo 5e-4)}"
    kind_args=(--task tnn_language_modeling --criterion cross_entropy --sample-break-mode none
      --optimizer adam --adam-betas '(0.9, 0.98)' --weight-decay 0.2 --clip-norm 1.0
      --lr "$lr" --lr-scheduler inverse_sqrt --warmup-updates "$warmup" --warmup-init-lr 1e-07)
  else
    seqs="${SEQS_PER_UPDATE:-512}"; batch="${BATCH_PER_GPU:-16}"; warmup="${WARMUP_UPDATES:-3000}"
    lr="${LR:-$([[ $fd == 1 ]] && echo 1e-3 || echo 5e-4)}"
    kind_args=(--task tnn_masked_lm --criterion masked_lm --sample-break-mode complete
      --skip-invalid-size-inputs-valid-test --oversized-blocks "${OVERSIZED:-drop}"
      --optimizer adam --adam-betas '(0.9, 0.98)' --adam-eps 1e-06 --weight-decay 0.2 --clip-norm 1.0
      --lr "$lr" --lr-scheduler polynomial_decay --warmup-updates "$warmup" --total-num-update "$max_update")
  fi
  [[ "${OVERSIZED:-drop}" == drop || "${OVERSIZED:-drop}" == error ]] \
    || die "OVERSIZED must be drop or error, not '${OVERSIZED}'" 2
  RECIPE_UPDATE_FREQ="$(recipe_update_freq "$seqs" "$batch" "$world")" || exit $?

  local precision="${PRECISION:-$([[ "${CPU:-0}" == 1 ]] && echo fp32 || echo fp16)}"
  local -a precision_args
  case "$precision" in
    fp16) precision_args=(--fp16) ;;
    bf16) precision_args=(--bf16-autocast) ;;
    fp32) precision_args=() ;;
    *) die "PRECISION must be fp16, bf16 or fp32, not '$precision'" 2 ;;
  esac
  [[ "${CPU:-0}" == 1 && "$precision" == fp16 ]] && die "CPU=1 trains in fp32 or bf16 (PRECISION=fp32 or bf16), not fp16" 2
  local compile="${TNN_COMPILE:-$([[ "${CPU:-0}" == 1 ]] && echo 0 || echo 1)}"
  case "$compile" in
    0) ;;
    1) precision_args+=(--tnn-compile) ;;
    strict) precision_args+=(--tnn-compile strict) ;;
    *) die "TNN_COMPILE must be 0 or 1 (--tnn-compile), or strict (--tnn-compile strict), not '$compile'" 2 ;;
  esac

  local save_root="${SAVE_ROOT:-$ROOT/checkpoints}"
  [[ "$save_root" == /* ]] || save_root="$PWD/$save_root"
  RECIPE_SAVE_DIR="$save_root/${RUN_NAME:-$preset}"

  RECIPE_ARGS=("$data" --user-dir "$ROOT/fairseq_tnn" --arch "$preset" "${kind_args[@]}"
    --tokens-per-sample "$tps" --batch-size "$batch" --update-freq "$RECIPE_UPDATE_FREQ" --max-update "$max_update"
    "${precision_args[@]}"
    --seed "${SEED:-1}" --num-workers "${NUM_WORKERS:-1}"
    --save-dir "$RECIPE_SAVE_DIR" --no-epoch-checkpoints
    --validate-interval-updates "${VALIDATE_INTERVAL_UPDATES:-1000}"
    --save-interval-updates "${SAVE_INTERVAL_UPDATES:-1000}" --keep-interval-updates "${KEEP_INTERVAL_UPDATES:-2}"
    --log-format json --log-interval "${LOG_INTERVAL:-100}" --log-file "$RECIPE_SAVE_DIR/train.log"
    --tensorboard-logdir "$RECIPE_SAVE_DIR/tensorboard")
  [[ "${CPU:-0}" == 1 ]] && RECIPE_ARGS+=(--cpu)
  return 0
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
      die "$dir already exists; refusing to overwrite it (FORCE=1 deletes it and starts over, RESUME=1 continues from its checkpoint_last.pt)"
    fi
  fi
  [[ -n "$dry" ]] || mkdir -p "$dir"
}
