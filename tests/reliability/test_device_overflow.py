"""``--fp16``'s overflow decided on the device (fairseq_tnn/patches/device_overflow.py): through fairseq's Trainer,
updates that overflow and updates that do not train, count, scale and log exactly as fairseq's own host check does,
while the update reads no device value; the flag is read before the next update, at once where fairseq-train acts
after the update, before a save and before a validation. On the CPU, with FP16Optimizer's flat master copy keyed as
fairseq's fp16 tests of it do (its device index faked); tests/gpu has the CUDA run, where the update makes no sync."""
import math

import pytest
import torch
from fairseq import metrics

from benchmarks import opcount
from benchmarks import trainer as tr
from fairseq_tnn import register
from fairseq_tnn.patches import device_overflow
from fairseq_tnn.patches.device_overflow import PENDING

register()  # the plugin as fairseq loads it (--user-dir): models, tasks and patches
# Meters of time and memory, which differ from run to run
TIMED = {"ups", "wps", "update_ms", "max_rss_mb", "train_wall", "wall", "gb_free"}


@pytest.fixture
def fp16_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # FP16Optimizer's flat master copy on the CPU
    # fairseq's overflow handler puts a zero norm on CUDA, which this CPU has not
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)


def fp16_trainer(tmp_path, section="causal", arch="tnn_lm_wt103", device="cpu", compiled=False, on_device=True):
    """A small model's Trainer under --fp16; ``on_device=False``: with fairseq's overflow check on the host (the
    benchmarks' ``fp16host``)."""
    torch.manual_seed(0)
    trainer = tr.build_trainer(section, arch, None, 32, device, "fp16" if on_device else "fp16host", compiled,
                               tr._dictionary_dir(str(tmp_path), 64), True, width=16)
    trainer.cfg.common.log_interval = 5  # before the first update, which snapshots the config
    return trainer


def overflowing(trainer, scale_window=3):
    """A loss scale at which this small model's fp16 gradients overflow, and a short window that grows it back into
    overflows: several of both kinds of update."""
    scaler = trainer.optimizer.scaler
    scaler.loss_scale, scaler.scale_window = 2.0 ** 17, scale_window


def train(trainer, section, steps, on_device, device="cpu"):
    """``steps`` updates as fairseq-train makes them (under the "train" and "train_inner" aggregators), with the
    overflow on the device or fairseq's host check; returns what train_step returned (None or not), the weights
    after each update and the "train" aggregator's values once the last flag is read."""
    results, weights = [], []
    metrics.reset()
    with metrics.aggregate("train"):
        for i in range(steps):
            sample = tr.synthetic_sample(section, 32, 2, 64, seed=i, device=device)
            with metrics.aggregate("train_inner"):
                out = trainer.train_step([sample])
                if i == 0:
                    overflowing(trainer)
            results.append(out is None)
            weights.append(torch.cat([p.detach().float().reshape(-1) for p in trainer.model.parameters()]))
        assert (trainer.__dict__.get(PENDING) is not None) == on_device
        device_overflow.learn(trainer)
        values = metrics.get_smoothed_values("train")
    return results, weights, {k: v for k, v in values.items() if k not in TIMED}


def state(trainer):
    scaler, adam = trainer.optimizer.scaler, trainer.optimizer.fp32_optimizer.optimizer
    return {"num_updates": trainer.get_num_updates(), "lr": trainer.get_lr(), "loss_scale": scaler.loss_scale,
            "scaler": (scaler._iter, scaler._last_overflow_iter, scaler._last_rescale_iter,
                       scaler._overflows_since_rescale),
            "adam_steps": [s["step"] for s in adam.state.values()],
            "master": torch.cat([m.detach().reshape(-1) for m in trainer.optimizer.fp32_params.values()])}


def both(tmp_path, section, arch, steps, device="cpu", compiled=False):
    runs = {}
    for on_device in (False, True):
        trainer = fp16_trainer(tmp_path / str(on_device), section, arch, device, compiled, on_device)
        runs[on_device] = (*train(trainer, section, steps, on_device, device), state(trainer))
    return runs[False], runs[True]


@pytest.mark.parametrize("section,arch", [("causal", "tnn_lm_wt103"), ("masked", "fd_tnn_mlm_wt103")])
def test_updates_with_and_without_overflow_train_count_and_log_as_fairseqs(tmp_path, fp16_on_the_cpu, section, arch):
    assert_trains_as_fairseqs(*both(tmp_path, section, arch, 14))


def assert_trains_as_fairseqs(host_run, device_run):
    (host_none, host_w, host_logs, host), (dev_none, dev_w, dev_logs, dev) = host_run, device_run
    overflows = host["scaler"][0] - host["num_updates"]
    assert overflows >= 3 and host["num_updates"] >= 5, host  # both kinds of update happened
    for i, (a, b) in enumerate(zip(host_w, dev_w)):
        assert torch.equal(a, b), f"the weights after update {i} differ"
    for key in ("num_updates", "lr", "loss_scale", "scaler", "adam_steps"):
        assert dev[key] == host[key], (key, dev[key], host[key])
    assert torch.equal(dev["master"], host["master"])
    assert dev_logs == host_logs
    # where fairseq-train logs after the update (each 5th), train_step knew at once: None after an overflow there
    fifth = [i for i, none in enumerate(dev_none) if none]
    assert fifth and set(fifth) <= {i for i, none in enumerate(host_none) if none}, (dev_none, host_none)


def test_an_update_reads_no_value_of_the_device(tmp_path, fp16_on_the_cpu):
    """The reads of one steady fp16 update (``benchmarks/opcount.py``'s counter, by calling line): fairseq's host
    check reads the gradient norm four times; on the device only train_step's isfinite check is left, of the finite
    stand-in on the CPU."""
    sites = {}
    for on_device in (False, True):
        trainer = fp16_trainer(tmp_path / str(on_device), on_device=on_device)
        sample = tr.synthetic_sample("causal", 32, 2, 64)
        trainer.train_step([sample])
        sites[on_device] = opcount.trainer_counts(trainer, sample)["host_read_sites"]
    assert sum(sites[False].values()) == 4 and any("fp16_optimizer.py" in s for s in sites[False]), sites[False]
    (site, reads), = sites[True].items()
    assert reads == 1 and site.startswith("fairseq/trainer.py") and site in sites[False], sites


def test_a_save_and_a_validation_read_the_pending_overflow_first(tmp_path, fp16_on_the_cpu):
    trainer = fp16_trainer(tmp_path)
    trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64)])
    overflowing(trainer)
    trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64, seed=1)])  # overflows, counted for now
    assert trainer.get_num_updates() == 2 and trainer.__dict__.get(PENDING) is not None
    trainer.consolidate_optimizer()
    trainer.save_checkpoint(str(tmp_path / "checkpoint.pt"), {})
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert trainer.__dict__.get(PENDING) is None
    assert saved["optimizer_history"][-1]["num_updates"] == 1 == trainer.get_num_updates()
    assert saved["last_optimizer_state"]["loss_scale"] == 2.0 ** 16
    assert [s["step"] for s in saved["last_optimizer_state"]["state"].values()] == [1]

    trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64, seed=2)])
    assert trainer.__dict__.get(PENDING) is not None
    trainer.begin_valid_epoch(1)
    assert trainer.__dict__.get(PENDING) is None


def test_the_minimum_loss_scale_stops_the_next_update_with_fairseqs_error(tmp_path, fp16_on_the_cpu):
    trainer = fp16_trainer(tmp_path)
    trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64)])
    overflowing(trainer)
    trainer.optimizer.scaler.min_loss_scale = 2.0 ** 16  # the first halving reaches it
    trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64, seed=1)])
    with pytest.raises(FloatingPointError, match="Minimum loss scale reached"):
        trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64, seed=2)])
    assert trainer.optimizer.scaler.loss_scale == 2.0 ** 17 and trainer.get_num_updates() == 1  # as fairseq leaves them


def test_the_statistics_of_an_update_are_read_once_its_overflow_is_known(tmp_path, fp16_on_the_cpu):
    trainer = fp16_trainer(tmp_path)
    first = trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64)])
    assert trainer.__dict__.get(PENDING) is not None and "not read yet" in repr(first)
    assert math.isfinite(first["loss"]) and first["sample_size"] == 64  # reading it read the flag
    assert trainer.__dict__.get(PENDING) is None
    overflowing(trainer)
    second = trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64, seed=1)])
    assert dict(second) == {} and trainer.get_num_updates() == 1  # overflowed: nothing logged, not counted


@pytest.mark.parametrize("option", ["--fp16-no-flatten-grads", "--memory-efficient-fp16"])
def test_other_fp16_set_ups_keep_fairseqs_host_check(tmp_path, monkeypatch, fp16_on_the_cpu, option):
    monkeypatch.setitem(tr.PRECISION_OPTIONS, "fp16", [*tr.PRECISION_OPTIONS["fp16"], option])
    trainer = fp16_trainer(tmp_path)
    trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64)])
    assert not device_overflow.applies(trainer) and trainer.__dict__.get(PENDING) is None


def test_it_applies_only_with_the_rows_it_works_with(tmp_path, monkeypatch, fp16_on_the_cpu):
    trainer = fp16_trainer(tmp_path)
    trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64)])
    assert device_overflow.applies(trainer)
    from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin
    from fairseq_tnn.patches import base
    fairseqs = base.resolve("fairseq.optim.fp16_optimizer:_FP16OptimizerMixin.step")
    monkeypatch.setattr(_FP16OptimizerMixin, "step", fairseqs)
    assert not device_overflow.applies(trainer)  # fairseq's step would ignore the device's verdict


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, tr.GRAPHS], ids=["eager", "cuda-graphs"])
def test_on_cuda_an_update_makes_no_sync_and_trains_as_fairseqs(tmp_path, compiled):
    """On a GPU, eager and with the stack's CUDA graphs (the recipe's default there): a steady fp16 update makes no
    synchronising call (torch's sync debug mode, as benchmarks/gpu_profile.py counts them; fairseq's host check makes
    four), and updates with and without overflow leave the weights, count, loss scale and logs of fairseq's check."""
    from benchmarks.gpu_profile import host_syncs
    assert_trains_as_fairseqs(*both(tmp_path, "causal", "tnn_lm_wt103", 14, "cuda", compiled))
    trainer = fp16_trainer(tmp_path / "syncs", device="cuda", compiled=compiled)
    samples = [tr.synthetic_sample("causal", 32, 2, 64, seed=i, device="cuda") for i in range(4)]
    for sample in samples[:3]:
        trainer.train_step([sample])
    syncs = host_syncs(lambda: trainer.train_step([samples[3]]), torch.cuda.set_sync_debug_mode)
    assert syncs["count"] == 0, syncs
