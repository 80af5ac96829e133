"""SKI-TNO ops: fast path against the dense reference, interpolation, f, and Theorem 1. The fast paths
against their references run on every device (the `device` fixture: CPU, and CUDA where present); the
interpolation, f, Theorem 1 and the errors on CPU only."""

import pytest
import torch

from helpers import assert_close_rel, assert_on, on, ski_inputs, tol

from fairseq_tnn.ops.ski import (
    inducing_points,
    interp_matrix,
    interp_weights,
    piecewise_linear,
    ski_approx_dense,
    ski_kernel,
    ski_lowrank_dense,
    ski_tno,
    ski_tno_ref,
    time_warp,
)
from fairseq_tnn.ops.toeplitz import toeplitz_dense

DTYPES = [torch.float32, torch.float64]
# Max abs error relative to the reference's max abs value.
TOL = {torch.float32: 2e-5, torch.float64: 1e-11}
# (n, r, m): n = 1, n = 2, n < r (rank reduced to n), r = 2, m = 1, m = 17 > n, n = 512.
CASES = [
    (1, 4, 3),
    (2, 2, 1),
    (2, 8, 17),
    (5, 8, 3),
    (31, 4, 17),
    (64, 2, 5),
    (100, 7, 1),
    (512, 32, 17),
]


make_inputs = ski_inputs  # x (b, n, d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,r,m", CASES)
def test_ski_tno_matches_ref(n, r, m, dtype, device):
    assert_matches_reference(ski_tno, ski_tno_ref, make_inputs(n, r, m, dtype, device=device), tol(TOL, dtype, device))


def assert_matches_reference(fast, reference, inputs, tol):
    """fast(x, conv_weight, knots) equals reference(...): the output and the gradients of all three."""
    inputs = [t.requires_grad_(True) for t in inputs]
    x = inputs[0]
    g = torch.randn(x.shape, dtype=x.dtype, device=x.device)
    y = fast(*inputs, lam=0.9)
    grads = torch.autograd.grad(y, inputs, g)
    y_ref = reference(*inputs, lam=0.9)
    grads_ref = torch.autograd.grad(y_ref, inputs, g)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_on(x.device, y, y_ref, *grads)
    assert_close_rel(y, y_ref, tol)
    for name, a, b in zip(("x", "conv_weight", "knots"), grads, grads_ref):
        assert a.shape == b.shape, name
        assert_close_rel(a, b, tol)


def test_sparse_tap_convention():
    # Tap k multiplies lag i - j = (m-1)/2 - k, i.e. x[i + k - (m-1)/2].
    n, m = 9, 5
    x = torch.zeros(1, n, 1)
    x[0, 4, 0] = 1.0
    conv_weight = torch.arange(1.0, m + 1)[None]  # taps 1..5
    knots = torch.zeros(4, 1)
    y = ski_tno(x, conv_weight, knots, lam=0.5)[0, :, 0]
    # y[i] = w[4 - i + 2]: y[2] = w[4] = 5, ..., y[6] = w[0] = 1.
    assert torch.equal(y, torch.tensor([0, 0, 5, 4, 3, 2, 1, 0, 0.0]))


def test_bf16_input(device):
    x, conv_weight, knots = make_inputs(256, 16, 17, torch.float32, device=device)
    x16 = x.to(torch.bfloat16)
    y16 = ski_tno(x16, conv_weight, knots, lam=0.99)
    y32 = ski_tno(x16.float(), conv_weight, knots, lam=0.99)
    assert y16.dtype == torch.bfloat16
    assert_on(device, y16, y32)
    # Computed in float32 on the same input; only the output rounding (2^-9 relative) differs.
    assert_close_rel(y16.float(), y32, 2.0**-8)


class _GemmDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """(name, dtype of the first matrix) of each GEMM (aten bmm, mm, addmm) dispatched while active."""

    def __init__(self):
        super().__init__()
        self.gemms = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("bmm", "mm", "addmm"):
            self.gemms.append((name, args[1 if name == "addmm" else 0].dtype))
        return func(*args, **(kwargs or {}))

    def named(self, dtype):
        return sorted(name for name, dt in self.gemms if dt == dtype)


# Max abs error relative to the reference's max abs value, 16-bit inputs and taps against float64 on the same values:
# a few roundings of the output (fp16 2^-11, bf16 2^-8) and of the GEMMs' 16-bit results
HALF_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_taps_run_the_gemms_in_their_dtype(dtype, device):
    """x and taps in one 16-bit dtype (a --fp16 model's half weights): the band's GEMMs (forward and both of its
    backward, and the placement of its taps) and the low rank's with W (W^T x, W A W^T x and their backward) run in that dtype (tensor cores on a
    GPU), only A's spectrum from the knots in float32; output and the three gradients match the float64 reference on
    the same values. With float32 taps (bf16 autocast) every GEMM stays in float32."""
    x, conv_weight, knots = make_inputs(256, 16, 17, torch.float32, device=device)
    inputs = [t.to(dtype).detach().requires_grad_(True) for t in (x, conv_weight, knots)]
    g = torch.randn(x.shape, device=device).to(dtype)
    with _GemmDtypes() as seen:
        y = ski_tno(*inputs, lam=0.9)
        grads = torch.autograd.grad(y, inputs, g)
    # 3 bmm: the band forward and its two backward; 5 mm: W^T x, its backward, the taps placed on the band's
    # diagonals (fast.enabled: forward and backward), W's part of the addmm backward
    assert seen.named(dtype) == ["addmm", "bmm", "bmm", "bmm", "mm", "mm", "mm", "mm", "mm"], seen.gemms
    assert set(seen.named(torch.float32)) == {"mm"} and y.dtype == dtype  # A's spectrum from the knots: fp32
    wide = [t.detach().double().requires_grad_(True) for t in inputs]
    y_ref = ski_tno_ref(*wide, lam=0.9)
    grads_ref = torch.autograd.grad(y_ref, wide, g.double())
    assert_on(device, y, *grads)
    assert_close_rel(y.double(), y_ref, HALF_TOL[dtype])
    for a, b in zip(grads, grads_ref):
        assert_close_rel(a.double(), b, 2 * HALF_TOL[dtype])
    with _GemmDtypes() as seen:
        y32 = ski_tno(inputs[0], conv_weight, knots, lam=0.9)
        torch.autograd.grad(y32, inputs[0], g)
    assert seen.named(dtype) == [] and "bmm" in seen.named(torch.float32) and y32.dtype == dtype


def test_autocast_runs_the_gemms_in_its_dtype(device):
    """Under bf16 autocast (--bf16-autocast: float32 taps, bf16 activations) the GEMMs run in bf16, as autocast runs
    every Linear (its float32 weights rounded), and the taps' gradient comes back in float32; the result is the
    same as with the taps rounded to bf16 beforehand."""
    x, conv_weight, knots = make_inputs(256, 16, 17, torch.float32, device=device)
    x16 = x.to(torch.bfloat16).requires_grad_(True)
    w = conv_weight.detach().requires_grad_(True)
    g = torch.randn(x.shape, device=device).to(torch.bfloat16)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16), _GemmDtypes() as seen:
        y = ski_tno(x16, w, knots, lam=0.9)
        gx, gw = torch.autograd.grad(y, [x16, w], g)
    assert seen.named(torch.bfloat16) == ["addmm", "bmm", "bmm", "bmm", "mm", "mm", "mm", "mm", "mm"], seen.gemms
    assert y.dtype == torch.bfloat16 and gw.dtype == torch.float32 and gx.dtype == torch.bfloat16
    rounded = w.detach().to(torch.bfloat16).requires_grad_(True)
    y_rounded = ski_tno(x16, rounded, knots, lam=0.9)
    assert torch.equal(y, y_rounded)


# ----------------------------------------------------------------------------
# Interpolation weights
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("n,r", [(1, 4), (2, 2), (5, 8), (31, 4), (100, 7), (512, 32), (2048, 32)])
def test_interp_weights(n, r):
    w = interp_matrix(n, r, dtype=torch.float64)
    r_eff = min(r, n)
    assert w.shape == (n, r_eff)
    assert torch.allclose(w.sum(1), torch.ones(n, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (w >= 0).all()
    assert ((w != 0).sum(1) <= 2).all()
    # Interpolating positions 0..n-1 from the inducing points reproduces them (linear exactness).
    p = inducing_points(n, r)
    assert p.shape == (r_eff,) and p[0] == 0 and p[-1] == n - 1
    assert torch.allclose(w @ p, torch.arange(n, dtype=torch.float64), rtol=0, atol=1e-9)
    index, weight = interp_weights(n, r, dtype=torch.float64)
    assert index.shape == weight.shape == (n, 2)
    assert (index[:, 1] - index[:, 0] <= 1).all() and index.min() >= 0 and index.max() < r_eff


def test_interp_identity_at_inducing_points():
    n, r = 31, 4  # h = 10: inducing points at positions 0, 10, 20, 30
    w = interp_matrix(n, r)
    for k in range(r):
        row = torch.zeros(r)
        row[k] = 1.0
        assert torch.equal(w[10 * k], row)
    assert torch.equal(w[15], torch.tensor([0.0, 0.5, 0.5, 0.0]))


@pytest.mark.parametrize("n,r", [(1, 4), (3, 8), (8, 8), (20, 32)])
def test_rank_reduced_to_n_gives_identity(n, r):
    assert torch.equal(interp_matrix(n, r), torch.eye(n))


# ----------------------------------------------------------------------------
# f, the time warp and A
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("r", [2, 5, 32])
def test_piecewise_linear(r):
    d = 3
    knots = torch.randn(2 * r, d, dtype=torch.float64)
    grid = torch.arange(-r, r + 1, dtype=torch.float64) / r  # knot positions
    f = piecewise_linear(knots, grid)
    assert f.shape == (2 * r + 1, d)
    assert torch.equal(f[r], torch.zeros(d))  # f(0) = 0 exactly
    expect = torch.cat([knots[:r], torch.zeros(1, d, dtype=torch.float64), knots[r:]])
    assert torch.allclose(f, expect, rtol=0, atol=1e-12)  # exact at knots
    mid = (grid[:-1] + grid[1:]) / 2
    assert torch.allclose(piecewise_linear(knots, mid), (expect[:-1] + expect[1:]) / 2, atol=1e-12)
    # Any query shape; differentiable in knots.
    xq = torch.rand(4, 5, dtype=torch.float64) * 2 - 1
    knots.requires_grad_(True)
    out = piecewise_linear(knots, xq)
    assert out.shape == (4, 5, d)
    (gk,) = torch.autograd.grad(out.sum(), knots)
    # Each query's weights sum to 1; the share on the fixed knot at 0 has no parameter.
    on_zero = (1.0 - (xq * r).abs()).clamp_min(0.0).sum()
    assert torch.allclose(gk.sum(0), (xq.numel() - on_zero).expand(d))


def test_time_warp():
    t = torch.tensor([-3.0, -1.0, 0.0, 1.0, 2.5], dtype=torch.float64)
    x = time_warp(t, 0.5)
    expect = torch.tensor([-0.125, -0.5, 0.0, 0.5, 0.5**2.5], dtype=torch.float64)
    assert torch.allclose(x, expect, rtol=1e-15, atol=0)
    assert time_warp(torch.tensor([0.0]), 0.99)[0] == 0


@pytest.mark.parametrize("n,r", [(1, 4), (3, 8), (512, 32)])
def test_ski_kernel_is_a(n, r):
    knots = torch.randn(2 * r, 2, dtype=torch.float64)
    pos, neg = ski_kernel(n, knots, 0.9)
    r_eff = min(r, n)
    assert pos.shape == (r_eff, 2) and neg.shape == (r_eff - 1, 2)
    assert (pos[0] == 0).all()  # A has zero diagonal since x(0) = 0 and f(0) = 0
    p = inducing_points(n, r)
    a = piecewise_linear(knots, time_warp(p[:, None] - p[None, :], 0.9)).permute(2, 0, 1)
    assert torch.allclose(toeplitz_dense(pos, neg), a, rtol=0, atol=1e-12)


def test_ski_lowrank_dense_matches_approx_dense():
    n, r, lam = 40, 6, 0.95
    knots = torch.randn(2 * r, 1, dtype=torch.float64)
    dense = ski_lowrank_dense(n, knots, lam)[0]

    def kfun(t):
        return piecewise_linear(knots, time_warp(t, lam))[..., 0]

    assert torch.allclose(dense, ski_approx_dense(n, r, kfun), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------
# Theorem 1: SKI error for a smooth kernel
# ----------------------------------------------------------------------------


def test_theorem1_ski_error_decreases_with_rank():
    # T[i, j] = k(i - j) with k(t) = exp(-(t/s)^2), L = max |k''| = 2 / s^2 (at t = 0).
    # Linear interpolation on a grid of spacing h errs by at most L h^2 / 8 (the
    # paper's |psi_1| / 2! <= h^2 / 8 times L). With A[a, b] = k(p_a - p_b) exact,
    #   (W A W^T - T)[i, j] = sum_a W[i, a] (sum_b W[j, b] k(p_a - p_b) - k(p_a - j))
    #                        + (sum_a W[i, a] k(p_a - j) - k(i - j)):
    # the second term interpolates t -> k(t - j) in i, the first is a convex
    # combination (W >= 0, rows sum to 1) of interpolation errors in j, so every
    # entry is within 2 L h^2 / 8 = L h^2 / 4, and ||E||_2 <= sqrt(||E||_1 ||E||_inf)
    # <= n L h^2 / 4. Theorem 1 bounds the same O(h^2) interpolation error (in
    # Frobenius form sqrt(nr) L h^2 / 8 per factor), plus the Nystrom term, which is
    # zero here because A is sampled from k exactly.
    n, s = 256, 32.0
    lip2 = 2.0 / s**2

    def kfun(t):
        return torch.exp(-((t / s) ** 2))

    i = torch.arange(n, dtype=torch.float64)
    t = kfun(i[:, None] - i[None, :])
    errors = []
    for r in (4, 8, 16, 32):
        h = (n - 1) / (r - 1)
        e = ski_approx_dense(n, r, kfun) - t
        entry_bound = lip2 * h**2 / 4
        assert e.abs().max() <= entry_bound * (1 + 1e-9), r
        err = torch.linalg.matrix_norm(e, ord=2).item()
        assert err <= n * entry_bound, r
        errors.append(err)
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    # Second-order convergence: halving h (roughly) divides the error by about 4.
    assert errors[-2] / errors[-1] > 3.0, errors
    assert errors[-1] < 0.05 * torch.linalg.matrix_norm(t, ord=2).item()


# ----------------------------------------------------------------------------
# Errors on bad input
# ----------------------------------------------------------------------------


def test_bad_rank():
    x, conv_weight, _ = make_inputs(16, 2, 3, torch.float32)
    with pytest.raises(ValueError, match=r"r.*>= 2.*r=1"):
        ski_tno(x, conv_weight, torch.zeros(2, 3), lam=0.9)
    with pytest.raises(ValueError, match=r"r=1"):
        interp_weights(16, 1)
    with pytest.raises(ValueError, match=r"2r, d"):
        ski_tno(x, conv_weight, torch.zeros(5, 3), lam=0.9)


@pytest.mark.parametrize("m", [0, 2, 16])
def test_bad_taps(m):
    x, _, knots = make_inputs(16, 4, 3, torch.float32)
    with pytest.raises(ValueError, match=rf"odd.*m={m}"):
        ski_tno(x, torch.zeros(3, m), knots, lam=0.9)


@pytest.mark.parametrize("lam", [1.0, 0.0, -0.5, 1.5])
def test_bad_lam(lam):
    x, conv_weight, knots = make_inputs(16, 4, 3, torch.float32)
    with pytest.raises(ValueError, match=r"0 < lam < 1"):
        ski_tno(x, conv_weight, knots, lam=lam)
    with pytest.raises(ValueError, match=r"lam"):
        ski_tno_ref(x, conv_weight, knots, lam=lam)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), torch.tensor(0.5), "0.5", True])
def test_bad_scale(scale):
    x, conv_weight, knots = make_inputs(16, 4, 3, torch.float32)
    for op in (ski_tno, ski_tno_ref):
        with pytest.raises(ValueError, match=r"scale=.*finite real number"):
            op(x, conv_weight, knots, lam=0.9, scale=scale)


# ----------------------------------------------------------------------------
# Channel-major layout and the blocked band
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,r,m", [(1, 4, 3), (5, 8, 3), (31, 4, 17), (100, 7, 1), (512, 32, 17)])
def test_channel_major_matches_ref(n, r, m, dtype, device):
    x, conv_weight, knots = make_inputs(n, r, m, dtype, device=device)
    xt = x.permute(2, 0, 1).contiguous()  # (d, b, n)
    inputs = [t.requires_grad_(True) for t in (xt, conv_weight, knots)]
    g = torch.randn(xt.shape, dtype=dtype, device=device)
    y = ski_tno(*inputs, lam=0.9, layout="dbn")
    y_ref = ski_tno_ref(*inputs, lam=0.9, layout="dbn")
    assert y.shape == xt.shape
    assert_on(device, y, y_ref)
    assert_close_rel(y, y_ref, tol(TOL, dtype, device))
    assert_close_rel(y.permute(1, 2, 0), ski_tno(x, conv_weight, knots, lam=0.9), tol(TOL, dtype, device))
    for a, b in zip(torch.autograd.grad(y, inputs, g), torch.autograd.grad(y_ref, inputs, g)):
        assert_close_rel(a, b, tol(TOL, dtype, device))


@pytest.mark.parametrize("n,m,block", [(1, 17, 32), (7, 5, 4), (32, 17, 32), (33, 17, 32), (100, 3, 8), (96, 31, 16)])
def test_band_conv_is_torchs_depthwise_conv(n, m, block, device):
    """The blocked-GEMM band equals F.conv1d (centred taps, zero padding), forward and gradients,
    for lengths that are and are not multiples of the block and taps wider than the sequence."""
    import torch.nn.functional as F

    from fairseq_tnn.ops.ski import band_conv
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, n, generator=g, dtype=torch.float64, requires_grad=True)  # (d, R, n)
    w = torch.randn(4, m, generator=g, dtype=torch.float64, requires_grad=True)
    x, w = on(device, x, w)
    y = band_conv(x, w, block=block)
    assert_on(device, y)
    y_ref = F.conv1d(x.transpose(0, 1), w[:, None, :], padding=(m - 1) // 2, groups=4).transpose(0, 1)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    cot = torch.randn(y.shape, generator=g, dtype=torch.float64).to(device)
    for a, b in zip(torch.autograd.grad(y, (x, w), cot), torch.autograd.grad(y_ref, (x, w), cot)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n,m", [(1, 17), (7, 5), (32, 17), (33, 17), (100, 3), (96, 31), (64, 1)])
def test_depthwise_band_is_the_banded_gemm(n, m, device):
    """The band by torch's depthwise convolution (``method="conv1d"``, the channel-major rows as its channels, the taps
    expanded over them) equals the blocked GEMM and F.conv1d of each channel, forward and gradients (float64)."""
    import torch.nn.functional as F

    from fairseq_tnn.ops.ski import band_conv
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 3, n, generator=g, dtype=torch.float64, requires_grad=True)  # (d, R, n)
    w = torch.randn(4, m, generator=g, dtype=torch.float64, requires_grad=True)
    x, w = on(device, x, w)
    y = band_conv(x, w, method="conv1d")
    assert_on(device, y)
    y_gemm = band_conv(x, w, method="gemm")
    y_ref = F.conv1d(x.transpose(0, 1), w[:, None, :], padding=(m - 1) // 2, groups=4).transpose(0, 1)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, y_gemm, rtol=1e-12, atol=1e-12)
    cot = torch.randn(y.shape, generator=g, dtype=torch.float64).to(device)
    for a, b in zip(torch.autograd.grad(y, (x, w), cot), torch.autograd.grad(y_gemm, (x, w), cot)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_depthwise_band_computes_in_the_taps_dtype(dtype, device):
    """As the GEMM's path: 16-bit taps on a 16-bit x give a 16-bit band, float32 taps a float32 one; both within
    16-bit rounding of the float64 band."""
    from fairseq_tnn.ops.ski import band_conv
    g = torch.Generator().manual_seed(5)
    x64 = torch.randn(8, 2, 40, generator=g, dtype=torch.float64)
    w64 = torch.randn(8, 17, generator=g, dtype=torch.float64) / 17 ** 0.5
    x64, w64 = on(device, x64, w64)
    want = band_conv(x64, w64, method="gemm")
    for taps, out in ((dtype, dtype), (torch.float32, torch.float32)):
        y = band_conv(x64.to(dtype), w64.to(taps), method="conv1d")
        assert y.dtype == out
        err = (y.double() - want).abs().max() / want.abs().max()
        assert err < (2e-2 if dtype == torch.bfloat16 else 3e-3)


def test_the_device_types_band_method_runs_the_ski_tno(monkeypatch):
    """``BAND_METHOD`` decides the band of a device type's SKI-TNO (here the CPU's set to "conv1d": a convolution is
    dispatched and no batched GEMM), and the TNO still equals its dense reference, forward and every gradient."""
    from benchmarks.opcount import OpCounter
    from fairseq_tnn.ops import ski
    x, conv_weight, knots = make_inputs(37, 8, 17, torch.float64)
    inputs = [t.requires_grad_(True) for t in (x, conv_weight, knots)]
    g = torch.randn(x.shape, dtype=torch.float64)
    y_ref = ski_tno_ref(*inputs, lam=0.9)
    grads_ref = torch.autograd.grad(y_ref, inputs, g)
    for method, band_op in (("conv1d", "convolution"), ("gemm", "bmm")):
        monkeypatch.setitem(ski.BAND_METHOD, "cpu", method)
        counter = OpCounter()
        with counter:
            y = ski_tno(*inputs, lam=0.9)
        assert counter.counts[band_op] == 1, (method, dict(counter.counts))
        assert counter.counts["convolution" if method == "gemm" else "bmm"] == 0
        assert_close_rel(y, y_ref, TOL[torch.float64])
        for a, b in zip(torch.autograd.grad(y, inputs, g), grads_ref):
            assert_close_rel(a, b, TOL[torch.float64])


def test_band_method_must_be_known():
    from fairseq_tnn.ops.ski import band_conv
    with pytest.raises(ValueError, match=r"method='fft' is invalid: must be one of \['gemm', 'conv1d', 'triton'\]"):
        band_conv(torch.zeros(2, 1, 8), torch.zeros(2, 3), method="fft")
