"""Precision: every TNO trains under bf16 and fp16 autocast (forward and the hand-written backwards),
positions stay exact, training through fairseq-train with --bf16-autocast works, and a float64 TNN is its
float64 formula lambda^|t| RPE(t) to float64 round-off.

The autocast tests run on every device (the `device` fixture: CPU, and CUDA where present), each under
that device's autocast (torch.autocast(device)) in both bf16 and fp16: CPU autocast takes fp16 as well
since torch 2.4. Their tolerances are set by the 8- and 11-bit significands, the same on either device.
The refusal of fp16 weights and the fairseq-train run are CPU only (tests/gpu trains on CUDA)."""

import math

import pytest
import torch

from helpers import assert_on, rel

from fairseq_tnn.modules.rpe import Rpe
from fairseq_tnn.modules.tno import build_tno
from fairseq_tnn.ops.toeplitz import toeplitz_ref

KINDS = [("tnn", True), ("tnn", False), ("fd", True), ("fd", False), ("ski", False)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tno,causal", KINDS)
def test_tno_trains_under_autocast(tno, causal, dtype, device):
    """Forward and backward under autocast (fp32 parameters, as in mixed-precision training) agree
    with fp32 to the precision of the low-precision projections; every gradient is finite."""
    torch.manual_seed(0)
    op = build_tno(tno, 48, causal)
    if tno == "ski":  # its default starts the knots at zero: draw them, so that the low rank is tested too
        with torch.no_grad():
            op.knots.normal_(0.0, 0.2)
    op = op.to(device)
    x = torch.randn(2, 300, 48).to(device)
    g = torch.randn(2, 300, 48).to(device)
    ref_x = x.clone().requires_grad_()
    (op(ref_x, layout="bnd") * g).sum().backward()
    ref_grads = [p.grad.clone() for p in op.parameters()]
    op.zero_grad()
    low_x = x.clone().requires_grad_()
    with torch.autocast(device, dtype=dtype):
        y = op(low_x, layout="bnd")
    (y.float() * g).sum().backward()
    assert_on(device, y, low_x.grad)
    assert rel(y, op(x)) < 3e-2
    assert rel(low_x.grad, ref_x.grad) < 3e-2
    for p, ref in zip(op.parameters(), ref_grads):
        assert p.grad is not None and torch.isfinite(p.grad).all()
        assert rel(p.grad, ref) < 5e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rpe_positions_stay_distinct_under_autocast(dtype, device):
    """The RPE's first projection runs in fp32 even under autocast: bf16 cannot tell lag 1000 from
    1001 (8-bit significand), fp16 not 3000 from 3001, so a low-precision projection would merge them."""
    torch.manual_seed(0)
    rpe = Rpe(8, hidden=16, layers=1).to(device)
    lags = torch.tensor([1000.0, 1001.0, 3000.0, 3001.0], device=device)
    with torch.autocast(device, dtype=dtype):
        h = rpe.features(lags)
    assert_on(device, h)
    assert not torch.equal(h[0], h[1]) and not torch.equal(h[2], h[3])
    ref = rpe.features(lags)
    assert rel(h, ref) < 3e-2


@pytest.mark.parametrize("section,arch", [("causal", "tnn_lm_wt103"), ("masked", "tnn_mlm_wt103")])
@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_autocast_reaches_the_gemms_of_both_tasks(tmp_path, section, arch, bf16):
    """fairseq's Trainer of either task with --bf16-autocast runs its training and validation GEMMs (the layers'
    projections, the output layer) in bf16, and without it in fp32. The causal task is a legacy fairseq task, whose
    ``cfg`` is None: reading the option there alone ignored it (causal bf16 trained in fp32; on an H200 its kernels
    took 2.9 times fp16's, docs/performance.md)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    import fairseq_tnn
    from benchmarks import trainer as tr
    fairseq_tnn.register()

    class Gemms(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                self.dtypes[args[-1].dtype] += 1  # the (m, k) @ (k, n) operand: the weight or the activations
            return func(*args, **(kwargs or {}))

    data = tr._dictionary_dir(str(tmp_path), tr.QUICK_VOCAB)
    trainer = tr.build_trainer(section, arch, None, 32, "cpu", "bf16" if bf16 else "fp32", False, data, True)
    sample = tr.synthetic_sample(section, 32, 2, tr.QUICK_VOCAB)
    want = torch.bfloat16 if bf16 else torch.float32
    for step in (lambda: trainer.train_step([sample]), lambda: trainer.valid_step(sample)):
        with Gemms() as gemms:
            step()
        assert gemms.dtypes and set(gemms.dtypes) == {want}, dict(gemms.dtypes)


@pytest.mark.parametrize("section,arch", [("causal", "tnn_lm_wt103"), ("masked", "tnn_mlm_wt103"),
                                          ("masked", "fd_tnn_mlm_wt103"), ("masked", "ski_tnn_mlm_wt103")])
def test_fp16_updates_of_a_new_model_on_padded_batches_do_not_overflow(tmp_path, monkeypatch, section, arch):
    """fairseq's Trainer under --fp16 (fp16 model, FP16Optimizer with its fp32 master copy and loss scale 128; on the
    CPU, which fairseq's fp16 allows once its flat master copy has a device) trains a new model on batches with
    padding without a single overflow: a new model's zero vectors at the padding positions made NaN in the layers'
    RMS norm in fp16 (its eps rounded to zero there; ops/norm.py, ``dtype_eps``), and every such update overflowed
    and was skipped (the masked recipe's --sample-break-mode complete pads nearly every batch)."""
    from fairseq.optim.dynamic_loss_scaler import DynamicLossScaler

    import fairseq_tnn
    from benchmarks import trainer as tr
    fairseq_tnn.register()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # FP16Optimizer's master copy: on the CPU
    norms = []  # the norms found to overflow (the plugin decides on the device, and checks only those on the host)
    check = DynamicLossScaler.check_overflow
    monkeypatch.setattr(DynamicLossScaler, "check_overflow",
                        lambda self, grad_norm: (norms.append(float(grad_norm)), check(self, grad_norm))[1])
    torch.manual_seed(0)
    trainer = tr.build_trainer(section, arch, None, 32, "cpu", "fp16", False, tr._dictionary_dir(str(tmp_path), 64),
                               True, width=16)
    losses = []
    for i in range(4):
        sample = tr.synthetic_sample(section, 32, 3, 64, seed=i)
        for row, start in ((0, 20), (2, 27)):  # two rows padded at the end
            sample["net_input"]["src_tokens"][row, start:] = 1
            sample["target"][row, start:] = 1
        sample["ntokens"] = int((sample["target"] != 1).sum())
        stats = trainer.train_step([sample])
        assert stats, f"update {i} overflowed: gradient norm {norms}"  # (read once its overflow is known)
        losses.append(stats["loss"])
    assert trainer.get_num_updates() == 4 and all(math.isfinite(n) for n in norms), norms
    assert trainer.optimizer.scaler.loss_scale == 128 and all(math.isfinite(x) for x in losses), losses


@pytest.mark.parametrize("task", ["tnn_language_modeling", "tnn_masked_lm"])
@pytest.mark.parametrize("other", ["--fp16", "--amp"])
def test_fairseq_train_refuses_bf16_autocast_with_another_precision(data_bin, tmp_path, task, other):
    """fairseq-train --bf16-autocast with --fp16 or --amp: refused while the command line is parsed, naming both
    options, before anything is loaded or written (exit status 2)."""
    from helpers import lm_train_cmd, mlm_train_cmd, run
    settings = dict(bf16_autocast=True, max_update=2, save_dir=tmp_path / "ck")
    cmd = lm_train_cmd(data_bin, other, **settings) if task == "tnn_language_modeling" else \
        mlm_train_cmd(data_bin, other, **settings)
    log = run(cmd, expect_ok=False)
    assert log.strip().splitlines()[-1].startswith(
        f"fairseq-train: error: --bf16-autocast (fp32 weights under bf16 autocast) cannot be combined with {other}"), \
        log[-3000:]
    assert not (tmp_path / "ck").exists()


def test_bf16_autocast_refuses_low_precision_weights():
    from fairseq_tnn.tasks.precision import _autocast_for
    model = torch.nn.Linear(2, 2).half()
    with pytest.raises(ValueError, match=r"--bf16-autocast .* cannot be combined with torch.float16 weights"):
        _autocast_for(model)


@pytest.mark.parametrize("causal", [True, False])
def test_float64_tnn_is_the_float64_formula(causal):
    """A float64 TNN's kernel is lambda^|t| RPE(t) computed in float64, lag by lag up to |t| = 999 (the decay
    is taken in the RPE's dtype: a float32 decay was off by up to 5e-7), and its forward applies that
    Toeplitz matrix."""
    torch.manual_seed(0)
    tno = build_tno("tnn", 8, causal).double()  # decay 0.99
    n = 1000
    t = torch.arange(-(n - 1), n, dtype=torch.float64)
    formula = torch.tensor(0.99, dtype=torch.float64) ** t.abs() * tno.rpe(t).t()  # (d, 2n - 1): lags -(n-1) .. n-1
    pos, neg = tno.kernel(n)
    assert pos.dtype == torch.float64 and (neg is None) == causal
    got, want = (pos, formula[:, n - 1:]) if causal else (torch.cat([neg.flip(-1), pos], dim=-1), formula)
    per_lag = (got - want).norm(dim=0) / want.norm(dim=0)
    assert per_lag.max() < 1e-13, f"lag {per_lag.argmax().item()}: relative error {per_lag.max().item():.2e}"
    m = 300
    x = torch.randn(2, m, 8, dtype=torch.float64)
    ref = toeplitz_ref(x, formula[:, n - 1:n - 1 + m].t(), None if causal else formula[:, n - m:n - 1].flip(-1).t())
    assert rel(tno(x), ref) < 1e-13


@pytest.mark.slow
@pytest.mark.parametrize("arch,task", [("fd_tnn_lm_tiny", "tnn_language_modeling"), ("ski_tnn_mlm_tiny", "tnn_masked_lm")])
def test_fairseq_train_with_bf16_autocast_learns(data_bin, tmp_path, arch, task):
    """--bf16-autocast through fairseq-train (CPU autocast here; CUDA on a GPU): fp32 weights in the
    checkpoint, finite losses that fall."""
    import re

    from helpers import NO_LR_SCHEDULE, lm_train_cmd, mlm_train_cmd, run
    causal = task == "tnn_language_modeling"
    settings = dict(arch=arch, bf16_autocast=True, tokens_per_sample=128, lr="0.003", max_update=30,
                    save_dir=tmp_path / "ck", log_interval=5, no_epoch_checkpoints=True, validate_interval_updates=10)
    log = run(lm_train_cmd(data_bin, **settings, **NO_LR_SCHEDULE) if causal else mlm_train_cmd(data_bin, **settings))
    losses = [float(x) for x in re.findall(r"valid on 'valid' subset \| loss ([0-9.]+)", log)]
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.5, log[-3000:]
    state = torch.load(tmp_path / "ck" / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    assert all(v.dtype == torch.float32 for v in state["model"].values() if v.is_floating_point())


def _bf16_trainer(tmp_path, section, arch):
    from benchmarks import trainer as tr
    torch.manual_seed(0)
    return tr.build_trainer(section, arch, None, 32, "cpu", "bf16w", False, tr._dictionary_dir(str(tmp_path), 64),
                            True, width=16)


def _bf16_updates(trainer, section, updates=2):
    from benchmarks import trainer as tr
    return [trainer.train_step([tr.synthetic_sample(section, 32, 3, 64, seed=i)])["loss"] for i in range(updates)]


@pytest.mark.parametrize("section,arch", [("causal", "tnn_lm_wt103"), ("masked", "fd_tnn_mlm_wt103"),
                                          ("masked", "ski_tnn_mlm_wt103")])
def test_fairseqs_bf16_trains_bf16_weights_with_an_fp32_master_copy(tmp_path, section, arch):
    """fairseq's own --bf16 off a TPU (fairseq_tnn/patches/bf16.py; here the launch's step that leaves --tpu off is
    build_trainer's): the Trainer on the CPU, the model's weights bf16 but the RPEs' (fp32), FP16Optimizer with an fp32
    master copy per parameter (flat is CUDA's) and no loss scaler; after each update every weight is its master
    weight rounded to its dtype, and the master weights moved."""
    import fairseq_tnn
    from fairseq.optim.fp16_optimizer import FP16Optimizer
    fairseq_tnn.register()
    trainer = _bf16_trainer(tmp_path, section, arch)
    assert trainer.cfg.common.bf16 and trainer.device.type == "cpu"
    # no TPU anywhere: the launch, and masked_lm, which on a TPU scores every token (and reads the masked count back)
    assert not any(trainer.cfg[k].get("tpu", False) for k in trainer.cfg.keys() if hasattr(trainer.cfg[k], "keys"))
    assert not getattr(trainer.criterion, "tpu", False)
    params = list(trainer.model.named_parameters())
    dtypes = {name: p.dtype for name, p in params}
    assert {d for n, d in dtypes.items() if ".rpe." not in n} == {torch.bfloat16}, dtypes
    assert {d for n, d in dtypes.items() if ".rpe." in n} == (set() if "ski" in arch else {torch.float32}), dtypes
    start = [p.detach().float().clone() for _, p in params]
    losses = _bf16_updates(trainer, section)
    opt = trainer.optimizer
    assert isinstance(opt, FP16Optimizer) and opt.scaler is None and not opt.has_flat_params
    assert all(math.isfinite(x) for x in losses), losses
    masters = opt.fp32_params
    assert len(masters) == len(params) and all(m.dtype == torch.float32 for m in masters)
    for (name, p), m, s in zip(params, masters, start):
        assert torch.equal(p.detach(), m.detach().to(p.dtype)), name
    moved = [name for (name, _), m, s in zip(params, masters, start) if not torch.equal(m.detach(), s)]
    assert len(moved) > 0.9 * len(params), moved


def test_fairseqs_bf16_with_a_flat_master_copy_trains_as_with_one_per_parameter(tmp_path, monkeypatch):
    """--bf16's flat master copy (what bf16-flat-master builds on CUDA; here on the CPU, its device index faked as
    fairseq's fp16 test of the flat copy does): one fp32 tensor for the syncs, the clipping and Adam, and the same
    training as fairseq's per-parameter copy, update by update."""
    import fairseq_tnn
    from fairseq_tnn.patches import bf16
    fairseq_tnn.register()
    runs = {}
    for flat in (False, True):
        with monkeypatch.context() as m:
            if flat:
                m.setattr(bf16, "flat_bf16", lambda cfg, params: True)
                m.setattr(torch.cuda, "current_device", lambda: None)  # the flat copy's key: the CPU's device index
            trainer = _bf16_trainer(tmp_path / str(flat), "causal", "tnn_lm_wt103")
            losses = _bf16_updates(trainer, "causal", 3)
            assert trainer.optimizer.has_flat_params == flat and trainer.optimizer.scaler is None
            masters = trainer.optimizer.fp32_params
            master = torch.cat([m.detach().reshape(-1) for m in (masters.values() if flat else masters)])
            runs[flat] = losses, master, [p.detach().clone() for p in trainer.model.parameters()]
    (loss0, master0, w0), (loss1, master1, w1) = runs[False], runs[True]
    assert loss0 == pytest.approx(loss1, rel=1e-6), (loss0, loss1)
    assert rel(master1, master0) < 1e-6  # bit for bit on the CI machine; the clipping's norm may sum in another order
    assert all(torch.equal(a, b.to(a.dtype)) or rel(a.float(), b.float()) < 1e-2 for a, b in zip(w0, w1))


def test_bf16_leaves_tpu_off_only_without_torch_xla_or_tpu(monkeypatch):
    """fairseq turns --tpu on with --bf16; the plugin turns it off again where neither torch_xla is installed nor --tpu
    given, and leaves every other configuration as it is."""
    from omegaconf import OmegaConf

    from fairseq_tnn.patches import bf16

    def cfg(bf16_on=True, tpu=True):  # as fairseq-train's command line makes it: copies of the flag, not references
        return OmegaConf.create({"common": {"bf16": bf16_on, "tpu": tpu, "cpu": False}, "criterion": {"tpu": tpu},
                                 "distributed_training": {"tpu": tpu}, "optimizer": {"tpu": tpu, "lr": [0.1]},
                                 "task": {"data": "x"}, "model": None})
    monkeypatch.setattr(bf16, "_xla_installed", lambda: False)
    c = cfg()
    assert bf16.bf16_leaves_tpu_off(c, ["data", "--bf16"])
    assert OmegaConf.to_container(c) == {**OmegaConf.to_container(cfg(tpu=False)), "common": {"bf16": True, "tpu": False,
                                                                                          "cpu": False}}
    for c, argv in ((cfg(), ["data", "--bf16", "--tpu"]), (cfg(tpu=False), ["--bf16"]), (cfg(bf16_on=False), ["--tpu"])):
        before = OmegaConf.to_container(c)
        assert not bf16.bf16_leaves_tpu_off(c, argv) and OmegaConf.to_container(c) == before
    monkeypatch.setattr(bf16, "_xla_installed", lambda: True)
    c = cfg()
    assert not bf16.bf16_leaves_tpu_off(c, ["--bf16"]) and c.common.tpu is True


@pytest.mark.parametrize("other", ["--fp16", "--amp"])
def test_fairseq_train_refuses_bf16_with_an_fp16_precision(data_bin, tmp_path, other):
    """fairseq-train --bf16 with --fp16 or --amp: refused while the command line is parsed, naming both options (fairseq
    would say "Cannot combine --fp16 and --tpu"), before anything is written."""
    from helpers import lm_train_cmd, run
    log = run(lm_train_cmd(data_bin, "--bf16", other, max_update=2, save_dir=tmp_path / "ck"), expect_ok=False)
    assert log.strip().splitlines()[-1].startswith(
        f"fairseq-train: error: --bf16 (bf16 weights) cannot be combined with {other} (fp16)"), log[-3000:]
    assert not (tmp_path / "ck").exists()


@pytest.mark.slow
@pytest.mark.parametrize("arch,task", [("fd_tnn_lm_tiny", "tnn_language_modeling"), ("ski_tnn_mlm_tiny", "tnn_masked_lm")])
def test_fairseq_train_with_fairseqs_bf16_learns_and_its_checkpoint_scores(data_bin, tmp_path, arch, task):
    """fairseq-train --bf16 --cpu (fairseq's own option, which without the plugin means a TPU and fails asking
    torch_xla for a device): the launch says it trains bf16 weights, the losses are finite and fall, and
    fairseq-eval-lm scores the checkpoint (saved in fp32, as fairseq saves any 16-bit model)."""
    import re

    from helpers import NO_LR_SCHEDULE, USER_DIR, cli, lm_train_cmd, mlm_train_cmd, run
    causal = task == "tnn_language_modeling"
    settings = dict(arch=arch, tokens_per_sample=128, lr="0.003", max_update=30, save_dir=tmp_path / "ck",
                    log_interval=5, no_epoch_checkpoints=True, validate_interval_updates=10)
    log = run(lm_train_cmd(data_bin, "--bf16", **settings, **NO_LR_SCHEDULE) if causal
              else mlm_train_cmd(data_bin, "--bf16", **settings))
    assert "--bf16 without torch_xla: bf16 weights with an fp32 master copy on the CPU" in log, log[-3000:]
    losses = [float(x) for x in re.findall(r"valid on 'valid' subset \| loss ([0-9.]+)", log)]
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.5, log[-3000:]
    if causal:
        out = run([cli("fairseq-eval-lm"), data_bin, "--user-dir", USER_DIR, "--cpu", "--task", task, "--path",
                   tmp_path / "ck" / "checkpoint_last.pt", "--gen-subset", "test", "--sample-break-mode", "none",
                   "--tokens-per-sample", 128, "--batch-size", 4, "--num-workers", 0])
        ppl = re.search(r"Loss \(base 2\): [0-9.]+, Perplexity: ([0-9.]+)", out)
        assert ppl and math.isfinite(float(ppl.group(1))), out[-2000:]


def test_fairseq_train_with_memory_efficient_bf16_trains_without_a_master_copy(data_bin, tmp_path):
    """fairseq's --memory-efficient-bf16 (bf16 weights, no fp32 master copy: MemoryEfficientFP16Optimizer) leaves --tpu
    off too, says so, and trains: finite losses over a few updates."""
    import re

    from helpers import NO_LR_SCHEDULE, lm_train_cmd, run
    log = run(lm_train_cmd(data_bin, "--memory-efficient-bf16", arch="tnn_lm_tiny", tokens_per_sample=64, max_update=10,
                           log_interval=5, save_dir=tmp_path / "ck", no_save=True, **NO_LR_SCHEDULE))
    assert "--bf16 without torch_xla: bf16 weights without a master copy (--memory-efficient-bf16) on the CPU" in log, \
        log[-3000:]
    losses = [float(x) for x in re.findall(r"train_inner \| .*?loss=([0-9.]+)", log)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), log[-3000:]
