"""Building a stack of TNN layers from a model config (shared by the LM and the MLM)."""
import dataclasses

import torch
from torch import nn

from ..modules import Glu, Gtu, TnnLayer, build_tno
from .config import block_tno_settings

# torch.compile keeps one graph per sequence length the layers see (more precisely, per FFT size:
# the lengths that share one reuse a graph). Training sees one length (--sample-break-mode none)
# or the few the batches are padded to; evaluation one per block length. Past this many graphs per
# layer torch runs the layer eagerly (still correct), instead of the default 8.
COMPILE_RECOMPILE_LIMIT = 64


def build_layers(cfg, dim: int, num_layers: int, causal: bool) -> nn.ModuleList:
    d1 = cfg.expand_ratio * dim
    glu_dim = cfg.glu_dim or dim
    tno_settings = dataclasses.asdict(block_tno_settings(cfg, causal))
    layers = []
    for _ in range(num_layers):
        tno = build_tno(str(cfg.tno_type), d1, causal, **tno_settings)
        gtu = Gtu(dim, d1, tno, activation=str(cfg.gtu_activation))
        glu = Glu(dim, glu_dim, activation=str(cfg.glu_activation))
        layers.append(TnnLayer(dim, gtu, glu, norm_type=str(cfg.norm_type),
                               normalize_before=str(cfg.norm_position) == "pre", dropout=cfg.dropout))
    layers = nn.ModuleList(layers)
    if getattr(cfg, "tnn_compile", False):
        compile_layers(layers)
    return layers


def length_bucket(n: int) -> int:
    """The length a compiled bidirectional stack pads a batch of length ``n`` to: 8 buckets per octave
    (n rounded up to a multiple of 2^(floor(log2(n - 1)) - 3)), so at most 12.5% padding and about 8
    compilations per doubling of the length, where every batch length would otherwise compile anew."""
    if n <= 16:
        return n
    q = 1 << ((n - 1).bit_length() - 4)
    return -(-n // q) * q


def compile_layers(layers: nn.ModuleList) -> None:
    """``torch.compile`` each layer in place (``nn.Module.compile``): the parameters and the
    state_dict keys stay those of the eager model, so checkpoints load in either mode. The layers
    share their code, so one compilation serves all of them."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, COMPILE_RECOMPILE_LIMIT)
    for layer in layers:
        layer.compile()
