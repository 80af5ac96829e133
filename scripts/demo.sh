#!/usr/bin/env bash
# The main job: a miniature of the paper's causal experiment on the bundled sample corpus, CPU only.
# Sets up .venv, binarises data/sample, trains a small TNN and a small FD-TNN causal LM side by side with
# the paper's recipe (scripts/train.sh, shortened), then for both: validation/test perplexity (Table 1
# layout), perplexity against evaluation length up to 16x the training length in one plot
# (scripts/eval_extrapolation.sh), validation perplexity against updates and wall-clock time, and the
# median wall time of one training update (scripts/plot_training.py), and a short sampled continuation of a
# fixed prompt from each model (fairseq-interactive with the incremental decoder).
#
# Knobs are environment variables (defaults): MODELS ("tnn_lm_tiny fd_tnn_lm_tiny"), MAX_UPDATE (300), TOKENS_PER_SAMPLE (128),
#   BATCH_SIZE (16), LR (0.003), WARMUP_UPDATES (50), LOG_INTERVAL (25), LENGTHS ("128 256 512 1024 2048"),
#   WORK (<repo>/demo-run), FAIRSEQ_BIN (unset: set up and use <repo>/.venv; set: the fairseq CLIs to use,
#   with PYTHON [$FAIRSEQ_BIN/python]). A finished training run in WORK is reused and an interrupted one resumed;
#   FORCE=1 deletes WORK's runs and results and starts again from scratch.
# Outputs in WORK: checkpoints/<model>/ (train.log, checkpoints), logs/<model>.out, results/demo/ (extrapolation.{json,md,png},
#   table.md), results/demo/training{,-wall}.png and training.{csv,json}, results/demo/kernels/<model>/ (the learned
#   kernels, scripts/plot_kernels.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib.sh
source "$ROOT/scripts/lib.sh"
usage="usage: bash scripts/demo.sh   (no arguments; settings are environment variables, see the header)"
[[ $# -eq 0 ]] || usage_error
setup=0; [[ -n "${FAIRSEQ_BIN:-}" ]] || setup=1  # fairseq installed elsewhere (a cluster's, the test suite's): use it
fairseq_env  # FAIRSEQ_BIN [<repo>/.venv/bin], PYTHON [$FAIRSEQ_BIN/python]
[[ "$setup" == 0 ]] || bash "$ROOT/scripts/setup.sh"
export FAIRSEQ_BIN PYTHON
MODELS="${MODELS:-tnn_lm_tiny fd_tnn_lm_tiny}"
MAX_UPDATE="${MAX_UPDATE:-300}"
TPS="${TOKENS_PER_SAMPLE:-128}"
BATCH="${BATCH_SIZE:-16}"
LENGTHS="${LENGTHS:-128 256 512 1024 2048}"
WORK="${WORK:-$ROOT/demo-run}"
[[ "$WORK" == /* ]] || WORK="$PWD/$WORK"
DATA="$ROOT/data-bin/sample"
RESULTS="$WORK/results/demo"

mkdir -p "$WORK"
FORCE=0 bash "$ROOT/scripts/preprocess.sh" "$ROOT/data/sample" "$DATA" > "$WORK/preprocess.log" 2>&1 \
  || { cat "$WORK/preprocess.log" >&2; exit 1; }
if [[ "${FORCE:-0}" == 1 ]]; then rm -rf "$WORK/checkpoints" "$WORK/results" "$WORK/logs"; fi

ckpts=(); logs=()
for arch in $MODELS; do
  dir="$WORK/checkpoints/$arch"
  ckpts+=("$arch=$dir/checkpoint_last.pt"); logs+=("$dir/train.log")
  out="$WORK/logs/$arch.out"  # fairseq-train's output (train.sh keeps the run directory for the run itself)
  if [[ -f "$dir/checkpoint_last.pt" ]] && grep -q "done training" "$out" 2>/dev/null; then
    echo "demo: reusing the finished run in $dir"
    continue
  fi
  resume=0; [[ -f "$dir/checkpoint_last.pt" ]] && resume=1
  echo "demo: training $arch for $MAX_UPDATE updates of $BATCH x $TPS tokens on CPU (log: $out)"
  mkdir -p "$WORK/logs"
  CPU=1 NPROC=1 SAVE_ROOT="$WORK/checkpoints" RESUME="$resume" FORCE=$((1 - resume)) MAX_UPDATE="$MAX_UPDATE" \
    TOKENS_PER_SAMPLE="$TPS" SEQS_PER_UPDATE="$BATCH" BATCH_PER_GPU="$BATCH" LR="${LR:-0.003}" \
    WARMUP_UPDATES="${WARMUP_UPDATES:-50}" VALIDATE_INTERVAL_UPDATES=50 SAVE_INTERVAL_UPDATES=100 \
    KEEP_INTERVAL_UPDATES=1 LOG_INTERVAL="${LOG_INTERVAL:-25}" NUM_WORKERS=0 \
    bash "$ROOT/scripts/train.sh" "$arch" "$DATA" --weight-decay 0.01 > "$out.part" 2>&1 \
    || { tail -n 30 "$out.part" >&2; die "training $arch failed, see $out.part"; }
  mv "$out.part" "$out"
done

echo "demo: evaluating at $LENGTHS tokens (trained at $TPS), every block scored"
FORCE=1 CPU=1 DATA="$DATA" LENGTHS="$LENGTHS" TABLE_TOKENS="$TPS" TRAIN_TOKENS="$TPS" NAME=demo \
  RESULTS_ROOT="$WORK/results" bash "$ROOT/scripts/eval_extrapolation.sh" "${ckpts[@]}" > "$WORK/eval.log" 2>&1 \
  || { tail -n 30 "$WORK/eval.log" >&2; exit 1; }
"$PYTHON" "$ROOT/scripts/plot_training.py" "${logs[@]}" --out "$RESULTS/training.png" --force \
  > "$WORK/training-summary.txt" 2> /dev/null
for arch in $MODELS; do  # what the two models learned: impulse/frequency responses and Toeplitz matrices
  "$PYTHON" "$ROOT/scripts/plot_kernels.py" "$WORK/checkpoints/$arch/checkpoint_last.pt" --out "$RESULTS/kernels/$arch" \
    --force > "$WORK/kernels-$arch.log" 2>&1 || { tail -n 20 "$WORK/kernels-$arch.log" >&2; exit 1; }
done

echo
echo "demo: $MODELS, $MAX_UPDATE updates of $BATCH x $TPS tokens each; vocabulary $(wc -l < "$DATA/dict.txt") + 4 symbols"
echo "demo: validation and test perplexity (context window 0, blocks of $TPS):"
cat "$RESULTS/table.md"
echo
echo "demo: test perplexity against evaluation length (trained at $TPS):"
cat "$RESULTS/extrapolation.md"
echo
echo "demo: training (validation perplexity at the first and the last validation, median wall time of one update):"
sed 's/^/  /' "$WORK/training-summary.txt"
echo
PROMPT="And God said unto Moses"
echo "demo: \"$PROMPT\" continued by each model (fairseq-interactive, top-10 sampling, seed 1, decoded with" \
  "data/sample/spm.model):"
for arch in $MODELS; do
  text="$(echo "$PROMPT" | "$FAIRSEQ_BIN/fairseq-interactive" "$DATA" --user-dir "$ROOT/fairseq_tnn" --task tnn_language_modeling \
    --path "$WORK/checkpoints/$arch/checkpoint_last.pt" --cpu --bpe sentencepiece \
    --sentencepiece-model "$ROOT/data/sample/spm.model" --beam 1 --sampling --sampling-topk 10 --seed 1 \
    --max-len-b 32 2> "$WORK/sample.log" | awk -F'\t' '/^D-0\t/ {print $3}')" \
    || { cat "$WORK/sample.log" >&2; die "sampling from $arch failed"; }
  echo "  $arch: $text"
done

echo
echo "demo: plots: $RESULTS/extrapolation.png $RESULTS/training.png $RESULTS/training-wall.png"
echo "demo: kernels: $(for arch in $MODELS; do printf '%s ' "$RESULTS/kernels/$arch/layer0.png"; done)(one per layer, kernels.json beside)"
