"""The fp16-grads-sync and fp16-params-sync patches (fairseq_tnn/patches/fp16_syncs.py): FP16Optimizer's syncs
between the fp16 model and its flat fp32 master copy, one multi-tensor copy per direction, do exactly what
fairseq's per-parameter loops do (the same flat layout and values), for the plugin's models and fairseq's own
(transformer_lm) alike; unflattened master weights keep fairseq's code."""
import re
import sys

import pytest
import torch
from fairseq.optim.fp16_optimizer import FP16Optimizer

from fairseq_tnn import register
from fairseq_tnn.patches.base import resolve
from helpers import ROOT, command_env, execute

register()  # the plugin as fairseq loads it: the patches installed

MIXIN = FP16Optimizer.__mro__[1]
# the installed syncs (ours) and the fairseq methods they replaced
SYNC_GRADS, SYNC_PARAMS = MIXIN._sync_fp16_grads_to_fp32, MIXIN._sync_fp32_params_to_fp16
FAIRSEQ_SYNC_GRADS, FAIRSEQ_SYNC_PARAMS = (resolve(f"fairseq.optim.fp16_optimizer:_FP16OptimizerMixin.{name}")
                                           for name in ("_sync_fp16_grads_to_fp32", "_sync_fp32_params_to_fp16"))


def fp16_optimizer(monkeypatch, params):
    """An FP16Optimizer's sync state for ``params`` (fairseq's own build_fp32_params, flat, on the CPU:
    a CPU tensor's device index is None, which stands for the current CUDA device here)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    opt = object.__new__(FP16Optimizer)
    opt.fp16_params = params
    opt.fp32_params = FP16Optimizer.build_fp32_params(None, params, flatten=True)
    return opt


def model_params(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 3), (3,), (5, 2, 2), (1,), (4, 4)]
    params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=g).half()) for s in shapes)
    for i, p in enumerate(params):
        p.grad = None if i == 3 else torch.randn(p.shape, generator=g).half()  # one parameter got no gradient
    return list(params)


def test_patched_syncs_are_installed():
    assert MIXIN.__name__ == "_FP16OptimizerMixin"
    assert SYNC_GRADS.fairseq_tnn_patch == "fp16-grads-sync" and SYNC_PARAMS.fairseq_tnn_patch == "fp16-params-sync"
    assert FAIRSEQ_SYNC_GRADS.__module__ == FAIRSEQ_SYNC_PARAMS.__module__ == "fairseq.optim.fp16_optimizer"


@pytest.mark.parametrize("step", range(2))  # the second round reuses the cached views
def test_gradient_and_weight_syncs_equal_fairseqs_loops(monkeypatch, step):
    ours, theirs = fp16_optimizer(monkeypatch, model_params(0)), fp16_optimizer(monkeypatch, model_params(0))
    for _ in range(step + 1):
        for opt in (ours, theirs):
            opt._needs_sync = True
        SYNC_GRADS(ours)
        FAIRSEQ_SYNC_GRADS(theirs)
        assert not ours._needs_sync
        flat, ref = ours.fp32_params[None], theirs.fp32_params[None]
        assert torch.equal(flat.grad, ref.grad) and flat.grad.dtype == torch.float32
        assert flat.grad[7 * 3 + 3 + 5 * 2 * 2].item() == 0.0  # the parameter without a gradient: zeros
        # an optimizer step on the master weights, then back into the fp16 model
        for f in (flat, ref):
            f.data.add_(f.grad, alpha=-0.5)
        SYNC_PARAMS(ours)
        FAIRSEQ_SYNC_PARAMS(theirs)
        for a, b in zip(ours.fp16_params, theirs.fp16_params):
            assert a.dtype == torch.float16 and torch.equal(a, b)
    assert torch.equal(torch.cat([p.detach().float().view(-1) for p in ours.fp16_params]),
                       ours.fp32_params[None].detach().half().float())


def test_unflattened_master_weights_keep_fairseqs_code():
    opt, ref = object.__new__(FP16Optimizer), object.__new__(FP16Optimizer)
    for o in (opt, ref):
        o.fp16_params = model_params(1)
        o.fp32_params = FP16Optimizer.build_fp32_params(None, o.fp16_params, flatten=False)  # a list
        o._needs_sync = True
    SYNC_GRADS(opt)
    FAIRSEQ_SYNC_GRADS(ref)
    for a, b in zip(opt.fp32_params, ref.fp32_params):
        assert torch.equal(a.grad, b.grad)


def half_model_params(model):
    model = model.half()
    g = torch.Generator().manual_seed(2)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)  # the TNN models' RPEs stay fp32 (modules/rpe.py)
    return params


@pytest.mark.parametrize("arch", ["transformer_lm", "tnn_lm_tiny"])
def test_every_model_takes_the_fast_path_with_fairseqs_values(monkeypatch, arch):
    """A model of the plugin's and fairseq's own transformer_lm (the benchmarks' baseline) alike sync through one
    multi-tensor copy per direction and parameter dtype, nothing in the model marked for it, and get fairseq's
    values. Each copy's sources share one dtype and its destinations another: what CUDA's multi-tensor copy needs
    for its one-kernel path (otherwise it copies tensor by tensor); the TNN models' RPE weights stay fp32."""
    import fairseq.models.transformer_lm  # noqa: F401  (registers fairseq's transformer_lm)
    from fairseq_tnn.models.build import build_arch
    sizes = dict(decoder_layers=1, decoder_embed_dim=8, decoder_ffn_embed_dim=16, decoder_attention_heads=2,
                 max_target_positions=32) if arch == "transformer_lm" else {}
    torch.manual_seed(0)
    ours = fp16_optimizer(monkeypatch, half_model_params(build_arch(arch, 64, **sizes)))
    torch.manual_seed(0)
    theirs = fp16_optimizer(monkeypatch, half_model_params(build_arch(arch, 64, **sizes)))
    copies = []
    foreach_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src, **k: copies.append(
        ({t.dtype for t in dst}, {t.dtype for t in src}, len(dst))) or foreach_copy(dst, src, **k))
    ours._needs_sync = theirs._needs_sync = True
    SYNC_GRADS(ours)
    SYNC_PARAMS(ours)
    dtypes = {p.dtype for p in ours.fp16_params}
    assert len(copies) == 2 * len(dtypes), copies
    assert all(len(dst) == len(src) == 1 for dst, src, _ in copies), copies
    assert sum(n for *_, n in copies) == 2 * len(ours.fp16_params)
    FAIRSEQ_SYNC_GRADS(theirs)
    FAIRSEQ_SYNC_PARAMS(theirs)
    assert torch.equal(ours.fp32_params[None].grad, theirs.fp32_params[None].grad)
    assert all(torch.equal(a, b) for a, b in zip(ours.fp16_params, theirs.fp16_params))
    assert dtypes == ({torch.float16} if arch == "transformer_lm" else {torch.float16, torch.float32}), dtypes


def test_the_benchmark_times_both_syncs_side_by_side():
    """benchmarks/fp16_syncs.py (the figures in docs/training.md) runs as documented and reports fairseq's loops
    and the plugin's copies for the same parameters."""
    code, out, _ = execute([sys.executable, ROOT / "benchmarks/fp16_syncs.py", "--arch", "tnn_lm_tiny", "--rounds", 2],
                           command_env(), 300, merge=True)
    assert code == 0, out[-3000:]
    assert re.search(r"tnn_lm_tiny, (\d+) parameters, device meta", out), out
    for name in ("fairseq", "plugin"):
        assert re.search(rf"^\| {name} \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$", out, re.M), out
