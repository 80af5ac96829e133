"""Ops behind incremental decoding, against dense references: the causal FD time kernel (explicit
inverse DFT) and the causal Toeplitz tail (explicit Toeplitz matrices), on every device (the `device`
fixture: CPU, and CUDA where present); the refusal of bad shapes on CPU only."""
import pytest
import torch

from helpers import assert_on, on, tol

from fairseq_tnn.ops.fd import fd_causal_kernel, fd_grid, fd_time_kernel, hilbert_causal_spectrum
from fairseq_tnn.ops.toeplitz import causal_toeplitz_tail, fft_conv, toeplitz_ref


KERNEL_TOL = {torch.float32: 2e-5, torch.float64: 1e-11}
TAIL_TOL = {torch.float32: 2e-6, torch.float64: 1e-12}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 5, 64, 300])
def test_fd_causal_kernel_is_the_inverse_dft_of_the_causal_spectrum(n, dtype, device):
    tol_ = tol(KERNEL_TOL, dtype, device)
    g = torch.Generator().manual_seed(n)
    size, _ = fd_grid(n)
    k_real = on(device, torch.randn(size // 2 + 1, 3, generator=g, dtype=torch.float64).to(dtype))
    ref = fd_time_kernel(k_real)  # (N, d): explicit inverse DFT, folded onto lags >= 0
    got = fd_causal_kernel(k_real)  # (N'+1, d)
    assert got.shape == (size // 2 + 1, 3) and got.dtype == dtype
    assert_on(device, ref, got)
    scale = ref.abs().max()
    assert (got - ref[: size // 2 + 1]).abs().max() <= tol_ * scale
    assert ref[size // 2 + 1:].abs().le(tol_ * scale).all()  # nothing at negative lags
    # channel-major gives the transpose
    torch.testing.assert_close(fd_causal_kernel(k_real.t().contiguous(), layout="dbn"), got.t())
    # and applying it as a causal Toeplitz matrix is the FD-TNO itself (its spectrum applied by FFT, as the model does)
    x = on(device, torch.randn(2, n, 3, generator=g, dtype=torch.float64).to(dtype))
    y = toeplitz_ref(x, got[:n])
    assert (y - fft_conv(x, hilbert_causal_spectrum(k_real), size)).abs().max() <= 10 * tol_ * y.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,start", [(1, 0), (7, 6), (7, 0), (40, 39), (40, 25), (129, 128)])
def test_causal_toeplitz_tail_matches_dense(n, start, dtype, device):
    tol_ = tol(TAIL_TOL, dtype, device)
    g = torch.Generator().manual_seed(n + start)
    d, extra = 4, 9  # the kernel is longer than the sequence, as when built once for the maximum length
    x = torch.randn(d, 2, 3, n, generator=g, dtype=torch.float64).to(dtype)  # (d, *batch, n)
    kernel = torch.randn(d, n + extra, generator=g, dtype=torch.float64).to(dtype)
    x, kernel = on(device, x, kernel)
    ref = toeplitz_ref(x, kernel[:, :n], layout="dbn")[..., start:]
    for got in (causal_toeplitz_tail(x, kernel, start),
                causal_toeplitz_tail(x, kernel.flip(-1).contiguous(), start, reversed_kernel=True)):
        assert got.shape == ref.shape and got.dtype == dtype
        assert_on(device, got)
        assert (got - ref).abs().max() <= tol_ * ref.abs().max() * max(1, n ** 0.5)


def test_causal_toeplitz_tail_refuses_bad_shapes():
    x = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="L >= n = 8"):
        causal_toeplitz_tail(x, torch.zeros(4, 7), 0)
    with pytest.raises(ValueError, match="start must be in"):
        causal_toeplitz_tail(x, torch.zeros(4, 8), 8)
