"""``--fp16``'s overflow decided on the device (fairseq_tnn/patches/device_overflow.py): through fairseq's Trainer,
updates that overflow and updates that do not train, count, scale and log exactly as fairseq's own host check does,
while the update reads no device value; the flag is read before the next update, at once where fairseq-train acts
after the update, before a save and before a validation. On the CPU, with FP16Optimizer's flat master copy keyed as
fairseq's fp16 tests of it do (its device index faked); tests/gpu has the CUDA run, where the update makes no sync."""
import math
import re

import pytest
import torch
from fairseq import metrics

from benchmarks import opcount
from benchmarks import trainer as tr
from helpers import command_env, execute, lm_train_cmd
from fairseq_tnn import register
from fairseq_tnn.patches import device_overflow
from fairseq_tnn.patches.device_overflow import PENDING

register()  # the plugin as fairseq loads it (--user-dir): models, tasks and patches
# Meters of time and memory, which differ from run to run (the GPU's peak by what each run's caching allocator holds)
TIMED = {"ups", "wps", "update_ms", "max_rss_mb", "gpu_peak_mb", "train_wall", "wall", "gb_free"}


@pytest.fixture
def on_the_cpu(monkeypatch):
    monkeypatch.setattr(device_overflow, "ON", ("cuda", "cpu"))  # (on the CPU fairseq's check costs nothing)


@pytest.fixture
def fp16_on_the_cpu(monkeypatch, on_the_cpu):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # FP16Optimizer's flat master copy on the CPU
    # fairseq's overflow handler puts a zero norm on CUDA, which this CPU has not
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)


def fp16_trainer(tmp_path, section="causal", arch="tnn_lm_wt103", device="cpu", compiled=False, on_device=True,
                 precision="fp16"):
    """A small model's Trainer (``precision``: the benchmarks' fp16, bf16 (autocast), bf16w (fairseq's --bf16) or
    fp32); ``on_device=False``: with fairseq's check of the norm on the host."""
    torch.manual_seed(0)
    if compiled:
        torch._dynamo.reset()  # each model compiles afresh (as benchmarks/gpu_profile.py does)
    trainer = tr.build_trainer(section, arch, None, 32, device, precision, compiled,
                               tr._dictionary_dir(str(tmp_path), 64), True, width=16)
    setattr(trainer, device_overflow.HOST_CHECK, not on_device)
    trainer.cfg.common.log_interval = 5  # before the first update, which snapshots the config
    trainer.cfg.checkpoint.save_dir = str(tmp_path / "checkpoints")
    (tmp_path / "checkpoints").mkdir(parents=True)  # (fairseq-train makes it)
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
                if i == 0 and getattr(trainer.optimizer, "scaler", None) is not None:
                    overflowing(trainer)
            results.append(out is None)
            weights.append(torch.cat([p.detach().float().reshape(-1) for p in trainer.model.parameters()]))
        assert (trainer.__dict__.get(PENDING) is not None) == on_device
        device_overflow.learn(trainer)
        kind = "scaler" if getattr(trainer.optimizer, "scaler", None) else "error"
        assert device_overflow.applies(trainer) == (kind if on_device else None)
        values = metrics.get_smoothed_values("train")
    return results, weights, {k: v for k, v in values.items() if k not in TIMED}


def state(trainer):
    opt = trainer.optimizer
    scaler, adam = getattr(opt, "scaler", None), device_overflow._adam(trainer)
    masters = getattr(opt, "fp32_params", {})
    masters = masters.values() if isinstance(masters, dict) else masters
    return {"num_updates": trainer.get_num_updates(), "lr": trainer.get_lr(),
            "loss_scale": scaler and scaler.loss_scale,
            "scaler": scaler and (scaler._iter, scaler._last_overflow_iter, scaler._last_rescale_iter,
                                  scaler._overflows_since_rescale),
            "adam_steps": [s["step"] for s in adam.state.values()],
            "master": torch.cat([m.detach().reshape(-1) for m in masters] or [torch.zeros(0)])}


def both(tmp_path, section, arch, steps, device="cpu", compiled=False, precision="fp16"):
    runs = {}
    for on_device in (False, True):
        trainer = fp16_trainer(tmp_path / str(on_device), section, arch, device, compiled, on_device, precision)
        runs[on_device] = (*train(trainer, section, steps, on_device, device), state(trainer))
    return runs[False], runs[True]


@pytest.mark.parametrize("section,arch", [("causal", "tnn_lm_wt103"), ("masked", "fd_tnn_mlm_wt103")])
def test_updates_with_and_without_overflow_train_count_and_log_as_fairseqs(tmp_path, fp16_on_the_cpu, section, arch):
    assert_trains_as_fairseqs(*both(tmp_path, section, arch, 14))


def assert_trains_as_fairseqs(host_run, device_run, overflows=True):
    (host_none, host_w, host_logs, host), (dev_none, dev_w, dev_logs, dev) = host_run, device_run
    if overflows:
        assert host["scaler"][0] - host["num_updates"] >= 3 and host["num_updates"] >= 5, host  # both kinds happened
    else:
        assert host["num_updates"] == len(host_w) and not any(host_none), host
    for i, (a, b) in enumerate(zip(host_w, dev_w)):
        assert torch.equal(a, b), f"the weights after update {i} differ"
    for key in ("num_updates", "lr", "loss_scale", "scaler", "adam_steps"):
        assert dev[key] == host[key], (key, dev[key], host[key])
    assert torch.equal(dev["master"], host["master"])
    assert dev_logs == host_logs
    # where fairseq-train logs after the update (each 5th), train_step knew at once: None after an overflow there
    fifth = [i for i, none in enumerate(dev_none) if none]
    assert set(fifth) <= {i for i, none in enumerate(host_none) if none}, (dev_none, host_none)
    assert bool(fifth) == overflows


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16w"])
def test_without_a_loss_scaler_updates_train_count_and_log_as_fairseqs(tmp_path, monkeypatch, fp16_on_the_cpu,
                                                                       precision):
    """fp32, bf16 autocast and fairseq's --bf16 (FP16Optimizer without a loss scaler, its master copy flat as on
    CUDA): train_step's check of the norm on the device, the same training and logs as fairseq's."""
    from fairseq_tnn.patches import bf16
    monkeypatch.setattr(bf16, "flat_bf16", lambda cfg, params: True)
    assert_trains_as_fairseqs(*both(tmp_path, "causal", "tnn_lm_wt103", 7, precision=precision), overflows=False)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_non_finite_norm_stops_the_next_update_as_fairseqs_check_stops_its_own(tmp_path, monkeypatch, fp16_on_the_cpu,
                                                                                 caplog, precision):
    """A NaN in the forward, and so in the gradients: without a loss scaler, fairseq's train_step saves crash.pt, runs the update again under its
    NanDetector and raises "gradients are Nan/Inf"; with the check on the device the update is skipped there and the
    next one does all that, from the same weights, count and Adam state. With fp16's scaler a NaN is an overflow
    instead, unless the scale is at --min-loss-scale: then fairseq's "Minimum loss scale reached" is raised the
    same way."""
    ends = {}
    for on_device in (False, True):
        trainer = fp16_trainer(tmp_path / str(on_device), on_device=on_device, precision=precision)
        trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64)])
        if precision == "fp16":
            trainer.optimizer.scaler.min_loss_scale = 64.0  # the next overflow halves 128 to it
        weights = [p.detach().clone() for p in trainer.model.parameters()]
        poisoned = trainer.model.decoder.embed_tokens.register_forward_hook(lambda module, x, out: out * math.nan)
        message = "gradients are Nan/Inf" if precision == "fp32" else "Minimum loss scale reached"
        caplog.clear()
        with pytest.raises(FloatingPointError, match=message):
            trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64, seed=1)])
            assert on_device  # fairseq's check raised in the update itself; on the device, in the next one
            trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64, seed=2)])
        poisoned.remove()
        assert (tmp_path / str(on_device) / "checkpoints" / "crash.pt").is_file()
        assert any("NaN detected" in r.getMessage() or "Inf detected" in r.getMessage() for r in caplog.records)
        assert all(torch.equal(a, b.detach()) for a, b in zip(weights, trainer.model.parameters()))
        ends[on_device] = state(trainer)
    for key in ("num_updates", "lr", "loss_scale", "scaler", "adam_steps"):
        assert ends[True][key] == ends[False][key], key
    assert torch.equal(ends[True]["master"], ends[False]["master"])


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


def test_the_statistics_of_an_update_are_read_once_its_overflow_is_known(tmp_path, fp16_on_the_cpu):
    trainer = fp16_trainer(tmp_path)
    first = trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64)])
    assert trainer.__dict__.get(PENDING) is not None and "not read yet" in repr(first)
    assert math.isfinite(first["loss"]) and first["sample_size"] == 64  # reading it read the flag
    assert trainer.__dict__.get(PENDING) is None
    overflowing(trainer)
    second = trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64, seed=1)])
    assert dict(second) == {} and trainer.get_num_updates() == 1  # overflowed: nothing logged, not counted


def test_on_the_cpu_fairseqs_check_stays(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    for precision in ("fp16", "fp32"):
        trainer = fp16_trainer(tmp_path / precision, precision=precision)
        trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64)])
        assert device_overflow.applies(trainer) is None and trainer.__dict__.get(PENDING) is None


@pytest.mark.parametrize("option", ["--fp16-no-flatten-grads", "--memory-efficient-fp16"])
def test_other_fp16_set_ups_keep_fairseqs_host_check(tmp_path, monkeypatch, fp16_on_the_cpu, option):
    monkeypatch.setitem(tr.PRECISION_OPTIONS, "fp16", [*tr.PRECISION_OPTIONS["fp16"], option])
    trainer = fp16_trainer(tmp_path)
    trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64)])
    assert not device_overflow.applies(trainer) and trainer.__dict__.get(PENDING) is None


def test_it_applies_only_with_the_rows_it_works_with(tmp_path, monkeypatch, fp16_on_the_cpu):
    trainer = fp16_trainer(tmp_path)
    trainer.train_step([tr.synthetic_sample("causal", 32, 2, 64)])
    assert device_overflow.applies(trainer) == "scaler"
    from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin
    from fairseq_tnn.patches import base
    fairseqs = base.resolve("fairseq.optim.fp16_optimizer:_FP16OptimizerMixin.step")
    monkeypatch.setattr(_FP16OptimizerMixin, "step", fairseqs)
    assert not device_overflow.applies(trainer)  # fairseq's step would ignore the device's verdict


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision,compiled", [("fp16", False), ("fp16", tr.GRAPHS), ("bf16", False),
                                                ("bf16w", tr.GRAPHS)],
                         ids=["fp16-eager", "fp16-cuda-graphs", "bf16-autocast-eager", "bf16-weights-cuda-graphs"])
def test_on_cuda_an_update_makes_no_sync_and_trains_as_fairseqs(tmp_path, precision, compiled):
    """On a GPU, eager and with the stack's CUDA graphs (the recipe's default there), fp16 and both bf16s: a steady
    update makes no synchronising call (torch's sync debug mode, as benchmarks/gpu_profile.py counts them; fairseq's
    check makes four under fp16, one otherwise), its CUDA events' waits only the step metrics' and the device
    check's flag copy (one each, for work an update old), and updates (with and without overflow, under fp16) leave
    the weights, count, loss scale and logs of fairseq's check."""
    from benchmarks.gpu_profile import host_syncs
    scaler = precision == "fp16"
    assert_trains_as_fairseqs(*both(tmp_path, "causal", "tnn_lm_wt103", 14 if scaler else 7, "cuda", compiled,
                                    precision), overflows=scaler)
    trainer = fp16_trainer(tmp_path / "syncs", device="cuda", compiled=compiled, precision=precision)
    samples = [tr.synthetic_sample("causal", 32, 2, 64, seed=i, device="cuda") for i in range(4)]
    for sample in samples[:3]:
        trainer.train_step([sample])
    syncs = host_syncs(lambda: trainer.train_step([samples[3]]), torch.cuda.set_sync_debug_mode, (torch.cuda.Event,))
    assert syncs["count"] == 0, syncs
    # the only event waits: the step metrics' for the update before's end, and the device's check's flag copy
    assert device_overflow.applies(trainer)
    expected = {"fairseq_tnn/tasks/step_metrics.py", "fairseq_tnn/patches/device_overflow.py"}
    assert {s["where"].rsplit(":", 1)[0] for s in syncs["event_waits"]["sites"]} == expected, syncs
    assert all(s["calls"] == 1 for s in syncs["event_waits"]["sites"]), syncs


TIMING_KEYS = re.compile(r'"(?:\w+_)?(?:wps|ups|wall|train_wall|update_ms|max_rss_mb|gb_free)": "[^"]*",? ?')


@pytest.mark.slow
def test_fairseq_train_logs_and_saves_what_it_does_with_fairseqs_check(data_bin, tmp_path, monkeypatch):
    """fairseq-train (the tests' causal recipe, fp32 on the CPU; the check made on the device as on a GPU, opted in
    here) over two short epochs of 68 updates with logs every 3 updates, a save and a validation every 5 and at each
    epoch's end (so the first epoch ends with an update whose check the validation reads, its statistics logged into
    the interval that goes on in the next epoch): the same json log lines, values and all (timings aside), and the
    same last checkpoint as with fairseq's check."""
    runs = {}
    for on_device in (False, True):
        with monkeypatch.context() as m:
            if on_device:
                m.setattr(device_overflow, "ON", ("cuda", "cpu"))
            pending = []
            learn = device_overflow.learn
            m.setattr(device_overflow, "learn", lambda trainer: pending.append(learn(trainer)) or pending[-1])
            save = tmp_path / str(on_device)
            code, log, _ = execute(lm_train_cmd(data_bin, tokens_per_sample=32, batch_size=8, max_epoch=2,
                                                train_subset="valid", valid_subset="test", max_valid_steps=2,
                                                log_format="json", log_interval=3, save_interval_updates=5,
                                                save_dir=save), command_env(), 600, merge=True)
        assert code == 0, log[-3000:]
        assert any(p is not None for p in pending) == on_device  # the updates were left to the device
        records = [TIMING_KEYS.sub("", line[line.index("{"):]) for line in log.splitlines() if '{"' in line]
        checkpoint = torch.load(save / "checkpoint_last.pt", weights_only=False)
        runs[on_device] = records, checkpoint
    (host_log, host_ck), (dev_log, dev_ck) = runs[False], runs[True]
    assert len(host_log) >= 8 and dev_log == host_log, "\n".join(dev_log[:4] + ["..."] + host_log[:4])
    assert dev_ck["optimizer_history"][-1]["num_updates"] == host_ck["optimizer_history"][-1]["num_updates"] > 4
    for name, value in host_ck["model"].items():
        assert torch.equal(dev_ck["model"][name], value), name
