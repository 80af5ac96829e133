#!/usr/bin/env bash
# Everything a CUDA GPU can check, in one command and one report (about 42 minutes on one H100; under a
# 10-minute limit per command, run it in five pieces: --only profile, --only tests, --only bench-fp16,
# --only bench-bf16, --only data,train):
#   bash scripts/gpu_check.sh [--out DIR] [--force] [--cpu] [--quick] [--only PART,...]
#                             [--pytest "ARGS"] [--limit PART=SECONDS]...
# Parts, in this order, each under a time limit; the check goes on past a part that fails:
#   environment   GPU, driver, CUDA, torch, fairseq, Python, Triton (environment.json)
#   profile       benchmarks/gpu_profile.py: where each millisecond of an update goes (issue 39), under 8 minutes:
#                 the seven wt103 presets, transformer_lm and the no-mixing bound at the paper's shapes, eager
#                 and (as far as a 180 s compile budget goes) compiled: update and kernel time, kernel launches,
#                 the forward/backward/optimizer/rest split, the 15 longest kernels, peak memory, compile time,
#                 operations dispatched; and each TNO's mixing time beside its floor (bytes / copy bandwidth)
#   tests         pytest tests/ops tests/modules tests/models tests/gpu (their CUDA cases run on the GPU)
#   bench-fp16    benchmarks/run.py --device cuda in fp16, eager and compiled, at the paper's per-GPU batches
#                 (causal 8 x 512, masked 16 x 512 and 4 x 2048): TNN (RPE 6), FD-TNN, SKI-TNN, the
#                 no-token-mixing bound and fairseq's transformer_lm of the same width and depth
#   bench-bf16    the same in bf16 (--bf16-autocast), compiled
#   data          data/sample binarised with a dictionary padded to Wikitext-103's 50,264 symbols
#   train         scripts/train.sh, 200 updates each of fd_tnn_lm_wt103 (8 x 512) and ski_tnn_mlm_wt103
#                 (16 x 512), compiled (TNN_COMPILE=1) and eager: update_ms and the validation loss of
#                 each; compiled and eager must agree, and no compiled layer may fall back to eager
# Writes DIR/report.md and DIR/report.json (machine and versions, each part passed or failed with the
# failing tests and the last lines of its log, the benchmark tables, the training runs, wall time per
# part) beside each part's own log and outputs. DIR defaults to results/gpu-check; an existing DIR is
# refused unless --force (which deletes it first).
#   --cpu     the same parts on the CPU (fp32 instead of fp16); without it and without a CUDA GPU the
#             command stops at once
#   --quick   toy sizes: small models, few updates, a few test files, one training preset (ski_tnn_mlm_tiny),
#             the first benchmark on the causal FD-TNN and the transformer only, the bf16 one on the masked
#             FD-TNN only.
#             `--cpu --quick` is what CI runs.
#   --only    only these parts (environment always runs): e.g. --only tests,train
#   --pytest  the tests part's pytest arguments instead of the default selection (e.g. "tests/gpu -x")
#   --limit   a part's time limit in seconds (tests, bench-fp16, bench-bf16, data, environment; train: each
#             of its runs); a part past its limit is stopped and reported as timed out
# Knobs are environment variables, as in every script; the flags above are shorthands that set them (a flag
# wins over the environment): OUT [results/gpu-check] (--out), FORCE [0] (--force: 1), CPU [0] (--cpu: 1),
# QUICK [0] (--quick: 1), ONLY [every part] (--only), PYTEST_ARGS [the selection above] (--pytest),
# LIMITS ["PART=SECONDS ...", space-separated; each --limit adds one], and
#   FAIRSEQ_BIN [<repo>/.venv/bin] and PYTHON [$FAIRSEQ_BIN/python], as scripts/train.sh; on a machine set up
#   from wheels (docs/references.md#gpu-machine-without-network):
#     PYTHONPATH=/tmp/site:$PWD FAIRSEQ_BIN=/tmp/site/bin PYTHON=python3 bash scripts/gpu_check.sh
#   TEST_WORKERS: pytest-xdist processes for the tests part (default: half the cores, at most 8, when
#   pytest-xdist is installed; 0: none).
# Exit status: 0 every part passed; 1 a part failed (report.md says which and why); 2 bad usage, no
# GPU without --cpu, or an existing --out without --force.
set -uo pipefail  # no -e: a failing part is recorded and the check goes on
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib.sh
source "$ROOT/scripts/lib.sh"
usage="usage: bash scripts/gpu_check.sh [--out DIR] [--force] [--cpu] [--quick] [--only PART,...] [--pytest \"ARGS\"] [--limit PART=SECONDS]..."
PARTS="environment profile tests bench-fp16 bench-bf16 data train"

orig_args=("$@")
env_knobs=()  # the knobs set in the environment, for the command line in the report
for k in OUT FORCE CPU QUICK ONLY PYTEST_ARGS LIMITS; do [[ -n "${!k:-}" ]] && env_knobs+=("$k=${!k}"); done
out="${OUT:-results/gpu-check}"; force="${FORCE:-0}"; cpu="${CPU:-0}"; quick="${QUICK:-0}"; only="${ONLY:-}"
pytest_args="${PYTEST_ARGS:-}"; limits="${LIMITS:-}"
while (( $# )); do
  case "$1" in
    --out) (( $# >= 2 )) || usage_error "--out needs a directory"; out="$2"; shift 2 ;;
    --force) force=1; shift ;;
    --cpu) cpu=1; shift ;;
    --quick) quick=1; shift ;;
    --only) (( $# >= 2 )) || usage_error "--only needs a comma-separated list of parts: $PARTS"; only="$2"; shift 2 ;;
    --pytest) [[ $# -ge 2 && -n "$2" ]] || usage_error "--pytest needs the pytest arguments, as one word"; pytest_args="$2"; shift 2 ;;
    --limit) (( $# >= 2 )) || usage_error "--limit needs PART=SECONDS"; limits="${limits:+$limits }$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) usage_error "unknown argument '$1'" ;;
  esac
done
for k in force cpu quick; do
  [[ "${!k}" == 0 || "${!k}" == 1 ]] || die "${k^^} must be 0 or 1 (--$k sets 1), not '${!k}'" 2
done
[[ -n "$out" ]] || die "OUT must name a directory (--out DIR), not ''" 2
declare -A limit_arg=()
for entry in $limits; do
  [[ "$entry" =~ ^([a-z0-9-]+)=([1-9][0-9]*)$ ]] \
    || die "LIMITS / --limit '$entry' is invalid: must be PART=SECONDS, SECONDS a positive integer" 2
  [[ " $PARTS " == *" ${BASH_REMATCH[1]} "* ]] || die "LIMITS / --limit '$entry': unknown part '${BASH_REMATCH[1]}'; parts: $PARTS" 2
  limit_arg[${BASH_REMATCH[1]}]="${BASH_REMATCH[2]}"
done
if [[ -n "$only" ]]; then
  for p in ${only//,/ }; do
    [[ " $PARTS " == *" $p "* ]] || die "ONLY / --only '$only': unknown part '$p'; parts: $PARTS" 2
  done
fi
wanted() { [[ "$1" == environment || -z "$only" || ",$only," == *",$1,"* ]]; }

fairseq_env
command -v "$PYTHON" >/dev/null 2>&1 || die "PYTHON=$PYTHON is not an executable (set up .venv with scripts/setup.sh, or set PYTHON and FAIRSEQ_BIN; docs/references.md#gpu-machine-without-network)" 2
[[ "$out" == /* ]] || out="$PWD/$out"
if [[ -e "$out" ]]; then
  [[ "$force" == 1 ]] || die "--out $out already exists; refusing to overwrite it (--force deletes it first, or choose another --out)" 2
fi
if [[ "$cpu" == 0 ]]; then
  "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
    || die "no CUDA GPU is visible to torch ($PYTHON): this check is for a GPU machine. --cpu runs the same parts on the CPU (--cpu --quick: toy sizes, a few minutes)" 2
fi
[[ "$force" == 1 && -e "$out" ]] && rm -rf "$out"
mkdir -p "$out" || die "cannot create --out $out"

device=cuda; [[ "$cpu" == 1 ]] && device=cpu
cores="$(nproc 2>/dev/null || echo 2)"
# time limits (seconds): on one H100 they add up to 20 minutes; toy sizes on a loaded CPU get more room
declare -A limit
if [[ "$quick" == 1 ]]; then
  limit=([environment]=600 [profile]=900 [tests]=900 [bench-fp16]=900 [bench-bf16]=900 [data]=600 [train]=900)
else
  # measured on one H100 (torch 2.11, 2026-11-25): tests 290 s with the compile tests failing fast (more with
  # them compiling), bench-fp16 past 300 s, bench-bf16 past 120 s, a compiled 200-update run 89-114 s
  # profile: written for 6-7 minutes (eager about 2.5, compiling 3), not yet run on a GPU; it writes its results
  # after every configuration, so a run stopped at the limit still reports what it measured
  limit=([environment]=45 [profile]=420 [tests]=600 [bench-fp16]=480 [bench-bf16]=300 [data]=45 [train]=180)
fi
for k in "${!limit_arg[@]}"; do limit[$k]="${limit_arg[$k]}"; done

export PYTHONUNBUFFERED=1
started="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
t_start=$(date +%s)
command_line="$(quote_cmd "${env_knobs[@]}" bash scripts/gpu_check.sh "${orig_args[@]}")"
: > "$out/parts.tsv"

part_pid=""
on_signal() {
  [[ -n "$part_pid" ]] && kill -TERM -- "-$part_pid" 2>/dev/null
  die "interrupted; the parts done so far are in $out (no report written)" 130
}
trap on_signal INT TERM

# run_part NAME SLUG KIND EXTRA LOG COMMAND...: COMMAND under the SLUG's time limit (SIGINT first, so that
# pytest still writes its results; SIGKILL 30 s later), its output in LOG (relative to $out); one line in
# parts.tsv: name, exit status, seconds, limit, log, kind, extra (the part's outputs, for the report).
run_part() {
  local name="$1" slug="$2" kind="$3" extra="$4" log="$5"; shift 5
  local t0 t1 code secs
  mkdir -p "$(dirname "$out/$log")"
  say "$name (limit ${limit[$slug]} s; log: $out/$log)"
  t0=$(date +%s.%N)
  # timeout(1) runs in a process group of its own: on Ctrl-C or TERM the trap below stops it
  (cd "$ROOT" && exec timeout -s INT -k 30 "${limit[$slug]}" "$@") > "$out/$log" 2>&1 &
  part_pid=$!
  wait "$part_pid"
  code=$?
  part_pid=""
  t1=$(date +%s.%N)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$code" "$secs" "${limit[$slug]}" "$log" "$kind" "$extra" >> "$out/parts.tsv"
  if (( code == 0 )); then say "$name: exit 0 after $secs s"; else say "$name: exit $code after $secs s (see $out/$log)"; fi
}

# ---- environment
run_part "environment" environment environment "" environment.log \
  "$PYTHON" scripts/gpu_check_report.py environment "$out/environment.json"

# ---- profile (benchmarks/gpu_profile.py: issue 39's measurement)
if wanted profile; then
  profile_precision=fp16; [[ "$cpu" == 1 ]] && profile_precision=fp32
  profile_args=()
  # toy sizes: three configurations, none compiled (the benchmark parts compile on CPU)
  [[ "$quick" == 1 ]] && profile_args=(--quick --timed 1 --configs fd3 ski bound_identity --compiled)
  run_part "profile (where an update's time goes)" profile profile profile profile/run.log \
    "$PYTHON" benchmarks/gpu_profile.py --device "$device" --precision "$profile_precision" --out "$out/profile" \
    "${profile_args[@]}"
fi

# ---- tests
if wanted tests; then
  if [[ -n "$pytest_args" ]]; then
    read -r -a selection <<< "$pytest_args"
  elif [[ "$quick" == 1 ]]; then
    # a few quick files of each layer (without their tests that start processes), and tests/gpu (skipped
    # without a GPU)
    selection=(tests/ops/test_circulant.py tests/modules/test_tno_registry.py tests/models/test_tno_config.py tests/gpu
               -m "not slow" -k "not options_command and not without_fairseq")
  else
    selection=(tests/ops tests/modules tests/models tests/gpu)
  fi
  workers="${TEST_WORKERS:-}"
  if [[ -z "$workers" ]]; then
    workers=$(( cores / 2 )); (( workers > 8 )) && workers=8
    [[ "$quick" == 1 ]] && workers=0
  fi
  [[ "$workers" =~ ^[0-9]+$ ]] || die "TEST_WORKERS=$workers is invalid: must be a whole number (0: no worker processes)" 2
  xdist=()
  if (( workers > 0 )) && "$PYTHON" -c 'import xdist' 2>/dev/null; then xdist=(-n "$workers" --dist load); fi
  run_part "tests" tests tests tests/junit.xml tests/pytest.log \
    env FAIRSEQ_BIN="$FAIRSEQ_BIN" "$PYTHON" -m pytest -v -rfE -p no:cacheprovider --strict-markers \
    --junitxml="$out/tests/junit.xml" "${xdist[@]}" "${selection[@]}"
fi

# ---- benchmarks (benchmarks/run.py --device: whole updates through fairseq's Trainer)
first_precision=fp16; [[ "$cpu" == 1 ]] && first_precision=fp32  # fairseq's --fp16 needs a GPU
if [[ "$quick" == 1 ]]; then
  bench_common=(--quick --rounds 2 --per-round 1 --warmup 1)
  # one model compiled per part in CI: the causal FD-TNN in fp32 (beside fairseq's transformer), the masked
  # one in bf16 (SKI-TNN's compiled training is the train part's)
  configs_first=(fd3 transformer); sections_first=(--sections causal); configs_bf16=(fd3); sections_bf16=(--sections masked)
else
  bench_common=(--rounds 3 --per-round 2 --warmup 3)
  configs_first=(tnn6 fd3 ski bound_identity transformer); sections_first=(); configs_bf16=(tnn6 fd3 ski bound_identity)
  sections_bf16=()
fi
if wanted bench-fp16; then
  run_part "benchmark $first_precision (eager and compiled)" bench-fp16 benchmark "bench-$first_precision" \
    "bench-$first_precision/run.log" "$PYTHON" benchmarks/run.py --device "$device" --precision "$first_precision" \
    --configs "${configs_first[@]}" "${sections_first[@]}" --modes eager compiled --no-plots --out "$out/bench-$first_precision" "${bench_common[@]}"
fi
if wanted bench-bf16; then
  run_part "benchmark bf16 (compiled)" bench-bf16 benchmark bench-bf16 bench-bf16/run.log \
    "$PYTHON" benchmarks/run.py --device "$device" --precision bf16 --configs "${configs_bf16[@]}" "${sections_bf16[@]}" --modes compiled \
    --no-plots --out "$out/bench-bf16" "${bench_common[@]}"
fi

# ---- data: the bundled sample, binarised (the full check: with Wikitext-103's dictionary size)
data_bin="$out/data/bin"
if wanted data || wanted train; then
  if [[ "$quick" == 1 ]]; then
    run_part "data (data/sample binarised)" data data "" data/preprocess.log \
      env FAIRSEQ_BIN="$FAIRSEQ_BIN" bash scripts/preprocess.sh data/sample "$data_bin"
  else
    run_part "data (data/sample, dictionary padded to 50,264 symbols)" data data "" data/preprocess.log bash -c '
      set -euo pipefail
      "$1" scripts/gpu_check_report.py dictionary data/sample/train.bpe 50264 "$3/dict.padded.txt"
      "$2/fairseq-preprocess" --only-source --srcdict "$3/dict.padded.txt" --trainpref data/sample/train.bpe \
        --validpref data/sample/valid.bpe --testpref data/sample/test.bpe --destdir "$3/bin" --workers 4' \
      _ "$PYTHON" "$FAIRSEQ_BIN" "$out/data"
  fi
fi

# ---- training: scripts/train.sh, compiled and eager
if wanted train; then
  if [[ "$quick" == 1 ]]; then
    # one preset: the paper's SKI-TNN; the compiled training of a causal tiny model through fairseq-train is
    # tests/modules/test_compile.py's, so CI does not compile it twice
    presets=(ski_tnn_mlm_tiny)
    knobs=(MAX_UPDATE=8 TOKENS_PER_SAMPLE=32 LOG_INTERVAL=2 VALIDATE_INTERVAL_UPDATES=8 WARMUP_UPDATES=4)
    extra=(--max-valid-steps 4)
  else
    presets=(fd_tnn_lm_wt103 ski_tnn_mlm_wt103)
    knobs=(MAX_UPDATE=200 LOG_INTERVAL=20 VALIDATE_INTERVAL_UPDATES=100 WARMUP_UPDATES=50)
    extra=()
  fi
  precision=fp16; [[ "$cpu" == 1 ]] && precision=fp32
  for preset in "${presets[@]}"; do
    # one process, the per-GPU batch of the recipe as the whole update (update-freq 1); the masked recipe's
    # --sample-break-mode complete would give the sample's short lines tens of lengths, each compiled anew:
    # blocks of the full length instead, as on Wikitext-103
    if [[ "$preset" == *mlm* ]]; then batch=16; kind_extra=(--sample-break-mode none); else batch=8; kind_extra=(); fi
    [[ "$quick" == 1 ]] && batch=4
    for mode in compiled eager; do
      compile=1; [[ "$mode" == eager ]] && compile=0
      run_part "train $preset $mode" train train "train/$preset-$mode" "train/$preset-$mode.log" \
        env "${knobs[@]}" NPROC=1 CPU="$cpu" PRECISION="$precision" TNN_COMPILE="$compile" BATCH_PER_GPU="$batch" \
        SEQS_PER_UPDATE="$batch" SAVE_ROOT="$out/train" RUN_NAME="$preset-$mode" NUM_WORKERS=0 \
        FAIRSEQ_BIN="$FAIRSEQ_BIN" PYTHON="$PYTHON" \
        bash scripts/train.sh "$preset" "$data_bin" --no-save "${kind_extra[@]}" "${extra[@]}"
    done
  done
fi

# ---- the report
t_end=$(date +%s)
"$PYTHON" - "$out/run.json" "$command_line" "$started" "$((t_end - t_start))" "$device" "$quick" "$only" <<'EOF'
import json, sys
path, command, started, seconds, device, quick, only = sys.argv[1:]
json.dump({"command": command, "started": started, "seconds": float(seconds), "device": device,
           "quick": quick == "1", "only": only or None}, open(path, "w"), indent=1)
EOF
"$PYTHON" scripts/gpu_check_report.py report "$out"
code=$?
(( code == 0 || code == 1 )) || die "writing the report failed (exit $code)"
say "report: $out/report.md ($(( t_end - t_start )) s)"
exit "$code"
