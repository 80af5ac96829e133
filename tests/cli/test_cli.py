"""End to end through the real fairseq CLIs with an absolute --user-dir, on data/sample."""
import math
import re

import pytest
import torch

from helpers import ROOT, USER_DIR, cli, command_env, execute, lm_train_cmd, mlm_train_cmd, rank0_updates, run, split_tokens, \
    valid_ppls

TPS = 64


def train_cmd(data_bin, save_dir, max_update):
    # validation on the valid split's first 8 batches (4,096 of its ~17,000 tokens): the whole split, ten
    # times over, cost as much as the 100 training updates
    return lm_train_cmd(data_bin, tokens_per_sample=TPS, max_update=max_update, save_dir=save_dir,
                        save_interval_updates=50, validate_interval_updates=10, no_epoch_checkpoints=True,
                        max_valid_steps=8)


@pytest.fixture(scope="module")
def lm_run(data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("lm") / "checkpoints"
    log = run(train_cmd(data_bin, save_dir, 100))
    return save_dir, log


def evaluated_tokens(log):
    m = re.search(r"Evaluated ([0-9,]+) tokens", log)
    assert m, log[-3000:]
    return int(m.group(1).replace(",", ""))


def eval_loss(log):
    m = re.search(r"Loss \(base 2\): ([0-9.]+|nan|inf), Perplexity: ([0-9.]+|nan|inf)", log)
    assert m, log[-3000:]
    return float(m.group(1)), float(m.group(2))


def test_training_learns_and_logs_step_metrics(lm_run, data_bin):
    save_dir, log = lm_run
    assert (save_dir / "checkpoint_last.pt").exists() and (save_dir / "checkpoint_best.pt").exists()
    assert re.search(r"update_ms[ =][0-9.]+", log) and re.search(r"max_rss_mb[ =][0-9.]+", log)
    ppls = valid_ppls(log)
    assert len(ppls) >= 5, log[-3000:]
    vocab = sum(1 for _ in open(data_bin / "dict.txt")) + 4
    # the first validation (10 updates) is already below uniform; 100 updates must cut it well below that
    assert ppls[0] < vocab * 1.5
    assert ppls[-1] < 0.5 * ppls[0], ppls
    assert ppls[-1] < vocab / 5, ppls


def test_resume_from_checkpoint_last(lm_run, data_bin):
    save_dir, _ = lm_run
    log = run(train_cmd(data_bin, save_dir, 110))
    assert re.search(r"[Ll]oaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 100 updates\)", log), log[-3000:]
    assert re.search(r"num_updates[ =]110", log), log[-3000:]


# (without a context window at the training length: scripts/eval_extrapolation.sh's runs, tests/scripts)
@pytest.mark.parametrize("extra,tokens_per_sample", [
    (["--context-window", TPS // 2], TPS),
    ([], 8 * TPS),  # 8x the training length: every block is scored
    (["--context-window", TPS], 8 * TPS),
])
def test_eval_lm_scores_every_token(lm_run, data_bin, extra, tokens_per_sample):
    save_dir, _ = lm_run
    log = eval_lm(data_bin, save_dir / "checkpoint_last.pt", tokens_per_sample, *extra)
    assert evaluated_tokens(log) == split_tokens(data_bin, "test")
    loss, ppl = eval_loss(log)
    assert math.isfinite(loss) and 1 < ppl < 1000


def eval_lm(data_bin, checkpoint, tokens_per_sample, *extra):
    return run([cli("fairseq-eval-lm"), data_bin, "--user-dir", USER_DIR, "--cpu", "--task", "tnn_language_modeling",
                "--path", checkpoint, "--gen-subset", "test", "--sample-break-mode", "none",
                "--tokens-per-sample", tokens_per_sample, "--batch-size", 4, "--num-workers", 0, *extra])


def test_fd_tnn_lm_trains_and_extrapolates(data_bin, tmp_path):
    save_dir = tmp_path / "ck"
    log = run(lm_train_cmd(data_bin, arch="fd_tnn_lm_tiny", tokens_per_sample=TPS, max_update=30, save_dir=save_dir,
                           no_epoch_checkpoints=True, validate_interval_updates=10, max_valid_steps=8))
    ppls = valid_ppls(log)
    assert len(ppls) >= 3 and ppls[-1] < ppls[0], ppls
    log = eval_lm(data_bin, save_dir / "checkpoint_last.pt", 8 * TPS)
    assert evaluated_tokens(log) == split_tokens(data_bin, "test")
    assert math.isfinite(eval_loss(log)[0])


@pytest.mark.runs_doc(r'^fairseq-validate data-bin/wikitext-103 ')
@pytest.mark.parametrize("arch", ["tnn_mlm_tiny", "fd_tnn_mlm_tiny", "ski_tnn_mlm_tiny"])
def test_masked_lm_trains_and_validates_at_8x_length(data_bin, tmp_path, arch):
    # 128 tokens: the longest sample line (112 pieces + eos + bos) fits one block in "complete" mode
    log = run(mlm_train_cmd(data_bin, arch=arch, tokens_per_sample=128, max_update=6, save_dir=tmp_path / "ck",
                            log_interval=2, validate_interval_updates=6))
    losses = [float(x) for x in re.findall(r"valid on 'valid' subset \| loss ([0-9.]+)", log)]
    assert losses and all(math.isfinite(x) for x in losses), log[-3000:]
    assert (tmp_path / "ck" / "checkpoint_last.pt").exists()
    # the checkpoint loads and scores blocks 8x the training length
    log = run([cli("fairseq-validate"), data_bin, "--user-dir", USER_DIR, "--cpu", "--task", "tnn_masked_lm",
               "--path", tmp_path / "ck" / "checkpoint_last.pt", "--valid-subset", "valid", "--batch-size", 2,
               "--required-batch-size-multiple", 1, "--num-workers", 0, "--model-overrides", "{'tokens_per_sample': 1024, 'sample_break_mode': 'none'}"])
    m = re.search(r"valid on 'valid' subset \| loss ([0-9.]+|nan|inf) .*\| wpb ([0-9.]+)", log)
    assert m and math.isfinite(float(m.group(1))), log[-3000:]
    if arch == "ski_tnn_mlm_tiny":
        # fairseq-eval-lm is for causal LMs: a masked checkpoint is refused, naming fairseq-validate, with
        # fairseq's default language_modeling task (which would score it as causal), with tnn_masked_lm and with the
        # causal task the docs' fairseq-eval-lm command names
        for task in ([], ["--task", "tnn_masked_lm"], ["--task", "tnn_language_modeling"]):
            log = run([cli("fairseq-eval-lm"), data_bin, "--user-dir", USER_DIR, "--cpu", *task,
                       "--path", tmp_path / "ck" / "checkpoint_last.pt", "--tokens-per-sample", 128], expect_ok=False)
            assert "is a bidirectional masked language model" in log and "fairseq-validate" in log, log[-3000:]


def test_ski_tnn_trains_alike_with_its_gate_recomputed_or_kept(data_bin, tmp_path):
    """fairseq-train of ski_tnn_mlm_tiny with --ski-backward recompute (the default: the GTU computes its gate again in
    the backward) and with keep: the same loss at every update, as the recomputed gate is the kept one to the bit and
    the layers' dropout, outside the gate, draws the same masks; each checkpoint's config holds its mode."""
    losses = {}
    for mode in ("recompute", "keep"):
        extra = [] if mode == "recompute" else ["--ski-backward", mode]
        log = run(mlm_train_cmd(data_bin, *extra, arch="ski_tnn_mlm_tiny", tokens_per_sample=128, max_update=4,
                                log_interval=1, save_dir=tmp_path / mode, disable_validation=True))
        losses[mode] = rank0_updates(log)
        state = torch.load(tmp_path / mode / "checkpoint_last.pt", map_location="cpu", weights_only=False)
        assert state["cfg"]["model"]["ski_backward"] == mode
    assert sorted(losses["keep"]) == [1, 2, 3, 4] and losses["recompute"] == losses["keep"], losses


def test_hydra_train_with_a_config_from_configs(data_bin, tmp_path):
    log = run([cli("fairseq-hydra-train"), "--config-dir", ROOT / "configs", "--config-name", "tnn_lm_sample",
               f"task.data={data_bin}", f"common.user_dir={USER_DIR}", f"checkpoint.save_dir={tmp_path / 'ck'}",
               "optimization.max_update=4", f"hydra.run.dir={tmp_path / 'hydra'}"])
    assert re.search(r"num_updates[ =]4", log), log[-3000:]
    assert (tmp_path / "ck" / "checkpoint_last.pt").exists()


def test_log_file_has_each_line_once_over_three_epochs(data_bin, tmp_path):
    """fairseq 0.12 adds a --log-file handler per progress bar (one per epoch); the plugin keeps one, so epoch 3's
    lines are not written three times. Three short epochs: the valid split as the training set."""
    log_file = tmp_path / "train.log"
    run(lm_train_cmd(data_bin, tokens_per_sample=TPS, batch_size=16, max_epoch=3, train_subset="valid",
                     valid_subset="test", max_valid_steps=2, save_dir=tmp_path / "ck", no_save=True, log_format="json",
                     log_interval=5, log_file=log_file))
    lines = log_file.read_text().splitlines()
    inner = re.findall(r'"num_updates": "([0-9]+)"', "\n".join(lines))
    assert len(inner) >= 9 and len(inner) == len(set(inner)), inner  # every train_inner update once
    assert len([x for x in lines if '"test_num_updates"' in x]) == 3  # one validation per epoch
    assert len([x for x in lines if '"train_num_updates"' in x]) == 3  # one end-of-epoch summary per epoch
    records = [x for x in lines if x.startswith('{"')]  # the json log lines (the model printout repeats itself)
    assert len(records) == len(set(records)) and len(records) >= 15


def scores(log):
    """The lines of a fairseq log that carry results (training and validation losses, eval-lm's loss,
    interactive's hypotheses), without their time stamps, speeds and timings."""
    keep = []
    for line in log.splitlines():
        line = re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| ", "", line)
        if re.search(r"\| (train_inner|valid|train) \||valid on|Loss \(base 2\)|^[SHD]-\d", line):
            keep.append(re.sub(r"(, | \| )?(update_ms|max_rss_mb|wps|ups|train_wall|wall)[ =][0-9.]+", "", line))
    return keep


@pytest.mark.slow
def test_console_scripts_run_as_processes(data_bin, tiny_checkpoints, tmp_path):
    """fairseq-train, fairseq-eval-lm, fairseq-validate and fairseq-interactive typed as a user types them, each a
    process of its own, give what the same command gives run in the test's process (tests/helpers.py, as the rest
    of the suite runs them): the same losses, scores and hypotheses."""
    lm, mlm = (tiny_checkpoints[arch] / "checkpoint_best.pt" for arch in ("tnn_lm_tiny", "tnn_mlm_tiny"))
    commands = {
        "train": lambda where: lm_train_cmd(data_bin, tokens_per_sample=TPS, max_update=6, log_interval=2,
                                            validate_interval_updates=6, max_valid_steps=2, save_dir=tmp_path / where),
        "eval-lm": lambda where: [cli("fairseq-eval-lm"), data_bin, "--user-dir", USER_DIR, "--cpu", "--path", lm,
                                  "--task", "tnn_language_modeling", "--tokens-per-sample", TPS, "--batch-size", 4,
                                  "--num-workers", 0],
        "validate": lambda where: [cli("fairseq-validate"), data_bin, "--user-dir", USER_DIR, "--cpu", "--path", mlm,
                                   "--task", "tnn_masked_lm", "--batch-size", 4, "--num-workers", 0],
        "interactive": lambda where: [cli("fairseq-interactive"), data_bin, "--user-dir", USER_DIR, "--cpu",
                                      "--task", "tnn_language_modeling", "--path", lm, "--bpe", "sentencepiece",
                                      "--sentencepiece-model", ROOT / "data/sample/spm.model", "--beam", 2,
                                      "--max-len-b", 8],
    }
    for name, command in commands.items():
        alone, here = (execute(command(where), command_env(), 300, stdin="And God said\n", process=where == "process")
                       for where in ("process", "in-process"))
        assert alone[0] == here[0] == 0, (name, alone, here)
        alone, here = ([scores(out), scores(err)] for _, out, err in (alone, here))  # each stream on its own
        assert alone == here and alone != [[], []], (name, alone, here)
