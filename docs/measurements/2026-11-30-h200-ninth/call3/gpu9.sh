#!/usr/bin/env bash
# The ninth GPU run's second call (one-off; its results are committed under docs/measurements/).
set -u
: "${OUT:?}"
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1 PYTHON=python3
[ -d /tmp/site/fairseq ] || python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit
export FAIRSEQ_BIN=/tmp/site/bin PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/machine.txt
git log --oneline -1 >> $OUT/machine.txt 2>/dev/null
crashed_code() {  # the generated file and line a segfault's trace names, with the lines before it
    local log=$1 name=$2 hit f l
    hit=$(grep -oE 'File "[^"]+\.py", line [0-9]+ in call' "$log" | head -1)
    [ -n "$hit" ] || return 0
    f=$(echo "$hit" | sed -E 's/File "([^"]+)".*/\1/'); l=$(echo "$hit" | sed -E 's/.*line ([0-9]+).*/\1/')
    echo "== $hit" >> "$log"; sed -n "$((l > 60 ? l - 60 : 1)),$((l + 5))p" "$f" >> "$log"
    cp "$f" "$OUT/$name-code.py"
}
part() {  # name timeout pytest-args...
    local name=$1 t=$2; shift 2
    echo "== $name $(date -u +%T)" | tee -a $OUT/status.txt
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout $t python3 -m pytest -v -rfE --tb=short -p no:cacheprovider "$@" \
        > $OUT/$name.log 2>&1
    echo "$name: exit $?" | tee -a $OUT/status.txt
    tail -n 4 $OUT/$name.log
    crashed_code $OUT/$name.log $name
}
# the ninth run's third call: the stack's graphs build their constants anew (fast.cuda_graphs)
part tnn-edges 45 tests/gpu/test_gpu.py -k "models_edges and tnn_lm_wt103 and not rpe3 and not fd_tnn"
echo "== profile $(date -u +%T)" | tee -a $OUT/status.txt
TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout 150 python3 benchmarks/gpu_profile.py --out $OUT/profile --timed 8 \
    --compile-budget 90 --shapes causal/512 --configs tnn6 transformer --compiled \
    --graphs causal/512/tnn6 --bf16-weights > $OUT/profile.log 2>&1
echo "profile: exit $?" | tee -a $OUT/status.txt
grep -v "DEBUG\|Warning\|warn" $OUT/profile.log | tail -n 3
head -c 2500 $OUT/profile/gpu_profile.md 2>/dev/null
tar -czf $OUT/profile.tgz -C $OUT profile profile.log && rm -rf $OUT/profile $OUT/profile.log
part fd-edges 45 tests/gpu/test_gpu.py -k "models_edges and fd_tnn_lm_wt103 and not rpe3"
ls -la $OUT
