"""The models' TNO options are derived from the TNO types' settings: fields, help, defaults, presets,
the deprecated ``--decay`` of SKI (now ``--ski-warp-decay``) on the command line and in old configs, and a
type registered from outside the package (a user's --user-dir package) on fairseq-train's command line."""
import dataclasses
import logging
import re
import sys

import pytest
from fairseq import options

from helpers import USER_DIR, cli, command_env, execute, lm_train_cmd, run
from fairseq_tnn.models.build import VocabTask, build_arch, dictionary_of_size
from fairseq_tnn.models.config import TnnBlockConfig
from fairseq_tnn.models.tnn_mlm import TnnMaskedLMModel, TnnMlmConfig
from fairseq_tnn.modules.tno import TNO_TYPES


def test_every_setting_of_every_type_is_a_config_field_with_its_help():
    fields = {f.name: f for f in dataclasses.fields(TnnBlockConfig)}
    for tno_type, cls in TNO_TYPES.items():
        for f in dataclasses.fields(cls.Settings):
            assert f.name in fields and fields[f.name].default is None, f.name
            help_text = fields[f.name].metadata["help"]
            assert f.metadata["help"] in help_text and tno_type in help_text.split("]")[0], help_text
    assert "(default 6 tnn, 3 fd)" in fields["rpe_layers"].metadata["help"]
    assert "[ski] deprecated name of --ski-warp-decay" in fields["decay"].metadata["help"]


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


# A user's own package, given to fairseq-train as --user-dir: it imports fairseq_tnn (which registers the
# plugin's models and tasks with fairseq) and registers a fourth TNO type with an option of its own.
BOX_PLUGIN = """
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import fairseq_tnn
from fairseq_tnn.modules.tno import Tno, TnoSettings, register_tno
from fairseq_tnn.modules.tno.base import is_int, require

fairseq_tnn.register()  # the plugin's models and tasks, which this package extends with a TNO type


@dataclass
class BoxSettings(TnoSettings):
    box_width: int = field(default=2, metadata={"help": "positions in the window, >= 1"})

    def check(self):
        require(is_int(self.box_width, 1), "box_width", self.box_width, "must be an integer >= 1")


@register_tno
class BoxTno(Tno):
    name = "box"
    summary = "box (a causal window of --box-width positions, its weights per channel learnt)"
    Settings = BoxSettings

    def __init__(self, dim, causal, settings=None, **values):
        super().__init__(dim, causal, settings, **values)
        w = self.settings.box_width
        self.weight = nn.Parameter(torch.full((dim, w), 1.0 / w))  # its shape says the width a checkpoint has

    def extra_repr(self):
        return f"box_width={self.settings.box_width}"

    def forward(self, x, layout="bnd"):
        xc = x.permute(2, 0, 1) if layout == "bnd" else x  # (d, *batch, n)
        w = self.settings.box_width
        windows = F.pad(xc, (w - 1, 0)).unfold(-1, w, 1)  # (d, *batch, n, w): x_{t-w+1} .. x_t
        y = (windows * self.weight.view(xc.shape[0], *[1] * (xc.dim() - 1), w)).sum(-1)
        return y.permute(1, 2, 0) if layout == "bnd" else y
"""


@pytest.mark.slow  # fairseq-train and fairseq-eval-lm processes
def test_a_type_from_a_user_dir_gets_its_options_on_the_command_line(data_bin, tmp_path):
    """fairseq-train --user-dir <a package registering --tno-type box> --tno-type box --box-width 3 parses,
    validates, builds the layers with box_width 3, trains and saves a checkpoint that fairseq-eval-lm loads; a bad
    --box-width is refused by name, and so is --box-width with another --tno-type."""
    plugin = tmp_path / "box_plugin"
    plugin.mkdir()
    (plugin / "__init__.py").write_text(BOX_PLUGIN)
    common = dict(user_dir=plugin, max_update=1, disable_validation=True, log_interval=1)
    log = run(lm_train_cmd(data_bin, "--tno-type", "box", "--box-width", 3, save_dir=tmp_path / "ck", **common))
    assert "'tno_type': box," in log and "'box_width': 3}" in log, log[-3000:]  # in cfg.model
    assert "(tno): BoxTno(box_width=3)" in log and "done training" in log, log[-3000:]  # in the model's layers
    # its checkpoint loads with its settings (fairseq merges the stored cfg.model into the model's dataclass, where
    # a field it lacked would be dropped and the default width would not fit the checkpoint's weights)
    log = run([cli("fairseq-eval-lm"), data_bin, "--user-dir", plugin, "--cpu", "--task", "tnn_language_modeling",
               "--path", tmp_path / "ck" / "checkpoint_last.pt", "--tokens-per-sample", 64, "--batch-size", 4,
               "--num-workers", 0, "--gen-subset", "valid"])
    assert re.search(r"Perplexity: [0-9.]+", log), log[-3000:]
    common["no_save"] = True
    log = run(lm_train_cmd(data_bin, "--tno-type", "box", "--box-width", 0, **common), expect_ok=False)
    assert "InvalidSetting: --box-width=0 is invalid: must be an integer >= 1" in log, log[-3000:]
    log = run(lm_train_cmd(data_bin, "--box-width", 3, **common), expect_ok=False)  # the preset's tno_type: tnn
    assert "--box-width=3 is invalid: it applies to --tno-type box only, not tnn" in log, log[-3000:]
