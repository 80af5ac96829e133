"""GTU, GLU and the TNN layer."""
from typing import Optional

import torch
from torch import nn

from ..ops.toeplitz import causal_toeplitz_tail
from .activations import get_activation
from .norm import build_norm


class Gtu(nn.Module):
    """Gated Toeplitz unit: out = W_o(act(W_u x) * TNO(act(W_v x))), width d1 = expand_ratio * d.

    Channel-major throughout (the layout every TNO computes in): u and v are produced as
    (d1, batch * n) by one GEMM with the transposed input, [W_u; W_v] x^T, the TNO works on
    contiguous rows, and the output projection consumes the gated product through a transposed
    operand: no activation is ever transposed (copied). u and v get separate activation outputs so
    that v's buffer is freed once the TNO has consumed it.
    """

    def __init__(self, dim: int, d1: int, tno: nn.Module, activation: str = "silu"):
        super().__init__()
        self.d1 = d1
        self.act = get_activation(activation)
        self.uv_proj = nn.Linear(dim, 2 * d1)  # W_u and W_v in one GEMM
        self.tno = tno
        self.out_proj = nn.Linear(d1, dim)

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, n, d = x.shape
        d1 = self.d1
        x2 = x.reshape(b * n, d)
        uv = torch.addmm(self.uv_proj.bias.unsqueeze(1), self.uv_proj.weight, x2.t())  # (2 d1, b n)
        u = self.act(uv[:d1]).view(d1, b, n)
        v = self.act(uv[d1:]).view(d1, b, n)
        if pad_mask is not None:
            # padded positions must not leak into real ones through the token mixing
            v = v.masked_fill(pad_mask.unsqueeze(0), 0.0)
        z = u * self.tno(v, layout="dbn")  # (d1, b, n)
        out = torch.addmm(self.out_proj.bias, z.view(d1, b * n).t(), self.out_proj.weight.t())  # (b n, d)
        return out.view(b, n, d)

    def forward_cached(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor], v_cache: torch.Tensor,
                       kernel: torch.Tensor, start: int) -> torch.Tensor:
        """Incremental decoding (causal TNO): the outputs of positions start .. start + c - 1.

        x (b, c, d): the new positions' inputs; pad_mask (b, c) or None; v_cache (d1, b, capacity):
        the TNO inputs v of positions 0 .. start - 1, to which the new ones are written; kernel
        (d1, L >= start + c): the TNO's causal time kernel, reversed (lag t at index L - 1 - t).
        u, v and the output projection are per-token; the token mixing is sum_{s <= t} k[t - s] v_s
        over the cache.
        """
        b, c, _ = x.shape
        u, v = self.act(self.uv_proj(x)).chunk(2, dim=-1)  # (b, c, d1)
        if pad_mask is not None:
            v = v.masked_fill(pad_mask.unsqueeze(-1), 0.0)  # as in forward: padding never mixes in
        end = start + c
        v_cache[:, :, start:end] = v.permute(2, 0, 1)
        y = causal_toeplitz_tail(v_cache[:, :, :end], kernel, start, reversed_kernel=True)  # (d1, b, c)
        return self.out_proj(u * y.permute(1, 2, 0).to(u.dtype))


class Glu(nn.Module):
    """Gated linear unit: W_3(act(W_1 x) * W_2 x)."""

    def __init__(self, dim: int, hidden: int, activation: str = "silu"):
        super().__init__()
        self.act = get_activation(activation)
        self.in_proj = nn.Linear(dim, 2 * hidden)  # W_1 and W_2 in one GEMM
        self.out_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.in_proj(x).chunk(2, dim=-1)
        return self.out_proj(self.act(a) * b)


class TnnLayer(nn.Module):
    """x = x + GTU(norm(x)); x = x + GLU(norm(x))  (pre-norm), or the post-norm variant
    x = norm(x + GTU(x)); x = norm(x + GLU(x)). Dropout on each residual branch."""

    def __init__(self, dim: int, gtu: Gtu, glu: Glu, norm_type: str = "simplermsnorm",
                 normalize_before: bool = True, dropout: float = 0.0):
        super().__init__()
        self.gtu, self.glu = gtu, glu
        self.token_norm = build_norm(norm_type, dim)
        self.channel_norm = build_norm(norm_type, dim)
        self.normalize_before = normalize_before
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.normalize_before:
            x = x + self.dropout(self.gtu(self.token_norm(x), pad_mask))
            return x + self.dropout(self.glu(self.channel_norm(x)))
        x = self.token_norm(x + self.dropout(self.gtu(x, pad_mask)))
        return self.channel_norm(x + self.dropout(self.glu(x)))

    def forward_cached(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor], v_cache: torch.Tensor,
                       kernel: torch.Tensor, start: int) -> torch.Tensor:
        """``forward`` for the new positions of incremental decoding (see ``Gtu.forward_cached``)."""
        if self.normalize_before:
            x = x + self.dropout(self.gtu.forward_cached(self.token_norm(x), pad_mask, v_cache, kernel, start))
            return x + self.dropout(self.glu(self.channel_norm(x)))
        x = self.token_norm(x + self.dropout(self.gtu.forward_cached(x, pad_mask, v_cache, kernel, start)))
        return self.channel_norm(x + self.dropout(self.glu(x)))
