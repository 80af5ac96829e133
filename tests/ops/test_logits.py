"""The output layer's logits over a padded vocabulary (``fairseq_tnn/ops/logits.py``) against ``F.linear``, forward and
gradients, on every device (the CPU with the padding asked for, as CUDA asks for it), and inside the models: the
masked model's head and the causal model's output layer run the padded GEMM and give the same loss and gradients."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq_tnn.ops import fast, logits


@pytest.fixture
def padded_on(device, monkeypatch):
    """The padding on ``device``'s type as on CUDA's (the CPU pads nothing by default), for the tests' few rows."""
    monkeypatch.setitem(logits.ALIGN, device, 8)
    monkeypatch.setattr(logits, "MIN_ROWS", 2)


class GemmShapes(TorchDispatchMode):
    """The dimensions of each matrix product dispatched inside the block (its operands' and its output's)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.shapes.append(tuple(sorted({n for t in (*args, out) if isinstance(t, torch.Tensor) for n in t.shape})))
        return out


def _grads(fn, x, w, cot):
    xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(xs, ws)
    y.backward(cot)
    return y.detach(), xs.grad, ws.grad


@pytest.mark.parametrize("vocab", [13, 16, 1])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_padded_logits_equal_f_linear_forward_and_gradients(device, padded_on, vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(3, 5, 24, generator=g, dtype=dtype).to(device)
    w = torch.randn(vocab, 24, generator=g, dtype=dtype).to(device)
    cot = torch.randn(3, 5, vocab, generator=g, dtype=dtype).to(device)
    with GemmShapes() as seen:
        y, gx, gw = _grads(logits.vocab_linear, x, w, cot)
    ref_y, ref_gx, ref_gw = _grads(F.linear, x, w, cot)
    assert y.shape == ref_y.shape and gw.shape == w.shape
    for got, ref in ((y, ref_y), (gx, ref_gx), (gw, ref_gw)):
        torch.testing.assert_close(got, ref)
    padded = logits.padded_vocab(vocab, device)
    assert padded % 8 == 0 and padded - vocab < 8
    # the forward's GEMM and the backward's two (the features' gradient, the weight's) run over the padded vocabulary
    assert len(seen.shapes) == 3 and all(padded in s for s in seen.shapes), seen.shapes


def test_nothing_is_padded_where_the_device_type_does_not_ask_for_few_rows_or_with_the_references(device,
                                                                                                 monkeypatch):
    x, w = torch.randn(4, 8, device=device), torch.randn(13, 8, device=device)
    monkeypatch.setitem(logits.ALIGN, device, 8)
    with GemmShapes() as seen:
        y = logits.vocab_linear(x, w)  # 4 rows, fewer than MIN_ROWS: a generation's step
    assert y.is_contiguous() and seen.shapes == [(4, 8, 13)]
    monkeypatch.setattr(logits, "MIN_ROWS", 4)
    monkeypatch.setitem(logits.ALIGN, device, 1)
    assert logits.padded_vocab(13, device) == 13
    with GemmShapes() as seen:
        y = logits.vocab_linear(x, w)
    assert y.is_contiguous() and seen.shapes == [(4, 8, 13)]
    monkeypatch.setitem(logits.ALIGN, device, 8)
    with fast.references(), GemmShapes() as seen:
        y = logits.vocab_linear(x, w)
    assert y.is_contiguous() and seen.shapes == [(4, 8, 13)]
    with GemmShapes() as seen:
        y = logits.vocab_linear(x, w)
    assert y.shape == (4, 13) and y.stride() == (16, 1) and seen.shapes == [(4, 8, 16)]


def test_cuda_pads_by_default_and_the_cpu_does_not():
    assert logits.padded_vocab(50265, "cuda") == 50272 and logits.padded_vocab(50264, "cuda") == 50264
    assert logits.padded_vocab(50265, "cpu") == 50265


def test_under_autocast_the_weight_is_cast_once_then_padded(device, padded_on):
    """Under autocast the GEMM runs in autocast's dtype, as F.linear's would: the weight cast before the padding."""
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=g).to(device)
    w = torch.randn(21, 16, generator=g).to(device)
    cot = torch.randn(6, 21, generator=g).to(device, dt)
    with torch.autocast(device, dtype=dt):
        y, gx, gw = _grads(logits.vocab_linear, x, w, cot)
        ref_y, ref_gx, ref_gw = _grads(F.linear, x, w, cot)
    assert y.dtype == ref_y.dtype == dt and gw.dtype == torch.float32
    for got, ref in ((y, ref_y), (gx, ref_gx), (gw, ref_gw)):
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("arch", ["ski_tnn_mlm_tiny", "tnn_lm_tiny"])
def test_a_models_output_layer_runs_the_padded_gemm_and_gives_the_same_loss_and_gradients(device, monkeypatch, arch):
    """A model whose dictionary is not a multiple of 8 (the masked recipes' 50,265 symbols are odd): its output layer
    (the masked head, the causal decoder's tied projection) runs the GEMM over the padded vocabulary where the device
    type pads, and the loss and every parameter's gradient are those of the plain GEMM."""
    from fairseq_tnn.models.build import build_arch

    monkeypatch.setattr(logits, "MIN_ROWS", 2)
    vocab = 37
    torch.manual_seed(0)
    model = build_arch(arch, vocab).to(device).double()
    size = len(model.encoder.dictionary if hasattr(model, "encoder") else model.decoder.dictionary)
    assert size % 8
    tokens = torch.randint(4, size, (2, 12), device=device)
    masked = torch.zeros_like(tokens, dtype=torch.bool)
    masked[:, ::3] = True

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout masks
        with GemmShapes() as seen:
            if hasattr(model, "encoder"):
                out, _ = model(tokens, masked_tokens=masked)
                target = tokens[masked]
            else:
                out, _ = model(tokens)
                target = tokens
            loss = F.cross_entropy(out.reshape(-1, size), target.reshape(-1))
            loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, [s for s in seen.shapes if size in s or logits.padded_vocab(size, "cuda") in s]

    monkeypatch.setitem(logits.ALIGN, device, 1)
    ref_loss, ref_grads, ref_shapes = loss_and_grads()
    monkeypatch.setitem(logits.ALIGN, device, 8)
    loss, grads, shapes = loss_and_grads()
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and grads
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], msg=k)
    padded = size + (-size % 8)
    assert ref_shapes and all(size in s and padded not in s for s in ref_shapes), ref_shapes
    assert len(shapes) == len(ref_shapes) and all(padded in s and size not in s for s in shapes), shapes
