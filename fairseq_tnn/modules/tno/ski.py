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
BACKWARD_MODES = ["recompute", "keep"]


@dataclass
class SkiSettings(TnoSettings):
    ski_rank: int = field(default=32, metadata={"help": "r, number of inducing points, >= 2"})
    ski_taps: int = field(default=17, metadata={"help": "m, taps of the sparse depthwise conv, odd"})
    ski_warp_decay: float = field(default=0.99, metadata={
        "help": "lambda of the inverse time warp sign(t) lambda^|t| that maps the inducing points' lags into "
                "[-1, 1], in (0, 1)"})
    ski_lowrank: str = field(default="mean", metadata={
        "help": "the low-rank part W A W^T x: 'mean' scales A by 1/h, h = (n-1)/(r-1) the spacing of the inducing "
                "points at the training length n (the task's --tokens-per-sample, kept in the checkpoint), so that at "
                "that length each one sees the mean of its segment of x, and at every length the model applies the "
                "same kernel (the plugin's choice, where the paper is silent: "
                "docs/design.md#ski-tnn-the-scale-of-the-low-rank-part); 'sum' uses A as the knots give it (the "
                "scale of checkpoints made before this option); 'off' drops it (the band alone, an ablation)",
        "choices": LOWRANK_MODES})
    ski_backward: str = field(default="recompute", metadata={
        "help": "what the GTU keeps of its gate u * SKI(v) for the backward: 'recompute' keeps the gate's input "
                "alone, [W_u; W_v] x before the activation, and computes u, v, SKI(v) and the product again in the "
                "backward (one more SKI-TNO forward a layer; ski_tnn_mlm_wt103's saved activations a third less at "
                "the paper's shapes, by benchmarks/memory.py's accounting: docs/performance.md); 'keep' keeps u, v "
                "and SKI(v), as the GTU of every other TNO does (the faster where the memory allows)",
        "choices": BACKWARD_MODES})

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
    x(t) = sign(t) lambda^|t| of the inducing-point lags (lambda: ``warp_decay``). When a sequence is
    shorter than r the rank drops to n (W becomes the identity). W A W^T is only approximately
    Toeplitz, so this TNO has no ``kernel``: the dense matrices are ``ops.ski.ski_tno_ref``'s.

    ``--ski-lowrank mean`` (the default) applies A with f = knots / h_0, h_0 = (n_0 - 1) / (r_0 - 1) the
    spacing of the inducing points at the training length n_0 (``training_length``, which the model
    passes; kept in the ``lowrank_length`` buffer, so a checkpoint keeps it at any evaluation length):
    W^T x sums about h_0 positions per inducing point at n_0, so this makes each one see the mean of
    its segment there, and gives the knots Adam steps 1/h_0 the size in output terms
    (``lowrank_knots``). Since A holds the kernel's values at the inducing points' lags, a fixed 1/h_0
    makes W A W^T the SKI approximation of one kernel f(x(t)) / h_0 at every length; the scale 1/h of
    the input's own length (``lowrank_length`` 0: a TNO built without a training length, and
    checkpoints of version 2) shrinks the low-rank part as the input grows (1/8 of it at 8 n_0), which
    measurably hurt beyond the training length (docs/design.md). Its knots start at zero, so a new
    model starts as its band alone. The operator is still W A W^T with A Toeplitz in the warped lags
    and f(0) = 0. A checkpoint saved before --ski-lowrank existed has no ``version`` entry and loads
    as ``sum``, computing what it computed.
    """

    name = "ski"
    summary = "ski (m-tap conv + SKI low rank; bidirectional only)"
    Settings = SkiSettings
    supports_causal = False
    why_not_causal = "SKI-TNO is bidirectional only (causal masking negates its benefit, the paper's appendix)"
    uses_training_length = True
    # 1: checkpoints before --ski-lowrank (the low rank as 'sum'); 2: the mode is the model config's, 'mean'
    # scaled at each input's length; 3: 'mean' scaled at the training length (lowrank_length)
    VERSION = 3

    def __init__(self, dim: int, causal: bool, settings: Optional[SkiSettings] = None,
                 training_length: Optional[int] = None, **values):
        super().__init__(dim, causal, settings, **values)
        s = self.settings
        self.warp_decay = s.ski_warp_decay
        self.lowrank = s.ski_lowrank
        self.recompute_gate = s.ski_backward == "recompute"
        # N(0, 1), as the SKI authors draw them (measured better than U(+-m^-1/2), for SKI and its band alone:
        # docs/design.md#initialisation)
        self.conv_weight = nn.Parameter(torch.randn(dim, s.ski_taps))
        if self.lowrank == "off":
            self.register_parameter("knots", None)
        else:
            # 'mean' starts at zero, the band alone, and grows the low rank where the gradient asks for it;
            # 'sum' keeps the N(0, 1/r) draw of the checkpoints before --ski-lowrank
            std = s.ski_rank ** -0.5 if self.lowrank == "sum" else 0.0
            self.knots = nn.Parameter(torch.randn(2 * s.ski_rank, dim) * std)
        self.register_buffer("version", torch.tensor(self.VERSION))
        if training_length is not None and not is_int(training_length, 1):
            raise ValueError(f"training_length={training_length!r} is invalid: must be an integer >= 1 (or None)")
        # n_0 of 'mean' (0: each input's own length); a Python copy beside the buffer, read without a host sync
        self.register_buffer("lowrank_length", torch.tensor(training_length or 0))
        self._lowrank_length = training_length or 0

    def lowrank_scale(self, n: int) -> float:
        """The factor between the knots and f at length n: 1 / h_0 for 'mean' (h_0 the inducing points' spacing at
        the training length, or at n where it is not known), 1 for 'sum'."""
        if self.lowrank != "mean":
            return 1.0
        n0 = self._lowrank_length or n
        r_eff = min(self.settings.ski_rank, n0)
        return (r_eff - 1) / (n0 - 1) if r_eff > 1 else 1.0

    def lowrank_knots(self, n: int) -> Optional[torch.Tensor]:
        """The values of f (2r, d) that the low-rank part applies at length n (None: no low-rank part)."""
        if self.knots is None:
            return None
        scale = self.lowrank_scale(n)
        return self.knots * scale if scale != 1.0 else self.knots

    def forward(self, x: torch.Tensor, layout: str = "bnd") -> torch.Tensor:
        n = seq_shape(x, layout)[0]
        # the scale goes to the operator, which folds it into a constant (one product fewer each way)
        return ski_tno(x, self.conv_weight, self.knots, self.warp_decay, layout=layout, scale=self.lowrank_scale(n))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "version"
        if key not in state_dict:  # saved before --ski-lowrank: its knots are f itself
            state_dict[key] = torch.tensor(1)
        if prefix + "lowrank_length" not in state_dict:  # version 1 or 2: 'mean' at each input's length
            state_dict[prefix + "lowrank_length"] = torch.tensor(0)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._lowrank_length = int(state_dict[prefix + "lowrank_length"])
        if int(state_dict[key]) < 2 and self.lowrank != "sum":
            if self.knots is None:
                raise ValueError(f"--ski-lowrank=off cannot load {prefix or 'the'} SKI-TNO of a checkpoint saved before "
                                 "--ski-lowrank existed (it has a low-rank part): use --ski-lowrank sum")
            logger.warning(f"{prefix}: a SKI-TNO saved before --ski-lowrank existed; it computes as it did "
                           f"(--ski-lowrank sum), not {self.lowrank}")
            self.lowrank = "sum"
