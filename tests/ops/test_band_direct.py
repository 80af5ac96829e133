"""SKI-TNO's band by direct summation (``fairseq_tnn/ops/band_direct.py``, Triton kernels) against torch's depthwise
convolution of each channel, forward and both gradients, on every device (the CPU under Triton's interpreter, CUDA
where present); and the SKI-TNO with the band method set to it against its dense reference."""

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close_rel, require_triton, ski_inputs

from fairseq_tnn.ops import band_direct, ski


@pytest.fixture(autouse=True)
def triton_kernels(request, monkeypatch):
    """Triton, and on the CPU its interpreter, with the kernels let run there (``CPU_INTERPRETED``)."""
    require_triton(request, device_less_on_cpu=True)
    monkeypatch.setattr(band_direct, "CPU_INTERPRETED", True)


def _conv(x, w):
    """Each channel's centred convolution by torch: x (d, R, n), w (d, m)."""
    m = w.shape[1]
    return F.conv1d(x.transpose(0, 1), w[:, None, :], padding=(m - 1) // 2, groups=w.shape[0]).transpose(0, 1)


def _case(d, rows, n, m, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(d, rows, n, generator=g, dtype=torch.float64)
    w = torch.randn(d, m, generator=g, dtype=torch.float64) / m ** 0.5
    cot = torch.randn(d, rows, n, generator=g, dtype=torch.float64)
    return x.to(device), w.to(device), cot.to(device)


# (d, R, n, m, BLOCK_MAX): one position, taps wider than the sequence, lengths that are and are not powers of 2, one
# tap, many; one block a row, and several (the taps' gradient summed over the blocks; windows across their edges)
CASES = [(3, 2, 1, 17, 1024), (4, 3, 7, 5, 1024), (2, 2, 33, 17, 1024), (2, 3, 300, 3, 1024), (3, 1, 96, 31, 1024),
         (2, 2, 64, 1, 1024), (2, 2, 100, 17, 16), (3, 2, 33, 5, 16), (2, 1, 64, 31, 16)]


@pytest.mark.parametrize("d,rows,n,m,block", CASES)
def test_the_direct_band_is_torchs_depthwise_convolution(d, rows, n, m, block, device, monkeypatch):
    """fp32: the output and both gradients (the input's, the taps') within fp32 rounding of torch's convolution of each
    channel in fp64, and the kernels' Function the one that ran."""
    monkeypatch.setattr(band_direct, "BLOCK_MAX", block)
    assert band_direct._block(n) == max(16, min(block, 1 << (n - 1).bit_length()))
    x64, w64, cot64 = _case(d, rows, n, m, device)
    x, w = x64.float().requires_grad_(), w64.float().requires_grad_()
    y = ski.band_conv(x, w, method="triton")
    assert _ran_direct(y), y.grad_fn
    gx, gw = torch.autograd.grad(y, (x, w), cot64.float())
    xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    y_ref = _conv(xr, wr)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (xr, wr), cot64)
    assert y.dtype == gx.dtype == gw.dtype == torch.float32
    for got, want in ((y, y_ref), (gx, gx_ref), (gw, gw_ref)):
        assert_close_rel(got.double(), want, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_direct_band_computes_in_the_taps_dtype(dtype, device):
    """As the other methods: 16-bit taps on a 16-bit x give a 16-bit band, fp32 taps an fp32 one, the input's gradient
    in x's dtype and the taps' in theirs, each within 16-bit rounding of the fp64 convolution."""
    x64, w64, cot64 = _case(8, 2, 40, 17, device, seed=5)
    xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    y_ref = _conv(xr, wr)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (xr, wr), cot64)
    bound = 2e-2 if dtype == torch.bfloat16 else 3e-3
    for taps in (dtype, torch.float32):
        x, w = x64.to(dtype).requires_grad_(), w64.to(taps).requires_grad_()
        y = ski.band_conv(x, w, method="triton")
        gx, gw = torch.autograd.grad(y, (x, w), cot64.to(taps))
        assert (y.dtype, gx.dtype, gw.dtype) == (taps, dtype, taps)
        for got, want in ((y, y_ref), (gx, gx_ref), (gw, gw_ref)):
            assert (got.double() - want).abs().max() / want.abs().max() < bound


def test_the_ski_tno_with_the_direct_band_equals_its_dense_reference(monkeypatch):
    """``BAND_METHOD`` set to "triton" for the CPU: the SKI-TNO (band and low rank, fp32) runs the direct band and
    equals its dense reference, forward and every gradient; fp64, which the kernels do not take, runs the
    convolution instead."""
    from benchmarks.opcount import OpCounter
    monkeypatch.setitem(ski.BAND_METHOD, "cpu", "triton")
    x, conv_weight, knots = ski_inputs(37, 8, 17, torch.float32)
    inputs = [t.requires_grad_(True) for t in (x, conv_weight, knots)]
    g = torch.randn(x.shape)
    y_ref = ski.ski_tno_ref(*[t.double() for t in inputs], lam=0.9)
    grads_ref = torch.autograd.grad(y_ref, inputs, g.double())
    y = ski.ski_tno(*inputs, lam=0.9)
    assert _ran_direct(y), "the direct band did not run"
    assert_close_rel(y.double(), y_ref, 2e-5)
    for a, b in zip(torch.autograd.grad(y, inputs, g), grads_ref):
        assert_close_rel(a.double(), b, 2e-5)
    counter = OpCounter()
    x64 = [t.detach().double() for t in inputs]
    with counter:
        ski.ski_tno(*x64, lam=0.9)
    assert counter.counts["convolution"] == 1, dict(counter.counts)


def _ran_direct(y) -> bool:
    """Whether a DirectBand node is in y's autograd graph."""
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "DirectBandBackward":
            return True
        todo.extend(n for n, _ in node.next_functions)
    return False


def test_where_the_kernels_cannot_run_the_convolution_does(monkeypatch):
    """Off the interpreter on the CPU (``CPU_INTERPRETED`` False, the CPU's training), ``method="triton"`` is the
    depthwise convolution: same band, no kernels."""
    monkeypatch.setattr(band_direct, "CPU_INTERPRETED", False)
    x, w, _ = _case(2, 2, 20, 5, "cpu")
    assert not band_direct.supports(x.float(), w.float())
    y = ski.band_conv(x.float().requires_grad_(), w.float(), method="triton")
    assert not _ran_direct(y)
    torch.testing.assert_close(y.double(), _conv(x, w), rtol=1e-5, atol=1e-5)
