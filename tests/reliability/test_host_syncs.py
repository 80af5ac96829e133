"""No host sync per update from the plugin's own code (on a GPU a sync stalls the queue of launched kernels that
compiled layers keep full): one update of a tiny causal and a tiny masked model through fairseq's Trainer, on the
CPU, with every call that waits for the device counted where fairseq_tnn's code makes it; and the update time
read from CUDA events one update later instead of torch.cuda.synchronize (step_metrics), with CUDA faked."""
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fairseq import metrics

import fairseq_tnn
from fairseq_tnn.patches.masked_positions import add_masked_positions
from fairseq_tnn.recipe import TASK
from fairseq_tnn.tasks import step_metrics
from helpers import USER_DIR

PLUGIN_DIR = os.path.dirname(os.path.abspath(fairseq_tnn.__file__)) + os.sep
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# What makes the host wait for the device: reading a value (item, tolist, numpy, cpu, a tensor in an `if`, int()
# or float() of one), an output whose size depends on values (nonzero), or a sync itself. A reduction such as
# .any() stays on the device; `if t.any():` waits through __bool__; and indexing with a boolean mask, x[mask], whose
# output size only the mask's values say (counted as "boolean index").
TENSOR_SYNCS = ["item", "tolist", "numpy", "cpu", "nonzero", "__bool__", "__int__", "__float__", "__index__"]
VOCAB = 100
N = 24


def plugin_caller():
    """'file:line' of the code that made the call, if it is fairseq_tnn's: the innermost frame outside torch
    (torch's own functions called by the plugin count as the plugin's) and outside this test; else None."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH_DIR)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(PLUGIN_DIR):
        return None
    return f"{os.path.relpath(frame.f_code.co_filename, PLUGIN_DIR)}:{frame.f_lineno}"


def count_plugin_syncs(monkeypatch):
    """Wrap the syncing calls; returns the list that collects 'name at file:line' of each made by the plugin."""
    calls = []

    def counted(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            where = plugin_caller()
            if where is not None:
                calls.append(f"{name} at {where}")
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, wrapper)

    for name in TENSOR_SYNCS:
        counted(torch.Tensor, name)
    counted(torch, "nonzero")
    counted(torch.cuda, "synchronize")
    getitem = torch.Tensor.__getitem__

    def boolean_index(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            where = plugin_caller()
            if where is not None:
                calls.append(f"boolean index at {where}")
        return getitem(self, index)
    monkeypatch.setattr(torch.Tensor, "__getitem__", boolean_index)
    return calls


def build_trainer(data_dir: Path, arch: str, causal: bool):
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer
    from fairseq_tnn.models.build import dictionary_of_size

    dictionary_of_size(VOCAB).save(str(data_dir / "dict.txt"))
    argv = [str(data_dir), "--user-dir", USER_DIR, "--cpu", "--arch", arch, "--tokens-per-sample", str(N),
            "--task", "tnn_language_modeling" if causal else "tnn_masked_lm",
            "--criterion", TASK["causal" if causal else "masked"]["criterion"], "--optimizer", "adam", "--lr", "1e-3",
            "--clip-norm", "1.0", "--dropout", "0.1", "--seed", "1", "--distributed-world-size", "1"]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    return Trainer(cfg, task, model, task.build_criterion(cfg.criterion))


def sample(causal: bool, pad: int, positions: bool = True):
    """A batch of 4 sequences of N tokens, the last two right-padded (as fairseq's collater pads); a masked one with
    its masked positions, as tnn_masked_lm collates it, unless ``positions`` is False (another task's batch)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, VOCAB, (4, N), generator=g)
    lengths = torch.tensor([N, N, N - 5, N - 9])
    padding = torch.arange(N) >= lengths.unsqueeze(1)
    tokens[padding] = pad
    if causal:
        target = torch.randint(4, VOCAB, (4, N), generator=g).masked_fill(padding, pad)
    else:  # masked_lm: the target is the padding symbol except at the masked positions
        masked = (torch.rand(4, N, generator=g) < 0.3) & ~padding
        masked[:, 1] = True
        target = torch.where(masked, torch.randint(4, VOCAB, (4, N), generator=g), torch.full_like(tokens, pad))
    batch = {"id": torch.arange(4), "nsentences": 4, "ntokens": int((target != pad).sum()),
             "net_input": {"src_tokens": tokens, "src_lengths": lengths}, "target": target}
    return batch if causal or not positions else add_masked_positions(batch, pad)


@pytest.mark.parametrize("arch", ["tnn_lm_tiny", "fd_tnn_lm_tiny", "tnn_mlm_tiny", "fd_tnn_mlm_tiny",
                                  "ski_tnn_mlm_tiny"])
def test_a_training_update_makes_no_host_sync_in_the_plugin(arch, tmp_path, monkeypatch):
    causal = "_mlm_" not in arch
    trainer = build_trainer(tmp_path, arch, causal)
    batch = sample(causal, trainer.task.source_dictionary.pad())
    trainer.train_step([batch])  # the first update builds the optimizer state; the count is of the second
    calls = count_plugin_syncs(monkeypatch)
    with metrics.aggregate(new_root=True):
        out = trainer.train_step([batch])
    assert out is not None and trainer.get_num_updates() == 2
    assert calls == [], f"host syncs made by fairseq_tnn in one update: {calls}"
    if causal:
        return
    # a masked batch that does not name its masked positions (another task's) goes through fairseq's criterion, whose
    # mask the model indexes its features with (x[masked_tokens], as fairseq's RoBERTa does): the one sync seen
    with metrics.aggregate(new_root=True):
        trainer.train_step([sample(causal, trainer.task.source_dictionary.pad(), positions=False)])
    assert [c.rsplit(":", 1)[0] for c in calls] == ["boolean index at models/tnn_mlm.py"], calls


@pytest.mark.parametrize("arch", ["tnn_mlm_tiny", "fd_tnn_mlm_tiny", "ski_tnn_mlm_tiny"])
def test_the_batchs_masked_positions_train_as_fairseqs_mask_does(arch, tmp_path):
    """The recipe's masked criterion (tnn_masked_lm: fairseq's masked_lm, its forward patched) with the batch's
    masked positions (patches/masked_positions.py) against fairseq's own code with the mask, through fairseq's Trainer, dropout on: the same loss and sample size at every update and the
    same weights after three, to the bit; the sample size a Python int (nothing for the Trainer to read back)."""
    from fairseq.criterions.masked_lm import MaskedLmLoss
    assert getattr(MaskedLmLoss.forward, "fairseq_tnn_patch", None) == "masked-lm-positions"
    runs = {}
    for positions in (True, False):
        (tmp_path / str(positions)).mkdir()
        torch.manual_seed(0)  # the same initial weights
        trainer = build_trainer(tmp_path / str(positions), arch, causal=False)
        pad = trainer.task.source_dictionary.pad()
        outputs = []
        for update in range(3):
            batch = sample(False, pad, positions)
            if update == 2:  # the rare batch without a masked token: fairseq scores every position (loss 0)
                batch["target"].fill_(pad)
                batch["ntokens"] = 0
                if positions:
                    add_masked_positions(batch, pad)
            loss, sample_size, logging = trainer.criterion(trainer.model, trainer._prepare_sample(batch)[0])
            outputs.append((loss.detach(), sample_size, logging["loss"]))
            with metrics.aggregate(new_root=True):
                trainer.train_step([batch])
        runs[positions] = (outputs, [p.detach().clone() for p in trainer.model.parameters()])
    (with_positions, weights), (with_mask, mask_weights) = runs[True], runs[False]
    assert [o[1] for o in with_positions] == [int(o[1]) for o in with_mask] and with_positions[2][1] == 0
    assert all(type(o[1]) is int for o in with_positions) and all(torch.is_tensor(o[1]) for o in with_mask)
    for (loss, _, logged), (mask_loss, _, mask_logged) in zip(with_positions, with_mask):
        assert torch.equal(loss, mask_loss) and torch.equal(logged, mask_logged), (loss, mask_loss)
    assert with_positions[2][0] == 0
    assert all(torch.equal(a, b) for a, b in zip(weights, mask_weights))


def test_the_criterion_hands_positions_only_to_a_model_that_takes_them(tmp_path, monkeypatch):
    """Another model (here the plugin's, saying it does not take positions) gets fairseq's mask, and the flat positions
    the plugin's model takes index the same features as that mask."""
    from fairseq_tnn.models.tnn_mlm import TnnEncoder
    trainer = build_trainer(tmp_path, "tnn_mlm_tiny", causal=False)
    batch = sample(False, trainer.task.source_dictionary.pad())
    seen, forward = [], TnnEncoder.forward

    def spy(self, *args, masked_tokens=None, **kwargs):
        seen.append(masked_tokens)
        return forward(self, *args, masked_tokens=masked_tokens, **kwargs)
    monkeypatch.setattr(TnnEncoder, "forward", spy)
    model = trainer.model.eval()
    with torch.no_grad():
        by_positions = trainer.criterion(model, batch)
        monkeypatch.setattr(type(model), "scores_masked_positions", False)
        by_mask = trainer.criterion(model, batch)
    assert seen[0].dtype == torch.int64 and torch.equal(seen[0], batch["masked_positions"])
    assert seen[1].dtype == torch.bool and torch.equal(seen[1].reshape(-1).nonzero().reshape(-1), seen[0])
    assert torch.equal(by_positions[0], by_mask[0]) and by_positions[1] == int(by_mask[1]) > 0


def test_the_masked_tasks_batches_name_their_masked_positions(data_bin):
    """tnn_masked_lm's batches, as fairseq's iterator hands them to the Trainer, carry the flat positions of their
    masked tokens: those whose target is not padding, in row-major order."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    argv = [str(data_bin), "--user-dir", USER_DIR, "--task", "tnn_masked_lm", "--tokens-per-sample", "32",
            "--arch", "tnn_mlm_tiny", "--seed", "3"]
    task = tasks.setup_task(convert_namespace_to_omegaconf(
        options.parse_args_and_arch(options.get_training_parser(), argv)).task)
    task.load_dataset("valid")
    batches = task.get_batch_iterator(task.dataset("valid"), max_tokens=256).next_epoch_itr(shuffle=False)
    pad, seen = task.source_dictionary.pad(), 0
    for batch in batches:
        expected = [i for i, t in enumerate(batch["target"].reshape(-1).tolist()) if t != pad]
        assert batch["masked_positions"].tolist() == expected and batch["masked_positions"].dtype == torch.int64
        seen += len(expected)
    assert seen > 0


def test_the_masked_models_training_mask_changes_no_output():
    """In training the masked model keeps an all-False padding mask where evaluation has None (to skip a host
    sync): the same features, and the same classification, to the bit."""
    from fairseq_tnn.models.build import build_arch
    torch.manual_seed(0)
    model = build_arch("tnn_mlm_tiny", VOCAB, pooler_dropout=0.0)  # no dropout anywhere
    model.register_classification_head("cls", num_classes=3)
    tokens = torch.randint(4, VOCAB, (2, 20))
    with torch.no_grad():
        trained = model.train()(tokens, features_only=True)
        evaluated = model.eval()(tokens, features_only=True)
        assert evaluated[1]["padding_mask"] is None
        assert torch.equal(trained[1]["padding_mask"], torch.zeros(2, 20, dtype=torch.bool))
        assert torch.equal(trained[0], evaluated[0])
        head = model.classification_heads["cls"]
        assert torch.equal(head(trained[0], trained[1]["padding_mask"]), head(evaluated[0], None))
        # with padding: the padded positions masked in both modes, the same outputs
        padded = torch.cat([tokens, torch.full((2, 5), model.encoder.padding_idx)], dim=1)
        a = model.train()(padded, classification_head_name="cls")
        b = model.eval()(padded, classification_head_name="cls")
        assert torch.equal(a[1]["padding_mask"], b[1]["padding_mask"]) and a[1]["padding_mask"][:, 20:].all()
        assert torch.equal(a[0], b[0])


def test_the_counter_sees_the_plugins_syncs(monkeypatch):
    """The counter is not blind: the plugin's syncs in evaluation (where it may make them) are seen, fairseq's
    are not."""
    from fairseq_tnn.models.build import build_arch
    model = build_arch("tnn_mlm_tiny", VOCAB).eval()
    calls = count_plugin_syncs(monkeypatch)
    with torch.no_grad():
        model(torch.randint(4, VOCAB, (2, 8)))
    assert any(c.startswith("__bool__ at models/tnn_mlm.py:") for c in calls), calls
    calls.clear()
    from fairseq import utils
    utils.item(torch.tensor(1.0))  # fairseq's own .item()
    bool(torch.tensor(True))  # this test's
    assert calls == []


class FakeEvent:
    """A CUDA event on a fake clock: record() stamps it, elapsed_time() gives the stamps' difference."""
    clock = 0.0
    log = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.time = None

    def record(self, stream=None):
        self.time = FakeEvent.clock

    def synchronize(self):
        FakeEvent.log.append(("synchronize", self))

    def elapsed_time(self, end):
        FakeEvent.log.append(("elapsed_time", self, end))
        return end.time - self.time


class FakeBase:
    """fairseq's task methods: an update takes 10 ms times its number on the fake clock."""

    def train_step(self, sample, model, *args, **kwargs):
        FakeEvent.clock += 10.0 * sample

    def optimizer_step(self, optimizer, model, update_num):
        pass


class FakeTask(step_metrics.StepMetricsMixin, FakeBase):
    pass


class FakeCudaModel:
    def parameters(self):
        yield SimpleNamespace(is_cuda=True)


def test_update_time_on_cuda_is_read_one_update_later_without_a_device_sync(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(a))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict",
                        lambda *a: {"allocated_bytes": {"all": {"peak": 3 * 2 ** 20}}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(FakeEvent, "log", [])
    task, logged = FakeTask(), []
    for update in (1, 2, 3):
        with metrics.aggregate(new_root=True) as agg:
            for _ in range(2):  # --update-freq 2: two train_steps, one optimizer step
                task.train_step(update, FakeCudaModel())
            task.optimizer_step(None, FakeCudaModel(), update)
            logged.append(agg.get_smoothed_values())
    assert syncs == []
    assert logged[0] == {"gpu_peak_mb": 3.0}  # the first update's time is not read yet
    assert logged[1] == {"update_ms": 20.0, "gpu_peak_mb": 3.0}  # update 1: two train_steps of 10 ms
    assert logged[2] == {"update_ms": 40.0, "gpu_peak_mb": 3.0}  # update 2
    # what was waited for: only an event of a finished update, the end of the one before, then read
    (_, sync2), (_, start1, end1), (_, sync3), (_, start2, end2) = FakeEvent.log
    assert sync2 is end1 and sync3 is end2 and start1.time == 0.0 and end1.time == 20.0 and end2.time == 60.0


def test_update_time_on_the_cpu_is_logged_with_the_update(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("synchronize on the CPU"))
    task, model = FakeTask(), torch.nn.Linear(1, 1)
    with metrics.aggregate(new_root=True) as agg:
        task.train_step(0, model)
        task.optimizer_step(None, model, 1)
        values = agg.get_smoothed_values()
    assert set(values) == {"update_ms", "max_rss_mb"} and values["update_ms"] >= 0 and values["max_rss_mb"] > 0


def _fairseqs_stats_logging(monkeypatch):
    from fairseq.trainer import Trainer
    from fairseq_tnn.patches.base import resolve
    monkeypatch.setattr(Trainer, "_reduce_and_log_stats", resolve("fairseq.trainer:Trainer._reduce_and_log_stats"))


TIMED = ("ups", "wps", "wall", "train_wall", "update_ms", "max_rss_mb")  # rates and clocks: differ between runs


@pytest.mark.parametrize("arch", ["tnn_lm_tiny", "ski_tnn_mlm_tiny"])
def test_an_updates_stats_are_fairseqs_without_reading_the_device(arch, tmp_path, monkeypatch):
    """The update-stats-without-reads patch (patches/update_stats.py) against fairseq's _reduce_and_log_stats, through
    fairseq's Trainer, three updates each: the same metrics in the run's aggregators and the same values returned by
    every update (read when looked into), and the update's host reads down to the one train_step's gradient-norm check
    makes (fairseq's logging made three more)."""
    from benchmarks.opcount import OpCounter
    from fairseq.trainer import Trainer
    from fairseq_tnn.patches.update_stats import UpdateStats
    assert getattr(Trainer._reduce_and_log_stats, "fairseq_tnn_patch", None) == "update-stats-without-reads"
    causal = "_mlm_" not in arch
    runs = {}
    for patched in (True, False):
        if not patched:
            _fairseqs_stats_logging(monkeypatch)
        (tmp_path / str(patched)).mkdir()
        torch.manual_seed(0)  # the same initial weights
        trainer = build_trainer(tmp_path / str(patched), arch, causal)
        batch = sample(causal, trainer.task.source_dictionary.pad())
        returned = []
        with metrics.aggregate(new_root=True), metrics.aggregate(f"run-{arch}-{patched}"):
            for update in range(3):
                with OpCounter() as counter:
                    out = trainer.train_step([batch])
                    reads = sum(counter.host_reads.values())
                assert isinstance(out, UpdateStats) == patched
                returned.append((dict(out), reads))
            logged = {k: v for k, v in metrics.get_smoothed_values(f"run-{arch}-{patched}").items() if k not in TIMED}
        runs[patched] = (returned, logged)
    (returned, logged), (fairseqs_returned, fairseqs_logged) = runs[True], runs[False]
    assert logged == fairseqs_logged and {"loss", "gnorm", "clip"} <= logged.keys(), (logged, fairseqs_logged)
    assert [r[0] for r in returned] == [r[0] for r in fairseqs_returned]
    assert [r[1] for r in returned] == [1, 1, 1] and [r[1] for r in fairseqs_returned] == [4, 4, 4]


def test_update_stats_read_the_aggregator_once_when_first_looked_into():
    from fairseq_tnn.patches.update_stats import UpdateStats
    reads = []

    class Aggregator:
        def get_smoothed_values(self):
            reads.append(1)
            return {"loss": 2.5, "ppl": 5.6, "wps": 1e4, "wpb": 30.0, "bsz": 2.0, "nll_loss": 2.0}
    stats = UpdateStats(Aggregator(), 24)
    assert stats is not None and reads == [] and repr(stats) == "UpdateStats(not read yet)"
    assert dict(stats) == {"loss": 2.5, "nll_loss": 2.0, "sample_size": 24} and reads == [1]
    stats["extra"] = 1
    del stats["nll_loss"]
    assert len(stats) == 3 and "extra" in stats and stats.get("ppl") is None and reads == [1]


def test_a_non_finite_gradient_norm_stops_the_update_before_its_stats_are_logged(tmp_path, monkeypatch):
    """The patch logs a norm without checking it because train_step has checked it: fp32 gradients with a NaN raise
    FloatingPointError (fairseq's, after its NanDetector re-run) and nothing of the update is logged."""
    from fairseq.trainer import Trainer
    monkeypatch.chdir(tmp_path)  # fairseq saves crash.pt under --save-dir, ./checkpoints (fairseq-train makes it)
    (tmp_path / "checkpoints").mkdir()
    trainer = build_trainer(tmp_path, "tnn_lm_tiny", causal=True)
    calls = []
    logging = Trainer._reduce_and_log_stats
    monkeypatch.setattr(Trainer, "_reduce_and_log_stats", lambda self, *a, **k: calls.append(a) or logging(self, *a, **k))
    batch = sample(True, trainer.task.source_dictionary.pad())
    with metrics.aggregate(new_root=True):
        trainer.train_step([batch])
        assert len(calls) == 1
        next(trainer.model.parameters()).register_hook(lambda g: g * float("nan"))
        with pytest.raises(FloatingPointError, match="gradients are Nan/Inf"):
            trainer.train_step([batch])
    assert len(calls) == 1 and trainer.get_num_updates() == 1


def record_host_data_to_device(monkeypatch):
    """Wrap torch's constructors from host data (``Tensor.new_tensor``, ``torch.tensor``, ``torch.as_tensor``); returns
    the list that collects the device of each tensor they make off the CPU: on a GPU each such tensor is a copy from
    host memory that waits for the device (torch's sync debug mode warns at it). These constructors dispatch no
    operation a TorchDispatchMode sees, hence the wrappers; a "meta" tensor stands in for the GPU's here."""
    made = []

    def recorded(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            out = original(*args, **kwargs)
            if out.device.type != "cpu":
                made.append(f"{name} on {out.device.type}")
            return out
        monkeypatch.setattr(owner, name, wrapper)

    recorded(torch.Tensor, "new_tensor")
    recorded(torch, "tensor")
    recorded(torch, "as_tensor")
    return made


def test_an_updates_stats_take_no_host_numbers_to_the_device(monkeypatch):
    """The patched logging of an update makes its clip statistic on the device from the norm itself: fairseq's
    torch.where(norm > clip, norm.new_tensor(100), norm.new_tensor(0)) moved two host numbers to the GPU, two waits an
    update in the fifth GPU run's host_syncs (update_stats.py, before this test), as the check here finds them."""
    from fairseq.trainer import Trainer
    from fairseq_tnn.patches.update_stats import reduce_and_log_stats
    assert getattr(Trainer._reduce_and_log_stats, "fairseq_tnn_patch", None) == "update-stats-without-reads"
    trainer = SimpleNamespace(
        tpu=False, cfg=SimpleNamespace(distributed_training=SimpleNamespace(ddp_backend="pytorch_ddp"),
                                       optimization=SimpleNamespace(clip_norm=1.0)),
        task=SimpleNamespace(reduce_metrics=lambda outputs, criterion: metrics.log_scalar(
            "loss", outputs[0]["loss"], 1, round=3)),
        get_criterion=lambda: None)
    patched = reduce_and_log_stats(lambda *args: pytest.fail(f"fell back to fairseq's: {args}"))
    norm, loss = torch.tensor(2.5, device="meta"), torch.tensor(3.0, device="meta")
    made = record_host_data_to_device(monkeypatch)
    with metrics.aggregate(new_root=True) as root:
        patched(trainer, [{"loss": loss}], 8, norm)
    assert made == [], made
    assert {"gnorm", "clip", "loss"} <= root.keys() and root["clip"].sum.device.type == "meta"
    # the check finds fairseq's way
    torch.where(norm > 1.0, norm.new_tensor(100), norm.new_tensor(0))
    assert made == ["new_tensor on meta"] * 2, made
