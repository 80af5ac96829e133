#!/bin/bash
# sixth GPU run: one call. profile (graphs for the targets' configurations), then the graph equality tests
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FAIRSEQ_BIN=/tmp/site/bin PYTHON=python3
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)"; } > $OUT/machine.txt 2>&1
timeout 330 python3 benchmarks/gpu_profile.py --out $OUT/profile --timed 8 --compile-budget 190 \
  --configs tnn6 tnn3 fd3 ski transformer bound_identity --compiled --bf16 \
  --graphs causal/512/tnn6 causal/512/fd3 masked/2048/ski masked/2048/tnn6 masked/2048/fd3 causal/512/tnn3 \
  > $OUT/profile.log 2>&1
echo "profile rc=$?" >> $OUT/profile.log
timeout 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_gpu.py -k cuda_graphs_equal_eager > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $OUT/tests.log
tail -3 $OUT/tests.log; tail -5 $OUT/profile.log
