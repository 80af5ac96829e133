"""Building a stack of TNN layers from a model config (shared by the LM and the MLM)."""
from typing import Optional

from torch import nn

from ..modules import Glu, Gtu, TnnLayer
from ..modules.tno import TnoSettings, tno_class


def build_layers(cfg, dim: int, num_layers: int, causal: bool, tno_settings: TnoSettings,
                 training_length: Optional[int] = None) -> nn.ModuleList:
    """The model's stack of TNN layers, each with a ``cfg.tno_type`` TNO of the checked ``tno_settings``
    (``validate_block_config``'s). ``training_length``: the length the model trains at, for a TNO type that
    ``uses_training_length`` (None: not known)."""
    d1 = cfg.expand_ratio * dim
    glu_dim = cfg.glu_dim or dim
    tno_cls = tno_class(str(cfg.tno_type))
    extra = {"training_length": training_length} if tno_cls.uses_training_length else {}
    layers = []
    for _ in range(num_layers):
        gtu = Gtu(dim, d1, tno_cls(d1, causal, tno_settings, **extra), activation=str(cfg.gtu_activation))
        glu = Glu(dim, glu_dim, activation=str(cfg.glu_activation))
        layers.append(TnnLayer(dim, gtu, glu, norm_type=str(cfg.norm_type),
                               normalize_before=str(cfg.norm_position) == "pre", dropout=cfg.dropout))
    return nn.ModuleList(layers)
