"""Toeplitz neural operators (TNOs): (batch, n, d) -> (batch, n, d), one Toeplitz matrix per channel.

Every TNO variant has the same interface and is built by ``build_tno`` from the
``tno_type`` config field, so a layer never needs to know which one it holds:

- ``tnn``: Qin et al.'s TNO, an RPE MLP of the integer lag times a decay lambda^|t|.
- ``fd``: the SKI paper's FD-TNO, an RPE MLP of the frequency (section 3.3); causal
  through the discrete Hilbert transform, bidirectional through a complex response.
- ``ski``: the SKI paper's SKI-TNO (section 3.2): m-tap depthwise convolution plus
  the asymmetric SKI low-rank part W A W^T with an inverse time warp; bidirectional only.
"""
import math
from typing import Dict

import torch
from torch import nn

from ..ops.fd import fd_bidirectional, fd_causal, fd_grid
from ..ops.ski import ski_tno
from ..ops.toeplitz import toeplitz_fft
from .rpe import Rpe


class TnnTno(nn.Module):
    """The TNO of Qin et al. (2023): T_ij = lambda^|i-j| * RPE(i-j), applied by FFT.

    The RPE sees the raw integer lag; it is evaluated once per forward for all
    lags in one batched call (n lags causal, 2n-1 bidirectional). The decay
    lambda is a fixed hyperparameter (not trained); lag 0 is undecayed.
    """

    def __init__(self, dim: int, causal: bool, rpe_dim: int = 64, rpe_layers: int = 6,
                 rpe_activation: str = "relu", decay: float = 0.99, norm_type: str = "simplermsnorm"):
        super().__init__()
        self.causal = causal
        self.decay = decay
        self.rpe = Rpe(dim, rpe_dim, rpe_layers, rpe_activation, norm_type)

    def kernel(self, n: int, device=None):
        """Kernel coefficients (pos (n, d), neg (n-1, d) or None) for length n."""
        lags = torch.arange(-(n - 1) if not self.causal else 0, n, device=device, dtype=torch.float32)
        coef = self.rpe(lags)  # (m, d)
        if self.decay < 1.0:
            coef = coef * torch.exp(lags.abs() * math.log(self.decay)).to(coef.dtype).unsqueeze(-1)
        if self.causal:
            return coef, None
        return coef[n - 1:], coef[: n - 1].flip(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos, neg = self.kernel(x.shape[1], x.device)
        return toeplitz_fft(x, pos, neg)  # (b, n, d)


class FdTno(nn.Module):
    """FD-TNO: the RPE MLP models the kernel's frequency response on omega_m = m pi / N'.

    Causal (Algorithm 2): the RPE output is the real part; the imaginary part is
    its discrete Hilbert transform, so the time kernel is causal. Bidirectional
    (section 3.3.2): the RPE outputs 2d values, real and imaginary parts, the
    imaginary part forced to 0 at omega = 0 and pi. No decay bias: the smoothness
    of the RPE's activation sets the kernel's decay (section 4.2). A longer
    sequence samples the same MLP on a finer grid over [0, pi].
    """

    def __init__(self, dim: int, causal: bool, rpe_dim: int = 64, rpe_layers: int = 3,
                 rpe_activation: str = "relu", norm_type: str = "simplermsnorm"):
        super().__init__()
        self.causal = causal
        self.rpe = Rpe(dim if causal else 2 * dim, rpe_dim, rpe_layers, rpe_activation, norm_type)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, omegas = fd_grid(x.shape[1], x.device)
        k = self.rpe(omegas)  # (N'+1, d) causal, (N'+1, 2d) bidirectional
        if self.causal:
            return fd_causal(x, k)
        k_real, k_imag = k.chunk(2, dim=-1)
        return fd_bidirectional(x, k_real, k_imag)


class SkiTno(nn.Module):
    """SKI-TNO (Algorithm 1): y = Band x + W A W^T x, bidirectional only.

    ``conv_weight`` (d, m) are the m centred taps of the sparse part; ``knots``
    (2r, d) are the values of the piecewise-linear f on [-1, 1] (r knots per side,
    f(0) = 0), evaluated at x(t) = sign(t) lambda^|t| of the inducing-point lags.
    When a sequence is shorter than r the rank drops to n (W becomes the identity).
    """

    def __init__(self, dim: int, causal: bool, rank: int = 32, taps: int = 17, decay: float = 0.99):
        super().__init__()
        if causal:
            raise ValueError("--tno-type ski is bidirectional only: causal masking negates SKI's benefit "
                             "(the paper's appendix); use --tno-type fd or tnn for a causal model")
        self.decay = decay
        self.conv_weight = nn.Parameter(torch.empty(dim, taps).uniform_(-taps ** -0.5, taps ** -0.5))
        self.knots = nn.Parameter(torch.randn(2 * rank, dim) * rank ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ski_tno(x, self.conv_weight, self.knots, self.decay)


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
