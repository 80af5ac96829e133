"""The TNO modules in both layouts, and the TNN layer's channel-major fast path against the plain formula."""
from argparse import Namespace

import pytest
import torch

from fairseq_tnn.modules import Gtu, build_tno

CASES = [("tnn", True), ("tnn", False), ("fd", True), ("fd", False), ("ski", False)]


@pytest.mark.parametrize("tno_type,causal", CASES)
@pytest.mark.parametrize("n", [1, 9, 64])
def test_tno_layouts_agree(tno_type, causal, n):
    torch.manual_seed(0)
    tno = build_tno(tno_type, 6, causal, Namespace(ski_rank=4, ski_taps=5)
                    if tno_type == "ski" else Namespace(rpe_dim=8, rpe_layers=2)).double()
    assert tno.layout == "dbn"
    x = torch.randn(2, n, 6, dtype=torch.float64, requires_grad=True)
    xt = x.detach().permute(2, 0, 1).contiguous().requires_grad_(True)
    y, yt = tno(x), tno(xt, layout="dbn")
    torch.testing.assert_close(yt.permute(1, 2, 0), y, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(y)
    params = list(tno.parameters())
    ga = torch.autograd.grad(y, [x] + params, g)
    gb = torch.autograd.grad(yt, [xt] + params, g.permute(2, 0, 1))
    torch.testing.assert_close(gb[0].permute(1, 2, 0), ga[0], rtol=1e-10, atol=1e-10)
    for a, b in zip(ga[1:], gb[1:]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_tnn_kernel_matches_the_rpe_times_decay():
    """The channel-major kernel (decay folded into the RPE's last GEMM) is RPE(lag) * lambda^|lag|."""
    torch.manual_seed(0)
    tno = build_tno("tnn", 5, False, Namespace(rpe_dim=8, rpe_layers=2, decay=0.9)).double()
    n = 7
    pos, neg = tno.kernel(n)
    lags = torch.arange(n, dtype=torch.float64)
    torch.testing.assert_close(pos, tno.rpe(lags) * 0.9 ** lags[:, None])
    torch.testing.assert_close(neg, tno.rpe(-lags[1:]) * 0.9 ** lags[1:, None])


@pytest.mark.parametrize("tno_type,causal", CASES)
@pytest.mark.parametrize("padded", [False, True])
def test_gtu_channel_major_path_is_the_plain_formula(tno_type, causal, padded):
    """out = W_o(silu(W_u x) * TNO(silu(W_v x))), with v zeroed at padded positions."""
    torch.manual_seed(0)
    d, d1, b, n = 8, 12, 3, 20
    tno = build_tno(tno_type, d1, causal, Namespace(ski_rank=4, ski_taps=5)
                    if tno_type == "ski" else Namespace(rpe_dim=8, rpe_layers=2)).double()
    gtu = Gtu(d, d1, tno).double()
    x = torch.randn(b, n, d, dtype=torch.float64, requires_grad=True)
    pad = None
    if padded:
        pad = torch.zeros(b, n, dtype=torch.bool)
        pad[0, 15:] = True
    out = gtu(x, pad)
    u, v = torch.nn.functional.silu(gtu.uv_proj(x)).chunk(2, dim=-1)
    if pad is not None:
        v = v.masked_fill(pad.unsqueeze(-1), 0.0)
    ref = gtu.out_proj(u * tno(v))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    params = [x] + list(gtu.parameters())
    for a, c in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)
