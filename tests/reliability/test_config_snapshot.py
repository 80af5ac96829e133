"""The ``config-snapshot`` patch (fairseq_tnn/patches/config_snapshot.py): during an update fairseq's Trainer reads a
snapshot of its OmegaConf config instead of the config, and trains exactly as with fairseq's own ``train_step``; the
snapshot holds the config's values, reads what it does not hold from the config, and cannot be written; a checkpoint
saved during an update (fairseq's crash.pt) holds the config itself."""
import copy
import sys

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from benchmarks import trainer as tr
from fairseq.trainer import Trainer
from fairseq_tnn import register
from fairseq_tnn.patches import base
from fairseq_tnn.patches.config_snapshot import ConfigSnapshot

register()  # the plugin as fairseq loads it (--user-dir): models, tasks and patches
FAIRSEQS = base.resolve("fairseq.trainer:Trainer.train_step")


def small_trainer(tmp_path):
    torch.manual_seed(0)
    return tr.build_trainer("causal", "tnn_lm_wt103", None, 16, "cpu", "fp32", False,
                            tr._dictionary_dir(str(tmp_path), 64), True, width=16)


def samples(n):
    return [tr.synthetic_sample("causal", 16, 2, 64, seed=i) for i in range(n)]


def test_an_update_trains_as_fairseqs_reading_no_config_attribute(tmp_path, monkeypatch):
    """Two Trainers from the same seed, one updated through fairseq's train_step, one through the patched one: the same
    losses and the same parameters after every update (dropout included: the same per-update seeds), bit for bit;
    fairseq's reads the config through DictConfig's attributes dozens of times an update, the patched one, once the
    optimizer exists (its first update builds it), not once from the Trainer or its learning-rate scheduler."""
    assert base.bound("fairseq.trainer:Trainer.train_step", "config-snapshot")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ours, theirs = small_trainer(tmp_path / "a"), small_trainer(tmp_path / "b")
    reads = []
    getattr_ = DictConfig.__getattr__

    def counted(self, key):
        caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
        if caller.endswith("fairseq/trainer.py") or "fairseq/optim/lr_scheduler/" in caller:
            reads.append(key)
        return getattr_(self, key)

    monkeypatch.setattr(DictConfig, "__getattr__", counted)
    for i, sample in enumerate(samples(3)):
        reads.clear()
        a = Trainer.train_step(ours, [sample])
        ours_reads = len(reads)
        reads.clear()
        b = FAIRSEQS(theirs, [sample])
        assert a == b and a["loss"] > 0, (i, a, b)
        for (name, p), q in zip(ours.model.named_parameters(), theirs.model.parameters()):
            assert torch.equal(p, q), (i, name)
        assert len(reads) >= 20, reads  # fairseq's: the patch's reason
        if i > 0:
            assert ours_reads == 0, reads
    assert isinstance(ours.cfg, DictConfig)  # the config itself again between updates
    assert isinstance(ours.lr_scheduler.cfg, DictConfig)


def test_the_snapshot_holds_the_configs_values_and_reads_the_rest_from_it():
    cfg = OmegaConf.create({"common": {"fp16": True, "seed": 3, "tag": "${common.seed}", "missing": "???"},
                            "optimization": {"lr": [0.25], "clip_norm": 0.0}})
    snap = ConfigSnapshot(cfg)
    assert snap.common.fp16 is True and snap.common.seed == 3 and snap.common.tag == 3  # interpolation resolved
    assert snap["optimization"].clip_norm == 0.0 and list(snap.optimization.lr) == [0.25]
    assert snap.common.get("seed") == 3 and snap.common.get("absent", 7) == 7 and "fp16" in snap.common
    assert "absent" not in snap.common and getattr(snap.common, "absent", None) is None
    with pytest.raises(Exception, match="Missing mandatory value"):  # what the config itself says
        snap.common.missing
    with pytest.raises(AttributeError, match="read-only"):
        snap.common.fp16 = False
    assert snap.source is cfg and snap.common.source is cfg.common


def test_a_checkpoint_saved_during_an_update_holds_the_config(tmp_path, monkeypatch):
    """An update that fails saves fairseq's crash.pt (``Trainer.state_dict`` during train_step): its config is the
    Trainer's config as a plain container, as without the patch, not the snapshot."""
    monkeypatch.chdir(tmp_path)
    trainer = small_trainer(tmp_path)
    trainer.train_step(samples(1))  # builds the optimizer: the next update reads the snapshot
    (tmp_path / trainer.cfg.checkpoint.save_dir).mkdir()  # fairseq-train makes it
    forward = trainer.model.forward

    def failing(*args, **kwargs):
        assert isinstance(trainer.cfg, ConfigSnapshot)  # the update in progress reads the snapshot
        raise ValueError("injected: the update fails")  # (a RuntimeError other than OOM is re-raised unsaved)

    monkeypatch.setattr(trainer.model, "forward", failing)
    with pytest.raises(ValueError, match="injected"):
        trainer.train_step(samples(1))
    monkeypatch.setattr(trainer.model, "forward", forward)
    crash = tmp_path / trainer.cfg.checkpoint.save_dir / "crash.pt"
    state = torch.load(crash, weights_only=False)
    assert type(state["cfg"]) is dict
    assert state["cfg"] == OmegaConf.to_container(copy.deepcopy(trainer.cfg), resolve=True, enum_to_str=True)
    assert isinstance(trainer.cfg, DictConfig)
