"""Faults, bad data and bad numbers, each proven by injecting it: a training run SIGKILLed and resumed, damaged
and older checkpoints, seeds, empty or oversized or mismatched data, evaluation at 14,336 tokens, bf16 autocast."""
import hashlib
import math
import os
import re
import shutil
import signal
import subprocess

import numpy
import pytest
import torch

from helpers import (BIN, ROOT, USER_DIR, cli, command_env, lm_train_cmd, mlm_train_cmd, rel, run, split_tokens,
                     wt103_presets)

TPS = 64


def lm_cmd(data_bin, save_dir, max_update=16, arch="tnn_lm_tiny", *extra):
    return lm_train_cmd(data_bin, *extra, arch=arch, tokens_per_sample=TPS, max_update=max_update, save_dir=save_dir,
                        log_interval=1, save_interval_updates=6, no_epoch_checkpoints=True, disable_validation=True)


def mlm_cmd(data_bin, save_dir, max_update=16, *extra):
    return mlm_train_cmd(data_bin, *extra, max_update=max_update, save_dir=save_dir, save_interval_updates=6,
                         disable_validation=True)


def losses_by_update(log):
    """{update: loss} from fairseq's per-update train_inner lines (3 decimals, as logged)."""
    out = {}
    for line in log.splitlines():
        if "train_inner" in line:
            loss = re.search(r"loss=([0-9.]+)", line)
            upd = re.search(r"num_updates=(\d+)", line)
            if loss and upd:
                out[int(upd.group(1))] = float(loss.group(1))
    return out


def kill_at(cmd, update):
    """Start fairseq-train cmd as a process, SIGKILL it as soon as it logs `update`; return what it printed."""
    assert cmd[0] == cli("fairseq-train"), cmd[0]
    proc = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=command_env())
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if f"num_updates={update}," in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen[-30:])
    return "".join(seen)


def train_cmd(kind, data_bin, save_dir):
    """The 16-update run of the fault tests: interval checkpoints at 6 and 12, no validation."""
    return lm_cmd(data_bin, save_dir) if kind == "causal" else mlm_cmd(data_bin, save_dir)


@pytest.fixture(scope="module")
def reference_runs(data_bin, tmp_path_factory):
    """{kind: (save dir, log)} of one uninterrupted 16-update run of each recipe: the reference of the SIGKILL
    tests, and (causal) the finished run whose checkpoints the checkpoint tests damage or edit."""
    root = tmp_path_factory.mktemp("reference")
    return {kind: (root / kind, run(train_cmd(kind, data_bin, root / kind))) for kind in ("causal", "masked")}


@pytest.fixture(scope="module")
def killed_runs(data_bin, tmp_path_factory):
    """{kind: (save dir, log)} of the same command SIGKILLed as soon as it logs update 9 (between the interval
    checkpoints at 6 and 12)."""
    root = tmp_path_factory.mktemp("killed")
    return {kind: (root / kind, kill_at(train_cmd(kind, data_bin, root / kind), 9)) for kind in ("causal", "masked")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["causal", "masked"])
def test_sigkill_then_resume_matches_an_uninterrupted_run(data_bin, reference_runs, killed_runs, kind):
    reference = losses_by_update(reference_runs[kind][1])
    assert sorted(reference) == list(range(1, 17))
    save_dir, first = killed_runs[kind]
    assert "checkpoint_1_6.pt" in first
    resumed_log = run(train_cmd(kind, data_bin, save_dir))
    assert re.search(r"[Ll]oaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 6 updates\)", resumed_log), resumed_log[-2000:]
    resumed = losses_by_update(resumed_log)
    assert sorted(resumed) == list(range(7, 17))
    for update, loss in resumed.items():
        assert loss == pytest.approx(reference[update], abs=1.5e-3), (update, loss, reference[update])


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def finished_run(reference_runs):
    """The causal reference run's checkpoints (interval ones at 6 and 12, checkpoint_last at 16); read only."""
    return reference_runs["causal"][0]


@pytest.mark.parametrize("damage", ["truncate", "garble"])
def test_unreadable_checkpoint_is_named_and_nothing_is_lost(data_bin, finished_run, tmp_path, damage):
    """fairseq-eval-lm names a damaged checkpoint and the older ones beside it, and changes nothing; the older one
    it names loads with --restore-file. (fairseq-train resuming from a damaged checkpoint_last.pt goes on from the
    newest readable checkpoint by itself: tests/reliability/test_resume.py.)"""
    save_dir = tmp_path / "ck"
    shutil.copytree(finished_run, save_dir)
    last = save_dir / "checkpoint_last.pt"
    data = last.read_bytes()
    if damage == "truncate":
        last.write_bytes(data[: len(data) // 2])
    else:
        last.write_bytes(data[:100] + os.urandom(len(data) - 200) + data[-100:])
    before = {p.name: sha(p) for p in save_dir.iterdir()}
    log = run([cli("fairseq-eval-lm"), data_bin, "--user-dir", USER_DIR, "--cpu", "--task", "tnn_language_modeling",
               "--path", last, "--tokens-per-sample", TPS], expect_ok=False)
    assert f"cannot read checkpoint {last}" in log, log[-2000:]
    assert "--restore-file" in log and "checkpoint_1_12.pt" in log
    assert {p.name: sha(p) for p in save_dir.iterdir()} == before  # nothing modified or deleted
    if damage == "garble":
        # the suggested older checkpoint does resume (the same for either damage: shown once)
        log = run(lm_cmd(data_bin, save_dir, 14, "tnn_lm_tiny", "--restore-file", save_dir / "checkpoint_1_12.pt"))
        assert re.search(r"num_updates=14", log)


def test_a_bad_model_override_is_fairseqs_error_not_a_damaged_checkpoint(data_bin, finished_run):
    """fairseq's loader applies --model-overrides after reading the file: an override it rejects stops with
    omegaconf's own error, and the intact checkpoint is not reported as truncated or corrupted."""
    from fairseq import checkpoint_utils
    from omegaconf.errors import ConfigKeyError

    import fairseq_tnn
    fairseq_tnn.register()
    path = str(finished_run / "checkpoint_last.pt")
    bad = {"data": str(data_bin), "model": {"no_such_option": {"x": 1}}}  # --model-overrides "{'model': ...}"
    with pytest.raises(ConfigKeyError, match="Missing key no_such_option") as info:
        checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides=bad)
    assert "cannot read checkpoint" not in str(info.value)
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides={"data": str(data_bin)})
    assert [type(m).__name__ for m in models] == ["TnnLanguageModel"]


def test_a_checkpoint_weights_only_refuses_is_named_with_the_users_options(data_bin, finished_run, tmp_path):
    """A valid checkpoint holding a numpy scalar (as other fairseq versions can write), which torch.load refuses
    with weights_only=True: fairseq-eval-lm names the refused global and what the user can do, and does not call
    the file damaged; following its advice for a trusted file scores it as the same checkpoint without the scalar."""
    state = torch.load(finished_run / "checkpoint_last.pt", weights_only=False)
    state["extra_state"]["val_loss"] = numpy.float64(4.25)
    path = tmp_path / "checkpoint_numpy.pt"
    torch.save(state, path)

    def eval_lm(checkpoint, **kwargs):
        return run([cli("fairseq-eval-lm"), data_bin, "--user-dir", USER_DIR, "--cpu", "--task", "tnn_language_modeling",
                    "--path", checkpoint, "--tokens-per-sample", TPS, "--gen-subset", "valid"], **kwargs)

    log = eval_lm(path, expect_ok=False)
    assert re.search(r"CheckpointRefusedError: cannot load checkpoint \S*checkpoint_numpy\.pt: it holds an object made "
                     r"by numpy\S*\.scalar, which torch\.load refuses with weights_only=True", log), log[-3000:]
    assert "only if you trust the file" in log and "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1" in log, log[-3000:]
    assert "truncated" not in log and "corrupted" not in log
    trusted = eval_lm(path, env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})
    original = eval_lm(finished_run / "checkpoint_last.pt")
    ppl = [re.search(r"Perplexity: ([0-9.]+)", log).group(1) for log in (trusted, original)]
    assert ppl[0] == ppl[1]


def test_checkpoint_from_before_an_option_existed_still_loads(data_bin, finished_run, tmp_path):
    """Config fields added later must default to the old behaviour: drop some from a saved cfg."""
    state = torch.load(finished_run / "checkpoint_last.pt", weights_only=False)
    for key in ("norm_position", "tno_type", "rpe_norm_type", "ski_rank", "ski_taps", "glu_dim"):
        state["cfg"]["model"].pop(key, None)
    old = tmp_path / "old.pt"
    torch.save(state, old)
    logs = [run([cli("fairseq-eval-lm"), data_bin, "--user-dir", USER_DIR, "--cpu", "--task", "tnn_language_modeling",
                 "--path", p, "--tokens-per-sample", TPS, "--gen-subset", "valid"])
            for p in (finished_run / "checkpoint_last.pt", old)]
    ppl = [re.search(r"Perplexity: ([0-9.]+)", log).group(1) for log in logs]
    assert ppl[0] == ppl[1]


@pytest.mark.parametrize("kind", ["causal", "masked"])
def test_same_seed_gives_identical_losses(reference_runs, killed_runs, kind):
    """The same command twice (the reference run and the one killed after update 9): the same loss at every
    update both logged."""
    a, b = (losses_by_update(runs[kind][1]) for runs in (reference_runs, killed_runs))
    common = sorted(set(a) & set(b))
    assert common[:9] == list(range(1, 10)) and [a[u] for u in common] == [b[u] for u in common]


# ---------------------------------------------------------------- bad data


def make_corpus(tmp_path, train, valid, test):
    src = tmp_path / "text"
    src.mkdir()
    for name, lines in (("train", train), ("valid", valid), ("test", test)):
        (src / f"{name}.bpe").write_text("".join(line + "\n" for line in lines))
    dest = tmp_path / "bin"
    run(["bash", ROOT / "scripts/preprocess.sh", src, dest], env={"FAIRSEQ_BIN": str(BIN)})
    return dest


def sample_lines(split, n):
    with open(ROOT / "data/sample" / f"{split}.bpe") as f:
        return [next(f).rstrip("\n") for _ in range(n)]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """200 training lines, an empty valid split and a one-line test split, binarised by scripts/preprocess.sh."""
    return make_corpus(tmp_path_factory.mktemp("small"), sample_lines("train", 200), [], sample_lines("test", 1))


def test_empty_split_is_a_clear_error(small_corpus, tmp_path):
    log = run(lm_cmd(small_corpus, tmp_path / "ck", 2)[:-1], expect_ok=False)  # with validation
    assert "valid.bin is empty" in log, log[-2000:]


def test_split_shorter_than_one_block_is_scored_in_full(small_corpus, tmp_path):
    data = small_corpus
    n = split_tokens(data, "test")
    assert n < TPS
    # a model trained on this tiny corpus (without validation), evaluated on the short split
    run(lm_cmd(data, tmp_path / "ck", 2))
    log = run([cli("fairseq-eval-lm"), data, "--user-dir", USER_DIR, "--cpu", "--task", "tnn_language_modeling",
               "--path", tmp_path / "ck" / "checkpoint_last.pt", "--tokens-per-sample", TPS])
    assert f"Evaluated {n} tokens" in log
    assert math.isfinite(float(re.search(r"Loss \(base 2\): ([0-9.]+)", log).group(1)))


def test_line_longer_than_a_block_in_complete_mode_is_a_clear_error(data_bin, tmp_path):
    # the masked task drops such blocks by default, and refuses them with --oversized-blocks error
    # (tests/cli/test_oversized_blocks.py, the same command and message)
    cmd = lm_cmd(data_bin, tmp_path / "ck", 2) + ["--sample-break-mode", "complete"]
    log = run(cmd, expect_ok=False)
    assert re.search(r"--tokens-per-sample=64 is too small for --sample-break-mode complete: line \d+ of .* has \d+ "
                     r"tokens", log), log[-2000:]
    assert "begin training" not in log


def test_data_binarised_with_another_dictionary_is_a_clear_error(data_bin, tmp_path):
    other = tmp_path / "bin"
    shutil.copytree(data_bin, other)
    lines = (other / "dict.txt").read_text().splitlines()
    (other / "dict.txt").write_text("\n".join(lines[:100]) + "\n")
    log = run(lm_cmd(other, tmp_path / "ck", 2), expect_ok=False)
    assert re.search(r"holds token id \d+ but the dictionary has only 104 symbols", log), log[-2000:]


# ---------------------------------------------------------------- numbers


ALL_ARCHS = wt103_presets("tnn_lm") + wt103_presets("tnn_mlm")  # fairseq's registry of our archs


@pytest.mark.slow
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_every_architecture_evaluates_at_14336_tokens(arch):
    """28x the paper's training length, the published layer sizes (fewer layers to fit CI), finite loss."""
    from fairseq_tnn.models.build import build_arch as build
    layers = {"decoder_layers": 1} if "_lm_" in arch else {"encoder_layers": 1}
    torch.manual_seed(0)
    model = build(arch, vocab=1000, **layers).eval()
    tokens = torch.randint(4, 1000, (1, 14336))
    with torch.no_grad():
        logits, _ = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]).float(), tokens.view(-1))
    assert logits.shape[:2] == (1, 14336) and math.isfinite(loss.item())


@pytest.mark.parametrize("tno,causal", [("tnn", True), ("tnn", False), ("fd", True), ("fd", False), ("ski", False)])
def test_bf16_autocast_stays_close_to_fp32(tno, causal):
    """FFTs run in fp32 under autocast; the stated tolerance covers bf16 projections (8-bit mantissa)."""

    from fairseq_tnn.modules.tno import build_tno
    torch.manual_seed(0)
    op = build_tno(tno, 96, causal)
    x = torch.randn(2, 700, 96)
    ref = op(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = op(x.bfloat16())
    err = rel(low, ref)
    assert err < 3e-2, err
