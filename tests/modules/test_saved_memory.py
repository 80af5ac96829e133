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
