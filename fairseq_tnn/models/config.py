"""Dataclass configs shared by the TNN models, and their validation.

Every TNN hyperparameter is a declared field with help text, so fairseq copies
it into ``cfg.model``, shows it in ``--help`` and lets the command line and
``--model-overrides`` win over the arch presets.
"""
from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from ..modules.activations import ACTIVATIONS
from ..modules.norm import NORM_CHOICES
from ..modules.tno import TNO_BUILDERS

ACTIVATION_CHOICES = ChoiceEnum(sorted(ACTIVATIONS))
NORM_TYPE_CHOICES = ChoiceEnum(list(NORM_CHOICES))
NORM_POSITION_CHOICES = ChoiceEnum(["pre", "post"])
TNO_TYPE_CHOICES = ChoiceEnum(sorted(TNO_BUILDERS))


@dataclass
class TnnBlockConfig(FairseqDataclass):
    """Hyperparameters of the TNN layer (GTU + GLU) and of its TNO."""

    dropout: float = field(default=0.1, metadata={"help": "dropout on the embeddings and on each residual branch"})
    norm_type: NORM_TYPE_CHOICES = field(
        default="simplermsnorm", metadata={"help": "normalisation in each layer: simplermsnorm (no parameters) or layernorm"})
    norm_position: NORM_POSITION_CHOICES = field(
        default="pre", metadata={"help": "pre-norm (x + f(norm(x))) or post-norm (norm(x + f(x))) residual blocks"})
    expand_ratio: int = field(default=3, metadata={"help": "GTU width d1 = expand_ratio * embedding dim"})
    gtu_activation: ACTIVATION_CHOICES = field(default="silu", metadata={"help": "activation of the GTU's u and v branches"})
    glu_dim: Optional[int] = field(default=None, metadata={"help": "GLU hidden width (default: the embedding dim)"})
    glu_activation: ACTIVATION_CHOICES = field(default="silu", metadata={"help": "activation of the GLU's gate"})
    tno_type: TNO_TYPE_CHOICES = field(default="tnn", metadata={"help": "Toeplitz neural operator: tnn (Qin et al.)"})
    rpe_dim: int = field(default=64, metadata={"help": "width of the RPE MLP"})
    rpe_layers: int = field(default=6, metadata={"help": "number of hidden [norm, act, linear] blocks of the RPE MLP"})
    rpe_activation: ACTIVATION_CHOICES = field(default="relu", metadata={"help": "activation inside the RPE MLP"})
    rpe_norm_type: NORM_TYPE_CHOICES = field(default="simplermsnorm", metadata={"help": "normalisation inside the RPE MLP"})
    decay: float = field(
        default=0.99, metadata={"help": "TNN decay bias lambda in (0, 1]: T_ij = lambda^|i-j| RPE(i-j); fixed, not trained; 1 = no decay"})


def _require(ok: bool, option: str, value, allowed: str):
    if not ok:
        raise ValueError(f"--{option.replace('_', '-')}={value!r} is invalid: {allowed}")


def validate_block_config(cfg, embed_dim_field: str, layers_field: str):
    """Refuse nonsensical hyperparameters with an error naming the option, before any work."""
    for name in (embed_dim_field, layers_field, "expand_ratio", "rpe_dim", "rpe_layers"):
        value = getattr(cfg, name)
        minimum = 0 if name == "rpe_layers" else 1
        _require(isinstance(value, int) and value >= minimum, name, value, f"must be an integer >= {minimum}")
    glu_dim = getattr(cfg, "glu_dim", None)
    _require(glu_dim is None or glu_dim >= 1, "glu_dim", glu_dim, "must be an integer >= 1 (or unset for the embedding dim)")
    _require(0.0 <= cfg.dropout < 1.0, "dropout", cfg.dropout, "must be in [0, 1)")
    _require(0.0 < cfg.decay <= 1.0, "decay", cfg.decay, "lambda must be in (0, 1]")
    for name in ("gtu_activation", "glu_activation", "rpe_activation"):
        value = str(getattr(cfg, name))
        _require(value in ACTIVATIONS, name, value, f"must be one of {sorted(ACTIVATIONS)}")
    for name in ("norm_type", "rpe_norm_type"):
        value = str(getattr(cfg, name))
        _require(value in NORM_CHOICES, name, value, f"must be one of {list(NORM_CHOICES)}")
    _require(str(cfg.norm_position) in ("pre", "post"), "norm_position", cfg.norm_position, "must be 'pre' or 'post'")
    _require(str(cfg.tno_type) in TNO_BUILDERS, "tno_type", cfg.tno_type, f"must be one of {sorted(TNO_BUILDERS)}")


def set_defaults(args, **defaults):
    """Arch presets: fill in every value the user did not give (command line wins)."""
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
