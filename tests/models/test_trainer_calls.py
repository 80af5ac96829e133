"""The plugin models' train() and set_num_updates (fairseq_tnn/models/trainer_calls.py), which fairseq's Trainer calls
at every update, do what nn.Module's and fairseq's do: the same training flags on every module from any mixed
state, a submodule's own train() still called, the same modules told the number of updates in the same order, the
same error for a mode that is not a bool; and they skip only work that changes nothing."""
import gc
import re
import sys
import weakref

import pytest
import torch
from torch import nn

from benchmarks.trainer_calls import fairseqs_calls
from fairseq_tnn.models.build import build_arch
from fairseq_tnn.models.trainer_calls import modules_of
from helpers import ROOT, command_env, execute

ARCHS = ["tnn_lm_tiny", "fd_tnn_lm_tiny", "tnn_mlm_tiny", "ski_tnn_mlm_tiny"]


def twins(arch):
    torch.manual_seed(0)
    ours = build_arch(arch, 60)
    torch.manual_seed(0)
    return ours, fairseqs_calls(build_arch(arch, 60))


def flags(model):
    return [m.training for m in model.modules()]


@pytest.mark.parametrize("arch", ARCHS)
def test_modules_of_is_modules_in_order(arch):
    model = build_arch(arch, 60)  # tied input and output embeddings: a module reached twice is listed once
    assert [id(m) for m in modules_of(model)] == [id(m) for m in model.modules()]


def test_the_kept_list_of_modules_follows_every_change_of_the_tree():
    """modules_of keeps its list between calls: after each way a tree can change (an assignment, a deletion,
    ModuleList.insert, which writes _modules itself, a direct write to _modules, a module shared twice, a submodule's
    own children replaced), it is still model.modules(), and set_num_updates reaches a module added that has one."""
    told = []

    class Counted(nn.Module):
        def set_num_updates(self, n):
            told.append((id(self), n))

    model = build_arch("tnn_lm_tiny", 60)
    layers = model.decoder.layers

    def same():
        return [id(m) for m in modules_of(model)] == [id(m) for m in model.modules()]
    assert same() and modules_of(model) is modules_of(model)  # kept while nothing changes
    changes = [lambda: setattr(model.decoder, "extra", Counted()),
               lambda: delattr(model.decoder, "extra"),
               lambda: layers.insert(0, Counted()),
               lambda: layers._modules.__setitem__("0", nn.Linear(2, 2)),
               lambda: setattr(model.decoder, "twice", layers[1]),
               lambda: setattr(layers[1], "inner", Counted()),
               lambda: layers[1]._modules.pop("inner")]
    for i, change in enumerate(changes):
        change()
        assert same(), i
    layers[2].inner = counted = Counted()
    model.set_num_updates(7)
    assert told == [(id(counted), 7)]
    # the list goes with the model: nothing else holds it alive
    gone = weakref.ref(model)
    del model, layers, same, changes
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("arch", ARCHS)
def test_train_and_eval_set_every_flag_as_nn_module_does(arch):
    ours, theirs = twins(arch)
    steps = [("eval", None), ("train", True), ("train", True), ("part eval", 1), ("train", True), ("train", False),
             ("part train", 2), ("train", False), ("eval", None), ("part train", 0), ("train", True)]
    for what, arg in steps:
        for model in (ours, theirs):
            if what == "eval":
                out = model.eval()
            elif what == "train":
                out = model.train(arg)
            else:  # one submodule set alone, as a user may: the next model.train() must reach it
                mods = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Dropout))]
                out = mods[arg].train(what == "part train") and model
            assert out is model
        assert flags(ours) == flags(theirs), what
    assert all(flags(ours)) and len(set(flags(ours))) == 1


def test_a_submodules_own_train_is_still_called():
    calls = []

    class Counting(nn.Module):
        def train(self, mode=True):
            calls.append(mode)
            return super().train(mode)

    model = build_arch("tnn_lm_tiny", 60)
    model.decoder.extra = Counting()
    model.train()
    model.train()
    model.eval()
    assert calls == [True, True, False]
    # a train() set on one module itself (as fairseq's make_generation_fast_ sets one that refuses to train)
    refusals = []
    layer = model.decoder.layers[0]
    layer.train = lambda mode=True: refusals.append(mode) or layer
    model.eval()
    assert refusals == [False] and calls == [True, True, False, False]


def test_a_mode_that_is_not_a_bool_is_refused_as_nn_module_refuses_it():
    model = build_arch("tnn_lm_tiny", 60)
    with pytest.raises(ValueError, match="training mode is expected to be boolean"):
        model.train("yes")


class Told(nn.Module):
    """A module that wants the number of updates (a method of its class)."""

    def __init__(self, log, name):
        super().__init__()
        self.log, self.name = log, name

    def set_num_updates(self, num_updates):
        self.log.append((self.name, num_updates))


@pytest.mark.parametrize("arch", ["tnn_lm_tiny", "tnn_mlm_tiny"])
def test_set_num_updates_reaches_the_modules_fairseqs_reaches_in_its_order(arch):
    logs = {}
    for name, model in zip(("ours", "theirs"), twins(arch)):
        log = logs[name] = []
        coder = model.decoder if arch.startswith("tnn_lm") else model.encoder
        coder.first = Told(log, "on a class")
        coder.layers[0].second = Told(log, "deep")
        odd = nn.Module()
        odd.set_num_updates = lambda n, log=log: log.append(("on an instance", n))  # what hasattr would find too
        coder.third = odd
        model.set_num_updates(7)
        model.set_num_updates(8)
    # the masked model's encoder passes the call on again to its own submodules, in fairseq and here alike
    assert logs["ours"] == logs["theirs"] and len(logs["ours"]) >= 6, logs


def test_the_benchmark_times_both_side_by_side():
    """benchmarks/trainer_calls.py (the figures in docs/performance.md) runs as documented and reports fairseq's
    calls and the plugin's for the same model, the Trainer's seed, fairseq's and the plugin's, and a small model's update
    reading the Trainer's config or its snapshot, and logged by fairseq's code or the plugin's."""
    code, out, _ = execute([sys.executable, ROOT / "benchmarks/trainer_calls.py", "--archs", "tnn_lm_tiny",
                            "--rounds", 5], command_env(), 300, merge=True)
    assert code == 0, out[-3000:]
    assert re.search(r"^\| tnn_lm_tiny \| \d+ \| [0-9.]+ \| [0-9.]+ \|$", out, re.M), out
    assert re.search(r"^\| the Trainer's seed \| - \| [0-9.]+ \| [0-9.]+ \|$", out, re.M), out
    assert re.search(r"^\| a small model's update, its config read \| - \| [0-9.]+ \| [0-9.]+ \|$", out, re.M), out
    assert re.search(r"^\| a small model's update, its stats logged \| - \| [0-9.]+ \| [0-9.]+ \|$", out, re.M), out
