"""Normalisation layers."""
import torch
from torch import nn

from ..ops import fast
from ..ops.norm import dtype_eps, simple_rms_norm

NORM_CHOICES = ("simplermsnorm", "layernorm")


class SimpleRMSNorm(nn.Module):
    """x / (||x||_2 * d^-1/2 + eps): RMS normalisation without parameters (eps as x's dtype holds it, at least its
    least positive number: ``dtype_eps`` in ops/norm.py)."""

    def __init__(self, dim: int, eps: float = 1e-8):
        super().__init__()
        self.scale = dim ** -0.5
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one operator with a hand-written backward (ops/norm.py): 9 operations instead of 15. Not under torch.compile,
        # where inductor fuses the plain operations and their backward alike, and where the operator, an
        # autograd.Function that saves tensors, would keep the layers of a stack from sharing one compiled region
        # under torch 2.11 (models/compile.py, ``STACK_REGIONS``)
        if fast.enabled() and not fast.compiling():
            return simple_rms_norm(x, self.eps)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The plain operations, differentiated by autograd."""
        return x / (x.norm(dim=-1, keepdim=True) * self.scale + dtype_eps(self.eps, x.dtype))


def build_norm(norm_type: str, dim: int) -> nn.Module:
    if norm_type == "simplermsnorm":
        return SimpleRMSNorm(dim)
    if norm_type == "layernorm":
        return nn.LayerNorm(dim)
    raise ValueError(f"norm_type={norm_type!r} is not one of {NORM_CHOICES}")
