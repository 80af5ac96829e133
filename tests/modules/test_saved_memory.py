"""What each TNO keeps for its backward: its input, in the input's own dtype, and nothing else of the
activations' size (benchmarks/memory.py found the rfft of the input, 4x an fp16 input, held over a quarter of
a TNN layer's activation memory, an fp32 copy in SKI's band, and both parts of FD's spectrum kept by
torch.complex). On every device (the `device` fixture: CPU, and CUDA where present): what autograd saves is
counted through saved_tensors_hooks, which see CUDA tensors as they see CPU ones."""
import pytest
import torch

from helpers import assert_on

from fairseq_tnn.modules import build_tno

KINDS = [("tnn", True), ("tnn", False), ("fd", True), ("fd", False), ("ski", False)]


def saved_storages(fn, *args, **kwargs):
    """fn's result and {storage id: (bytes, dtype)} of every tensor autograd saved while it ran."""
    saved = {}

    def pack(t):
        saved.setdefault(t.untyped_storage()._cdata, (t.untyped_storage().nbytes(), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return out, saved


def _saved_by_tno(tno, x):
    y, saved = saved_storages(tno, x, layout="dbn")
    params = {p.untyped_storage()._cdata for p in tno.parameters()}
    return y, {k: v for k, v in saved.items() if k not in params}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,causal", KINDS)
def test_a_tno_keeps_its_input_and_little_else_that_grows_with_the_batch(kind, causal, dtype, device):
    torch.manual_seed(0)
    d, n, batches = 8, 256, (4, 8)
    tno = build_tno(kind, d, causal).to(device)
    other = []
    for b in batches:
        x = torch.randn(d, b, n, dtype=dtype, device=device, requires_grad=True)
        y, saved = _saved_by_tno(tno, x)
        assert_on(device, y)
        assert saved.pop(x.untyped_storage()._cdata) == (x.nbytes, dtype)  # x itself, not a copy
        other.append(sum(nbytes for nbytes, _ in saved.values()))
        assert y.dtype == dtype
        y.float().square().sum().backward()  # the backward runs from what was kept
        assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()
    growth = other[1] - other[0]
    if kind == "ski":  # W^T x, r = 32 values per channel and sequence (fp32): an eighth of an fp32 x here
        assert 0 < growth <= d * (batches[1] - batches[0]) * 32 * 4
    else:  # the spectrum, the RPE's features: per layer, not per token
        assert growth == 0


def test_the_fft_product_returns_a_compact_output(device):
    """The output is not a view of the size-long irfft buffer, which an operator saving it would keep whole."""
    from fairseq_tnn.ops.toeplitz import fft_conv, next_fast_len
    n = 40
    size = next_fast_len(2 * n - 1)
    x = torch.randn(4, 3, n, device=device)
    y = fft_conv(x, torch.randn(4, size // 2 + 1, dtype=torch.complex64, device=device), size, layout="dbn")
    assert_on(device, y)
    assert y.is_contiguous() and y.untyped_storage().nbytes() == y.nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_ski_gtu_recomputes_its_gate_in_the_backward_and_gives_the_same_gradients(dtype, device):
    """--ski-backward recompute (the default): once the forward is done, the SKI-TNO's output is not alive (autograd
    keeps the gate's input, the projection, alone: ``Tno.recompute_gate``), the backward runs the TNO's forward again,
    and the output and every gradient are those of ``keep``, which keeps the output for the backward, to the bit (the
    recomputation repeats the same operations). A padded row included; fp16 as fairseq's --fp16 model runs it."""
    import copy
    import gc
    import weakref

    from fairseq_tnn.modules.layers import Gtu
    if dtype == torch.float16 and device == "cpu":
        pytest.skip("fp16 GEMMs are the GPU's (the CPU test runs fp32)")
    torch.manual_seed(0)
    d, d1, b, n = 16, 48, 3, 40
    gtus = {"recompute": Gtu(d, d1, build_tno("ski", d1, False)).to(device, dtype)}
    gtus["keep"] = copy.deepcopy(gtus["recompute"])
    gtus["keep"].tno.recompute_gate = False
    assert gtus["recompute"].tno.recompute_gate and build_tno("ski", d1, False, ski_backward="keep").recompute_gate is False
    assert not build_tno("tnn", d1, True).recompute_gate and not build_tno("fd", d1, False).recompute_gate
    x = torch.randn(b, n, d, device=device, dtype=dtype)
    pad_mask = torch.zeros(b, n, dtype=torch.bool, device=device)
    pad_mask[1, -7:] = True
    g = torch.randn(b, n, d, device=device, dtype=dtype)
    results = {}
    for mode, gtu in gtus.items():
        outputs = []
        hook = gtu.tno.register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out)))
        xi = x.clone().requires_grad_()
        y = gtu(xi, pad_mask)
        gc.collect()
        alive = [ref() is not None for ref in outputs]
        y.backward(g)
        hook.remove()
        assert_on(device, y, xi.grad)
        results[mode] = (alive, len(outputs), [y, xi.grad] + [p.grad for p in gtu.parameters()])
    assert results["recompute"][:2] == ([False], 2), results["recompute"][:2]  # freed; run again in the backward
    assert results["keep"][:2] == ([True], 1), results["keep"][:2]  # kept by the gate's product for its backward
    for a, k in zip(results["recompute"][2], results["keep"][2]):
        assert a is not None and torch.equal(a, k)
    with torch.no_grad():  # no autograd, no checkpoint: one forward
        outputs = []
        gtus["recompute"].tno.register_forward_hook(lambda module, args, out: outputs.append(out))
        assert torch.equal(gtus["recompute"](x, pad_mask), results["keep"][2][0]) and len(outputs) == 1
