"""Dataclass configs shared by the TNN models, their validation, and the arch presets' defaults.

Every TNN hyperparameter is a declared field with help text, so fairseq copies it into
``cfg.model``, shows it in ``--help`` and lets the command line and ``--model-overrides`` win over
the arch presets. A TNO type's settings are written once, in its ``Settings`` dataclass
(fairseq_tnn/modules/tno/: each setting's default, help, choices and check): ``TnnBlockConfig`` is
``TnnLayerConfig`` plus ``--tno-type`` and one field per setting of the package's TNO types, made from
those dataclasses, each ``None`` unless given, meaning the chosen type's default. Setting one that the
chosen ``--tno-type`` does not use is an error. A model resolves its TNO's settings once
(``validate_block_config``) and gives the checked ``Settings`` to every layer.
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from ..modules.activations import ACTIVATIONS
from ..modules.norm import NORM_CHOICES
from ..modules.tno import TNO_TYPES, TnoSettings, tno_class
from ..modules.tno.base import require

ACTIVATION_CHOICES = ChoiceEnum(sorted(ACTIVATIONS))
NORM_TYPE_CHOICES = ChoiceEnum(list(NORM_CHOICES))
NORM_POSITION_CHOICES = ChoiceEnum(["pre", "post"])
# The --tno-type choices: the types fairseq_tnn/modules/tno/__init__.py imports, in its order
TNO_TYPE_NAMES = list(TNO_TYPES)


# {setting: {TNO type: its Settings field}}: every setting of the package's types, once (tnn and fd share the RPE's)
TNO_SETTINGS: Dict[str, Dict[str, dataclasses.Field]] = {}
for _name in TNO_TYPE_NAMES:
    for _f in dataclasses.fields(TNO_TYPES[_name].Settings):
        TNO_SETTINGS.setdefault(_f.name, {})[_name] = _f


def tno_option(by_type: Dict[str, dataclasses.Field]):
    """The config field of one TNO setting: None (the chosen type's default), its help saying which types use it
    and their defaults, e.g. "[tnn, fd] hidden [norm, act, linear] blocks of the RPE MLP (default 6 tnn, 3 fd)";
    an enum of its choices where it has them (fairseq's parser and hydra then refuse other values)."""
    first = next(iter(by_type.values()))
    defaults = {t: f.default for t, f in by_type.items()}
    if len(set(map(repr, defaults.values()))) == 1:
        default_text = f"default {first.default}"
    else:
        default_text = "default " + ", ".join(f"{v} {t}" for t, v in defaults.items())
    choices = first.metadata.get("choices")
    kind = ChoiceEnum(choices) if choices else first.type
    help_text = f"[{', '.join(by_type)}] {first.metadata['help']} ({default_text})"
    return Optional[kind], field(default=None, metadata={"help": help_text})


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
    tnn_cuda_graphs: bool = field(
        default=False, metadata={
            "help": "with --tnn-compile: while training on a GPU, the compiled layer stack runs as CUDA graphs "
                    "(torch.compile's reduce-overhead mode: the stack's forward one graph launch and its backward "
                    "another, instead of some thousand kernel launches; CUDA_GRAPHS=1 in scripts/train.sh, its "
                    "default on one GPU). Evaluation, "
                    "generation and layers on the CPU run the plain compiled layers. Needs --tnn-compile and a CUDA GPU"})


TnnBlockConfig = dataclasses.make_dataclass(
    "TnnBlockConfig",
    [("tno_type", ChoiceEnum(TNO_TYPE_NAMES), field(default="tnn", metadata={
        "help": "Toeplitz neural operator: " + ", ".join(TNO_TYPES[t].summary for t in TNO_TYPE_NAMES)})),
     *[(name, *tno_option(by_type)) for name, by_type in TNO_SETTINGS.items()]],
    bases=(TnnLayerConfig,),
    namespace={"__doc__": "TnnLayerConfig plus --tno-type and the settings of every TNO type (None: the chosen "
                          "type's default; their help, defaults and checks are the types' Settings)."})
TnnBlockConfig.__module__ = __name__


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


def cuda_graphs(cfg) -> bool:
    """Whether the compiled layers run as CUDA graphs while training: ``cfg.tnn_cuda_graphs`` with ``--tnn-compile``.
    A checkpoint trained with both and loaded with ``tnn_compile`` overridden to false runs eagerly (graphs and all)."""
    return bool(getattr(cfg, "tnn_cuda_graphs", False)) and compile_mode(cfg) is not None


def check_cuda_graphs_for_training(cfg) -> None:
    """fairseq-train with --tnn-cuda-graphs: refused without --tnn-compile (the graphs are the compiled layers') and
    where torch sees no CUDA GPU (the graphs would never run). A checkpoint trained with them loads anywhere:
    evaluation runs the plain compiled layers."""
    if not getattr(cfg, "tnn_cuda_graphs", False):
        return
    require(compile_mode(cfg) is not None, "tnn_cuda_graphs", True,
            "needs --tnn-compile (the CUDA graphs are the compiled layers'); add --tnn-compile or drop --tnn-cuda-graphs")
    require(torch.cuda.is_available(), "tnn_cuda_graphs", True,
            "needs a CUDA GPU, and torch sees none (drop --tnn-cuda-graphs; on the CPU the compiled layers run "
            "without graphs)")


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
    """The checked settings of ``cfg.tno_type`` from a model config (those not given: the type's defaults);
    a setting of another TNO type is refused."""
    tno_type = str(cfg.tno_type)
    cls = tno_class(tno_type)
    own = [f.name for f in dataclasses.fields(cls.Settings)]
    for name, users in TNO_SETTINGS.items():
        value = getattr(cfg, name, None)
        require(value is None or name in own, name, value,
                f"it applies to --tno-type {' or '.join(users)} only, not {tno_type}")
    return cls.checked_settings(causal, **{name: getattr(cfg, name) for name in own
                                           if getattr(cfg, name, None) is not None})


def set_defaults(args, **preset):
    """Arch presets: fill in every value the user did not give (command line wins).

    A preset names its ``tno_type`` and the settings where it departs from that type's ``Settings``
    defaults. Only the settings of the final ``--tno-type`` are filled: from the preset where it has
    the setting, else from its own type's defaults, else from the final type's; so e.g. ``--arch
    tnn_lm_wt103 --tno-type fd`` keeps the preset's RPE of 6 layers."""
    own = preset.get("tno_type", "tnn")
    for key, value in preset.items():
        if key not in TNO_SETTINGS and getattr(args, key, None) is None:
            setattr(args, key, value)
    final = str(getattr(args, "tno_type", None) or own)
    if final not in TNO_TYPES:
        return  # refused by name when the model is built
    inherited = {**dataclasses.asdict(TNO_TYPES[own].Settings()), **{k: v for k, v in preset.items() if k in TNO_SETTINGS}}
    for f in dataclasses.fields(TNO_TYPES[final].Settings):
        if getattr(args, f.name, None) is None:
            setattr(args, f.name, inherited.get(f.name, f.default))
