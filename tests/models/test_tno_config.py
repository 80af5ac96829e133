"""The models' TNO options on fairseq's command line: their help, the options command, and the presets'
TNO part (the published configurations; a flag wins, and switching the type keeps the preset's RPE)."""
import sys

import pytest
from fairseq import options

from helpers import USER_DIR, command_env, execute
from fairseq_tnn.models.build import build_arch


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


def tno_of(arch, **overrides):
    model = build_arch(arch, 40, **overrides)
    layers = model.decoder.layers if hasattr(model, "decoder") else model.encoder.layers
    return layers[0].gtu.tno


# The published TNO configurations (docs/references.md#published-configurations): Qin et al.'s TNN, RPE 64 x 6 of
# [SimpleRMSNorm, ReLU, Linear] blocks, decay 0.99; the SKI paper's 3-layer-RPE TNN and FD-TNN (no decay); its
# SKI-TNN Wikitext runs, r = 32 inducing points, m = 17 taps, lambda = 0.99.
TNN = dict(rpe_dim=64, rpe_layers=6, rpe_activation="relu", rpe_norm_type="simplermsnorm", decay=0.99)
PUBLISHED = [
    ("tnn_lm_wt103", "TnnTno", TNN), ("tnn_lm_wt103_rpe3", "TnnTno", {**TNN, "rpe_layers": 3}),
    ("fd_tnn_lm_wt103", "FdTno", dict(rpe_dim=64, rpe_layers=3, rpe_activation="relu", rpe_norm_type="simplermsnorm")),
    ("tnn_mlm_wt103", "TnnTno", TNN), ("tnn_mlm_wt103_rpe3", "TnnTno", {**TNN, "rpe_layers": 3}),
    ("fd_tnn_mlm_wt103", "FdTno", dict(rpe_dim=64, rpe_layers=3, rpe_activation="relu", rpe_norm_type="simplermsnorm")),
    ("ski_tnn_mlm_wt103", "SkiTno", dict(ski_rank=32, ski_taps=17, ski_warp_decay=0.99, ski_lowrank="mean",
                                                ski_backward="recompute")),
]


@pytest.mark.parametrize("arch,tno_class,published", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_presets_build_the_published_tno(arch, tno_class, published):
    layers = {"decoder_layers": 1} if "_lm_" in arch else {"encoder_layers": 1}
    tno = tno_of(arch, **layers)
    assert type(tno).__name__ == tno_class
    assert vars(tno.settings) == published
    if tno_class == "SkiTno":
        assert tno.conv_weight.shape[1] == 17 and tno.knots.shape[0] == 2 * 32
    else:  # the RPE MLP as built: Linear(1 -> 64), then its hidden blocks
        assert tno.rpe.proj.out_features == 64 and len(tno.rpe.linears) == published["rpe_layers"]


def test_a_flag_wins_over_the_preset_and_switching_the_type_keeps_its_rpe():
    assert tno_of("tnn_lm_wt103", decoder_layers=1, rpe_dim=32).settings.rpe_dim == 32
    fd = tno_of("tnn_lm_wt103", decoder_layers=1, tno_type="fd")  # the preset's RPE of 6 layers, no decay
    assert type(fd).__name__ == "FdTno" and len(fd.rpe.linears) == 6 and not hasattr(fd.settings, "decay")
    tnn = tno_of("fd_tnn_lm_wt103", decoder_layers=1, tno_type="tnn")  # FD-TNN's 3 layers, TNN's decay 0.99
    assert len(tnn.rpe.linears) == 3 and tnn.decay == 0.99
