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
            "--criterion", "cross_entropy" if causal else "masked_lm", "--optimizer", "adam", "--lr", "1e-3",
            "--clip-norm", "1.0", "--dropout", "0.1", "--seed", "1", "--distributed-world-size", "1"]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    return Trainer(cfg, task, model, task.build_criterion(cfg.criterion))


def sample(causal: bool, pad: int):
    """A batch of 4 sequences of N tokens, the last two right-padded (as fairseq's collater pads)."""
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
    return {"id": torch.arange(4), "nsentences": 4, "ntokens": int((target != pad).sum()),
            "net_input": {"src_tokens": tokens, "src_lengths": lengths}, "target": target}


@pytest.mark.parametrize("arch", ["tnn_lm_tiny", "fd_tnn_lm_tiny", "tnn_mlm_tiny", "fd_tnn_mlm_tiny",
                                  "ski_tnn_mlm_tiny"])
def test_a_training_update_makes_no_host_sync_in_the_plugin_but_the_masked_positions(arch, tmp_path, monkeypatch):
    causal = "_mlm_" not in arch
    trainer = build_trainer(tmp_path, arch, causal)
    batch = sample(causal, trainer.task.source_dictionary.pad())
    trainer.train_step([batch])  # the first update builds the optimizer state; the count is of the second
    calls = count_plugin_syncs(monkeypatch)
    with metrics.aggregate(new_root=True):
        out = trainer.train_step([batch])
    assert out is not None and trainer.get_num_updates() == 2
    # one in the masked model, as in fairseq's RoBERTa: the features of the criterion's masked positions
    # (x[masked_tokens]), whose number only the data says
    expected = [] if causal else ["boolean index at models/tnn_mlm.py"]
    assert [c.rsplit(":", 1)[0] for c in calls] == expected, f"host syncs made by fairseq_tnn in one update: {calls}"


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
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * 2 ** 20)
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
