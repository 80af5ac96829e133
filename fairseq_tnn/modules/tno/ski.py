"""The SKI paper's SKI-TNO (``--tno-type ski``): sparse band + asymmetric SKI low rank (section 3.2)."""
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ...ops.ski import ski_tno
from ...ops.toeplitz import seq_shape
from .base import Tno, TnoSettings, is_int, register_tno, require

logger = logging.getLogger(__name__)

LOWRANK_MODES = ["mean", "sum", "off"]


@dataclass
class SkiSettings(TnoSettings):
    ski_rank: int = field(default=32, metadata={"help": "r, number of inducing points, >= 2"})
    ski_taps: int = field(default=17, metadata={"help": "m, taps of the sparse depthwise conv, odd"})
    ski_warp_decay: float = field(default=0.99, metadata={
        "help": "lambda of the inverse time warp sign(t) lambda^|t| that maps the inducing points' lags into "
                "[-1, 1], in (0, 1)",
        "alias": "decay"})
    ski_lowrank: str = field(default="mean", metadata={
        "help": "the low-rank part W A W^T x: 'mean' scales A by 1/h, h = (n-1)/(r-1) the spacing of the inducing "
                "points, so that each one sees the mean of its segment of x (the plugin's choice, where the paper is "
                "silent: docs/design.md#ski-tnn-the-scale-of-the-low-rank-part); 'sum' uses A as the knots give it "
                "(the scale of checkpoints made before this option); 'off' drops it (the band alone, an ablation)",
        "choices": LOWRANK_MODES})

    def check(self) -> None:
        require(is_int(self.ski_rank, 2), "ski_rank", self.ski_rank, "r must be an integer >= 2")
        require(is_int(self.ski_taps, 1) and self.ski_taps % 2 == 1, "ski_taps", self.ski_taps,
                "m must be an odd integer >= 1 (the taps are centred)")
        require(isinstance(self.ski_warp_decay, (int, float)) and 0.0 < self.ski_warp_decay < 1.0, "ski_warp_decay",
                self.ski_warp_decay, "lambda must be in (0, 1) for --tno-type ski")
        super().check()


@register_tno
class SkiTno(Tno):
    """SKI-TNO (Algorithm 1): y = Band x + W A W^T x, bidirectional only.

    ``conv_weight`` (d, m) are the m centred taps of the sparse part; ``knots`` (2r, d) are the
    values of the piecewise-linear f on [-1, 1] (r knots per side, f(0) = 0), evaluated at
    x(t) = sign(t) lambda^|t| of the inducing-point lags (lambda: ``decay``). When a sequence is
    shorter than r the rank drops to n (W becomes the identity). W A W^T is only approximately
    Toeplitz, so this TNO has no ``kernel``: the dense matrices are ``ops.ski.ski_tno_ref``'s.

    ``--ski-lowrank mean`` (the default) applies A with f = knots / h, h = (n - 1) / (r_eff - 1) the
    spacing of the inducing points: W^T x sums about h positions per inducing point, so this makes
    each one see the mean of its segment, keeps the low-rank output an average at any length, and
    gives the knots Adam steps 1/h the size in output terms (``lowrank_knots``); its knots start at
    zero, so a new model starts as its band alone. The operator is
    still W A W^T with A Toeplitz in the warped lags and f(0) = 0. A checkpoint saved before the
    option existed has no ``version`` entry and loads as ``sum``, computing what it computed.
    """

    name = "ski"
    summary = "ski (m-tap conv + SKI low rank; bidirectional only)"
    Settings = SkiSettings
    supports_causal = False
    why_not_causal = "SKI-TNO is bidirectional only (causal masking negates its benefit, the paper's appendix)"
    # 1: checkpoints before --ski-lowrank (the low rank as 'sum'); 2: the mode is the model config's
    VERSION = 2

    def __init__(self, dim: int, causal: bool, settings: Optional[SkiSettings] = None, **values):
        super().__init__(dim, causal, settings, **values)
        s = self.settings
        self.decay = s.ski_warp_decay
        self.lowrank = s.ski_lowrank
        self.conv_weight = nn.Parameter(torch.empty(dim, s.ski_taps).uniform_(-s.ski_taps ** -0.5, s.ski_taps ** -0.5))
        if self.lowrank == "off":
            self.register_parameter("knots", None)
        else:
            # 'mean' starts at zero, the band alone, and grows the low rank where the gradient asks for it;
            # 'sum' keeps the N(0, 1/r) draw of the checkpoints before --ski-lowrank
            std = s.ski_rank ** -0.5 if self.lowrank == "sum" else 0.0
            self.knots = nn.Parameter(torch.randn(2 * s.ski_rank, dim) * std)
        self.register_buffer("version", torch.tensor(self.VERSION))

    def lowrank_scale(self, n: int) -> float:
        """The factor between the knots and f at length n: 1 / h for 'mean', 1 for 'sum'."""
        r_eff = min(self.settings.ski_rank, n)
        return (r_eff - 1) / (n - 1) if self.lowrank == "mean" and r_eff > 1 else 1.0

    def lowrank_knots(self, n: int) -> Optional[torch.Tensor]:
        """The values of f (2r, d) that the low-rank part applies at length n (None: no low-rank part)."""
        if self.knots is None:
            return None
        scale = self.lowrank_scale(n)
        return self.knots * scale if scale != 1.0 else self.knots

    def forward(self, x: torch.Tensor, layout: str = "bnd") -> torch.Tensor:
        n = seq_shape(x, layout)[0]
        return ski_tno(x, self.conv_weight, self.lowrank_knots(n), self.decay, layout=layout)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "version"
        if key not in state_dict:  # saved before --ski-lowrank: its knots are f itself
            state_dict[key] = torch.tensor(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if int(state_dict[key]) < 2 and self.lowrank != "sum":
            if self.knots is None:
                raise ValueError(f"--ski-lowrank=off cannot load {prefix or 'the'} SKI-TNO of a checkpoint saved before "
                                 "--ski-lowrank existed (it has a low-rank part): use --ski-lowrank sum")
            logger.warning(f"{prefix}: a SKI-TNO saved before --ski-lowrank existed; it computes as it did "
                           f"(--ski-lowrank sum), not {self.lowrank}")
            self.lowrank = "sum"
