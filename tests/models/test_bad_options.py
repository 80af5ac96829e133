"""A table of invalid settings across all architectures and tasks.

Each runs fairseq-train's own argument parsing, task setup and model building in
process (fast), and must stop with a message naming the option, the value and what
is allowed, before any dataset is loaded (data_utils.load_indexed_dataset is never
called). tests/cli/test_bad_input_cli.py runs a few of these through the real CLI.
"""
import re

import pytest
from fairseq import options
from fairseq.data import data_utils
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq_cli import train

import fairseq_tnn
from helpers import USER_DIR

# fairseq's --user-dir imports the plugin only if no module of it was imported before in this process (another
# test module's fairseq_tnn.ops, say): the plugin registered explicitly, as that case needs
fairseq_tnn.register()

LM = ["--task", "tnn_language_modeling", "--criterion", "cross_entropy", "--tokens-per-sample", "64"]
MLM = ["--task", "tnn_masked_lm", "--criterion", "masked_lm", "--tokens-per-sample", "128",
       "--sample-break-mode", "complete"]

# (architecture, task args, bad args, pattern naming the option and value, what is allowed)
TABLE = [
    ("tnn_lm_tiny", LM, ["--decoder-embed-dim", "0"], r"--decoder-embed-dim=0", ">= 1"),
    ("tnn_lm_tiny", LM, ["--decoder-layers", "-2"], r"--decoder-layers=-2", ">= 1"),
    ("tnn_lm_tiny", LM, ["--expand-ratio", "0"], r"--expand-ratio=0", ">= 1"),
    ("tnn_lm_tiny", LM, ["--glu-dim", "-4"], r"--glu-dim=-4", ">= 1"),
    ("tnn_lm_tiny", LM, ["--rpe-dim", "0"], r"--rpe-dim=0", ">= 1"),
    ("tnn_lm_tiny", LM, ["--rpe-layers", "-1"], r"--rpe-layers=-1", ">= 0"),
    ("tnn_lm_tiny", LM, ["--decay", "0"], r"--decay=0.0", "(0, 1]"),
    ("tnn_lm_tiny", LM, ["--decay", "1.01"], r"--decay=1.01", "(0, 1]"),
    ("tnn_lm_tiny", LM, ["--decay", "-0.5"], r"--decay=-0.5", "(0, 1]"),
    ("tnn_lm_tiny", LM, ["--dropout", "1.5"], r"--dropout=1.5", "[0, 1)"),
    ("tnn_lm_tiny", LM, ["--tno-type", "fourier"], r"--tno-type.*fourier", "choose from"),
    ("tnn_lm_tiny", LM, ["--rpe-activation", "swishy"], r"--rpe-activation.*swishy", "choose from"),
    ("tnn_lm_tiny", LM, ["--gtu-activation", "tanhh"], r"--gtu-activation.*tanhh", "choose from"),
    ("tnn_lm_tiny", LM, ["--glu-activation", "x"], r"--glu-activation.*'x'", "choose from"),
    ("tnn_lm_tiny", LM, ["--norm-type", "batchnorm"], r"--norm-type.*batchnorm", "choose from"),
    ("tnn_lm_tiny", LM, ["--norm-position", "middle"], r"--norm-position.*middle", "choose from"),
    ("tnn_lm_tiny", LM, ["--ski-rank", "8"], r"--ski-rank=8", "applies to --tno-type ski only"),
    ("tnn_lm_tiny", LM, ["--tno-type", "ski"], r"--tno-type='ski'", "bidirectional only"),
    ("tnn_lm_tiny", LM, ["--tokens-per-sample", "0"], r"--tokens-per-sample=0", ">= 1"),
    ("tnn_lm_tiny", LM, ["--sample-break-mode", "paragraph"], r"--sample-break-mode.*paragraph", "choose from"),
    ("tnn_mlm_tiny", LM, [], r"--arch 'tnn_mlm_tiny'", "needs one (e.g. tnn_lm_*)"),
    ("fd_tnn_lm_tiny", LM, ["--decay", "0.9"], r"--decay=0.9", "applies to --tno-type tnn only, not fd"),
    ("fd_tnn_lm_tiny", LM, ["--rpe-layers", "-3"], r"--rpe-layers=-3", ">= 0"),
    ("fd_tnn_lm_tiny", LM, ["--rpe-activation", "softsign"], r"--rpe-activation.*softsign", "choose from"),
    ("fd_tnn_lm_tiny", LM, ["--ski-taps", "5"], r"--ski-taps=5", "applies to --tno-type ski only"),
    ("tnn_lm_tiny", MLM, [], r"--arch 'tnn_lm_tiny'", "needs a bidirectional model"),
    ("tnn_mlm_tiny", MLM, ["--encoder-embed-dim", "0"], r"--encoder-embed-dim=0", ">= 1"),
    ("tnn_mlm_tiny", MLM, ["--encoder-layers", "0"], r"--encoder-layers=0", ">= 1"),
    ("tnn_mlm_tiny", MLM, ["--tokens-per-sample", "1"], r"--tokens-per-sample=1", ">= 2"),
    ("tnn_mlm_tiny", MLM, ["--oversized-blocks", "skip"], r"--oversized-blocks.*skip", "choose from"),
    ("fd_tnn_mlm_tiny", MLM, ["--rpe-dim", "-1"], r"--rpe-dim=-1", ">= 1"),
    ("fd_tnn_mlm_tiny", MLM, ["--ski-rank", "4"], r"--ski-rank=4", "applies to --tno-type ski only"),
    ("ski_tnn_mlm_tiny", MLM, ["--ski-rank", "1"], r"--ski-rank=1", ">= 2"),
    ("ski_tnn_mlm_tiny", MLM, ["--ski-rank", "0"], r"--ski-rank=0", ">= 2"),
    ("ski_tnn_mlm_tiny", MLM, ["--ski-taps", "4"], r"--ski-taps=4", "odd integer >= 1"),
    ("ski_tnn_mlm_tiny", MLM, ["--ski-taps", "-1"], r"--ski-taps=-1", "odd integer >= 1"),
    ("ski_tnn_mlm_tiny", MLM, ["--ski-warp-decay", "1.0"], r"--ski-warp-decay=1.0", "(0, 1) for --tno-type ski"),
    ("ski_tnn_mlm_tiny", MLM, ["--ski-warp-decay", "0"], r"--ski-warp-decay=0.0", "(0, 1) for --tno-type ski"),
    ("ski_tnn_mlm_tiny", MLM, ["--ski-lowrank", "median"], r"--ski-lowrank.*median", "choose from"),
    ("ski_tnn_mlm_tiny", MLM, ["--ski-backward", "never"], r"--ski-backward.*never", "choose from"),
    ("fd_tnn_mlm_tiny", MLM, ["--ski-backward", "keep"], r"--ski-backward=keep", "applies to --tno-type ski only"),
    ("ski_tnn_mlm_tiny", MLM, ["--decay", "0.9"], r"--decay=0.9", "applies to --tno-type tnn only, not ski"),
    ("ski_tnn_mlm_tiny", MLM, ["--rpe-layers", "3"], r"--rpe-layers=3", "applies to --tno-type tnn or fd only"),
    ("ski_tnn_mlm_tiny", MLM, ["--rpe-dim", "32"], r"--rpe-dim=32", "applies to --tno-type tnn or fd only"),
]


@pytest.mark.parametrize("arch,task_args,bad,pattern,allowed", TABLE,
                         ids=[f"{a}:{' '.join(b) or 'task'}" for a, _, b, _, _ in TABLE])
def test_invalid_setting_stops_before_any_data_is_loaded(data_bin, tmp_path, monkeypatch, capsys,
                                                         arch, task_args, bad, pattern, allowed):
    def no_data(*args, **kwargs):
        raise AssertionError(f"a dataset was loaded before the bad setting was reported: {args}")

    monkeypatch.setattr(data_utils, "load_indexed_dataset", no_data)
    argv = [str(data_bin), "--user-dir", USER_DIR, "--cpu", "--arch", arch, *task_args, "--optimizer", "adam",
            "--lr", "0.001", "--batch-size", "2", "--max-update", "1", "--save-dir", str(tmp_path / "ck"), *bad]
    with pytest.raises((ValueError, SystemExit)) as info:
        parser = options.get_training_parser()
        args = options.parse_args_and_arch(parser, input_args=argv)
        train.main(convert_namespace_to_omegaconf(args))
    message = str(info.value) if isinstance(info.value, ValueError) else capsys.readouterr().err
    assert re.search(pattern, message), message
    assert allowed in message, message
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
