"""Toeplitz neural operators (TNOs): (batch, n, d) -> (batch, n, d), one Toeplitz matrix per channel.

Every TNO variant has the same interface and is built by ``build_tno`` from the
``tno_type`` config field, so a layer never needs to know which one it holds:

- ``tnn``: Qin et al.'s TNO, an RPE MLP of the integer lag times a decay lambda^|t|.
- ``fd``: the SKI paper's FD-TNO, an RPE MLP of the frequency (section 3.3); causal
  through the discrete Hilbert transform, bidirectional through a complex response.
- ``ski``: the SKI paper's SKI-TNO (section 3.2): m-tap depthwise convolution plus
  the asymmetric SKI low-rank part W A W^T with an inverse time warp; bidirectional only.

``forward(x)`` takes (batch, n, d); ``forward(x, layout="dbn")`` takes channel-major
(d, batch, n) activations, the layout every TNO here prefers (attribute ``layout``):
the TNN layer then feeds them straight from its input projection, with no transposes.
"""
import math
from typing import Dict, Tuple

import torch
from torch import nn

from ..ops.fd import fd_bidirectional_spectrum, fd_causal_kernel, fd_grid, hilbert_causal_spectrum
from ..ops.ski import ski_tno
from ..ops.toeplitz import KernelRfft, fft_conv, fft_dtype, next_fast_len, seq_shape, swap_kernel_layout
from .rpe import Rpe


def _length(x: torch.Tensor, layout: str) -> int:
    return seq_shape(x, layout)[0]


def _conv(x: torch.Tensor, spectrum: torch.Tensor, size: int, layout: str) -> torch.Tensor:
    """Apply a (d, size // 2 + 1) spectrum to x in either layout."""
    return fft_conv(x, swap_kernel_layout(spectrum, layout), size, layout)


class TnnTno(nn.Module):
    """The TNO of Qin et al. (2023): T_ij = lambda^|i-j| * RPE(i-j), applied by FFT.

    The RPE sees the raw integer lag; it is evaluated once per forward for all
    lags in one batched call (n lags causal, 2n-1 bidirectional), its last
    Linear producing the kernel channel-major with the decay folded in
    (``Rpe.channel_major``); one real FFT of the kernel per forward. The decay
    lambda is a fixed hyperparameter (not trained); lag 0 is undecayed.

    ``forward(x, layout)``: x (b, n, d) for ``"bnd"`` or (d, *batch, n) for
    ``"dbn"`` (channel-major, ``layout`` below is the one it prefers: its FFTs
    run along the contiguous last dim).
    """

    layout = "dbn"
    # the kernel at a lag does not depend on the sequence length
    kernel_depends_on_length = False

    def __init__(self, dim: int, causal: bool, rpe_dim: int = 64, rpe_layers: int = 6,
                 rpe_activation: str = "relu", decay: float = 0.99, norm_type: str = "simplermsnorm"):
        super().__init__()
        self.causal = causal
        self.decay = decay
        self.rpe = Rpe(dim, rpe_dim, rpe_layers, rpe_activation, norm_type)

    def kernel(self, n: int, device=None):
        """Kernel coefficients (pos (n, d), neg (n-1, d) or None) for length n."""
        lags = torch.arange(-(n - 1) if not self.causal else 0, n, device=device, dtype=torch.float32)
        coef = self.rpe.channel_major(lags, self._decay(lags)).t()  # (m, d)
        if self.causal:
            return coef, None
        return coef[n - 1:], coef[: n - 1].flip(0)

    def causal_kernel(self, n: int, device=None) -> torch.Tensor:
        """The causal time kernel (d, n), lag t at index t: RPE(t) lambda^t, float32 (what ``spectrum``
        transforms). Incremental decoding computes it once for the longest sequence it will decode."""
        if not self.causal:
            raise ValueError("causal_kernel is defined for a causal TNO only")
        lags = torch.arange(n, device=device, dtype=torch.float32)
        k = self.rpe.channel_major(lags, self._decay(lags))
        return k.to(fft_dtype(k))

    def _decay(self, lags: torch.Tensor):
        if self.decay >= 1.0:
            return None
        return torch.exp(lags.abs() * math.log(self.decay))

    def spectrum(self, n: int, device=None) -> Tuple[torch.Tensor, int]:
        """(d, size // 2 + 1) spectrum of the circulant embedding for length n, and size."""
        size = next_fast_len(2 * n - 1)  # no wrap-around for lags up to n - 1 either way
        if self.causal:
            k = self.causal_kernel(n, device)  # (d, n), zero-padded by the FFT
        else:
            # the RPE is evaluated straight at the circulant's first column: lags 0 .. n-1, then
            # zeros (padding slots, RPE input 0, scaled by 0), then lags -(n-1) .. -1
            t = torch.arange(size, device=device)
            lags = torch.where(t < n, t, t - size)
            valid = (t < n) | (t > size - n)
            lags = torch.where(valid, lags, torch.zeros_like(lags)).to(torch.float32)
            scale = self._decay(lags)
            if size > 2 * n - 1:  # padding slots exist (decided on ints: no device sync, no graph break)
                scale = valid.to(torch.float32) if scale is None else scale * valid
            k = self.rpe.channel_major(lags, scale)  # (d, size)
        return KernelRfft.apply(k.to(fft_dtype(k)), size), size

    def forward(self, x: torch.Tensor, layout: str = "bnd") -> torch.Tensor:
        spec, size = self.spectrum(_length(x, layout), x.device)
        return _conv(x, spec, size, layout)


class FdTno(nn.Module):
    """FD-TNO: the RPE MLP models the kernel's frequency response on omega_m = m pi / N'.

    Causal (Algorithm 2): the RPE output is the real part; the imaginary part is
    its discrete Hilbert transform, so the time kernel is causal. Bidirectional
    (section 3.3.2): the RPE outputs 2d values, real and imaginary parts, the
    imaginary part forced to 0 at omega = 0 and pi. No decay bias: the smoothness
    of the RPE's activation sets the kernel's decay (section 4.2). A longer
    sequence samples the same MLP on a finer grid over [0, pi]. Layouts as for
    ``TnnTno``; the RPE's output is produced channel-major.
    """

    layout = "dbn"
    # the grid, hence every lag's coefficient, follows the sequence length
    kernel_depends_on_length = True

    def __init__(self, dim: int, causal: bool, rpe_dim: int = 64, rpe_layers: int = 3,
                 rpe_activation: str = "relu", norm_type: str = "simplermsnorm"):
        super().__init__()
        self.causal = causal
        self.rpe = Rpe(dim if causal else 2 * dim, rpe_dim, rpe_layers, rpe_activation, norm_type)
        # Set (by TnnDecoder.set_decoding_length) while a causal model generates: the kernel is then
        # that of a sequence of max(n, kernel_length) positions, the same at every step of a generation,
        # cached or not (a causal model's output at t never depends on the positions after t, but
        # FD's kernel depends on the length: see causal_kernel). None: the input's own length.
        self.kernel_length = None

    def causal_kernel(self, n: int, device=None) -> torch.Tensor:
        """The causal time kernel (d, n) of a sequence of n positions: lag t at index t, float32.

        The inverse DFT of the causal spectrum on n's grid (``fd_causal_kernel``); a longer sequence
        samples the RPE on a finer grid, so every lag's coefficient changes a little with n. For the
        first m < n positions it is the kernel the full forward uses when ``kernel_length`` = n."""
        if not self.causal:
            raise ValueError("causal_kernel is defined for a causal TNO only")
        _, omegas = fd_grid(n, device)
        return fd_causal_kernel(self.rpe.channel_major(omegas), layout="dbn")[:, :n]

    def spectrum(self, n: int, device=None) -> Tuple[torch.Tensor, int]:
        size, omegas = fd_grid(n, device)
        k = self.rpe.channel_major(omegas)  # (d, N'+1) causal, (2d, N'+1) bidirectional
        if self.causal:
            return hilbert_causal_spectrum(k, layout="dbn"), size
        k_real, k_imag = k.chunk(2, dim=0)
        return fd_bidirectional_spectrum(k_real, k_imag, layout="dbn"), size

    def forward(self, x: torch.Tensor, layout: str = "bnd") -> torch.Tensor:
        spec, size = self.spectrum(max(_length(x, layout), self.kernel_length or 0), x.device)
        return _conv(x, spec, size, layout)


class SkiTno(nn.Module):
    """SKI-TNO (Algorithm 1): y = Band x + W A W^T x, bidirectional only.

    ``conv_weight`` (d, m) are the m centred taps of the sparse part; ``knots``
    (2r, d) are the values of the piecewise-linear f on [-1, 1] (r knots per side,
    f(0) = 0), evaluated at x(t) = sign(t) lambda^|t| of the inducing-point lags.
    When a sequence is shorter than r the rank drops to n (W becomes the identity).
    Layouts as for ``TnnTno`` (channel-major preferred: the band and W run as GEMMs
    over (d * batch, n) rows).
    """

    layout = "dbn"

    def __init__(self, dim: int, causal: bool, rank: int = 32, taps: int = 17, decay: float = 0.99):
        super().__init__()
        if causal:
            raise ValueError("--tno-type ski is bidirectional only: causal masking negates SKI's benefit "
                             "(the paper's appendix); use --tno-type fd or tnn for a causal model")
        self.decay = decay
        self.conv_weight = nn.Parameter(torch.empty(dim, taps).uniform_(-taps ** -0.5, taps ** -0.5))
        self.knots = nn.Parameter(torch.randn(2 * rank, dim) * rank ** -0.5)

    def forward(self, x: torch.Tensor, layout: str = "bnd") -> torch.Tensor:
        return ski_tno(x, self.conv_weight, self.knots, self.decay, layout=layout)


# Per TNO type: the config fields it uses and their defaults (None in a config = this default).
TNO_FIELDS: Dict[str, Dict[str, object]] = {
    "tnn": dict(rpe_dim=64, rpe_layers=6, rpe_activation="relu", rpe_norm_type="simplermsnorm", decay=0.99),
    "fd": dict(rpe_dim=64, rpe_layers=3, rpe_activation="relu", rpe_norm_type="simplermsnorm"),
    "ski": dict(ski_rank=32, ski_taps=17, decay=0.99),
}
TYPE_SPECIFIC_FIELDS = sorted({f for fields in TNO_FIELDS.values() for f in fields})


def tno_settings(tno_type: str, cfg) -> Dict[str, object]:
    """The settings of one TNO type: config values where given, else the type's defaults."""
    return {k: (getattr(cfg, k, None) if getattr(cfg, k, None) is not None else v)
            for k, v in TNO_FIELDS[tno_type].items()}


def build_tno(tno_type: str, dim: int, causal: bool, cfg) -> nn.Module:
    if tno_type not in TNO_FIELDS:
        raise ValueError(f"--tno-type={tno_type!r} is invalid: must be one of {sorted(TNO_FIELDS)}")
    s = tno_settings(tno_type, cfg)
    if tno_type == "tnn":
        return TnnTno(dim, causal, s["rpe_dim"], s["rpe_layers"], str(s["rpe_activation"]), s["decay"],
                      str(s["rpe_norm_type"]))
    if tno_type == "fd":
        return FdTno(dim, causal, s["rpe_dim"], s["rpe_layers"], str(s["rpe_activation"]), str(s["rpe_norm_type"]))
    return SkiTno(dim, causal, s["ski_rank"], s["ski_taps"], s["decay"])
