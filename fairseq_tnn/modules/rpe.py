"""The relative positional encoder (RPE): an MLP from a scalar to d values."""
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

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t: (m,) positions or frequencies -> (m, out_dim)."""
        w = self.proj.weight
        # The first projection runs in at least fp32: integer lags above 2048 are not
        # representable in fp16, so a half-precision model would merge distinct lags.
        dtype = torch.promote_types(w.dtype, torch.float32)
        h = F.linear(t.to(dtype).unsqueeze(-1), w.to(dtype), self.proj.bias.to(dtype)).to(w.dtype)  # (m, hidden)
        for norm, linear in zip(self.norms, self.linears):
            h = linear(self.act(norm(h)))
        return self.out(self.act(self.norms[-1](h)))
