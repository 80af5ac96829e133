"""The compiled layers and the stack's CUDA graphs under torch's DistributedDataParallel, as a run on several GPUs
trains (fairseq's ``--ddp-backend pytorch_ddp``): two ranks of fairseq-train started by torchrun on the CPU, joined
by gloo, each loses at every update what the same ranks lose eagerly.

Under DDP, dynamo compiles every graph it meets inside DDP's forward through its DDPOptimizer, which cuts the graph
at DDP's gradient buckets (``--bucket-cap-mb``) so that a bucket's all-reduce can start while the rest of the
backward runs, and compiles each piece apart. The stack's graphs hold the model's edges (the embedding) and its
layers as regions; cut into pieces, each piece must keep the layers it holds as regions, and the gradients DDP
all-reduces must be the eager ones, with ``--update-freq 2`` (the first micro-batch under DDP's ``no_sync``).

The CPU stands in for the GPU (tests/gpu has the same run on CUDA, with CUDA graphs recorded): a hook installed as
``sitecustomize`` in the ranks makes the stack's graphs run where they would on a GPU
(``CompiledStack.trains_on_cuda``), compiles every graph with AOT autograd and no compiler (``aot_eager``: inductor's time spared; dynamo's tracing, the
regions and the DDPOptimizer's cuts are the real ones) and records each graph it is given, and lets fairseq's
``pytorch_ddp`` wrap a CPU model (fairseq passes CUDA ``device_ids``, which torch refuses for a CPU module)."""
import json
import os
import sys

import pytest

from helpers import lm_args, mlm_args, rank0_updates, run
from fairseq_tnn.models import compile as compiling

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not compiling.STACK_REGIONS, reason="this torch compiles no stack regions")]

STAND_IN = """
import json, os
import torch
from fairseq.models import distributed_fairseq_model
from fairseq_tnn.models import compile as compiling
from fairseq_tnn.tasks import tnn_language_modeling, tnn_masked_lm


class CpuDistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    def __init__(self, module, device_ids=None, output_device=None, **options):  # fairseq's CUDA device ids
        super().__init__(module, **options)


def recording_backend(gm, example_inputs):
    regions = [n.args[0].target for n in gm.graph.nodes
               if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph]
    with open(os.environ["TNN_GRAPHS_LOG"], "a") as log:
        log.write(json.dumps({"rank": os.environ["RANK"], "regions": len(regions), "distinct": len(set(regions)),
                              "tokens": any(x.dtype == torch.int64 for x in example_inputs
                                            if isinstance(x, torch.Tensor))}) + "\\n")
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


distributed_fairseq_model.DistributedDataParallel = CpuDistributedDataParallel
options = compiling._compile_options
compiling._compile_options = lambda: {**options(), "backend": recording_backend}
compiling.CUDA_GRAPHS_MODE = {}
compiling.CompiledStack.trains_on_cuda = (
    lambda self, layer, x: self.error is None and layer.training and torch.is_grad_enabled())
for task in (tnn_language_modeling, tnn_masked_lm):
    task.check_cuda_graphs_for_training = lambda cfg: None
"""

# --bucket-cap-mb 1 (fairseq's default is 25) so that DDP's buckets cut the tiny models' graphs: the embedding's
# bucket apart from the layers', and at width 256 each layer's apart.
RUNS = {"causal": lambda: lm_args(tokens_per_sample=64, batch_size=4, log_interval=1, decoder_layers=3,
                                  decoder_embed_dim=256),
        "masked": lambda: mlm_args(batch_size=4, encoder_layers=3, encoder_embed_dim=256)}


def ddp_ranks(data_bin, run_dir, kind, *options):
    """fairseq-train ``kind``'s tiny recipe as two torchrun ranks with fairseq's pytorch_ddp on the CPU, the stand-in
    installed: (rank 0's {update: loss}, the graphs each rank compiled, the log)."""
    run_dir.mkdir()
    (run_dir / "sitecustomize.py").write_text(STAND_IN)
    graphs = run_dir / "graphs.jsonl"
    env = {"OMP_NUM_THREADS": "1", "TNN_GRAPHS_LOG": str(graphs),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(run_dir), os.environ.get("PYTHONPATH")]))}
    log = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", 2, "--standalone",
               "-m", "fairseq_cli.train", data_bin, *RUNS[kind](), "--dropout", 0, "--update-freq", 2,
               "--max-update", 8, "--disable-validation", "--no-epoch-checkpoints", "--save-dir", run_dir / "ck",
               "--distributed-world-size", 2, "--distributed-rank", "${local_rank}", "--distributed-init-method",
               "env://", "--distributed-no-spawn", "--distributed-backend", "gloo", "--ddp-backend", "pytorch_ddp",
               "--bucket-cap-mb", 1, *options], env=env)
    assert "training on 2 devices" in log and "ddp_backend': 'pytorch_ddp'" in log, log[-3000:]
    losses = {update: loss for update, (loss, _) in rank0_updates(log).items()}
    recorded = [json.loads(line) for line in graphs.read_text().splitlines()] if graphs.exists() else []
    return losses, recorded, log


@pytest.mark.parametrize("kind", ["causal", "masked"])
def test_the_stacks_graphs_and_the_compiled_layers_under_ddp_lose_what_eager_loses(kind, data_bin, tmp_path):
    """Eager, compiled layers (--tnn-compile strict: what a run on several GPUs trains with today) and the stack's
    graphs (--tnn-cuda-graphs), two DDP ranks each: the same loss at every update. The stack's graphs came to the
    backend cut at DDP's buckets, the embedding (the tokens in) in a piece of its own, every layer still a region,
    three in all per rank and shape; nothing fell back to fewer regions or to eager layers (a warning would say so,
    and strict would stop)."""
    eager, none, _ = ddp_ranks(data_bin, tmp_path / "eager", kind)
    assert sorted(eager) == list(range(1, 9)) and none == [], eager
    compiled, layer_graphs, log = ddp_ranks(data_bin, tmp_path / "compiled", kind, "--tnn-compile", "strict")
    assert layer_graphs and all(g["regions"] == 0 and not g["tokens"] for g in layer_graphs), layer_graphs
    graphed, pieces, log = ddp_ranks(data_bin, tmp_path / "graphs", kind, "--tnn-compile", "strict",
                                     "--tnn-cuda-graphs")
    assert "--tnn-cuda-graphs:" not in log and "--tnn-compile:" not in log, log[-3000:]  # no fallback's warning
    for losses in (compiled, graphed):
        assert sorted(losses) == list(range(1, 9))
        assert all(losses[u] == pytest.approx(eager[u], abs=2e-3) for u in eager), (eager, losses)
    for rank in "01":
        mine = [g for g in pieces if g["rank"] == rank]
        stack = [g for g in mine if g["regions"] or g["tokens"]]
        # the stack's graph of each shape in pieces: the one with the tokens, then the layers' (one region each at
        # width 256), as many layers in all as the model has for every shape the rank compiled
        shapes = sum(g["tokens"] for g in stack)
        assert shapes >= 1 and len(mine) > shapes, mine
        assert sum(g["regions"] for g in stack) == 3 * shapes and all(g["distinct"] <= 1 for g in stack), mine
        assert not any(g["tokens"] and g["regions"] for g in stack), mine  # the embedding's bucket is cut apart
