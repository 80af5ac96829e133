"""The relative positional encoder (RPE): an MLP from a scalar to d values."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import fast
from ..ops.rpe import ACTIVATIONS as FAST_ACTIVATIONS
from ..ops.rpe import rpe_mlp, rpe_mlp_packed, rpe_params
from ..ops.toeplitz import autocast_off
from .activations import get_activation
from .linear import PackedLinear, PackedWeights  # noqa: F401 (PackedLinear: imported from here too)
from .norm import build_norm


class Rpe(PackedWeights, nn.Module):
    """Linear(in -> h), then ``layers`` x [norm, act, Linear(h -> h)], then [norm, act, Linear(h -> out)].

    ``in_dim`` is 1 for a lag or a frequency.
    """

    def __init__(self, out_dim: int, hidden: int = 64, layers: int = 6, activation: str = "relu",
                 norm_type: str = "simplermsnorm", in_dim: int = 1):
        super().__init__()
        self.activation, self.norm_type = activation, norm_type
        self.act = get_activation(activation)
        # nn.Linear's initialisation, drawn in the order it always was; then the Linears' weights packed
        self.proj = nn.Linear(in_dim, hidden)
        self.norms = nn.ModuleList(build_norm(norm_type, hidden) for _ in range(layers + 1))
        self.linears = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, out_dim)
        self._pack()

    def _pack(self) -> None:
        """The Linears' weights and biases as one parameter, ``packed`` (``PackedWeights``): flattened one after
        another in the order ``rpe_mlp`` takes them (proj, then each hidden Linear, then out; weight before bias), and
        each Linear a ``PackedLinear`` of views into it. One tensor instead of 2 (layers + 2) is what autograd, the
        optimizer and a compiled graph see: for a causal wt103 stack, 7 where there were 112 (RPE 6), which a
        CUDA-graphed update checks, hands to autograd and accumulates one by one (docs/performance.md). The state_dict
        keeps the Linears' names, so checkpoints are the same as without the packing."""
        linears = [("proj", self.proj)] + [(f"linears.{i}", m) for i, m in enumerate(self.linears)] + [("out", self.out)]
        views = self.pack(linears)
        self.proj, self.out = views[0], views[-1]
        self.linears = nn.ModuleList(views[1:-1])

    def _apply(self, fn, recurse=True):
        """A cast of the model to a 16-bit float (fairseq's ``model.half()`` under ``--fp16``, ``.to(torch.bfloat16)``)
        leaves the RPE's weights in fp32; device moves and other casts apply as usual. The MLP computes in fp32
        anyway (below); kept in fp16, its weights were rounded to fp16 and, worse, their gradients stored in fp16:
        the RPE's weights gather gradient from every lag (or frequency), channel and sequence of the batch, and
        its input projection's multiplies the raw lag (up to +-2047 at 2048 tokens), so they are the model's
        largest, and overflowed fp16 where no other gradient did (eager masked TNN: fairseq's loss scale fell from
        128 to 1/32; docs/performance.md). fairseq's FP16Optimizer keeps a flat fp32 master copy of every
        parameter whatever its dtype, so fp32 parameters train beside fp16 ones."""
        half = (torch.float16, torch.bfloat16)

        def keep_fp32(t):
            out = fn(t)
            if out.dtype in half and t.is_floating_point() and t.dtype not in half:
                return t.to(device=out.device, dtype=torch.float32)
            return out
        return super()._apply(keep_fp32, recurse)

    def features(self, t: torch.Tensor) -> torch.Tensor:
        """t: (m,) -> (m, hidden), the input of the last Linear, in fp32 (fp64 for fp64 weights)."""
        with autocast_off(t.device.type):
            h = self._linear(t.unsqueeze(-1), self.proj)  # (m, hidden)
            for norm, linear in zip(self.norms, self.linears):
                h = self._linear(self.act(self._norm(norm, h)), linear)
            return self.act(self._norm(self.norms[-1], h))

    # The whole MLP runs in at least fp32, outside autocast and whatever the weights' dtype (--fp16
    # halves them): its input is an integer lag or a frequency, and a linear function of lag t has
    # to resolve t from t + 1. bf16 (8-bit significand) cannot from t = 256 on, fp16 (11 bits) from
    # 2048: the model would give distinct lags the same kernel value. The MLP is tiny (m x hidden).
    # The helpers below run inside the caller's autocast-free region.
    def _dtype(self) -> torch.dtype:
        return torch.promote_types(self.packed.dtype, torch.float32)

    def _linear(self, h: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        dt = self._dtype()
        return F.linear(h.to(dt), linear.weight.to(dt), linear.bias.to(dt))

    @staticmethod
    def _norm(norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if isinstance(norm, nn.LayerNorm):
            dt = h.dtype
            return F.layer_norm(h, norm.normalized_shape, norm.weight.to(dt), norm.bias.to(dt), norm.eps)
        return norm(h)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t: (m,) positions or frequencies -> (m, out_dim), fp32 (see ``_dtype``)."""
        h = self.features(t)
        with autocast_off(t.device.type):
            return self._linear(h, self.out)

    def channel_major(self, t: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(out_dim, m): ``forward(t).t()``, times ``scale`` (m,) per position if given.

        The fast path (``ops/rpe.py``): the whole MLP as one operator with a hand-written backward, which
        dispatches about half the operations autograd does; ``channel_major_ref`` is its reference, taken
        within ``fairseq_tnn.ops.fast.references()``."""
        if not fast.enabled() or self.activation not in FAST_ACTIVATIONS:
            return self.channel_major_ref(t, scale)
        eps, dt = self.norms[0].eps, self._dtype()
        with autocast_off(t.device.type):
            if self.norm_type == "layernorm":  # the norms' weights beside the packed ones
                return rpe_mlp(t, scale, rpe_params(self), self.activation, self.norm_type, eps, len(self.linears), dt)
            return rpe_mlp_packed(t, scale, self.packed.unsqueeze(0), self._shapes, self.activation, self.norm_type,
                                  eps, len(self.linears), dt).squeeze(0)

    def _shape(self) -> tuple:
        """What two RPEs must share to be evaluated as one batched MLP: every setting and weight's shape, the
        dtype they compute in, the device."""
        return (self.activation, self.norm_type, self.norms[0].eps, self._dtype(), self.packed.device, self._shapes)

    @staticmethod
    def stackable(rpes) -> bool:
        """Whether ``stacked_channel_major`` evaluates these RPEs together: one shape (``_shape``), an activation
        of the fast path, RMS norms (a LayerNorm's fused kernel takes one weight), and not the references."""
        first = rpes[0]
        if not fast.enabled() or first.activation not in FAST_ACTIVATIONS or first.norm_type == "layernorm":
            return False
        shape = first._shape()
        return all(r._shape() == shape for r in rpes[1:])

    @staticmethod
    def stacked_channel_major(rpes, t: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(L, out_dim, m): ``channel_major(t, scale)`` of each of the L ``rpes`` (``stackable``), as one batched
        MLP (``ops.rpe.rpe_mlp_packed``): their packed weights stacked (one operation; its backward hands each RPE its
        row of the gradient as a view), then the operations of one RPE."""
        first = rpes[0]
        eps, dt = first.norms[0].eps, first._dtype()
        with autocast_off(t.device.type):
            return rpe_mlp_packed(t, scale, torch.stack([r.packed for r in rpes]), first._shapes, first.activation,
                                  first.norm_type, eps, len(first.linears), dt)

    def channel_major_ref(self, t: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``channel_major`` by the plain operations, differentiated by autograd.

        One GEMM produces the kernel channel-major, as the last-dim FFTs want it,
        with the bias and the per-position scale (TNN's decay, zeros on padding
        slots) folded in: [W, b] @ [h * s, s]^T, so no pass over the (out, m)
        kernel is spent on transposing, adding the bias or scaling.
        """
        h = self.features(t)  # (m, hidden), fp32
        w, b = self.out.weight.to(h.dtype), self.out.bias.to(h.dtype)
        # (hidden, m) operands are made contiguous (small copies): with a transposed view, torch's
        # backward computes the (out, m)-sized gradient product transposed and copies it
        with autocast_off(h.device.type):
            if scale is None:
                return torch.addmm(b.unsqueeze(1), w, h.t().contiguous())  # (out, m)
            s = scale.to(h.dtype).unsqueeze(1)  # (m, 1)
            return torch.cat([w, b.unsqueeze(1)], dim=1) @ torch.cat([h * s, s], dim=1).t().contiguous()  # (out, m)
