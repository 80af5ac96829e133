#!/usr/bin/env bash
# The main job on the bundled sample corpus, CPU only:
# set up .venv, binarise data/sample, train a small causal TNN LM for a few minutes,
# then score it with fairseq-eval-lm and print validation and test perplexity.
#
# Environment (defaults): ARCH (tnn_lm_tiny), MAX_UPDATE (300), TOKENS_PER_SAMPLE (128),
#   BATCH_SIZE (16), LR (0.003), WORK (<repo>/demo-run), EXTRA_ARGS (more fairseq-train flags).
#   A finished run in WORK is reused; FORCE=1 starts it again from scratch.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
BIN="$ROOT/.venv/bin"
ARCH="${ARCH:-tnn_lm_tiny}"
MAX_UPDATE="${MAX_UPDATE:-300}"
TPS="${TOKENS_PER_SAMPLE:-128}"
WORK="${WORK:-$ROOT/demo-run}"
DATA="$ROOT/data-bin/sample"
CKPT="$WORK/checkpoints/$ARCH"

bash "$ROOT/scripts/preprocess.sh" "$ROOT/data/sample" "$DATA"
if [[ "${FORCE:-0}" == 1 ]]; then rm -rf "$CKPT" "$WORK/train-$ARCH.log"; fi
mkdir -p "$WORK"

echo "demo: training $ARCH for $MAX_UPDATE updates on CPU (log: $WORK/train-$ARCH.log)"
# shellcheck disable=SC2086
"$BIN/fairseq-train" "$DATA" --user-dir "$ROOT/fairseq_tnn" --cpu \
  --task tnn_language_modeling --arch "$ARCH" --criterion cross_entropy \
  --tokens-per-sample "$TPS" --sample-break-mode none --batch-size "${BATCH_SIZE:-16}" \
  --optimizer adam --adam-betas '(0.9, 0.98)' --weight-decay 0.01 --clip-norm 1.0 \
  --lr "${LR:-0.003}" --lr-scheduler inverse_sqrt --warmup-updates 50 --warmup-init-lr 1e-7 \
  --max-update "$MAX_UPDATE" --validate-interval-updates 50 --save-interval-updates 100 \
  --keep-interval-updates 1 --no-epoch-checkpoints --save-dir "$CKPT" \
  --log-format simple --log-interval 25 --seed 1 ${EXTRA_ARGS:-} 2>&1 | tee "$WORK/train-$ARCH.log" \
  | grep -E "valid on|train_inner|done training|Error|error" || true
[[ -f "$CKPT/checkpoint_last.pt" ]] || { echo "demo: training failed, see $WORK/train-$ARCH.log" >&2; exit 1; }

declare -A PPL
for split in valid test; do
  "$BIN/fairseq-eval-lm" "$DATA" --user-dir "$ROOT/fairseq_tnn" --cpu --task tnn_language_modeling \
    --path "$CKPT/checkpoint_last.pt" --gen-subset "$split" --tokens-per-sample "$TPS" \
    --sample-break-mode none --context-window $((TPS / 2)) --batch-size 8 \
    > "$WORK/eval-$split.log" 2>&1 || { cat "$WORK/eval-$split.log" >&2; exit 1; }
  PPL[$split]=$(grep -oE "Perplexity: [0-9.]+" "$WORK/eval-$split.log" | awk '{print $2}')
done
first=$(grep -m1 "valid on 'valid'" "$WORK/train-$ARCH.log" | grep -oE "ppl [0-9.]+" | awk '{print $2}')
echo
echo "demo: $ARCH, $MAX_UPDATE updates of ${BATCH_SIZE:-16} x $TPS tokens; vocabulary $(wc -l < "$DATA/dict.txt") + 4 symbols"
echo "demo: validation perplexity after the first 50 updates: $first"
echo "demo: fairseq-eval-lm (context window $((TPS / 2))): valid perplexity ${PPL[valid]}, test perplexity ${PPL[test]}"
