"""The TNO modules in both layouts; the operator a spectral TNO applies is the Toeplitz matrix of the
kernel it reports (the dense reference of tests/ops); the TNN layer's channel-major path against the
plain formula. Every test on every device (the `device` fixture: CPU, and CUDA where present)."""
import pytest
import torch

from helpers import assert_on

from fairseq_tnn.modules import Gtu, SpectralTno, build_tno
from fairseq_tnn.ops.toeplitz import toeplitz_ref

CASES = [("tnn", True), ("tnn", False), ("fd", True), ("fd", False), ("ski", False)]
SPECTRAL = [c for c in CASES if c[0] != "ski"]


def small_tno(tno_type, dim, causal, device="cpu", **settings):
    """A small float64 TNO on device (initialised on CPU, so that every device gets the same parameters;
    SKI's knots drawn N(0, 1), since its default starts them at zero and the low rank must be tested)."""
    base = dict(ski_rank=4, ski_taps=5) if tno_type == "ski" else dict(rpe_dim=8, rpe_layers=2)
    tno = build_tno(tno_type, dim, causal, **{**base, **settings})
    if getattr(tno, "knots", None) is not None:
        with torch.no_grad():
            tno.knots.normal_()
    return tno.double().to(device)


@pytest.mark.parametrize("tno_type,causal", CASES)
@pytest.mark.parametrize("n", [1, 9, 64])
def test_tno_layouts_agree(tno_type, causal, n, device):
    torch.manual_seed(0)
    tno = small_tno(tno_type, 6, causal, device)
    x = torch.randn(2, n, 6, dtype=torch.float64, device=device, requires_grad=True)
    xt = x.detach().permute(2, 0, 1).contiguous().requires_grad_(True)
    y, yt = tno(x), tno(xt, layout="dbn")
    assert_on(device, y, yt)
    torch.testing.assert_close(yt.permute(1, 2, 0), y, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(y)
    params = list(tno.parameters())
    ga = torch.autograd.grad(y, [x] + params, g)
    gb = torch.autograd.grad(yt, [xt] + params, g.permute(2, 0, 1))
    torch.testing.assert_close(gb[0].permute(1, 2, 0), ga[0], rtol=1e-10, atol=1e-10)
    for a, b in zip(ga[1:], gb[1:]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_tnn_kernel_matches_the_rpe_times_decay(device):
    """The channel-major kernel (decay folded into the RPE's last GEMM) is RPE(lag) * lambda^|lag|."""
    torch.manual_seed(0)
    tno = small_tno("tnn", 5, False, device, decay=0.9)
    n = 7
    pos, neg = tno.kernel(n, device)  # (d, n), (d, n - 1)
    assert_on(device, pos, neg)
    lags = torch.arange(n, dtype=torch.float64, device=device)
    torch.testing.assert_close(pos, (tno.rpe(lags) * 0.9 ** lags[:, None]).t())
    torch.testing.assert_close(neg, (tno.rpe(-lags[1:]) * 0.9 ** lags[1:, None]).t())


@pytest.mark.parametrize("tno_type,causal", SPECTRAL)
@pytest.mark.parametrize("n", [1, 2, 17, 64])
def test_forward_is_the_dense_toeplitz_product_of_its_kernel(tno_type, causal, n, device):
    """What the model runs (spectrum -> FFT product) equals the dense Toeplitz matrix of ``kernel(n)``,
    forward and every gradient (the input's and the RPE's): the kernel that incremental decoding and
    scripts/plot_kernels.py use is the operator the layer applies."""
    torch.manual_seed(0)
    tno = small_tno(tno_type, 5, causal, device)
    assert isinstance(tno, SpectralTno)
    x = torch.randn(5, 3, n, dtype=torch.float64, device=device, requires_grad=True)  # (d, batch, n)
    y = tno(x, layout="dbn")
    pos, neg = tno.kernel(n, device)
    assert_on(device, y, pos, neg)
    assert pos.shape == (5, n) and (neg is None) == causal
    ref = toeplitz_ref(x, pos, neg, layout="dbn")
    torch.testing.assert_close(y, ref, rtol=1e-9, atol=1e-10)
    g = torch.randn_like(y)
    params = [x] + list(tno.parameters())
    for a, b in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_fd_planned_kernel_length_is_the_kernel_of_that_length(device):
    """Called with ``kernel_length`` (a planned generation), FD applies the kernel of that many positions."""
    torch.manual_seed(0)
    tno = small_tno("fd", 4, True, device)
    x = torch.randn(4, 2, 10, dtype=torch.float64, device=device)
    pos, _ = tno.kernel(40, device)
    assert_on(device, pos, tno(x, layout="dbn", kernel_length=40))
    torch.testing.assert_close(tno(x, layout="dbn", kernel_length=40), toeplitz_ref(x, pos[:, :10], None, layout="dbn"))
    assert (tno(x, layout="dbn") - toeplitz_ref(x, pos[:, :10], None, layout="dbn")).abs().max() > 1e-6


@pytest.mark.parametrize("tno_type,causal", CASES)
@pytest.mark.parametrize("padded", [False, True])
def test_gtu_channel_major_path_is_the_plain_formula(tno_type, causal, padded, device):
    """out = W_o(silu(W_u x) * TNO(silu(W_v x))), with v zeroed at padded positions."""
    torch.manual_seed(0)
    d, d1, b, n = 8, 12, 3, 20
    tno = small_tno(tno_type, d1, causal)
    gtu = Gtu(d, d1, tno).double().to(device)
    x = torch.randn(b, n, d, dtype=torch.float64, device=device, requires_grad=True)
    pad = None
    if padded:
        pad = torch.zeros(b, n, dtype=torch.bool, device=device)
        pad[0, 15:] = True
    out = gtu(x, pad)
    assert_on(device, out)
    u, v = torch.nn.functional.silu(gtu.uv_proj(x)).chunk(2, dim=-1)
    if pad is not None:
        v = v.masked_fill(pad.unsqueeze(-1), 0.0)
    ref = gtu.out_proj(u * tno(v))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    params = [x] + list(gtu.parameters())
    for a, c in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)
