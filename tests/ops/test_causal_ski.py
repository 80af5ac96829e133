"""Causal SKI (the paper's appendix, benchmark-only): both implementations against the dense
lower-triangular reference, forward and every gradient, on every device (the `device` fixture: CPU, and
CUDA where present)."""
import pytest
import torch

from conftest import assert_on, tol

from fairseq_tnn.ops.ski_causal import ski_causal_cumsum, ski_causal_local, ski_causal_tno_ref
from test_ski import assert_matches_reference
from test_ski import make_inputs as make_bnd_inputs

TOL = {torch.float32: 3e-5, torch.float64: 1e-11}
# (n, r, m): n = 1, n < r (rank reduced to n), r = 2, m = 1, m > n, segments of unequal length, n = 512
CASES = [(1, 4, 3), (2, 2, 1), (5, 8, 3), (31, 4, 17), (64, 2, 5), (100, 7, 1), (257, 32, 17), (512, 32, 17)]
IMPLS = [ski_causal_cumsum, ski_causal_local]


def make_inputs(n, r, m, dtype, **sizes):
    """test_ski's inputs (on sizes' device, default CPU), x channel-major (d, b, n) as the causal variants take it."""
    x, conv_weight, knots = make_bnd_inputs(n, r, m, dtype, **sizes)
    return x.permute(2, 0, 1).contiguous(), conv_weight, knots


@pytest.mark.parametrize("impl", IMPLS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,r,m", CASES)
def test_causal_ski_matches_dense_reference(impl, n, r, m, dtype, device):
    inputs = make_inputs(n, r, m, dtype, device=device)
    assert_matches_reference(impl, ski_causal_tno_ref, inputs, tol(TOL, dtype, device))


@pytest.mark.parametrize("impl", IMPLS, ids=lambda f: f.__name__)
def test_causal_ski_ignores_the_future(impl, device):
    x, conv_weight, knots = make_inputs(60, 8, 17, torch.float64, b=1, device=device)
    x.requires_grad_(True)
    y = impl(x, conv_weight, knots, lam=0.95)
    i = 23
    (gx,) = torch.autograd.grad(y[:, 0, i].sum(), x)
    assert_on(device, y, gx)
    assert gx[:, 0, i + 1:].abs().max() < 1e-12
    assert gx[:, 0, : i + 1].abs().max() > 1e-3


def test_reference_is_the_lower_triangle_of_the_bidirectional_operator(device):
    from fairseq_tnn.ops.ski import ski_tno_ref
    x, conv_weight, knots = make_inputs(40, 6, 5, torch.float64, device=device)
    full = ski_tno_ref(x, conv_weight, knots, 0.9, layout="dbn")
    causal = ski_causal_tno_ref(x, conv_weight, knots, 0.9)
    assert_on(device, full, causal)
    # the last position sees the whole sequence either way
    torch.testing.assert_close(causal[..., -1], full[..., -1], rtol=0, atol=1e-12)
    assert (causal[..., :-1] - full[..., :-1]).abs().max() > 1e-6
