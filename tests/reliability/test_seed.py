"""The ``direct-seed`` patch (fairseq_tnn/patches/seed.py): the Trainer's seed at every update draws the random numbers
fairseq's own draws, formats no Python stack, and leaves the seed to fairseq's own wherever another backend could draw
them."""
import traceback
import types

import pytest
import torch

from fairseq.trainer import Trainer
from fairseq_tnn import register
from fairseq_tnn.patches import base, seed

register()  # the plugin as fairseq loads it (--user-dir): models, tasks and patches
FAIRSEQS = base.resolve("fairseq.trainer:Trainer._set_seed")


def fake_trainer(run_seed: int, updates: int):
    """What ``Trainer._set_seed`` reads of a trainer: its config's seed and its update count."""
    return types.SimpleNamespace(cfg=types.SimpleNamespace(common=types.SimpleNamespace(seed=run_seed)),
                                 get_num_updates=lambda: updates)


def draws(device):
    return torch.rand(5, device=device), torch.randn(3, device=device), torch.randint(0, 1000, (4,), device=device)


@pytest.mark.parametrize("run_seed,updates", [(1, 0), (1, 12345), (7, 3)])
def test_the_seed_draws_what_fairseqs_draws(run_seed, updates, device):
    assert Trainer._set_seed is not FAIRSEQS and getattr(Trainer._set_seed, base.MARK) == "direct-seed"
    trainer = fake_trainer(run_seed, updates)
    got = []
    for set_seed in (Trainer._set_seed, FAIRSEQS):
        torch.manual_seed(999)  # a state of the generators unlike either seed's
        set_seed(trainer)
        got.append((draws("cpu"), draws(device)))
    for a, b in zip(*[[t for pair in g for t in pair] for g in got]):
        assert a.device == b.device and torch.equal(a, b)


def test_the_seed_formats_no_python_stack(monkeypatch):
    """fairseq's seed (torch.manual_seed) formats the stack of the call for each backend not initialised (XPU, MTIA, and
    CUDA on a machine without it); the patched one, none."""
    calls = []
    real = traceback.format_stack
    monkeypatch.setattr(traceback, "format_stack", lambda *a, **k: calls.append(1) or real(*a, **k))
    trainer = fake_trainer(1, 5)
    FAIRSEQS(trainer)
    assert len(calls) >= 1, "fairseq's seed formatted no stack: the patch's reason is gone"
    calls.clear()
    Trainer._set_seed(trainer)
    assert calls == []


@pytest.mark.parametrize("other", ["xpu", "mtia", "xla", "mps"])
def test_fairseqs_seed_runs_where_another_backend_could_draw(other, monkeypatch):
    """Where another backend is initialised (or a TPU is in use, or MPS is available), the patched seed is fairseq's own."""
    from fairseq import utils
    assert seed._only_cpu_and_cuda()
    if other == "xla":
        monkeypatch.setattr(utils, "xm", object(), raising=False)
    elif other == "mps":
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    else:
        monkeypatch.setattr(getattr(torch, other), "is_initialized", lambda: True)
    assert not seed._only_cpu_and_cuda()
    called = []
    patched = seed.set_seed(lambda self: called.append(self))
    trainer = fake_trainer(1, 2)
    patched(trainer)
    assert called == [trainer]
