"""The lag circulant (a Toeplitz kernel given as a function of the lag, evaluated straight on the
circulant's first column) against the explicit embedding of ``kernel_spectrum``, forward and
gradients; and ``spectrum_kernel``, its inverse. On every device (the `device` fixture: CPU, and CUDA where
present), but for the refusal of a too small circulant (CPU only)."""
import pytest
import torch

from helpers import assert_on, on

from fairseq_tnn.ops.toeplitz import (circulant_column, circulant_lags, fft_conv, kernel_spectrum, lag_function_spectrum,
                                      next_fast_len, spectrum_kernel, toeplitz_ref)


def table_function(pos, neg):
    """coefficients(lags, weights) of a kernel given by its tables pos (d, n), neg (d, n-1)."""
    n = pos.shape[1]
    table = torch.cat([neg.flip(-1), pos], dim=1)  # lags -(n-1) .. n-1

    def coefficients(lags, weights=None):
        k = table[:, lags.long() + n - 1]
        return k if weights is None else k * weights.to(k.dtype)
    return coefficients


@pytest.mark.parametrize("n,size", [(1, 1), (1, 4), (5, 9), (5, 10), (7, 16), (64, 128), (33, 75)])
def test_circulant_lags_are_the_circulant_column(n, size, device):
    lags, weights = circulant_lags(n, size, device)
    assert lags.shape == (size,) and lags.dtype == torch.float32
    assert (weights is None) == (size == 2 * n - 1)
    pos = torch.arange(n, dtype=torch.float64, device=device)[None] + 1.0  # coefficient = lag + 1, nonzero everywhere
    neg = -torch.arange(1, n, dtype=torch.float64, device=device)[None] + 1.0
    column = circulant_column(pos, neg, size)
    got = table_function(pos, neg)(lags, weights)
    assert_on(device, lags, weights, got)
    torch.testing.assert_close(got, column)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 2, 9, 50])
def test_lag_function_spectrum_is_the_kernel_spectrum(causal, n, device):
    torch.manual_seed(0)
    d = 3
    pos = on(device, torch.randn(d, n, dtype=torch.float64, requires_grad=True))
    neg = None if causal else on(device, torch.randn(d, n - 1, dtype=torch.float64, requires_grad=True))
    size = next_fast_len(2 * n - 1)
    fn = table_function(pos, neg if neg is not None else pos.new_zeros(d, n - 1))
    got = lag_function_spectrum(fn, n, size, causal, device)
    want = kernel_spectrum(pos, neg, size, layout="dbn")
    assert_on(device, got, want)
    torch.testing.assert_close(got, want)
    # the product it gives is the dense Toeplitz product, and so are the gradients through it
    x = on(device, torch.randn(d, 2, n, dtype=torch.float64, requires_grad=True))
    y = fft_conv(x, got, size, layout="dbn")
    ref = toeplitz_ref(x, pos, neg, layout="dbn")
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    leaves = [x, pos] + ([] if causal else [neg])
    for a, b in zip(torch.autograd.grad(y, leaves, g), torch.autograd.grad(ref, leaves, g)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("n,size", [(1, 1), (4, 7), (4, 8), (30, 60), (30, 81)])
def test_spectrum_kernel_inverts_kernel_spectrum(n, size, device):
    torch.manual_seed(1)
    pos, neg = on(device, torch.randn(4, n, dtype=torch.float64), torch.randn(4, n - 1, dtype=torch.float64))
    got_pos, got_neg = spectrum_kernel(kernel_spectrum(pos, neg, size, layout="dbn"), size, n)
    assert_on(device, got_pos, got_neg)
    torch.testing.assert_close(got_pos, pos)
    torch.testing.assert_close(got_neg, neg)


def test_too_small_a_circulant_is_refused():
    with pytest.raises(ValueError, match=r"size must be >= 2n - 1 = 9, got 8"):
        circulant_lags(5, 8)
    with pytest.raises(ValueError, match=r"size must be >= 2n - 1 = 9, got 8"):
        spectrum_kernel(torch.zeros(2, 5, dtype=torch.complex128), 8, 5)
