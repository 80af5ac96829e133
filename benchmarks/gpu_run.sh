#!/usr/bin/env bash
# The next GPU run's calls (docs/performance.md, "The next GPU run, prepared"), one per device call:
#
#   bash benchmarks/gpu_run.sh CALL...      CALL: tests, direct, update, targets, no-edges, one-graph, direct-update,
#                                                  versions, ski-backward, ski-band
#
# on the GPU machine, from the repository root, with $OUT its output folder; each call's log and results come back as
# $OUT/CALL.tgz (at most 8 files come back), beside machine.txt and status.txt, and the markdown of its results is
# printed. Where the machine has no network (docs/references.md, "GPU machine without network"), carry .whl (made
# beforehand on a machine with network, as references.md says): the wheels are installed into /tmp/site first, once
# per machine. The older trees the versions call compares are carried as .gpurun/at-REV (made by `git archive`, as
# performance.md says). Nothing here runs without a CUDA GPU; the calls are sized to fit the device's 10-minute limit
# per command and its 15 minutes a session, of which starting the machine takes about 4: `tests` (at most 5
# minutes), then `update` (about 5), then what is left (`no-edges`, `direct`).
set -u
: "${OUT:?the output folder of the device machine}"
cd "$(dirname "$0")/.."
ROOT=$PWD
# PYTHONFAULTHANDLER: a process that a signal ends (the ninth GPU run's segmentation fault in a compiled backward)
# prints each thread's Python stack first, which names the generated code it was in
export PYTHONUNBUFFERED=1 PYTHON=python3 PYTHONFAULTHANDLER=1

[ $# -gt 0 ] || { echo "usage: bash benchmarks/gpu_run.sh CALL..." >&2; exit 2; }
for call in "$@"; do
    case $call in
    tests | direct | update | targets | no-edges | one-graph | direct-update | versions | ski-backward | ski-band) ;;
    *) echo "unknown call: $call (tests, direct, update, targets, no-edges, one-graph, direct-update, versions," \
            "ski-backward or ski-band)" >&2
       exit 2 ;;
    esac
done

if [ -d .whl ] && ! [ -d /tmp/site/fairseq ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit
fi
if [ -d /tmp/site ]; then
    export FAIRSEQ_BIN=/tmp/site/bin
    SITE=/tmp/site:
else
    SITE=
fi
export PYTHONPATH="$SITE$ROOT"

machine() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)"
}

# After a process that a signal ended, with its output in LOG: the generated code its trace names (inductor's, the
# ninth GPU run's segmentation fault) kept in DIR as crash-SECONDS.py, its lines before the crash printed.
keep_crash() {
    local log=$1 dir=$2 seen file line
    seen=$(grep -oE 'File "[^"]+\.py", line [0-9]+ in call' "$log" | head -n 1)
    [ -n "$seen" ] || return 0
    file=$(sed -E 's/File "([^"]+)".*/\1/' <<< "$seen")
    line=$(sed -E 's/.* line ([0-9]+) .*/\1/' <<< "$seen")
    cp "$file" "$dir/crash-$SECONDS.py" 2>/dev/null && sed -n "$((line > 40 ? line - 40 : 1)),${line}p" "$file"
}

# gpu_profile.py into DIR within SECONDS, each process with an empty inductor cache of its own (so that every compile
# time is a cold one): where a signal ends its process (a crash, the ninth GPU run's lost FD-TNN rows and every row
# after them), the generated code it crashed in is kept and the run resumed (--resume) without the configuration
# that crashed, for as long as time is left.
resumable_profile() {
    local dir=$1 seconds=$2 end code resume=()
    shift 2
    end=$((SECONDS + seconds))
    while :; do
        TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout $((end - SECONDS)) python3 benchmarks/gpu_profile.py \
            --out "$dir" "$@" "${resume[@]}" 2>&1 | tee "$dir/part.log"
        code=${PIPESTATUS[0]}
        if [ "$code" -gt 128 ]; then
            echo "== gpu_profile: the process ended by signal $((code - 128))"
            keep_crash "$dir/part.log" "$dir"
        fi
        rm -f "$dir/part.log"
        [ "$code" -gt 128 ] || return "$code"
        [ $((end - SECONDS)) -gt 30 ] || { echo "== gpu_profile: no time left to resume"; return "$code"; }
        echo "== gpu_profile: resumed without the configuration that ended the process"
        resume=(--resume)
    done
}

# A profile of causal TNN's graphed update (and, where given, other configurations and options); the accumulated
# updates (--update-freq 16) are the targets call's alone, so that these calls keep the times they were sized to.
profile() {
    local out=$1 budget=$2
    shift 2
    resumable_profile "$out" $((budget + 60)) --timed 8 --compile-budget "$budget" --shapes causal/512 --compiled \
        --bf16-weights --accumulated "$@"
}

# One part of the tests call: pytest with what is left of the call's 5 minutes (TESTS_END), each test's outcome printed
# as it ends, the failures' short tracebacks and the durations at the end. A test that crashes the process (a signal:
# the ninth GPU run's segmentation fault in a compiled backward) would leave the rest of the part unrun: the generated
# code its trace names is kept (CRASH_DIR, and its lines before the crash printed), and the part runs again without
# the tests that have an outcome and the one that crashed, as long as time is left.
tests_part() {
    local left code crashed deselect=()
    while :; do
        left=$((TESTS_END - SECONDS))
        [ $left -gt 10 ] || { echo "tests: no time left for $*"; return 124; }
        echo "== tests: $* (at most $left s)${deselect[*]:+ ${deselect[*]}}"
        timeout $left python3 -m pytest -v -rfE --tb=short --durations=0 -p no:cacheprovider "$@" "${deselect[@]}" \
            2>&1 | tee "$CRASH_DIR/part.log"
        code=${PIPESTATUS[0]}
        [ "$code" -gt 128 ] || return "$code"
        crashed=$(grep -oE '^tests/[^ ]+::[^ ]+' "$CRASH_DIR/part.log" | tail -n 1)
        echo "== tests: the process ended by signal $((code - 128)) in ${crashed:-an unknown test}"
        keep_crash "$CRASH_DIR/part.log" "$CRASH_DIR"
        [ -n "$crashed" ] || return "$code"
        for t in $(grep -oE '^tests/[^ ]+::[^ ]+ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)' "$CRASH_DIR/part.log" \
                   | cut -d' ' -f1) "$crashed"; do
            deselect+=(--deselect "$t")
        done
    done
}

run_call() {
    local call=$1 dir=$OUT/$1
    mkdir -p "$dir"
    echo "== $call: $(date -u +%H:%M:%S)"
    case $call in
    tests)
        # at most 5 minutes in all (TESTS_SECONDS, where a call runs tests and update together), so that a call of its
        # own leaves the device's 15 minutes room for the update's measurement, in parts, the one that matters most
        # first: the recipe's default path on one GPU (every preset with the model's edges and the layers as regions in
        # the stack's graphs), then the recipes' loss (tnn_cross_entropy's and tnn_masked_lm's fused kernels against
        # fairseq's computation, the output layer's padded GEMMs against F.linear, and the benchmarks' peak memory held
        # over fairseq's resets, then the two losses timed side by side, some 20 s, and the output layer's GEMMs plain
        # and padded, some 10 s), then SKI's direct band (its tests, then the band's methods timed, some 30 s), then
        # the graphs under DistributedDataParallel
        # (CUDA_GRAPHS' default on several GPUs rests on it since the ninth run), then the stack's graphs
        # without the edges (the first fallback) and the regions' dropout, then the direct product (off by default).
        # Each part gets what the parts before it left, and prints each test's outcome as it ends, so that a part cut
        # short by the timeout still tells what passed.
        local code=0 left
        TESTS_END=$((SECONDS + ${TESTS_SECONDS:-300})) CRASH_DIR=$dir
        tests_part tests/gpu/test_gpu.py -k models_edges || code=$?
        tests_part tests/ops/test_cross_entropy.py tests/ops/test_logits.py \
            tests/gpu/test_gpu.py::test_the_benchmarks_peak_is_the_updates_not_the_memory_between_them || code=$?
        left=$((TESTS_END - SECONDS))
        if [ $left -gt 30 ]; then
            timeout $((left < 60 ? left : 60)) python3 benchmarks/cross_entropy.py --out "$dir/cross-entropy" || code=$?
        fi
        # the output layer's GEMMs over the masked dictionary's odd 50,265 symbols, plain and padded (some 10 s)
        left=$((TESTS_END - SECONDS))
        if [ $left -gt 30 ]; then
            timeout 30 python3 benchmarks/vocab_linear.py --out "$dir/vocab-linear" || code=$?
        fi
        # SKI-TNO's band by the Triton kernels (off by default), the low rank in them: against the convolution on CUDA,
        # compiled and in the stack's graphs; then each band method timed side by side, eagerly, the direct band's with
        # the low rank fused and after it (some 30 s; the ski-band call compiles)
        local band=0
        tests_part tests/ops/test_band_direct.py \
            tests/gpu/test_gpu.py::test_the_direct_band_in_ski_tnns_compiled_layers_and_graphs_equals_eager || band=$?
        [ $band -eq 0 ] || code=$band
        left=$((TESTS_END - SECONDS))
        if [ $left -gt 40 ]; then
            timeout $((left < 70 ? left : 70)) python3 benchmarks/ski_band.py --device cuda --rounds 5 \
                --out "$dir/ski-band" || code=$?
        fi
        tests_part tests/gpu/test_gpu.py -k distributed_data_parallel || code=$?
        tests_part tests/gpu/test_gpu.py -k "cuda_graphs_equal_eager or regions" || code=$?
        tests_part tests/ops/test_toeplitz_direct.py || code=$?
        # last, so that the call's output ends with it: the band the targets call should train SKI-TNN with, by the
        # timing above and the band's tests (the environment of `bash benchmarks/gpu_run.sh targets`)
        if [ -f "$dir/ski-band/ski_band.json" ]; then
            python3 benchmarks/ski_band.py --choice "$dir/ski-band/ski_band.json" \
                $([ $band -eq 0 ] || echo --tests-failed) || code=$?
        fi
        return $code ;;
    direct)
        # handed the kernel in time first (TNN's and causal FD-TNN's stacks hand it so; the FFT way transforms it),
        # at each of the rows a program and bytes a load of T's tile that toeplitz_direct.py times by default; then
        # the spectrum (bidirectional FD-TNN's, which the direct way takes back by an irfft) as the module runs it
        local code=0
        timeout 200 python3 benchmarks/toeplitz_direct.py --out "$dir" || code=$?
        timeout 80 python3 benchmarks/toeplitz_direct.py --operand spectrum --module-way --out "$dir/spectrum" || code=$?
        return $code ;;
    update)
        profile "$dir" 220 --configs tnn6 fd3 transformer bound_identity \
            --graphs causal/512/tnn6 causal/512/fd3 causal/512/bound_identity --host-profile causal/512/tnn6 ;;
    targets)
        # every target of issue 39 side by side in one run (its "done when"): gpu_profile's defaults (the three shapes,
        # every configuration eager, the stack's graphs of each row a target compares while the compile budget lasts,
        # the main target's two sides again with the recipe's gradient accumulation, fairseq's --bf16 of causal TNN,
        # and last the floors again with the direct product) without the compiled rows the recipe does not train;
        # about 8-9 minutes, a call of its own. SKI_BAND and SKI_LOWRANK (the tests call's last line says which):
        # SKI-TNO's band and low rank for the run (gpu_profile's --ski-band, --ski-lowrank), BAND_METHOD's otherwise
        resumable_profile "$dir" 540 --timed 8 --compile-budget 315 --compiled ${SKI_BAND:+--ski-band "$SKI_BAND"} \
            ${SKI_LOWRANK:+--ski-lowrank "$SKI_LOWRANK"} ;;
    no-edges)
        profile "$dir" 90 --no-graph-edges --configs tnn6 --graphs causal/512/tnn6 --host-profile causal/512/tnn6 ;;
    one-graph)
        profile "$dir" 150 --no-stack-regions --configs tnn6 fd3 --graphs causal/512/tnn6 causal/512/fd3 ;;
    direct-update)
        # the graphed updates with the direct product, and the compiled layers' floors with it (the recipe's layers:
        # the mixing's kernels by kind, the direct product's among them)
        profile "$dir" 240 --direct-max-n 512 --shapes causal/512 masked/512 --configs tnn6 fd3 bound_identity \
            --compiled causal/512/tnn6 causal/512/fd3 masked/512/tnn6 --graphs causal/512/tnn6 masked/512/tnn6 ;;
    ski-backward)
        # SKI-TNN with its gate kept for the backward (--ski-backward keep) and recomputed there (recompute, the
        # default), one after the other in the call: eager at both masked shapes and with the stack's graphs at
        # 4 x 2048, the memory the recompute saves and the time it costs; about 4 minutes
        local code=0 mode
        for mode in keep recompute; do
            mkdir -p "$dir/$mode"
            resumable_profile "$dir/$mode" 130 --timed 8 --compile-budget 70 --shapes masked/512 masked/2048 \
                --configs ski --compiled --graphs masked/2048/ski --accumulated --bf16-weights --direct-floor \
                --ski-backward "$mode" || code=$?
        done
        return $code ;;
    ski-band)
        # SKI-TNO's band each way (the banded GEMM, cuDNN's depthwise convolution, the direct band's Triton kernels),
        # alone and in the whole SKI-TNO (the direct band's with the low rank fused and after it), eager and compiled;
        # then SKI-TNN's update with the convolution's band and with the direct one (the low rank fused), one after the
        # other: eager at both masked shapes and with the stack's graphs at 4 x 2048; about 6-7 minutes
        local code=0 method
        timeout 180 python3 benchmarks/ski_band.py --device cuda --compiled --out "$dir/ski-band" || code=$?
        for method in conv1d triton; do
            mkdir -p "$dir/$method"
            resumable_profile "$dir/$method" 110 --timed 8 --compile-budget 60 --shapes masked/512 masked/2048 \
                --configs ski --compiled --graphs masked/2048/ski --bf16-weights --ski-band "$method" || code=$?
        done
        return $code ;;
    versions)
        # the host time of the versions, alternated (the current tree, then each older one carried as .gpurun/at-REV)
        local tree rev k=0
        for rev in current 97356b1 bd203d5 3cde7bb current 97356b1; do
            k=$((k + 1))
            if [ "$rev" = current ]; then tree=$ROOT; else tree=$ROOT/.gpurun/at-$rev; fi
            [ -d "$tree/fairseq_tnn" ] || { echo "no $tree (carry .gpurun/at-$rev)"; continue; }
            (cd "$tree" && PYTHONPATH="$SITE$tree" timeout 150 python3 benchmarks/gpu_profile.py --out "$dir/$rev-$k" \
                --timed 8 --compile-budget 90 --shapes causal/512 --configs tnn6 --compiled --graphs causal/512/tnn6 \
                --host-profile causal/512/tnn6)
        done ;;
    esac
}

machine > "$OUT/machine.txt" 2>&1
status=0
for call in "$@"; do
    run_call "$call" > "$OUT/$call.log" 2>&1
    code=$?
    echo "$call: exit $code" | tee -a "$OUT/status.txt"
    tail -n 5 "$OUT/$call.log"
    find "$OUT/$call" -name '*.md' -exec cat {} + 2>/dev/null | head -c 4000
    # at most 8 files come back from the device: each call's folder and log as one archive
    mv "$OUT/$call.log" "$OUT/$call/" && tar -czf "$OUT/$call.tgz" -C "$OUT" "$call" && rm -rf "${OUT:?}/$call"
    [ $code -eq 0 ] || status=$code
done
exit $status
