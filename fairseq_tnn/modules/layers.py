"""GTU, GLU and the TNN layer, and the layer's cache for incremental decoding."""
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Tuple

import torch
import torch.utils.checkpoint
from torch import nn

from ..ops.logits import vocab_linear
from ..ops.toeplitz import causal_toeplitz_tail, direct_product
from .activations import get_activation
from .linear import FusedLinear
from .norm import build_norm
from .tno.base import SpectralTno


@dataclass
class GtuCache:
    """What a causal GTU keeps while decoding incrementally: ``kernel`` (d1, capacity), its TNO's causal
    time kernel reversed (lag t at index capacity - 1 - t, so that a step reads its lags contiguously),
    and ``v`` (d1, batch, capacity), the TNO inputs of the positions decoded so far."""

    kernel: torch.Tensor
    v: torch.Tensor

    @property
    def batch(self) -> int:
        return self.v.shape[1]

    @property
    def capacity(self) -> int:
        return self.v.shape[2]

    def reordered(self, new_order: torch.Tensor, used: int) -> "GtuCache":
        """Beam search: the rows ``new_order`` of the first ``used`` positions (the spare capacity is not copied)."""
        v = self.v.new_zeros(self.v.shape[0], new_order.numel(), self.capacity)
        v[:, :, :used] = self.v[:, :, :used].index_select(1, new_order)
        return GtuCache(self.kernel, v)


class Gtu(nn.Module):
    """Gated Toeplitz unit: out = W_o(act(W_u x) * TNO(act(W_v x))), width d1 = expand_ratio * d.

    Channel-major throughout (the layout every TNO computes in): u and v are produced as
    (d1, batch * n) by one GEMM with the transposed input, [W_u; W_v] x^T, the TNO works on
    contiguous rows, and the output projection consumes the gated product through a transposed
    operand: no activation is ever transposed (copied). u and v get separate activation outputs so
    that v's buffer is freed once the TNO has consumed it. ``forward`` and the incremental ``step``
    share the projections, the activation and the masking; they differ in the token mixing only.
    """

    def __init__(self, dim: int, d1: int, tno: nn.Module, activation: str = "silu"):
        super().__init__()
        self.d1 = d1
        self.act = get_activation(activation)
        self.uv_proj = FusedLinear(dim, 2 * d1)  # W_u and W_v in one GEMM
        self.tno = tno
        self.out_proj = FusedLinear(d1, dim)

    def _projection(self, x: torch.Tensor) -> torch.Tensor:
        """[W_u; W_v] x^T (2 d1, b n) of x (b, n, d): the gate's input, before the activation."""
        b, n, d = x.shape
        weight, bias = self.uv_proj.parts()
        return torch.addmm(bias.unsqueeze(1), weight, x.reshape(b * n, d).t())

    def _activations(self, uv: torch.Tensor, b: int, n: int,
                     pad_mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """u and v (d1, b, n) of the projection uv (2 d1, b n); v is zero at the padded positions of pad_mask (b, n)."""
        d1 = self.d1
        u = self.act(uv[:d1]).view(d1, b, n)
        v = self.act(uv[d1:]).view(d1, b, n)
        if pad_mask is not None:
            # padded positions must not leak into real ones through the token mixing
            v = v.masked_fill(pad_mask.unsqueeze(0), 0.0)
        return u, v

    def _gate_inputs(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """u and v (d1, b, n) of x (b, n, d) (``_activations`` of ``_projection``)."""
        return self._activations(self._projection(x), x.shape[0], x.shape[1], pad_mask)

    def _gate(self, uv: torch.Tensor, b: int, n: int, pad_mask: Optional[torch.Tensor], extra: dict) -> torch.Tensor:
        """The gated product u * TNO(v) (d1, b, n) of the projection uv (2 d1, b n); ``extra``: the TNO's keywords."""
        u, v = self._activations(uv, b, n, pad_mask)
        return u * self.tno(v, layout="dbn", **extra)

    def _output(self, z: torch.Tensor) -> torch.Tensor:
        """W_o z for the gated product z (d1, b, n): (b, n, d)."""
        d1, b, n = z.shape
        weight, bias = self.out_proj.parts()
        out = torch.addmm(bias, z.reshape(d1, b * n).t(), weight.t())  # (b n, d)
        return out.view(b, n, -1)

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None,
                kernel_length: Optional[int] = None, spectrum: Optional[Tuple[torch.Tensor, int]] = None) -> torch.Tensor:
        """``kernel_length``: a causal model's planned generation length, handed to a TNO whose kernel depends on
        the length (``kernel_depends_on_length``), which then applies the kernel of max(n, kernel_length)
        positions; the other TNOs are called without it. ``spectrum``: the TNO's spectrum for this forward,
        computed with the other layers' (``layer_spectra``), handed to the TNO; None: the TNO computes it.

        Where the TNO asks for it (``Tno.recompute_gate``: SKI's ``--ski-backward recompute``) and autograd records,
        the gated product runs under ``torch.utils.checkpoint``: the backward keeps the projection uv alone, of
        what the gate computes from it (u, v, the TNO's output and what the TNO keeps for its own backward), and
        computes them again from uv when it gets there. The TNO is deterministic, so no random state is kept; under
        torch.compile the checkpoint is traced, and the compiled backward recomputes the same operations."""
        b, n = x.shape[0], x.shape[1]
        uv = self._projection(x)
        extra = {"kernel_length": kernel_length} if kernel_length and self.tno.kernel_depends_on_length else {}
        if spectrum is not None:
            extra["spectrum"] = spectrum
        if self.tno.recompute_gate and torch.is_grad_enabled():
            z = torch.utils.checkpoint.checkpoint(self._gate, uv, b, n, pad_mask, extra, use_reentrant=False,
                                                  preserve_rng_state=False)
        else:
            z = self._gate(uv, b, n, pad_mask, extra)
        return self._output(z)

    def init_cache(self, batch: int, capacity: int, device=None) -> GtuCache:
        """An empty cache for decoding up to ``capacity`` positions of ``batch`` sequences (causal TNO)."""
        if not self.tno.supports_incremental:
            raise ValueError(f"--tno-type {self.tno.name} cannot decode incrementally (supports_incremental is False "
                             "in its class): decode with the full forward")
        kernel = self.tno.decoding_kernel(capacity, device)  # (d1, capacity), once per generation
        return GtuCache(kernel.flip(-1).contiguous(), kernel.new_zeros(self.d1, batch, capacity))

    def grow_cache(self, cache: GtuCache, capacity: int, used: int) -> Optional[GtuCache]:
        """``cache`` with room for ``capacity`` positions, its first ``used`` kept; None where the TNO's kernel
        depends on the length (FD): the cached inputs were mixed with the old kernel, decoding starts again."""
        if self.tno.kernel_depends_on_length:
            return None
        grown = self.init_cache(cache.batch, capacity, cache.v.device)
        grown.v[:, :, :used] = cache.v[:, :, :used]
        return grown

    def step(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor], cache: GtuCache, start: int) -> torch.Tensor:
        """Incremental decoding: the outputs of positions start .. start + c - 1 of x (b, c, d), whose TNO
        inputs v are written to the cache after those of positions 0 .. start - 1; the token mixing is
        sum_{s <= t} k[t - s] v_s over the cache."""
        u, v = self._gate_inputs(x, pad_mask)
        end = start + x.shape[1]
        cache.v[:, :, start:end] = v
        y = causal_toeplitz_tail(cache.v[:, :, :end], cache.kernel, start, reversed_kernel=True)  # (d1, b, c)
        return self._output(u * y.to(u.dtype))


class Glu(nn.Module):
    """Gated linear unit: W_3(act(W_1 x) * W_2 x)."""

    def __init__(self, dim: int, hidden: int, activation: str = "silu"):
        super().__init__()
        self.act = get_activation(activation)
        self.in_proj = FusedLinear(dim, 2 * hidden)  # W_1 and W_2 in one GEMM
        self.out_proj = FusedLinear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.in_proj(x).chunk(2, dim=-1)
        return self.out_proj(self.act(a) * b)


class TnnLayer(nn.Module):
    """x = x + GTU(norm(x)); x = x + GLU(norm(x))  (pre-norm), or the post-norm variant
    x = norm(x + GTU(x)); x = norm(x + GLU(x)). Dropout on each residual branch.

    The layer is the interface of incremental decoding (a causal model's decoder talks to its layers
    only): ``supports_incremental``, ``init_cache`` / ``grow_cache`` and ``step``, and the ``kernel_length`` of
    ``forward`` (a planned generation's length, see ``Gtu.forward``); the TNO says what decoding needs
    (``Tno.decoding_kernel``, ``kernel_depends_on_length``)."""

    def __init__(self, dim: int, gtu: Gtu, glu: Glu, norm_type: str = "simplermsnorm",
                 normalize_before: bool = True, dropout: float = 0.0):
        super().__init__()
        self.gtu, self.glu = gtu, glu
        self.token_norm = build_norm(norm_type, dim)
        self.channel_norm = build_norm(norm_type, dim)
        self.normalize_before = normalize_before
        self.dropout = nn.Dropout(dropout)

    def _residual(self, x: torch.Tensor, token_mixer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The two residual blocks around ``token_mixer`` (the GTU's forward or step) and the GLU."""
        if self.normalize_before:
            x = x + self.dropout(token_mixer(self.token_norm(x)))
            return x + self.dropout(self.glu(self.channel_norm(x)))
        x = self.token_norm(x + self.dropout(token_mixer(x)))
        return self.channel_norm(x + self.dropout(self.glu(x)))

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None,
                kernel_length: Optional[int] = None, spectrum: Optional[Tuple[torch.Tensor, int]] = None) -> torch.Tensor:
        """``spectrum``: see ``Gtu.forward`` (``layer_spectra`` computes it for a stack of layers)."""
        return self._residual(x, lambda h: self.gtu(h, pad_mask, kernel_length, spectrum))

    @property
    def supports_incremental(self) -> bool:
        """Whether ``step`` works: the TNO gives a causal time kernel (``Tno.supports_incremental``)."""
        return self.gtu.tno.supports_incremental

    def init_cache(self, batch: int, capacity: int, device=None) -> GtuCache:
        return self.gtu.init_cache(batch, capacity, device)

    def grow_cache(self, cache: GtuCache, capacity: int, used: int) -> Optional[GtuCache]:
        return self.gtu.grow_cache(cache, capacity, used)

    def step(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor], cache: GtuCache, start: int) -> torch.Tensor:
        """``forward`` of the new positions start .. start + c - 1 of incremental decoding (see ``Gtu.step``)."""
        return self._residual(x, lambda h: self.gtu.step(h, pad_mask, cache, start))


def layer_spectra(layers, n: int, kernel_length: Optional[int] = None, device=None,
                  dtype: torch.dtype = torch.float32) -> Iterable:
    """For a forward of n positions through ``layers`` (a model's stack), on a ``dtype`` residual stream on ``device``,
    each layer's ``spectrum`` argument, in order (``SpectralTno.mixing_kernel``: the kernels in time, TNN's and causal
    FD-TNN's, where their products of n positions run by direct summation, ``toeplitz.direct_product``; the spectra
    otherwise): the spectra of their TNOs computed together where they train (autograd on) and are alike
    (``SpectralTno.stacked_spectra``: the RPEs as one batched MLP, the operations of one layer's spectrum instead of one
    per layer); otherwise each layer's own, computed when the loop reaches its layer (without autograd, in evaluation
    and generation, each spectrum is then freed once its layer is done, where all of them at once would hold L of them,
    1.2 GB for a causal wt103 model at 14,336 tokens; with autograd every layer keeps its spectrum for the backward
    anyway); None for a TNO that is not spectral (SKI), which computes its own mixing.

    The models hand these to eager layers, and to compiled ones on a GPU, whose graphs then hold the FFT convolution
    and not the RPE, the FFT of its output or FD's Hilbert transform, launched once per layer (and compiled into each
    of its graphs) instead of once per stack (``stack_spectra`` in ``fairseq_tnn/models/compile.py``)."""
    tnos = [layer.gtu.tno for layer in layers]
    if not tnos or not isinstance(tnos[0], SpectralTno):
        return [None] * len(layers)
    direct = direct_product(n, dtype, device)
    if torch.is_grad_enabled():
        stacked = SpectralTno.stacked_spectra(tnos, tnos[0].spectrum_length(n, kernel_length), device, direct)
        if stacked is not None:
            return stacked
    return (tno.mixing_kernel(tno.spectrum_length(n, kernel_length), direct, device)
            if isinstance(tno, SpectralTno) else None for tno in tnos)


class MaskedLMHead(nn.Module):
    """The masked model's output head: dense -> gelu -> LayerNorm -> the projection tied to the input embeddings
    (``weight``), plus a bias. (fairseq_tnn.models.tnn_mlm and fairseq_tnn.pretrained both use it.)"""

    def __init__(self, dim: int, weight: nn.Parameter):
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.weight = weight
        self.bias = nn.Parameter(torch.zeros(weight.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the projection's GEMMs aligned on a GPU (ops/logits.py: the masked dictionary's 50,265 symbols are odd)
        return vocab_linear(self.norm(nn.functional.gelu(self.dense(x))), self.weight) + self.bias
