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
from ..modules.tno import TNO_FIELDS, TYPE_SPECIFIC_FIELDS, tno_settings

ACTIVATION_CHOICES = ChoiceEnum(sorted(ACTIVATIONS))
NORM_TYPE_CHOICES = ChoiceEnum(list(NORM_CHOICES))
NORM_POSITION_CHOICES = ChoiceEnum(["pre", "post"])
TNO_TYPE_CHOICES = ChoiceEnum(sorted(TNO_FIELDS))


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
    tno_type: TNO_TYPE_CHOICES = field(
        default="tnn", metadata={"help": "Toeplitz neural operator: tnn (Qin et al.: RPE MLP of the lag x decay), "
                                         "fd (RPE MLP of the frequency; causal via the Hilbert transform), "
                                         "ski (m-tap conv + SKI low rank; bidirectional only)"})
    # The fields below apply to some TNO types only; unset (None) means the type's default
    # (fairseq_tnn.modules.tno.TNO_FIELDS), and setting one the chosen type does not use is an error.
    rpe_dim: Optional[int] = field(default=None, metadata={"help": "[tnn, fd] width of the RPE MLP (default 64)"})
    rpe_layers: Optional[int] = field(
        default=None, metadata={"help": "[tnn, fd] hidden [norm, act, linear] blocks of the RPE MLP (default 6 tnn, 3 fd)"})
    rpe_activation: Optional[ACTIVATION_CHOICES] = field(
        default=None, metadata={"help": "[tnn, fd] activation inside the RPE MLP (default relu; for fd, relu/silu/gelu "
                                        "give square-summable/super-polynomial/super-exponential decay, paper section 4.2)"})
    rpe_norm_type: Optional[NORM_TYPE_CHOICES] = field(
        default=None, metadata={"help": "[tnn, fd] normalisation inside the RPE MLP (default simplermsnorm)"})
    decay: Optional[float] = field(
        default=None, metadata={"help": "[tnn, ski] lambda (default 0.99). tnn: decay bias lambda^|i-j| in (0, 1], "
                                        "fixed, not trained, 1 = none; ski: inverse time warp sign(t) lambda^|t|, in (0, 1)"})
    ski_rank: Optional[int] = field(default=None, metadata={"help": "[ski] r, number of inducing points, >= 2 (default 32)"})
    ski_taps: Optional[int] = field(default=None, metadata={"help": "[ski] m, taps of the sparse depthwise conv, odd (default 17)"})
    tnn_compile: bool = field(
        default=False, metadata={"help": "compile each TNN layer with torch.compile (fewer, fused kernels; on by default in "
                                         "the GPU recipe of scripts/train.sh). Per layer: checkpoints keep their keys and "
                                         "load with or without it; each new sequence length (FFT size) compiles once"})


def _require(ok: bool, option: str, value, allowed: str):
    if not ok:
        raise ValueError(f"--{option.replace('_', '-')}={value!r} is invalid: {allowed}")


def validate_block_config(cfg, embed_dim_field: str, layers_field: str, causal: bool):
    """Refuse nonsensical hyperparameters with an error naming the option, before any work."""
    for name in (embed_dim_field, layers_field, "expand_ratio"):
        value = getattr(cfg, name)
        _require(isinstance(value, int) and value >= 1, name, value, "must be an integer >= 1")
    glu_dim = getattr(cfg, "glu_dim", None)
    _require(glu_dim is None or glu_dim >= 1, "glu_dim", glu_dim, "must be an integer >= 1 (or unset for the embedding dim)")
    _require(0.0 <= cfg.dropout < 1.0, "dropout", cfg.dropout, "must be in [0, 1)")
    for name in ("gtu_activation", "glu_activation"):
        value = str(getattr(cfg, name))
        _require(value in ACTIVATIONS, name, value, f"must be one of {sorted(ACTIVATIONS)}")
    _require(str(cfg.norm_type) in NORM_CHOICES, "norm_type", cfg.norm_type, f"must be one of {list(NORM_CHOICES)}")
    _require(str(cfg.norm_position) in ("pre", "post"), "norm_position", cfg.norm_position, "must be 'pre' or 'post'")
    tno_type = str(cfg.tno_type)
    _require(tno_type in TNO_FIELDS, "tno_type", tno_type, f"must be one of {sorted(TNO_FIELDS)}")
    for name in TYPE_SPECIFIC_FIELDS:
        value = getattr(cfg, name, None)
        users = [t for t, fields in TNO_FIELDS.items() if name in fields]
        _require(value is None or name in TNO_FIELDS[tno_type], name, value,
                 f"it applies to --tno-type {' or '.join(users)} only, not {tno_type}")
    s = tno_settings(tno_type, cfg)
    if "rpe_dim" in s:
        _require(isinstance(s["rpe_dim"], int) and s["rpe_dim"] >= 1, "rpe_dim", s["rpe_dim"], "must be an integer >= 1")
        _require(isinstance(s["rpe_layers"], int) and s["rpe_layers"] >= 0, "rpe_layers", s["rpe_layers"],
                 "must be an integer >= 0")
        _require(str(s["rpe_activation"]) in ACTIVATIONS, "rpe_activation", s["rpe_activation"],
                 f"must be one of {sorted(ACTIVATIONS)}")
        _require(str(s["rpe_norm_type"]) in NORM_CHOICES, "rpe_norm_type", s["rpe_norm_type"],
                 f"must be one of {list(NORM_CHOICES)}")
    if tno_type == "tnn":
        _require(0.0 < s["decay"] <= 1.0, "decay", s["decay"], "lambda must be in (0, 1] for --tno-type tnn")
    if tno_type == "ski":
        _require(0.0 < s["decay"] < 1.0, "decay", s["decay"], "lambda must be in (0, 1) for --tno-type ski")
        _require(isinstance(s["ski_rank"], int) and s["ski_rank"] >= 2, "ski_rank", s["ski_rank"],
                 "r must be an integer >= 2")
        _require(isinstance(s["ski_taps"], int) and s["ski_taps"] >= 1 and s["ski_taps"] % 2 == 1, "ski_taps",
                 s["ski_taps"], "m must be an odd integer >= 1 (the taps are centred)")
    if causal and tno_type == "ski":
        raise ValueError("--tno-type='ski' is invalid for a causal model: SKI-TNO is bidirectional only (causal "
                         "masking negates its benefit, the paper's appendix); use --tno-type fd or tnn")


def set_defaults(args, **defaults):
    """Arch presets: fill in every value the user did not give (command line wins).

    Type-specific TNO fields are filled only where the final --tno-type uses them,
    so e.g. ``--arch tnn_lm_wt103 --tno-type fd`` works."""
    tno_type = getattr(args, "tno_type", None) or defaults.get("tno_type")
    for key, value in defaults.items():
        if key in TYPE_SPECIFIC_FIELDS and tno_type in TNO_FIELDS and key not in TNO_FIELDS[tno_type]:
            continue
        if getattr(args, key, None) is None:
            setattr(args, key, value)
