"""FD-TNO ops: the FD-TNO as the models compute it (``fd_tno`` below: FdTno.spectrum's spectra applied by
``fft_conv``, as SpectralTno.forward does) against explicit-DFT dense references, forward and gradients, on
every device (the `device` fixture: CPU, and CUDA where present); FdTno's own forward against the same
references. The tests without `device` check the frequency grid and errors: CPU only, by design."""
import math

import pytest
import torch

from helpers import assert_close_rel, assert_on, on, tol

from fairseq_tnn.modules.tno import build_tno
from fairseq_tnn.ops.fd import (
    check_fd_args,
    fd_bidirectional_ref,
    fd_bidirectional_spectrum,
    fd_causal_ref,
    fd_grid,
    fd_spectrum_ref,
    fd_time_kernel,
    hilbert_causal_spectrum,
)
from fairseq_tnn.ops.toeplitz import fft_conv, seq_shape

DTYPES = [torch.float32, torch.float64]
LENGTHS = [1, 2, 7, 64, 513]
# Max abs error relative to the reference's max abs value.
TOL = {torch.float32: 2e-5, torch.float64: 1e-11}


def fd_tno(x, k_real, k_imag=None, layout="bnd"):
    """The FD-TNO on x with the RPE output k_real (causal) or k_real, k_imag (bidirectional), by the ops the
    models run: the spectrum of FdTno.spectrum (``hilbert_causal_spectrum`` / ``fd_bidirectional_spectrum``) on
    ``fd_grid``'s FFT size, applied by ``fft_conv`` as SpectralTno.forward does."""
    size, _ = fd_grid(seq_shape(x, layout)[0])
    if k_imag is None:
        return fft_conv(x, hilbert_causal_spectrum(k_real, layout), size, layout)
    return fft_conv(x, fd_bidirectional_spectrum(k_real, k_imag, layout), size, layout)


def absmax(t):
    return t.abs().max() if t.numel() else torch.zeros((), dtype=t.real.dtype, device=t.device)


def make_inputs(n, dtype, d=3, b=2, seed=0, device="cpu"):
    """x (b, n, d), k_real and k_imag (N'+1, d) on device, drawn on CPU."""
    g = torch.Generator().manual_seed(seed)
    size, _ = fd_grid(n)
    x = torch.randn(b, n, d, generator=g, dtype=torch.float64).to(dtype)
    k_real = torch.randn(size // 2 + 1, d, generator=g, dtype=torch.float64).to(dtype)
    k_imag = torch.randn(size // 2 + 1, d, generator=g, dtype=torch.float64).to(dtype)
    return on(device, x, k_real, k_imag)


def grads(fn, inputs, cotangent):
    inputs = [t.detach().requires_grad_(True) for t in inputs]
    y = fn(*inputs)
    return y.detach(), torch.autograd.grad(y, inputs, cotangent)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 513, 1000])
def test_grid(n):
    size, omegas = fd_grid(n)
    assert size % 2 == 0 and size >= 2 * n
    assert omegas.dtype == torch.float32 and omegas.shape == (size // 2 + 1,)
    assert omegas[0] == 0 and math.isclose(omegas[-1].item(), math.pi, rel_tol=1e-6)
    steps = omegas.diff()
    assert torch.allclose(steps, torch.full_like(steps, math.pi / (size // 2)), rtol=0, atol=1e-6)


def test_grid_longer_is_finer():
    (s1, o1), (s2, o2) = fd_grid(512), fd_grid(2048)
    assert s2 > s1 and o2.numel() > o1.numel()
    assert o1[-1] == o2[-1] and o1[0] == o2[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_causal_matches_ref(n, dtype, device):
    x, k_real, _ = make_inputs(n, dtype, device=device)
    g = torch.randn_like(x)
    y, (gx, gk) = grads(fd_tno, [x, k_real], g)
    y_ref, (gx_ref, gk_ref) = grads(fd_causal_ref, [x, k_real], g)
    assert y.dtype == dtype and y.shape == x.shape
    assert_on(device, y, y_ref, gx, gk)
    t = tol(TOL, dtype, device)
    assert_close_rel(y, y_ref, t)
    assert_close_rel(gx, gx_ref, t)
    assert_close_rel(gk, gk_ref, t)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_bidirectional_matches_ref(n, dtype, device):
    x, k_real, k_imag = make_inputs(n, dtype, device=device)
    g = torch.randn_like(x)
    y, (gx, gr, gi) = grads(fd_tno, [x, k_real, k_imag], g)
    y_ref, (gx_ref, gr_ref, gi_ref) = grads(fd_bidirectional_ref, [x, k_real, k_imag], g)
    assert y.dtype == dtype and not y.is_complex() and y.shape == x.shape
    assert_on(device, y, y_ref, gx, gr, gi)
    t = tol(TOL, dtype, device)
    assert_close_rel(y, y_ref, t)
    assert_close_rel(gx, gx_ref, t)
    assert_close_rel(gr, gr_ref, t)
    assert_close_rel(gi, gi_ref, t)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_causal_spectrum(n, dtype, device):
    _, k_real, _ = make_inputs(n, dtype, device=device)
    t = tol(TOL, dtype, device)
    size = 2 * (k_real.shape[0] - 1)
    spec = hilbert_causal_spectrum(k_real)
    assert spec.is_complex() and spec.shape == k_real.shape
    # The real part is the given one; the implied kernel vanishes at negative lags.
    assert_close_rel(spec.real, k_real, t)
    kernel = torch.fft.irfft(spec, n=size, dim=0)  # (N, d)
    assert absmax(kernel[size // 2 + 1 :]) <= t * kernel.abs().max()
    # Same kernel and spectrum from the explicit inverse / forward DFT.
    kernel_ref = fd_time_kernel(k_real)
    assert_on(device, spec, kernel_ref)
    assert (kernel_ref[size // 2 + 1 :] == 0).all()
    assert_close_rel(kernel, kernel_ref, t)
    spec_ref = fd_spectrum_ref(kernel_ref)
    assert_close_rel(torch.view_as_real(spec), torch.view_as_real(spec_ref), t)


def test_causal_gradient_causality(device):
    n = 7
    x, k_real, _ = make_inputs(n, torch.float64, d=2, b=1, device=device)
    x.requires_grad_(True)
    y = fd_tno(x, k_real)
    assert_on(device, y)
    for i in range(n):
        (gx,) = torch.autograd.grad(y[:, i].sum(), x, retain_graph=True)
        assert absmax(gx[:, i + 1 :]) < 1e-12, f"y[{i}] depends on future x"
        assert gx[:, : i + 1].abs().max() > 1e-3  # and it does depend on the past


@pytest.mark.parametrize("n", [1, 7, 64])
def test_bidirectional_forced_real_at_dc_and_nyquist(n, device):
    _, k_real, k_imag = make_inputs(n, torch.float32, device=device)
    spec = fd_bidirectional_spectrum(k_real, k_imag)
    assert_on(device, spec)
    assert spec.imag[0].eq(0).all() and spec.imag[-1].eq(0).all()
    assert torch.equal(spec.real, k_real) and torch.equal(spec.imag[1:-1], k_imag[1:-1])
    x, k_real, k_imag = make_inputs(n, torch.float32, device=device)
    k_imag.requires_grad_(True)
    (gi,) = torch.autograd.grad(fd_tno(x, k_real, k_imag).square().sum(), k_imag)
    assert gi[0].eq(0).all() and gi[-1].eq(0).all()
    if n > 1:
        assert gi[1:-1].abs().max() > 0


@pytest.mark.parametrize("n", [64, 513])
@pytest.mark.parametrize("causal", [True, False])
def test_bf16_input(n, causal, device):
    x, k_real, k_imag = make_inputs(n, torch.float32, device=device)
    x16 = x.to(torch.bfloat16)
    args = (k_real,) if causal else (k_real, k_imag)
    y16 = fd_tno(x16, *args)
    y32 = fd_tno(x16.float(), *args)
    assert y16.dtype == torch.bfloat16
    assert_on(device, y16, y32)
    # The FFTs run in float32 on the same (bf16-representable) input, so the only
    # difference is rounding the output to bf16's 8-bit significand: <= 2^-9 |y|.
    assert_close_rel(y16.float(), y32, 2.0**-8)


def test_bad_shapes():
    x, k_real, k_imag = make_inputs(7, torch.float32)
    with pytest.raises(ValueError, match=r"k_real must have shape \(9, 3\) for n=7 .* got \(8, 3\)"):
        fd_causal_ref(x, k_real[:-1])
    with pytest.raises(ValueError, match=r"k_imag must have shape \(9, 3\) for n=7 .* got \(9, 1\)"):
        fd_bidirectional_ref(x, k_real, k_imag[:, :1])
    assert check_fd_args(x, k_real, k_imag) == 16


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 40])
def test_fd_tno_forward_is_the_reference(causal, n):
    """FdTno's own forward (float64) is the dense reference with its RPE's output on fd_grid as the spectrum:
    the ops compared above are the ones the model runs."""
    torch.manual_seed(0)
    tno = build_tno("fd", 4, causal).double()
    x = torch.randn(2, n, 4, dtype=torch.float64)
    _, omegas = fd_grid(n)
    k = tno.rpe.channel_major(omegas).t()  # (N'+1, d) causal, (N'+1, 2d) bidirectional
    ref = fd_causal_ref(x, k) if causal else fd_bidirectional_ref(x, *k.chunk(2, dim=1))
    assert_close_rel(tno(x), ref, 1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 64, 513])
@pytest.mark.parametrize("causal", [True, False])
def test_channel_major_matches_ref(n, causal, dtype, device):
    """layout="dbn": x (d, batch, n), spectra (d, N'+1); forward and gradients against the reference."""
    x, k_real, k_imag = make_inputs(n, dtype, device=device)
    t = tol(TOL, dtype, device)
    xt, krt, kit = x.permute(2, 0, 1).contiguous(), k_real.t().contiguous(), k_imag.t().contiguous()
    args = [xt, krt] if causal else [xt, krt, kit]
    ref = (lambda *a: fd_causal_ref(*a, layout="dbn")) if causal else (lambda *a: fd_bidirectional_ref(*a, layout="dbn"))
    g = torch.randn_like(xt)
    y, gs = grads(lambda *a: fd_tno(*a, layout="dbn"), args, g)
    y_ref, gs_ref = grads(ref, args, g)
    assert y.shape == xt.shape
    assert_on(device, y, y_ref, *gs)
    assert_close_rel(y, y_ref, t)
    default = fd_tno(x, k_real) if causal else fd_tno(x, k_real, k_imag)
    assert_close_rel(y.permute(1, 2, 0), default, t)
    for a, b in zip(gs, gs_ref):
        assert_close_rel(a, b, t)
