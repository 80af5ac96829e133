"""On a CUDA GPU (skipped without one, as in CI): every wt103 architecture trains through fairseq-train
in fp16 and bf16, compiled layers equal eager ones on the GPU, evaluation at 14,336 tokens is finite in
fp16, and the causal models are causal in fp32.

Run on a GPU machine with ``python -m pytest tests/gpu/test_gpu.py`` (FAIRSEQ_BIN names the fairseq CLIs
when they are not beside that Python)."""
import copy
import math
import re

import pytest
import torch

from helpers import USER_DIR, assert_compiled_matches_eager, cli, rel, run, wt103_presets
from fairseq_tnn.models.compile import compile_layers
from fairseq_tnn.models.build import build_arch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CAUSAL = wt103_presets("tnn_lm")  # fairseq's registry of our archs
MASKED = wt103_presets("tnn_mlm")


def small(arch):
    return {"decoder_layers": 2} if arch in CAUSAL else {"encoder_layers": 2}


@pytest.mark.runs_doc(r'^(FAIRSEQ_BIN=\S+ )?python3? -m pytest tests/gpu/test_gpu\.py')
@pytest.mark.parametrize("precision", ["--fp16", "--bf16-autocast"])
@pytest.mark.parametrize("arch", CAUSAL + MASKED)
def test_fairseq_train_on_gpu(data_bin, tmp_path, arch, precision):
    causal = arch in CAUSAL
    layers = ["--decoder-layers" if causal else "--encoder-layers", 2]
    log = run([cli("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--arch", arch, *layers, precision,
               "--task", "tnn_language_modeling" if causal else "tnn_masked_lm",
               "--criterion", "cross_entropy" if causal else "masked_lm",
               "--sample-break-mode", "none" if causal else "complete", "--tokens-per-sample", 128,
               "--batch-size", 8, "--optimizer", "adam", "--lr", "0.001", "--max-update", 40, "--seed", 1,
               "--save-dir", tmp_path / "ck", "--log-format", "simple", "--log-interval", 10, "--num-workers", 0,
               "--no-epoch-checkpoints", "--validate-interval-updates", 20,
               "--tnn-compile", "strict"])  # strict: a compilation failure fails the test instead of running eagerly
    assert "gpu_peak_mb" in log, log[-3000:]
    losses = [float(x) for x in re.findall(r"valid on 'valid' subset \| loss ([0-9.]+)", log)]
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], log[-3000:]


@pytest.mark.parametrize("arch", CAUSAL + MASKED)
def test_compiled_equals_eager_on_gpu(arch):
    torch.manual_seed(0)
    model = build_arch(arch, 1000, dropout=0.0, **small(arch)).cuda()
    stack = model.decoder if arch in CAUSAL else model.encoder
    eager = stack.layers[0]
    compiled = copy.deepcopy(eager)
    compile_layers(torch.nn.ModuleList([compiled]))
    width = stack.embed_tokens.embedding_dim  # 512 causal, 768 masked
    for n in (512, 1000):
        assert_compiled_matches_eager(eager, compiled, torch.randn(2, n, width, device="cuda"))


@pytest.mark.slow
@pytest.mark.parametrize("arch", CAUSAL + MASKED)
def test_fp16_evaluation_at_14336_tokens(arch):
    torch.manual_seed(0)
    model = build_arch(arch, 1000, **small(arch)).cuda().half().eval()
    tokens = torch.randint(4, 1000, (1, 14336), device="cuda")
    with torch.no_grad():
        logits = model(tokens)[0]
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", CAUSAL)
def test_causal_in_fp32_on_gpu(arch):
    """A changed token at t moves no output before t by more than 1e-4 relative."""
    torch.manual_seed(0)
    model = build_arch(arch, 1000, dropout=0.0, **small(arch)).cuda().eval()
    tokens = torch.randint(4, 1000, (2, 1024), device="cuda")
    changed = tokens.clone()
    t = 700
    changed[:, t] = (changed[:, t] + 1 - 4) % 996 + 4
    with torch.no_grad():
        a, b = model(tokens)[0], model(changed)[0]
    assert rel(b[:, :t], a[:, :t]) < 1e-4
    assert rel(b[:, t:], a[:, t:]) > 1e-4  # the change does reach the later positions
