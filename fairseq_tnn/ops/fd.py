"""FD-TNO: Toeplitz operators parametrised by their frequency response.

Paper section 3.3 (Algorithm 2). Shapes follow ``toeplitz.py``: ``x`` is
(batch, n, d), one kernel per channel. The kernel is never given in the time
domain; instead its frequency response is given on the grid

    omega_m = m * pi / N',  m = 0, ..., N',   N' = next_fast_len(n),

so the FFT size is N = 2 N' >= 2n and the circular convolution of length N
does not wrap around for lags |i - j| <= n - 1. A longer sequence samples the
same interval [0, pi] on a finer grid (this is how FD-TNN extrapolates).

* causal: only the real part ``k_real`` (N'+1, d) is given. The imaginary part
  is minus the discrete Hilbert transform of the real part, which makes the
  time kernel zero at negative lags (``hilbert_causal_spectrum``).
* bidirectional: real and imaginary parts ``k_real``, ``k_imag`` (N'+1, d) are
  both given; the imaginary part is forced to 0 at omega = 0 and omega = pi,
  where a real kernel's spectrum is real. One FFT fewer than TNN's TNO: the
  kernel is never transformed.

Every op also takes ``layout="dbn"`` (channel-major, see ``toeplitz.py``): x
(d, *batch, n) and spectra (d, N'+1), FFTs along the contiguous last dimension.

The ops here give the spectra; the FD-TNO applies one as every spectral TNO
does, ``toeplitz.fft_conv(x, spectrum, N)`` (``SpectralTno.forward`` in
modules/tno/base.py), so the FD-TNO is ``fft_conv(x, hilbert_causal_spectrum(
k_real), N)`` causal and ``fft_conv(x, fd_bidirectional_spectrum(k_real,
k_imag), N)`` bidirectional, N from ``fd_grid``: the compositions
tests/ops/test_fd.py compares with the ``*_ref`` functions, which build the time
kernel by an explicit inverse DFT (a dense cos/sin matrix) and multiply by dense
Toeplitz matrices. FFTs (with the hand-written backward passes of
``toeplitz.py``) and references compute in float32 (float64 for float64 input)
and cast the output back to ``x.dtype``.
"""
import math
from typing import Optional, Tuple

import torch

from . import fast
from .checks import check_layout, check_length, check_shape
from .toeplitz import KernelRfft, fft_dtype, next_fast_len, seq_shape, swap_kernel_layout, toeplitz_dense


def fd_grid(n: int, device=None) -> Tuple[int, torch.Tensor]:
    """FFT size N = 2 N' and the N' + 1 frequencies m pi / N' (float32) for length n."""
    check_length(n)
    half = next_fast_len(n)  # N'
    omegas = fast.constant(("fd-grid", half), device, lambda: (
        torch.arange(half + 1, device=device, dtype=torch.float64) * (math.pi / half)).to(torch.float32))
    return 2 * half, omegas


def _causal_fold(size: int, device, dtype) -> torch.Tensor:
    """(size,) mask 1, 2, ..., 2, 1, 0, ..., 0 that turns an even sequence causal (built once: ``fast.constant``)."""
    return fast.constant(("causal-fold", size, dtype), device, lambda: _make_causal_fold(size, device, dtype))


def _make_causal_fold(size: int, device, dtype) -> torch.Tensor:
    half = size // 2
    fold = torch.zeros(size, device=device, dtype=dtype)
    fold[0].fill_(1.0)  # fill_, not ``fold[0] = 1.0``, a copy from the host (``fast.constant``)
    fold[1:half].fill_(2.0)
    fold[half].fill_(1.0)
    return fold


def hilbert_causal_spectrum(k_real: torch.Tensor, layout: str = "bnd") -> torch.Tensor:
    """H = k_real - i Hilbert{k_real}: the spectrum of the causal kernel with real part k_real.

    k_real: (N'+1, d) real (``dbn``: (d, N'+1)), on the grid of ``fd_grid``.
    Returns complex of the same shape in complex64 (complex128 for float64
    input). irfft(k_real) is a real even sequence e of length N = 2N'; keeping
    e[0] and e[N/2], doubling e[1:N/2] and zeroing e[N/2+1:] gives a causal
    sequence whose rfft has real part exactly k_real (to round-off): cos is
    even, so e[t] + e[N-t] = 2 e[t]. The zeroed half is never materialised:
    the rfft zero-pads its input of length N/2 + 1.
    """
    causal = fd_causal_kernel(k_real, layout)
    causal = swap_kernel_layout(causal, layout)  # (d, N'+1)
    spec = KernelRfft.apply(causal, 2 * (causal.shape[-1] - 1))  # (d, N'+1)
    return swap_kernel_layout(spec, layout)


def fd_causal_kernel(k_real: torch.Tensor, layout: str = "bnd") -> torch.Tensor:
    """The causal time kernel whose spectrum ``hilbert_causal_spectrum`` returns: lags 0 .. N'.

    k_real: (N'+1, d) real (``dbn``: (d, N'+1)) on the grid of ``fd_grid``; returns the kernel in the
    same shape (lag t at index t; lags above N' are zero), float32 (float64 for float64 input). A
    causal FD-TNO on n <= N' inputs is y[t] = sum_{s <= t} kernel[t - s] x[s] (no wrap-around: the
    FFT size is 2 N'), which is how incremental decoding applies it one position at a time.
    """
    check_layout(layout)
    kr = k_real.to(fft_dtype(k_real))
    kr = swap_kernel_layout(kr, layout)  # (d, N'+1)
    size = 2 * (kr.shape[-1] - 1)
    if size < 2:
        raise ValueError(f"k_real must have N'+1 >= 2 frequencies, got shape {tuple(k_real.shape)}")
    even = torch.fft.irfft(kr, n=size)  # (d, N), even sequence
    causal = even[..., : size // 2 + 1] * _causal_fold(size, kr.device, kr.dtype)[: size // 2 + 1]
    return swap_kernel_layout(causal, layout)


def fd_bidirectional_spectrum(k_real: torch.Tensor, k_imag: torch.Tensor, layout: str = "bnd") -> torch.Tensor:
    """k_real + i k_imag with the imaginary part multiplied by 0 at omega = 0 and pi.

    Shapes (N'+1, d), or (d, N'+1) for ``dbn``."""
    check_layout(layout)
    ct = fft_dtype(k_real)
    kr, ki = k_real.to(ct), k_imag.to(ct)
    freq_dim = 0 if layout == "bnd" else -1
    mask = fast.constant(("imag-ends-mask", ki.shape[freq_dim], ct), ki.device, lambda: _ends_mask(ki.shape[freq_dim], ki.device, ct))
    mask = mask[:, None] if layout == "bnd" else mask
    # d / d k_imag is 0 at both ends. Interleaved by stack, not torch.complex: autograd's complex()
    # keeps both parts for its backward, half again the spectrum's memory per layer until the backward.
    return torch.view_as_complex(torch.stack([kr, ki * mask], dim=-1))


def _ends_mask(length: int, device, dtype) -> torch.Tensor:
    """(length,) ones with zeros at both ends."""
    mask = torch.ones(length, device=device, dtype=dtype)
    mask[0].fill_(0.0)  # fill_, not ``mask[0] = 0.0``, a copy from the host (``fast.constant``)
    mask[-1].fill_(0.0)
    return mask


# ----------------------------------------------------------------------------
# References: explicit DFT matrices and dense Toeplitz matrices.
# ----------------------------------------------------------------------------


def _dft_angles(size: int, device) -> torch.Tensor:
    """(N'+1, N) angles 2 pi m t / N, reduced mod N in integers first (float64)."""
    m = torch.arange(size // 2 + 1, device=device)
    t = torch.arange(size, device=device)
    return (m[:, None] * t[None, :] % size).to(torch.float64) * (2.0 * math.pi / size)


def fd_time_kernel(k_real: torch.Tensor, k_imag: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The (N, d) time kernel, by an explicit inverse DFT of the half spectrum.

    Index t holds lag t for t < N/2 and lag t - N for t > N/2. With ``k_imag=None``
    (causal) the inverse DFT of k_real alone gives the even sequence, which is
    folded onto non-negative lags; otherwise the imaginary part enters with sin
    weights that are 0 at omega = 0 and pi (the forced zeros).
    """
    ct = fft_dtype(k_real)
    half = k_real.shape[0] - 1
    size = 2 * half
    ang = _dft_angles(size, k_real.device)  # (N'+1, N)
    w_cos = torch.full((half + 1,), 2.0, dtype=torch.float64, device=k_real.device)
    w_cos[0] = w_cos[-1] = 1.0  # DC and Nyquist appear once in a length-N spectrum
    w_sin = torch.full((half + 1,), 2.0, dtype=torch.float64, device=k_real.device)
    w_sin[0] = w_sin[-1] = 0.0
    cos = (w_cos[:, None] * torch.cos(ang) / size).to(ct)  # (N'+1, N)
    kernel = cos.t() @ k_real.to(ct)  # (N, d)
    if k_imag is None:
        return kernel * _causal_fold(size, k_real.device, ct)[:, None]
    sin = (w_sin[:, None] * torch.sin(ang) / size).to(ct)
    return kernel - sin.t() @ k_imag.to(ct)


def fd_spectrum_ref(kernel: torch.Tensor) -> torch.Tensor:
    """Explicit DFT (N'+1, d) of a real (N, d) time kernel: sum_t k[t] exp(-2 pi i m t / N)."""
    ang = _dft_angles(kernel.shape[0], kernel.device).to(kernel.dtype)  # (N'+1, N)
    return torch.complex(torch.cos(ang) @ kernel, -(torch.sin(ang) @ kernel))


def _toeplitz_from_kernel(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """y = T x with T[i, j] = kernel[(i - j) mod N], via dense (d, n, n) matrices."""
    n = x.shape[-2]
    pos = kernel[:n]  # lags 0 .. n-1
    neg = kernel.flip(0)[: n - 1]  # lags -1 .. -(n-1): indices N-1, N-2, ...
    t = toeplitz_dense(pos, neg)  # (d, n, n)
    y = torch.einsum("cij,bjc->bic", t, x.to(kernel.dtype))
    return y.to(x.dtype)


def _bnd(t: Optional[torch.Tensor], layout: str) -> Optional[torch.Tensor]:
    """A ``dbn`` kernel (d, F) as the references' (F, d)."""
    return t.t() if (t is not None and layout == "dbn") else t


def _ref_apply(x: torch.Tensor, kernel: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "bnd":
        return _toeplitz_from_kernel(x, kernel)
    d, n = x.shape[0], x.shape[-1]
    xb = x.reshape(d, -1, n).permute(1, 2, 0)  # (batch, n, d)
    return _toeplitz_from_kernel(xb, kernel).permute(2, 0, 1).reshape(x.shape)


def fd_causal_ref(x: torch.Tensor, k_real: torch.Tensor, layout: str = "bnd") -> torch.Tensor:
    """Dense reference for the causal FD-TNO, ``fft_conv(x, hilbert_causal_spectrum(k_real), N)`` (explicit
    inverse DFT, O(n^2 d)). ``bnd``: x (b, n, d), k_real (N'+1, d); ``dbn``: x (d, *batch, n), k_real (d, N'+1)."""
    check_fd_args(x, k_real, layout=layout)
    return _ref_apply(x, fd_time_kernel(_bnd(k_real, layout)), layout)


def fd_bidirectional_ref(x: torch.Tensor, k_real: torch.Tensor, k_imag: torch.Tensor, layout: str = "bnd") -> torch.Tensor:
    """Dense reference for the bidirectional FD-TNO, ``fft_conv(x, fd_bidirectional_spectrum(k_real, k_imag), N)``
    (explicit inverse DFT, O(n^2 d)); shapes as for ``fd_causal_ref``, k_imag like k_real."""
    check_fd_args(x, k_real, k_imag, layout)
    return _ref_apply(x, fd_time_kernel(_bnd(k_real, layout), _bnd(k_imag, layout)), layout)


def check_fd_args(x: torch.Tensor, k_real: torch.Tensor, k_imag: Optional[torch.Tensor] = None,
                  layout: str = "bnd") -> int:
    """The spectra fit x: (N'+1, d), or (d, N'+1) for ``dbn``, N' = next_fast_len(n). Returns the FFT size N = 2 N'."""
    n, d = seq_shape(x, layout)
    size = 2 * next_fast_len(n)
    want = (size // 2 + 1, d) if layout == "bnd" else (d, size // 2 + 1)
    why = f"for n={n} and layout {layout!r} (N' = next_fast_len(n))"
    check_shape("k_real", k_real, want, why)
    if k_imag is not None:
        check_shape("k_imag", k_imag, want, why)
    return size
