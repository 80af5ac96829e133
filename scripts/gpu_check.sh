#!/usr/bin/env bash
# Everything a CUDA GPU can check, in one command and one report (about 45-50 minutes on one H100; under a
# 10-minute limit per command, run it in five pieces: --only profile, --only tests, --only bench-fp16,
# --only bench-bf16, --only data,train):
#   bash scripts/gpu_check.sh [--out DIR] [--force] [--cpu] [--quick] [--only PART,...]
#                             [--pytest "ARGS"] [--limit PART=SECONDS]...
# Parts, in this order, each under a time limit; the check goes on past a part that fails:
#   environment   GPU, driver, CUDA, torch, fairseq, Python, Triton (environment.json)
#   profile       benchmarks/gpu_profile.py: where each millisecond of an update goes (issue 39), under 8 minutes:
#                 the seven wt103 presets, transformer_lm and the no-mixing bound at the paper's shapes, eager
#                 and (as far as a 180 s compile budget goes) compiled and compiled with CUDA graphs: update and
#                 kernel time, kernel launches, the forward/backward/optimizer/rest split, the 15 longest
#                 kernels and host items, peak memory, compile time, operations dispatched; and each TNO's
#                 mixing time beside its floor (bytes / copy bandwidth)
#   tests         pytest tests/ops tests/modules tests/models tests/gpu (their CUDA cases run on the GPU)
#   bench-fp16    benchmarks/run.py --device cuda in fp16, eager and compiled, at the paper's per-GPU batches
#                 (causal 8 x 512, masked 16 x 512 and 4 x 2048): TNN (RPE 6), FD-TNN, SKI-TNN, the
#                 no-token-mixing bound and fairseq's transformer_lm of the same width and depth
#   bench-bf16    the same in bf16 (--bf16-autocast), compiled
#   data          data/sample binarised with a dictionary padded to Wikitext-103's 50,264 symbols
#   train         scripts/train.sh, 200 updates each of fd_tnn_lm_wt103 (8 x 512) and ski_tnn_mlm_wt103
#                 (16 x 512), compiled with CUDA graphs (CUDA_GRAPHS=1), compiled (TNN_COMPILE=1) and eager:
#                 update_ms and the validation loss of each; each compiled run must agree with the eager one,
#                 and no compiled layer may fall back to eager
# Writes DIR/report.md and DIR/report.json (machine and versions, each part passed or failed with the
# failing tests and the last lines of its log, the benchmark tables, the training runs, wall time per
# part) beside each part's own log and outputs. DIR defaults to results/gpu-check; an existing DIR is
# refused unless --force (which deletes it first). --cpu runs the same parts on the CPU (without it and
# without a CUDA GPU the command stops at once); `--cpu --quick` (toy sizes) is what CI runs. On a machine
# set up from wheels (docs/references.md#gpu-machine-without-network):
#   PYTHONPATH=/tmp/site:$PWD FAIRSEQ_BIN=/tmp/site/bin PYTHON=python3 bash scripts/gpu_check.sh
# Exit status: 0 every part passed; 1 a part failed (report.md says which and why); 2 bad usage, no
# GPU without --cpu, or an existing --out without --force.
# Flags and knobs (the flags are shorthands for the knobs OUT, FORCE, CPU, QUICK, ONLY, PYTEST_ARGS, LIMITS),
# time limits: python -m fairseq_tnn gpu-check --help (fairseq_tnn/commands/gpu_check.py, which this script
# hands over to).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/lib.sh"
hand_over gpu-check "$@"
