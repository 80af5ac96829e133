"""The SKI paper's SKI-TNO (``--tno-type ski``): sparse band + asymmetric SKI low rank (section 3.2)."""
from dataclasses import dataclass, field

import torch
from torch import nn

from ...ops.ski import ski_tno
from .base import Tno, TnoSettings, is_int, register_tno, require


@dataclass
class SkiSettings(TnoSettings):
    ski_rank: int = field(default=32, metadata={"help": "r, number of inducing points, >= 2"})
    ski_taps: int = field(default=17, metadata={"help": "m, taps of the sparse depthwise conv, odd"})
    ski_warp_decay: float = field(default=0.99, metadata={
        "help": "lambda of the inverse time warp sign(t) lambda^|t| that maps the inducing points' lags into "
                "[-1, 1], in (0, 1)",
        "alias": "decay"})

    def check(self) -> None:
        require(is_int(self.ski_rank, 2), "ski_rank", self.ski_rank, "r must be an integer >= 2")
        require(is_int(self.ski_taps, 1) and self.ski_taps % 2 == 1, "ski_taps", self.ski_taps,
                "m must be an odd integer >= 1 (the taps are centred)")
        require(isinstance(self.ski_warp_decay, (int, float)) and 0.0 < self.ski_warp_decay < 1.0, "ski_warp_decay",
                self.ski_warp_decay, "lambda must be in (0, 1) for --tno-type ski")


@register_tno
class SkiTno(Tno):
    """SKI-TNO (Algorithm 1): y = Band x + W A W^T x, bidirectional only.

    ``conv_weight`` (d, m) are the m centred taps of the sparse part; ``knots`` (2r, d) are the
    values of the piecewise-linear f on [-1, 1] (r knots per side, f(0) = 0), evaluated at
    x(t) = sign(t) lambda^|t| of the inducing-point lags (lambda: ``decay``). When a sequence is
    shorter than r the rank drops to n (W becomes the identity). W A W^T is only approximately
    Toeplitz, so this TNO has no ``kernel``: the dense matrices are ``ops.ski.ski_tno_ref``'s.
    """

    name = "ski"
    summary = "ski (m-tap conv + SKI low rank; bidirectional only)"
    Settings = SkiSettings
    supports_causal = False
    why_not_causal = "SKI-TNO is bidirectional only (causal masking negates its benefit, the paper's appendix)"

    def __init__(self, dim: int, causal: bool, **settings):
        super().__init__(dim, causal, **settings)
        s = self.settings
        self.decay = s.ski_warp_decay
        self.conv_weight = nn.Parameter(torch.empty(dim, s.ski_taps).uniform_(-s.ski_taps ** -0.5, s.ski_taps ** -0.5))
        self.knots = nn.Parameter(torch.randn(2 * s.ski_rank, dim) * s.ski_rank ** -0.5)

    def forward(self, x: torch.Tensor, layout: str = "bnd") -> torch.Tensor:
        return ski_tno(x, self.conv_weight, self.knots, self.decay, layout=layout)
