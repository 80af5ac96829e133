"""Nonsensical settings stop fairseq-train with an error naming the option, before any training.

Through the real CLI, one case of each kind: a TNO setting, an option of the layer, a model for the
other task (both ways) and a SKI setting of a masked model. The full table of invalid settings, every
architecture and task, runs fairseq-train's own parsing, task set-up and model building in process:
tests/models/test_bad_options.py (each CLI case here is also a row there)."""
import pytest

from helpers import LM_TRAIN, cli, mlm_train_cmd, run

CASES = [
    (["--arch", "tnn_lm_tiny", "--decay", "1.01"], "--decay=1.01"),
    (["--arch", "tnn_lm_tiny", "--expand-ratio", "0"], "--expand-ratio=0"),
    (["--arch", "tnn_mlm_tiny"], "not a causal language model"),
]


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_option_stops_before_training(data_bin, tmp_path, args, message):
    save_dir = tmp_path / "ck"
    log = run([cli("fairseq-train"), data_bin, *LM_TRAIN, "--tokens-per-sample", 64, "--batch-size", 4,
               "--max-update", 2, "--save-dir", save_dir, *args], expect_ok=False)
    assert message in log, log[-2000:]
    assert "begin training" not in log and "Start iterating" not in log
    assert not save_dir.exists() or not any(save_dir.iterdir())


def test_masked_model_refuses_causal_task_and_reverse(data_bin, tmp_path):
    log = run(mlm_train_cmd(data_bin, arch="tnn_lm_tiny", max_update=1, batch_size=2, save_dir=tmp_path / "ck"),
              expect_ok=False)
    assert "is a causal language model" in log and "--task tnn_language_modeling" in log
    assert "begin training" not in log


@pytest.mark.parametrize("args,message", [
    (["--arch", "ski_tnn_mlm_tiny", "--ski-rank", "1"], "--ski-rank=1"),
])
def test_bad_ski_option_stops_before_training(data_bin, tmp_path, args, message):
    log = run(mlm_train_cmd(data_bin, *args, arch=None, max_update=1, batch_size=2, save_dir=tmp_path / "ck"),
              expect_ok=False)
    assert message in log, log[-2000:]
    assert "begin training" not in log
