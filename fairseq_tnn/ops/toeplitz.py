"""Toeplitz matrix-vector products, one Toeplitz matrix per channel.

Shapes: ``x`` is (batch, n, d); a kernel is given by its coefficients per lag,
``pos`` (n, d) for lags 0, 1, ..., n-1 (on and below the diagonal) and ``neg``
(n-1, d) for lags -1, -2, ..., -(n-1) (above the diagonal), so that

    y[b, i, c] = sum_j T_c[i, j] x[b, j, c],   T_c[i, j] = t_c(i - j).

``neg=None`` means a causal (lower-triangular) matrix.

``toeplitz_fft`` embeds T in a circulant matrix of a fast FFT size >= 2n - 1 and
multiplies in the frequency domain in O(n log n); ``toeplitz_ref`` builds the
dense n x n matrices explicitly. Both have the same signature and the tests
compare them, forward and gradients. FFTs always run in float32 (or float64)
even under fp16/bf16 autocast: cuFFT's half precision only supports powers of
two and its round-off is too large for long kernels.
"""
from typing import Optional

import torch


def next_fast_len(m: int) -> int:
    """Smallest integer >= m whose only prime factors are 2, 3 and 5.

    pocketfft (CPU) and cuFFT are fastest on such sizes; powers of two win
    ties because they are tried first at equal size.
    """
    if m <= 1:
        return 1
    best = 1 << (m - 1).bit_length()  # next power of two
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            p = p35
            while p < m:
                p *= 2
            best = min(best, p)
            p35 *= 3
        p5 *= 5
    return best


def fft_dtype(x: torch.Tensor) -> torch.dtype:
    """The real dtype in which an FFT of ``x`` is computed."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def circulant_kernel(pos: torch.Tensor, neg: Optional[torch.Tensor], size: int) -> torch.Tensor:
    """First column (size, d) of the circulant matrix that embeds T."""
    n, d = pos.shape
    pieces = [pos, pos.new_zeros(size - 2 * n + 1 if neg is not None else size - n, d)]
    if neg is not None:
        pieces.append(neg.flip(0))  # lags -(n-1) ... -1 at the end
    return torch.cat(pieces, dim=0)


def kernel_spectrum(pos: torch.Tensor, neg: Optional[torch.Tensor], size: int) -> torch.Tensor:
    """rfft (size // 2 + 1, d) of the circulant embedding of T, in fp32/fp64."""
    c = circulant_kernel(pos.to(fft_dtype(pos)), None if neg is None else neg.to(fft_dtype(pos)), size)
    return torch.fft.rfft(c, n=size, dim=0)


def fft_conv(x: torch.Tensor, spectrum: torch.Tensor, size: int) -> torch.Tensor:
    """y = first n rows of irfft(rfft(x, size) * spectrum), in x's dtype.

    x: (batch, n, d); spectrum: (size // 2 + 1, d) complex.
    """
    n = x.shape[-2]
    xf = torch.fft.rfft(x.to(fft_dtype(x)), n=size, dim=-2)  # (b, size//2+1, d)
    y = torch.fft.irfft(xf * spectrum, n=size, dim=-2)[..., :n, :]
    return y.to(x.dtype)


def toeplitz_fft(x: torch.Tensor, pos: torch.Tensor, neg: Optional[torch.Tensor] = None) -> torch.Tensor:
    """T x by FFT. x: (b, n, d), pos: (n, d), neg: (n-1, d) or None (causal)."""
    n = x.shape[-2]
    _check(x, pos, neg)
    size = next_fast_len(2 * n - 1)  # no wrap-around for lags up to n-1 either way
    return fft_conv(x, kernel_spectrum(pos, neg, size), size)


def toeplitz_dense(pos: torch.Tensor, neg: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The explicit (d, n, n) Toeplitz matrices."""
    n, d = pos.shape
    lag = torch.arange(n, device=pos.device)
    lag = lag[:, None] - lag[None, :]  # (n, n): i - j
    if neg is None:
        neg = pos.new_zeros(max(n - 1, 0), d)
    coeffs = torch.cat([neg.flip(0), pos], dim=0)  # lags -(n-1) ... n-1
    return coeffs[lag + n - 1].permute(2, 0, 1)  # (d, n, n)


def toeplitz_ref(x: torch.Tensor, pos: torch.Tensor, neg: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense reference for ``toeplitz_fft``: explicit matrices, O(n^2 d)."""
    _check(x, pos, neg)
    t = toeplitz_dense(pos, neg)  # (d, n, n)
    return torch.einsum("cij,bjc->bic", t.to(x.dtype), x)


def _check(x, pos, neg):
    n, d = x.shape[-2], x.shape[-1]
    if pos.shape != (n, d):
        raise ValueError(f"pos must have shape (n, d) = {(n, d)}, got {tuple(pos.shape)}")
    if neg is not None and neg.shape != (n - 1, d):
        raise ValueError(f"neg must have shape (n-1, d) = {(n - 1, d)}, got {tuple(neg.shape)}")
