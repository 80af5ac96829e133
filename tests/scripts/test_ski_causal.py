"""benchmarks/ski_causal.py, the causal SKI of the paper's appendix (benchmark-only): both implementations
against the dense lower-triangular reference, forward and every gradient, on every device (the `device`
fixture: CPU, and CUDA where present)."""
import sys

import pytest
import torch

from helpers import ROOT, assert_close_rel, assert_on, ski_inputs, tol

if str(ROOT) not in sys.path:  # benchmarks/ is imported as a package from the repository root, as its scripts do
    sys.path.insert(0, str(ROOT))

from benchmarks.ski_causal import ski_causal_cumsum, ski_causal_local, ski_causal_tno_ref  # noqa: E402
from fairseq_tnn.ops.ski import ski_tno_ref  # noqa: E402

TOL = {torch.float32: 3e-5, torch.float64: 1e-11}
# (n, r, m): n = 1, n < r (rank reduced to n), r = 2, m = 1, m > n, segments of unequal length, n = 512
CASES = [(1, 4, 3), (2, 2, 1), (5, 8, 3), (31, 4, 17), (64, 2, 5), (100, 7, 1), (257, 32, 17), (512, 32, 17)]
IMPLS = [ski_causal_cumsum, ski_causal_local]


def make_inputs(n, r, m, dtype, **kwargs):
    """x channel-major (d, b, n), as the causal variants take it; conv_weight (d, m), knots (2r, d)."""
    return ski_inputs(n, r, m, dtype, layout="dbn", **kwargs)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,r,m", CASES)
def test_causal_ski_matches_dense_reference(impl, n, r, m, dtype, device):
    inputs = [t.requires_grad_(True) for t in make_inputs(n, r, m, dtype, device=device)]
    x = inputs[0]
    g = torch.randn(x.shape, dtype=x.dtype, device=x.device)
    y = impl(*inputs, lam=0.9)
    grads = torch.autograd.grad(y, inputs, g)
    y_ref = ski_causal_tno_ref(*inputs, lam=0.9)
    grads_ref = torch.autograd.grad(y_ref, inputs, g)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_on(device, y, y_ref, *grads)
    t = tol(TOL, dtype, device)
    assert_close_rel(y, y_ref, t, "y")
    for name, a, b in zip(("x", "conv_weight", "knots"), grads, grads_ref):
        assert a.shape == b.shape, name
        assert_close_rel(a, b, t, "d/d" + name)


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
    x, conv_weight, knots = make_inputs(40, 6, 5, torch.float64, device=device)
    full = ski_tno_ref(x, conv_weight, knots, 0.9, layout="dbn")
    causal = ski_causal_tno_ref(x, conv_weight, knots, 0.9)
    assert_on(device, full, causal)
    # the last position sees the whole sequence either way
    torch.testing.assert_close(causal[..., -1], full[..., -1], rtol=0, atol=1e-12)
    assert (causal[..., :-1] - full[..., :-1]).abs().max() > 1e-6
