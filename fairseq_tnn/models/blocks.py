"""Building a stack of TNN layers from a model config (shared by the LM and the MLM)."""
from torch import nn

from ..modules import Glu, Gtu, TnnLayer, build_tno


def build_layers(cfg, dim: int, num_layers: int, causal: bool) -> nn.ModuleList:
    d1 = cfg.expand_ratio * dim
    glu_dim = cfg.glu_dim or dim
    layers = []
    for _ in range(num_layers):
        tno = build_tno(str(cfg.tno_type), d1, causal, cfg)
        gtu = Gtu(dim, d1, tno, activation=str(cfg.gtu_activation))
        glu = Glu(dim, glu_dim, activation=str(cfg.glu_activation))
        layers.append(TnnLayer(dim, gtu, glu, norm_type=str(cfg.norm_type),
                               normalize_before=str(cfg.norm_position) == "pre", dropout=cfg.dropout))
    return nn.ModuleList(layers)
