"""--tnn-compile: torch.compile per TNN layer. Compiled == eager (fp32, relative 1e-5, forward and
gradients) for all five TNO kinds, with no graph break inside a layer; checkpoints load in either
mode; new lengths recompile a bounded number of times."""
import copy
import re

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import LM_TRAIN, USER_DIR, assert_compiled_matches_eager, cli, rel, run
from fairseq_tnn.models.blocks import compile_layers
from fairseq_tnn.models.build import build_arch

KINDS = {"tnn causal": "tnn_lm_tiny", "fd causal": "fd_tnn_lm_tiny", "tnn bidirectional": "tnn_mlm_tiny",
         "fd bidirectional": "fd_tnn_mlm_tiny", "ski": "ski_tnn_mlm_tiny"}


def layers_of(model):
    return model.decoder.layers if hasattr(model, "decoder") else model.encoder.layers


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_compiled_layer_equals_eager(kind):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_arch(KINDS[kind], 50)
    eager = layers_of(model)[0]
    compiled = copy.deepcopy(eager)
    compile_layers(torch.nn.ModuleList([compiled]))
    # the whole layer is one graph: no break in the FFT convolutions or their hand-written backwards
    explain = torch._dynamo.explain(copy.deepcopy(eager))(torch.randn(2, 40, 64))
    assert explain.graph_break_count == 0, explain.break_reasons
    counters.clear()
    for n in (40, 40, 23):  # a second call reuses the graph; a new length compiles once more
        assert_compiled_matches_eager(eager, compiled, torch.randn(2, n, 64))
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert rel(pc.grad, pe.grad) < 1e-5, name
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    # the compiled module has the eager module's parameter names: checkpoints are interchangeable
    assert list(compiled.state_dict()) == list(eager.state_dict())


@pytest.mark.slow
def test_tnn_compile_trains_and_checkpoint_loads_in_either_mode(data_bin, tmp_path):
    """fairseq-train --tnn-compile learns; its checkpoint scores the same with and without compilation."""
    save = tmp_path / "ck"
    log = run([cli("fairseq-train"), data_bin, *LM_TRAIN, "--arch", "fd_tnn_lm_tiny", "--tnn-compile",
               "--tokens-per-sample", 64, "--batch-size", 8, "--max-update", 12, "--save-dir", save,
               "--no-epoch-checkpoints", "--validate-interval-updates", 12, "--dropout", 0.0])
    assert re.search(r"num_updates[ =]12", log), log[-3000:]
    ppls = []
    for overrides in ("{}", "{'tnn_compile': False}"):
        log = run([cli("fairseq-eval-lm"), data_bin, "--user-dir", USER_DIR, "--cpu", "--path", save / "checkpoint_last.pt",
                   "--tokens-per-sample", 64, "--batch-size", 4, "--num-workers", 0, "--model-overrides", overrides])
        m = re.search(r"Perplexity: ([0-9.]+)", log)
        assert m, log[-3000:]
        ppls.append(float(m.group(1)))
    assert abs(ppls[0] - ppls[1]) <= 1e-4 * ppls[1], ppls
