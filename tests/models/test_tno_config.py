"""The models' TNO options: TnnBlockConfig's hand-written fields in step with the TNO types' settings, their
help, defaults and presets, the deprecated ``--decay`` of SKI (now ``--ski-warp-decay``) on the command line and
in old configs, and a type registered from outside the package (built with its defaults, not a command-line
choice)."""
import dataclasses
import logging
import sys
import typing
from dataclasses import dataclass, field
from enum import Enum

import pytest
import torch
from fairseq import options
from fairseq.dataclass.utils import merge_with_parent
from fairseq.models import MODEL_DATACLASS_REGISTRY
from omegaconf import OmegaConf, ValidationError

from helpers import USER_DIR, command_env, execute
from fairseq_tnn.models.build import VocabTask, build_arch, dictionary_of_size
from fairseq_tnn.models.config import TNO_TYPE_NAMES, TnnBlockConfig, TnnLayerConfig
from fairseq_tnn.models.tnn_lm import TnnLmConfig
from fairseq_tnn.models.tnn_mlm import TnnMaskedLMModel, TnnMlmConfig
from fairseq_tnn.modules.tno import TNO_TYPES, Tno, TnoSettings, register_tno
from fairseq_tnn.modules.tno.base import is_int, require


def builtin_types():
    """The TNO types the package's own modules register (tests may register more for a while)."""
    return {t: cls for t, cls in TNO_TYPES.items() if cls.__module__.startswith("fairseq_tnn.modules.tno.")}


def tno_config_fields():
    """TnnBlockConfig's TNO settings fields: its own fields but --tno-type."""
    layer = {f.name for f in dataclasses.fields(TnnLayerConfig)}
    return {f.name: f for f in dataclasses.fields(TnnBlockConfig) if f.name not in layer and f.name != "tno_type"}


def test_the_hand_written_tno_fields_match_the_settings_of_every_type():
    """Every Settings field (and deprecated alias) of every built-in type is a config field, default None, of a
    compatible type (the field's type, or an enum of exactly its choices), with the type's help; nothing else is;
    --tno-type offers exactly the built-in types. A type added to fairseq_tnn/modules/tno/ fails here until its
    settings are written into TnnBlockConfig and its name into TNO_TYPE_NAMES."""
    types = builtin_types()
    assert TNO_TYPE_NAMES == list(types), f"config.TNO_TYPE_NAMES {TNO_TYPE_NAMES} != the TNO types {list(types)}"
    tno_type = TnnBlockConfig.__dataclass_fields__["tno_type"]
    assert [c.value for c in tno_type.type] == TNO_TYPE_NAMES and tno_type.default == "tnn"
    fields = tno_config_fields()
    expected = {}  # config field -> [(TNO type, its settings field)] for each type declaring it or an alias of it
    for name, cls in types.items():
        for f in dataclasses.fields(cls.Settings):
            expected.setdefault(f.name, []).append((name, f))
            if "alias" in f.metadata:
                expected.setdefault(f.metadata["alias"], []).append((name, f))
    assert sorted(fields) == sorted(expected), (f"TnnBlockConfig lacks {sorted(set(expected) - set(fields))}, has "
                                                f"{sorted(set(fields) - set(expected))} that no TNO type declares")
    for name, declared in expected.items():
        config_field = fields[name]
        assert config_field.default is None, name
        args = typing.get_args(config_field.type)
        assert typing.get_origin(config_field.type) is typing.Union and len(args) == 2 and args[1] is type(None), name
        for tno_type_name, f in declared:
            choices = f.metadata.get("choices")
            if choices is not None:
                assert issubclass(args[0], Enum) and {c.value for c in args[0]} == set(choices), (name, tno_type_name)
            else:
                assert args[0] is f.type, (name, tno_type_name, args[0], f.type)
            help_text = config_field.metadata["help"]
            if f.name == name:
                assert f.metadata["help"] in help_text and tno_type_name in help_text.split("]")[0], help_text
            else:
                assert f"[{tno_type_name}] deprecated name of --{f.name.replace('_', '-')}" in help_text, help_text
    assert "(default 6 tnn, 3 fd)" in fields["rpe_layers"].metadata["help"]
    assert fields["decay"].metadata["help"].endswith("(default 0.99); [ski] deprecated name of --ski-warp-decay")


def test_help_lists_the_tno_options():
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, input_args=["data", "--user-dir", USER_DIR, "--arch", "ski_tnn_mlm_tiny",
                                                           "--task", "tnn_masked_lm", "--criterion", "masked_lm"])
    assert args.ski_warp_decay == 0.99 and args.ski_rank == 8
    assert getattr(args, "decay", None) is None and getattr(args, "rpe_dim", None) is None  # not ski settings
    text = parser.format_help()
    assert "--ski-warp-decay" in text and "inverse time warp" in text


def options_command(arch):
    """python -m fairseq_tnn.options ARCH: (exit status, stdout, stderr)."""
    return execute([sys.executable, "-m", "fairseq_tnn.options", arch], command_env(), 300)


@pytest.mark.parametrize("arch,expect", [
    ("tnn_lm_wt103", ["--rpe-layers", "[tnn_lm_wt103: 6]", "[tnn_lm_wt103: tnn]", "[tnn_lm_wt103: 0.99]"]),
    ("ski_tnn_mlm_wt103", ["--ski-warp-decay", "[ski_tnn_mlm_wt103: 32]", "task tnn_masked_lm"])])
def test_options_command_lists_an_architectures_options_with_its_values(arch, expect):
    """python -m fairseq_tnn.options ARCH: what fairseq-train --help cannot show (it prints before adding them)."""
    code, out, err = options_command(arch)
    assert code == 0, err[-3000:]
    text = " ".join(out.split())  # argparse wraps the lines
    assert all(e in text for e in expect), text
    assert "--decoder-layers" in text or "--encoder-layers" in text


def test_options_command_refuses_an_unknown_architecture():
    code, _, err = options_command("tnn_lm_huge")
    assert code == 2 and "'tnn_lm_huge' is not a TNN architecture: must be one of" in err


def parse(arch, *extra):
    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, input_args=["data", "--user-dir", USER_DIR, "--arch", arch, *extra,
                                                           "--task", "tnn_masked_lm", "--criterion", "masked_lm"])


def test_decay_is_a_deprecated_alias_for_ski(caplog):
    args = parse("ski_tnn_mlm_tiny", "--decay", "0.9")
    assert args.decay == 0.9 and getattr(args, "ski_warp_decay", None) is None  # the preset leaves it to --decay
    cfg = TnnMlmConfig(**{k: v for k, v in vars(args).items() if k in TnnMlmConfig.__dataclass_fields__})
    with caplog.at_level(logging.WARNING):
        model = TnnMaskedLMModel.build_model(cfg, VocabTask(dictionary_of_size(40)))
    assert caplog.text.count("--decay for --tno-type ski is deprecated: it is now --ski-warp-decay") == 1
    assert {layer.gtu.tno.decay for layer in model.encoder.layers} == {0.9}
    # the new name, and both names agreeing, work; disagreeing is refused by name
    assert build_arch("ski_tnn_mlm_tiny", 40, ski_warp_decay=0.8).encoder.layers[0].gtu.tno.decay == 0.8
    assert build_arch("ski_tnn_mlm_tiny", 40, ski_warp_decay=0.8, decay=0.8).encoder.layers[0].gtu.tno.decay == 0.8
    with pytest.raises(ValueError, match=r"--decay=0.9 and --ski-warp-decay=0.8 disagree"):
        build_arch("ski_tnn_mlm_tiny", 40, ski_warp_decay=0.8, decay=0.9)


def test_an_old_ski_config_with_decay_builds_the_same_model():
    """A checkpoint saved before the rename stores ``decay`` (and no ``ski_warp_decay``) in cfg.model."""
    old = TnnMlmConfig(encoder_embed_dim=16, encoder_layers=1, tno_type="ski", decay=0.95, ski_rank=4, ski_taps=3)
    new = TnnMlmConfig(encoder_embed_dim=16, encoder_layers=1, tno_type="ski", ski_warp_decay=0.95, ski_rank=4,
                       ski_taps=3)
    task = VocabTask(dictionary_of_size(30))
    a, b = TnnMaskedLMModel.build_model(old, task), TnnMaskedLMModel.build_model(new, task)
    assert a.state_dict().keys() == b.state_dict().keys()
    assert a.encoder.layers[0].gtu.tno.settings == b.encoder.layers[0].gtu.tno.settings


def test_presets_take_the_tno_part_from_the_settings():
    def settings(arch, **overrides):
        model = build_arch(arch, 40, **overrides)
        layers = model.decoder.layers if hasattr(model, "decoder") else model.encoder.layers
        return layers[0].gtu.tno.settings

    assert settings("tnn_lm_wt103", decoder_layers=1) == TNO_TYPES["tnn"].Settings()
    assert settings("fd_tnn_lm_wt103", decoder_layers=1) == TNO_TYPES["fd"].Settings()
    assert settings("ski_tnn_mlm_wt103", encoder_layers=1) == TNO_TYPES["ski"].Settings()
    assert settings("tnn_lm_wt103_rpe3", decoder_layers=1).rpe_layers == 3
    assert settings("tnn_mlm_wt103_rpe3", encoder_layers=1).rpe_layers == 3
    # a flag wins over the preset; switching the type keeps the preset's shared RPE size
    assert settings("tnn_lm_wt103", decoder_layers=1, rpe_dim=32).rpe_dim == 32
    assert settings("tnn_lm_wt103", decoder_layers=1, tno_type="fd").rpe_layers == 6


@dataclass
class BoxSettings(TnoSettings):
    box_width: int = field(default=2, metadata={"help": "positions in the window, >= 1"})

    def check(self):
        require(is_int(self.box_width, 1), "box_width", self.box_width, "must be an integer >= 1")


class BoxTno(Tno):
    """A type registered from outside the package, as a user's own: a causal window of box_width positions."""

    name = "box"
    summary = "box (a causal window of --box-width positions, its weights per channel learnt)"
    Settings = BoxSettings

    def __init__(self, dim, causal, settings=None, **values):
        super().__init__(dim, causal, settings, **values)
        self.weight = torch.nn.Parameter(torch.full((dim, self.settings.box_width), 1.0 / self.settings.box_width))

    def forward(self, x, layout="bnd"):
        xc = x.permute(2, 0, 1) if layout == "bnd" else x  # (d, *batch, n)
        w = self.settings.box_width
        windows = torch.nn.functional.pad(xc, (w - 1, 0)).unfold(-1, w, 1)  # (d, *batch, n, w)
        y = (windows * self.weight.view(xc.shape[0], *[1] * (xc.dim() - 1), w)).sum(-1)
        return y.permute(1, 2, 0) if layout == "bnd" else y


@pytest.fixture
def box_registered():
    register_tno(BoxTno)
    yield
    del TNO_TYPES["box"]


def test_a_type_from_outside_the_package_runs_with_its_defaults_and_is_no_command_line_choice(box_registered, capsys):
    """Registering a type changes no model config (nothing is re-registered with fairseq or hydra). In Python
    (build_arch) it builds with its Settings defaults, and a value for one of its settings is refused by name
    instead of dropped; fairseq's command line and configs offer only the package's types, and say so."""
    assert MODEL_DATACLASS_REGISTRY["tnn_lm"] is TnnLmConfig and MODEL_DATACLASS_REGISTRY["tnn_mlm"] is TnnMlmConfig
    assert "box_width" not in TnnLmConfig.__dataclass_fields__
    model = build_arch("tnn_lm_tiny", 40, tno_type="box")
    assert model.decoder.layers[0].gtu.tno.settings == BoxSettings()
    assert model(torch.randint(4, 40, (2, 9)))[0].shape == (2, 9, 40)
    with pytest.raises(ValueError, match=r"--box-width=3 is invalid: --tno-type box is not one of the model config's "
                                         r"types \(tnn, fd, ski\), so its settings are not options"):
        build_arch("tnn_lm_tiny", 40, tno_type="box", box_width=3)
    with pytest.raises(ValueError, match=r"--rpe-dim=8 is invalid: it applies to --tno-type tnn or fd only, not box"):
        build_arch("tnn_lm_tiny", 40, tno_type="box", rpe_dim=8)
    for extra, error in [(["--tno-type", "box"], "argument --tno-type: invalid choice: 'box' (choose from 'tnn', "
                                                 "'fd', 'ski')"),
                         (["--box-width", "3"], "unrecognized arguments: --box-width 3")]:
        with pytest.raises(SystemExit):
            options.parse_args_and_arch(options.get_training_parser(), input_args=[
                "data", "--user-dir", USER_DIR, "--arch", "tnn_lm_tiny", "--task", "tnn_language_modeling", *extra])
        assert error in capsys.readouterr().err
    with pytest.raises(ValidationError, match=r"Invalid value 'box', expected one of \[tnn, fd, ski\]\n\s+full_key: "
                                              r"tno_type"):  # a config, --model-overrides or a checkpoint's cfg.model
        merge_with_parent(TnnLmConfig(), OmegaConf.create({"tno_type": "box"}))
