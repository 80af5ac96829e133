#!/usr/bin/env bash
# Train one of the paper's Wikitext-103 models with its published recipe (fairseq_tnn/recipe.py, through
# scripts/recipe.sh):
#   bash scripts/train.sh <preset> <data-bin> [extra fairseq-train args...]
# e.g.
#   bash scripts/train.sh fd_tnn_lm_wt103 data-bin/wikitext-103              # all GPUs of this machine
#   NPROC=1 bash scripts/train.sh tnn_lm_wt103 data-bin/wikitext-103         # one GPU
#   CPU=1 MAX_UPDATE=20 TOKENS_PER_SAMPLE=64 SEQS_PER_UPDATE=8 bash scripts/train.sh tnn_lm_tiny data-bin/sample
#
# Presets: causal  tnn_lm_wt103 tnn_lm_wt103_rpe3 fd_tnn_lm_wt103 (tnn_lm_tiny fd_tnn_lm_tiny for smoke runs)
#          masked  tnn_mlm_wt103 tnn_mlm_wt103_rpe3 fd_tnn_mlm_wt103 ski_tnn_mlm_wt103
#                  (tnn_mlm_tiny fd_tnn_mlm_tiny ski_tnn_mlm_tiny)
# Extra arguments go last to fairseq-train, so they win over the recipe (e.g. --max-epoch 1).
#
# Knobs are environment variables (defaults in brackets; an empty value is the default):
#   NPROC [number of GPUs seen (CUDA_VISIBLE_DEVICES, else nvidia-smi), 1 with CPU=1]: processes.
#         1 runs fairseq-train directly (with --distributed-world-size 1); more runs
#         "python -m fairseq_tnn.distributed.launch --nproc NPROC [--cpu] -- <fairseq-train args>":
#         on GPUs one fairseq-train that spawns a process per GPU, on CPU torchrun with NPROC ranks.
#   CPU [0]            1 trains on CPU (adds --cpu, fp32).
#   DRY_RUN [0]        1 prints the exact command line instead of running it, whatever is on disk (missing data
#                      and a run directory a real run would refuse are reported, not fatal).
#   FAIRSEQ_BIN [<repo>/.venv/bin]  where fairseq-train lives; PYTHON [$FAIRSEQ_BIN/python] runs the launcher.
#   and the recipe's knobs, documented in fairseq_tnn/recipe.py: MAX_UPDATE [50000], TOKENS_PER_SAMPLE [512],
#   SEQS_PER_UPDATE [128 causal, 512 masked], BATCH_PER_GPU [8 causal, 16 masked], LR [5e-4, FD-TNN 1e-3],
#   WARMUP_UPDATES [4000 causal, 3000 masked], SEED [1], NUM_WORKERS [1], LOG_INTERVAL [100],
#   VALIDATE_INTERVAL_UPDATES [1000], SAVE_INTERVAL_UPDATES [1000], KEEP_INTERVAL_UPDATES [2],
#   PRECISION [fp16 on GPU, fp32 on CPU], TNN_COMPILE [1 on GPU, 0 on CPU], OVERSIZED [drop (masked)],
#   SAVE_ROOT [<repo>/checkpoints], RUN_NAME [<preset>],
#   FORCE [0] (1: delete an existing SAVE_ROOT/RUN_NAME first), RESUME [0] (1: continue it). A run
#   directory without a checkpoint (a failed attempt) needs neither: its files go to previous-attempt/.
# update-freq = SEQS_PER_UPDATE / (BATCH_PER_GPU x NPROC): the tokens per update stay the paper's
# whatever the number of processes (e.g. 128 / (8 x 8) = 2); a remainder is an error.
# Outputs in SAVE_ROOT/RUN_NAME: checkpoint_{best,last}.pt, checkpoint_1_<update>.pt, train.log (json
# lines; scripts/plot_training.py reads it), tensorboard/, command.txt (the command line that ran).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage="usage: bash scripts/train.sh <preset> <data-bin> [extra fairseq-train args...]"
# shellcheck source=recipe.sh
source "$ROOT/scripts/recipe.sh"

[[ $# -ge 2 && "$1" != -* ]] || usage_error "presets: $TNN_CAUSAL_PRESETS $TNN_MASKED_PRESETS"
PRESET="$1"; DATA="$2"; shift 2
[[ -n "$(recipe_kind "$PRESET")" ]] || { echo "$usage" >&2; recipe_check_preset "$PRESET"; }

CPU="${CPU:-0}"
if [[ -z "${NPROC:-}" ]]; then
  if [[ "$CPU" == 1 ]]; then NPROC=1; else NPROC="$(count_gpus)"; (( NPROC >= 1 )) || NPROC=1; fi
fi
is_pos_int "$NPROC" || die "NPROC must be a positive integer, not '$NPROC'" 2

recipe_init "$PRESET" "$DATA" "$NPROC"

if (( NPROC == 1 )); then
  cmd=("$FAIRSEQ_BIN/fairseq-train" "${RECIPE_ARGS[@]}" --distributed-world-size 1 "$@")
else
  launch=("$PYTHON" -m fairseq_tnn.distributed.launch --nproc "$NPROC")
  [[ "$CPU" == 1 ]] && launch+=(--cpu)
  cmd=("${launch[@]}" -- "${RECIPE_ARGS[@]}" "$@")
fi

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  recipe_claim_save_dir dry
  quote_cmd "${cmd[@]}"
  exit 0
fi
recipe_claim_save_dir
quote_cmd "${cmd[@]}" >> "$RECIPE_SAVE_DIR/command.txt"
say "$PRESET, $NPROC process(es), update-freq $RECIPE_UPDATE_FREQ; logs and checkpoints in $RECIPE_SAVE_DIR"
exec "${cmd[@]}"
