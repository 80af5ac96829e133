"""Dataclass configs shared by the TNN models, their validation, and the arch presets' defaults.

Every TNN hyperparameter is a declared field with help text, so fairseq copies it into
``cfg.model``, shows it in ``--help`` and lets the command line and ``--model-overrides`` win over
the arch presets. ``TnnBlockConfig`` writes out ``--tno-type`` and the settings of every TNO type
of fairseq_tnn/modules/tno/, each ``None`` unless given, meaning the chosen type's default. Each
default, help text and check is written once, in the type's ``Settings`` dataclass: the fields here
take their help from it at import (``tno_help``), and tests/models/test_tno_config.py checks that
they match the ``Settings`` fields one for one. Setting one that the chosen ``--tno-type`` does not
use is an error. A model resolves its TNO's settings once (``validate_block_config``) and gives the
checked ``Settings`` to every layer.
"""
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from ..modules.activations import ACTIVATIONS
from ..modules.norm import NORM_CHOICES
from ..modules.tno import TNO_TYPES, tno_class, tno_settings
from ..modules.tno.base import InvalidSetting, TnoSettings, option, require
from ..modules.tno.ski import LOWRANK_MODES

logger = logging.getLogger(__name__)

ACTIVATION_CHOICES = ChoiceEnum(sorted(ACTIVATIONS))
NORM_TYPE_CHOICES = ChoiceEnum(list(NORM_CHOICES))
NORM_POSITION_CHOICES = ChoiceEnum(["pre", "post"])
# The TNO types of fairseq_tnn/modules/tno/, the --tno-type choices: a new type adds its name here and its
# settings to TnnBlockConfig (docs/design.md#adding-a-tno-type)
TNO_TYPE_NAMES = ["tnn", "fd", "ski"]
TNO_TYPE_CHOICES = ChoiceEnum(TNO_TYPE_NAMES)
SKI_LOWRANK_CHOICES = ChoiceEnum(LOWRANK_MODES)


def _settings_fields(tno_type: str) -> Dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(TNO_TYPES[tno_type].Settings)}


def _aliases(tno_type: str) -> Dict[str, str]:
    """{old option name: settings field} of one TNO type."""
    return {f.metadata["alias"]: f.name for f in _settings_fields(tno_type).values() if "alias" in f.metadata}


def tno_field_users() -> Dict[str, List[str]]:
    """Every TNO settings field (and alias) of the registered types -> the types it applies to."""
    users: Dict[str, List[str]] = {}
    for tno_type in TNO_TYPES:
        for name in [*_settings_fields(tno_type), *_aliases(tno_type)]:
            users.setdefault(name, []).append(tno_type)
    return users


def tno_help(name: str) -> str:
    """The help of the config field ``name`` from the TNO types' ``Settings``: the types that use it, its help
    and their defaults, e.g. "[tnn, fd] hidden [norm, act, linear] blocks of the RPE MLP (default 6 tnn, 3 fd)",
    and the types whose deprecated name for another field it is."""
    owners = {t: _settings_fields(t)[name] for t in TNO_TYPE_NAMES if name in _settings_fields(t)}
    parts = []
    if owners:
        defaults = {t: f.default for t, f in owners.items()}
        if len(set(map(repr, defaults.values()))) == 1:
            default_text = f"default {next(iter(defaults.values()))}"
        else:
            default_text = "default " + ", ".join(f"{v} {t}" for t, v in defaults.items())
        help_text = next(iter(owners.values())).metadata["help"]
        parts.append(f"[{', '.join(owners)}] {help_text} ({default_text})")
    for t in TNO_TYPE_NAMES:
        if name in _aliases(t):
            parts.append(f"[{t}] deprecated name of {option(_aliases(t)[name])}")
    return "; ".join(parts)


@dataclass
class TnnLayerConfig(FairseqDataclass):
    """Hyperparameters of the TNN layer (GTU + GLU) and the choice of its TNO."""

    dropout: float = field(default=0.1, metadata={"help": "dropout on the embeddings and on each residual branch"})
    norm_type: NORM_TYPE_CHOICES = field(
        default="simplermsnorm", metadata={"help": "normalisation in each layer: simplermsnorm (no parameters) or layernorm"})
    norm_position: NORM_POSITION_CHOICES = field(
        default="pre", metadata={"help": "pre-norm (x + f(norm(x))) or post-norm (norm(x + f(x))) residual blocks"})
    expand_ratio: int = field(default=3, metadata={"help": "GTU width d1 = expand_ratio * embedding dim"})
    gtu_activation: ACTIVATION_CHOICES = field(default="silu", metadata={"help": "activation of the GTU's u and v branches"})
    glu_dim: Optional[int] = field(default=None, metadata={"help": "GLU hidden width (default: the embedding dim)"})
    glu_activation: ACTIVATION_CHOICES = field(default="silu", metadata={"help": "activation of the GLU's gate"})
    # Any, not a typed field: configs and checkpoints written before the modes existed hold true / false, and
    # fairseq merges a checkpoint's cfg.model into this dataclass (merge_with_parent), where an enum field
    # refuses true / false (omegaconf ValidationError) and an Optional[str] one turns them into 'True' /
    # 'False' while giving the parser no choices (fairseq derives argparse choices from enum fields only).
    # compile_mode() checks the value and add_compile_choices() gives the command line its choices.
    tnn_compile: Any = field(
        default=False, metadata={
            "help": "compile each TNN layer with torch.compile (fewer, fused kernels; on by default in the GPU "
                    "recipe of scripts/train.sh). --tnn-compile (= fallback): if compiling a layer fails (dynamo or "
                    "inductor error, no Triton, no C++ compiler), the layers of its stack run eagerly, with one "
                    "warning naming the layer and the error; --tnn-compile strict: that failure stops the run. "
                    "Per layer: checkpoints "
                    "keep their keys and load with or without it; each new sequence length (FFT size) compiles "
                    "once. In a config: fallback, strict or false (true, as older configs say: fallback)",
            "argparse_const": "fallback"})


@dataclass
class TnnBlockConfig(TnnLayerConfig):
    """TnnLayerConfig plus --tno-type and the settings of every TNO type (None: the chosen type's default; their
    help, defaults and checks are the types' Settings)."""

    tno_type: TNO_TYPE_CHOICES = field(default="tnn", metadata={
        "help": "Toeplitz neural operator: " + ", ".join(TNO_TYPES[t].summary for t in TNO_TYPE_NAMES)})
    # tnn, fd: the RPE MLP
    rpe_dim: Optional[int] = field(default=None, metadata={"help": tno_help("rpe_dim")})
    rpe_layers: Optional[int] = field(default=None, metadata={"help": tno_help("rpe_layers")})
    rpe_activation: Optional[ACTIVATION_CHOICES] = field(default=None, metadata={"help": tno_help("rpe_activation")})
    rpe_norm_type: Optional[NORM_TYPE_CHOICES] = field(default=None, metadata={"help": tno_help("rpe_norm_type")})
    # tnn; for ski, the deprecated name of ski_warp_decay (older commands and checkpoints)
    decay: Optional[float] = field(default=None, metadata={"help": tno_help("decay")})
    # ski
    ski_rank: Optional[int] = field(default=None, metadata={"help": tno_help("ski_rank")})
    ski_taps: Optional[int] = field(default=None, metadata={"help": tno_help("ski_taps")})
    ski_warp_decay: Optional[float] = field(default=None, metadata={"help": tno_help("ski_warp_decay")})
    ski_lowrank: Optional[SKI_LOWRANK_CHOICES] = field(default=None, metadata={"help": tno_help("ski_lowrank")})


COMPILE_MODES = ("fallback", "strict")


def compile_mode(cfg) -> Optional[str]:
    """``cfg.tnn_compile`` as None (eager layers), "fallback" or "strict"; true, as configs and checkpoints
    from before the modes say, is "fallback"."""
    value = getattr(cfg, "tnn_compile", False)
    if value is None or value is False:
        return None
    if value is True:
        return "fallback"
    require(isinstance(value, str) and value in COMPILE_MODES, "tnn_compile", value,
            "must be fallback or strict (--tnn-compile alone: fallback), or false / true in a config "
            "(true: fallback)")
    return str(value)


def add_compile_choices(parser) -> None:
    """Give --tnn-compile its choices on fairseq's command line (the field's type is Any, see above), so
    that e.g. `--tnn-compile data-bin` is refused by name instead of taking the data directory as its
    value."""
    for action in parser._actions:
        if "--tnn-compile" in action.option_strings:
            action.choices = list(COMPILE_MODES)
            action.metavar = "{" + ",".join(COMPILE_MODES) + "}"


def validate_block_config(cfg, embed_dim_field: str, layers_field: str, causal: bool) -> TnoSettings:
    """Refuse nonsensical hyperparameters with an error naming the option, before any work; return the checked
    settings of the config's TNO, which every layer of the model is built with (resolved once per model)."""
    for name in (embed_dim_field, layers_field, "expand_ratio"):
        value = getattr(cfg, name)
        require(isinstance(value, int) and value >= 1, name, value, "must be an integer >= 1")
    glu_dim = getattr(cfg, "glu_dim", None)
    require(glu_dim is None or glu_dim >= 1, "glu_dim", glu_dim, "must be an integer >= 1 (or unset for the embedding dim)")
    require(0.0 <= cfg.dropout < 1.0, "dropout", cfg.dropout, "must be in [0, 1)")
    for name in ("gtu_activation", "glu_activation"):
        value = str(getattr(cfg, name))
        require(value in ACTIVATIONS, name, value, f"must be one of {sorted(ACTIVATIONS)}")
    require(str(cfg.norm_type) in NORM_CHOICES, "norm_type", cfg.norm_type, f"must be one of {list(NORM_CHOICES)}")
    require(str(cfg.norm_position) in ("pre", "post"), "norm_position", cfg.norm_position, "must be 'pre' or 'post'")
    compile_mode(cfg)
    return resolve_tno_settings(cfg, causal)


def resolve_tno_settings(cfg, causal: bool) -> TnoSettings:
    """The checked settings of ``cfg.tno_type`` from a model config (those not given: the type's defaults).

    Refuses a setting of another TNO type. A deprecated option name (``--decay`` for SKI's
    ``--ski-warp-decay``) sets its field, with a warning, so old commands and checkpoints still work; an
    error about its value names it as the user spelled it."""
    tno_type = str(cfg.tno_type)
    tno_class(tno_type)
    fields, aliases = _settings_fields(tno_type), _aliases(tno_type)
    for name, users in tno_field_users().items():
        value = getattr(cfg, name, None)
        require(value is None or name in fields or name in aliases, name, value,
                f"it applies to --tno-type {' or '.join(users)} only, not {tno_type}")
    values = {name: getattr(cfg, name) for name in fields if getattr(cfg, name, None) is not None}
    spelled = {}  # settings field -> the deprecated name it was given by
    for old, target in aliases.items():
        value = getattr(cfg, old, None)
        if value is None:
            continue
        if target in values and values[target] != value:
            raise ValueError(f"{option(old)}={value!r} and {option(target)}={values[target]!r} disagree: for "
                             f"--tno-type {tno_type}, {option(old)} is the deprecated name of {option(target)}; "
                             f"pass {option(target)} alone")
        logger.warning(f"{option(old)} for --tno-type {tno_type} is deprecated: it is now {option(target)} (same "
                       f"meaning); using {option(target)}={value!r}")
        values[target] = value
        spelled[target] = old
    try:
        return tno_settings(tno_type, causal, **values)
    except InvalidSetting as err:
        if err.name not in spelled:
            raise
        old = spelled[err.name]
        raise InvalidSetting(old, err.value, f"{err.allowed} ({option(old)} is the deprecated name of "
                                             f"{option(err.name)})") from None


def set_defaults(args, **preset):
    """Arch presets: fill in every value the user did not give (command line wins).

    A preset names its ``tno_type`` and may override some of its settings; the rest of its TNO part
    is that type's ``Settings`` defaults. Only the settings of the final ``--tno-type`` are filled
    (from the preset where it has the field, else that type's defaults), so e.g. ``--arch
    tnn_lm_wt103 --tno-type fd`` works and keeps the preset's RPE size. A type registered from outside the
    package is built with its ``Settings`` defaults (the model config has no fields for its settings)."""
    own = preset.get("tno_type", "tnn")
    final = str(getattr(args, "tno_type", None) or own)
    users = tno_field_users()
    tno_part = {**dataclasses.asdict(TNO_TYPES[own].Settings()), **{k: v for k, v in preset.items() if k in users}}
    for key, value in preset.items():
        if key not in users and getattr(args, key, None) is None:
            setattr(args, key, value)
    if final not in TNO_TYPE_NAMES:
        # unknown: refused by name when the model is built; a type registered from outside fairseq_tnn/modules/tno/
        # (build_arch(..., tno_type=NAME)) has no config fields for its settings, so it runs with their defaults
        for name in _settings_fields(final) if final in TNO_TYPES else ():
            value = getattr(args, name, None)
            require(value is None or name in TnnBlockConfig.__dataclass_fields__, name, value,
                    f"--tno-type {final} is not one of the model config's types ({', '.join(TNO_TYPE_NAMES)}), so "
                    f"its settings are not options: it takes their defaults")
        return
    aliased = {target for old, target in _aliases(final).items() if getattr(args, old, None) is not None}
    for name, f in _settings_fields(final).items():
        if getattr(args, name, None) is None and name not in aliased:
            setattr(args, name, tno_part.get(name, f.default))
