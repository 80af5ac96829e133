"""The relative positional encoder (RPE): an MLP from a scalar to d values."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .activations import get_activation
from .norm import build_norm


class Rpe(nn.Module):
    """Linear(in -> h), then ``layers`` x [norm, act, Linear(h -> h)], then [norm, act, Linear(h -> out)].

    ``in_dim`` is 1 for a lag or a frequency.
    """

    def __init__(self, out_dim: int, hidden: int = 64, layers: int = 6, activation: str = "relu",
                 norm_type: str = "simplermsnorm", in_dim: int = 1):
        super().__init__()
        self.act = get_activation(activation)
        self.proj = nn.Linear(in_dim, hidden)
        self.norms = nn.ModuleList(build_norm(norm_type, hidden) for _ in range(layers + 1))
        self.linears = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, out_dim)

    def features(self, t: torch.Tensor) -> torch.Tensor:
        """t: (m,) -> (m, hidden), the input of the last Linear."""
        w = self.proj.weight
        # The first projection runs in at least fp32: integer lags above 2048 are not
        # representable in fp16, so a half-precision model would merge distinct lags.
        dtype = torch.promote_types(w.dtype, torch.float32)
        h = F.linear(t.to(dtype).unsqueeze(-1), w.to(dtype), self.proj.bias.to(dtype)).to(w.dtype)  # (m, hidden)
        for norm, linear in zip(self.norms, self.linears):
            h = linear(self.act(norm(h)))
        return self.act(self.norms[-1](h))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t: (m,) positions or frequencies -> (m, out_dim)."""
        return self.out(self.features(t))

    def channel_major(self, t: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(out_dim, m): ``forward(t).t()``, times ``scale`` (m,) per position if given.

        One GEMM produces the kernel channel-major, as the last-dim FFTs want it,
        with the bias and the per-position scale (TNN's decay, zeros on padding
        slots) folded in: [W, b] @ [h * s, s]^T, so no pass over the (out, m)
        kernel is spent on transposing, adding the bias or scaling.
        """
        h = self.features(t)  # (m, hidden)
        w, b = self.out.weight, self.out.bias
        # (hidden, m) operands are made contiguous (small copies): with a transposed view, torch's
        # backward computes the (out, m)-sized gradient product transposed and copies it
        if scale is None:
            return torch.addmm(b.unsqueeze(1), w, h.t().contiguous())  # (out, m)
        s = scale.to(h.dtype).unsqueeze(1)  # (m, 1)
        return torch.cat([w, b.unsqueeze(1)], dim=1) @ torch.cat([h * s, s], dim=1).t().contiguous()  # (out, m)
