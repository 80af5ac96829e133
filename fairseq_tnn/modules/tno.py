"""Toeplitz neural operators (TNOs): (batch, n, d) -> (batch, n, d), one Toeplitz matrix per channel.

Every TNO variant has the same interface and is built by ``build_tno`` from the
``tno_type`` config field, so a layer never needs to know which one it holds.
"""
import math
from typing import Callable, Dict

import torch
from torch import nn

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
            coef = coef * torch.exp(lags.abs() * math.log(self.decay)).unsqueeze(-1)
        if self.causal:
            return coef, None
        return coef[n - 1:], coef[: n - 1].flip(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos, neg = self.kernel(x.shape[1], x.device)
        return toeplitz_fft(x, pos, neg)  # (b, n, d)


# tno_type -> builder(dim, causal, cfg) ; cfg is the model config (attribute access)
TNO_BUILDERS: Dict[str, Callable[..., nn.Module]] = {
    "tnn": lambda dim, causal, cfg: TnnTno(
        dim, causal, rpe_dim=cfg.rpe_dim, rpe_layers=cfg.rpe_layers,
        rpe_activation=cfg.rpe_activation, decay=cfg.decay, norm_type=cfg.rpe_norm_type),
}


def build_tno(tno_type: str, dim: int, causal: bool, cfg) -> nn.Module:
    if tno_type not in TNO_BUILDERS:
        raise ValueError(f"tno_type={tno_type!r} is not one of {sorted(TNO_BUILDERS)}")
    return TNO_BUILDERS[tno_type](dim, causal, cfg)
