"""The models' TNO options are derived from the TNO types' settings: fields, help, defaults, presets,
and the deprecated ``--decay`` of SKI (now ``--ski-warp-decay``) on the command line and in old configs."""
import dataclasses
import logging

import pytest
from fairseq import options

from conftest import USER_DIR
from fairseq_tnn.models.build import VocabTask, build_arch, dictionary_of_size
from fairseq_tnn.models import config
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


@pytest.mark.parametrize("arch,expect", [
    ("tnn_lm_wt103", ["--rpe-layers", "[tnn_lm_wt103: 6]", "[tnn_lm_wt103: tnn]", "[tnn_lm_wt103: 0.99]"]),
    ("ski_tnn_mlm_wt103", ["--ski-warp-decay", "[ski_tnn_mlm_wt103: 32]", "task tnn_masked_lm"])])
def test_options_command_lists_an_architectures_options_with_its_values(arch, expect):
    """python -m fairseq_tnn.options ARCH: what fairseq-train --help cannot show (it prints before adding them)."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "fairseq_tnn.options", arch], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = " ".join(proc.stdout.split())  # argparse wraps the lines
    assert all(e in text for e in expect), text
    assert "--decoder-layers" in text or "--encoder-layers" in text
    proc = subprocess.run([sys.executable, "-m", "fairseq_tnn.options", "tnn_lm_huge"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 2 and "'tnn_lm_huge' is not a TNN architecture: must be one of" in proc.stderr


def parse(arch, *extra):
    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, input_args=["data", "--user-dir", USER_DIR, "--arch", arch, *extra,
                                                           "--task", "tnn_masked_lm", "--criterion", "masked_lm"])


def test_decay_is_a_deprecated_alias_for_ski(caplog):
    args = parse("ski_tnn_mlm_tiny", "--decay", "0.9")
    assert args.decay == 0.9 and getattr(args, "ski_warp_decay", None) is None  # the preset leaves it to --decay
    cfg = TnnMlmConfig(**{k: v for k, v in vars(args).items() if k in TnnMlmConfig.__dataclass_fields__})
    config._WARNED.clear()  # warned once per process: an earlier test may have used --decay with ski
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
