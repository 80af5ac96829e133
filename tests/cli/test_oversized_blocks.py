"""Lines longer than a block in the masked recipe (tnn_masked_lm --oversized-blocks), on data/sample at 64 tokens
per block, where many lines are longer than a block (the longest training line has 85 pieces, validation 113)."""
import re

import numpy as np
import pytest

from helpers import USER_DIR, cli, mlm_train_cmd, run

TPS = 64


def line_sizes(data_bin, split):
    from fairseq.data import data_utils
    dataset = data_utils.load_indexed_dataset(str(data_bin / split), None)
    return np.array(dataset.sizes, copy=True)  # sizes is a view of the index's mmap, closed with the dataset


def mlm_train(data_bin, save_dir, mode, *extra, expect_ok=True):
    return run(mlm_train_cmd(data_bin, *extra, sample_break_mode=mode, tokens_per_sample=TPS, max_update=2,
                             save_dir=save_dir, validate_interval_updates=2, max_valid_steps=2), expect_ok=expect_ok)


def dropped(log, split):
    m = re.search(rf"([0-9,]+) of ([0-9,]+) blocks of the {split} split \(([0-9,]+) tokens\) are longer than "
                  rf"--tokens-per-sample={TPS} \(the longest has ([0-9]+)\)[^;]*; (dropped|scored at their full length)",
                  log)
    assert m, log[-4000:]
    return int(m.group(1).replace(",", "")), m.group(5), int(m.group(4))


def test_complete_mode_drops_long_training_lines_and_validation_scores_them_unless_told_to_skip(data_bin, tmp_path):
    """One fairseq-train run in complete mode: the long training lines dropped and counted (in the log and as a
    metric on every training line), the long validation lines scored at their full length; then fairseq-validate
    of its checkpoint, without and with --skip-invalid-size-inputs-valid-test (the flag that drops them)."""
    train, valid = line_sizes(data_bin, "train"), line_sizes(data_bin, "valid")
    # a line of more than TPS - 1 tokens (eos included; <s> is the block's first token) is its own block
    long_train, long_valid = int((train > TPS - 1).sum()), int((valid > TPS - 1).sum())
    assert long_train > 10 and long_valid > 10  # the corpus has long lines at this length
    log = mlm_train(data_bin, tmp_path / "ck", "complete")
    assert dropped(log, "train") == (long_train, "dropped", int(train.max()) + 1)
    assert dropped(log, "valid") == (long_valid, "scored at their full length", int(valid.max()) + 1)
    counts = re.findall(r"dropped_blocks[=| ]+([0-9]+)", log)
    assert len(counts) >= 3 and set(counts) == {str(long_train)}, log[-3000:]
    assert re.search(r"valid on 'valid' subset \| loss [0-9.]+", log)
    # fairseq-validate follows the same rule: without the flag the long blocks are scored, with it dropped
    ckpt = tmp_path / "ck" / "checkpoint_last.pt"
    base = [cli("fairseq-validate"), data_bin, "--user-dir", USER_DIR, "--cpu", "--task", "tnn_masked_lm",
            "--path", ckpt, "--valid-subset", "valid", "--batch-size", 8, "--num-workers", 0]
    full = run(base)
    skipped = run(base + ["--skip-invalid-size-inputs-valid-test"])
    assert dropped(full, "valid") == (long_valid, "scored at their full length", int(valid.max()) + 1)
    assert dropped(skipped, "valid") == (long_valid, "dropped", int(valid.max()) + 1)
    bsz = [int(float(re.search(r"valid on 'valid' subset .*\| bsz ([0-9.]+)", log_).group(1))) for log_ in (full, skipped)]
    assert bsz[0] >= bsz[1]


def test_none_mode_drops_nothing(data_bin, tmp_path):
    log = mlm_train(data_bin, tmp_path / "ck", "none", "--skip-invalid-size-inputs-valid-test")
    assert re.search(rf"train: all [0-9,]+ blocks fit in --tokens-per-sample={TPS}; none dropped", log), log[-3000:]
    assert re.search(rf"valid: all [0-9,]+ blocks fit", log)
    counts = re.findall(r"dropped_blocks[=| ]+([0-9]+)", log)
    assert counts and set(counts) == {"0"}


@pytest.mark.parametrize("mode", ["complete", "eos"])
def test_strict_option_refuses_long_lines_before_training(data_bin, tmp_path, mode):
    log = mlm_train(data_bin, tmp_path / "ck", mode, "--oversized-blocks", "error", expect_ok=False)
    longest = int(line_sizes(data_bin, "valid").max())
    assert f"--tokens-per-sample={TPS} is too small for --sample-break-mode {mode}" in log, log[-3000:]
    assert f"has {longest} tokens" in log and "leave out --oversized-blocks error" in log
    assert "num_updates" not in log and not (tmp_path / "ck" / "checkpoint_last.pt").exists()
