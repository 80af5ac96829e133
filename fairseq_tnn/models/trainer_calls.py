"""Two calls fairseq's Trainer makes at every update, without their per-module overhead, for the plugin's models.

Each ``train_step`` calls ``model.train()`` twice (the Trainer, then the task) and ``model.set_num_updates`` once.
``nn.Module.train`` sets ``training`` on every submodule through ``nn.Module.__setattr__``, and fairseq's
``set_num_updates`` asks ``hasattr(m, "set_num_updates")`` of every submodule, which for one without it raises and
catches an AttributeError; ``FairseqEncoder``'s does the same again over the encoder. A TNN model has many small
modules (209 in ``tnn_lm_wt103``, 358 in ``tnn_mlm_wt103``: each RPE's linear layers and norms), so on the CI
machine the three calls took 1.0 ms of host time per update for ``tnn_lm_wt103`` and 2.3 ms for ``tnn_mlm_wt103``
(0.5 ms for fairseq's ``transformer_lm`` of ``tnn_lm_wt103``'s depth): time in which a GPU that has finished the
previous update's kernels waits for the next ones (docs/performance.md).

``TrainerCalls.train(mode)`` returns at once where every module is in that mode already and none overrides
``train``, in its class or on itself (then ``nn.Module.train`` would set each flag to the value it has);
``set_num_updates`` calls the method of each submodule that has one, as fairseq does, finding it on the module's
class or in its own attributes instead of by a failing lookup. ``benchmarks/trainer_calls.py`` times both against
fairseq's; tests/models/test_trainer_calls.py checks that they do what fairseq's do.
"""
from typing import Dict, List

from torch import nn

NAME = "set_num_updates"

# the root module's attribute that keeps (its modules in pre-order, each one's children as its ``_modules`` held them
# when listed): on the root itself, so that it goes with the root (a table keyed by the root would hold the root alive)
LISTED = "_tnn_modules_listed"
# a module class -> whether it defines set_num_updates
_CLASS_HAS: Dict[type, bool] = {}


def _walk(root: nn.Module) -> List[nn.Module]:
    out, seen = [root], {id(root)}

    def visit(m):
        for child in m._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                out.append(child)
                visit(child)
    visit(root)
    return out


def modules_of(root: nn.Module) -> List[nn.Module]:
    """``list(root.modules())`` (pre-order, each module once) without building the prefix strings of
    ``named_modules``, which were half its time; the list is kept from the last call and given again where every
    listed module's children (its ``_modules``, in order) are the same objects as when it was made. The tree of
    modules is made of those children alone, so the list is the walk's, whatever changed it (an assignment, a
    deletion, ``ModuleList.insert``, a write to ``_modules``); checking them is a flat loop, about half the walk's
    time (0.05 against 0.10 ms for ``tnn_lm_wt103``'s 209 modules on the CI machine), three times an update."""
    listed = root.__dict__.get(LISTED)
    if listed is not None:
        mods, children = listed
        if all(tuple(m._modules.values()) == c for m, c in zip(mods, children)):
            return mods
    mods = _walk(root)
    root.__dict__[LISTED] = (mods, [tuple(m._modules.values()) for m in mods])
    return mods


def _class_has(cls: type) -> bool:
    has = _CLASS_HAS.get(cls)
    if has is None:
        has = _CLASS_HAS[cls] = hasattr(cls, NAME)
    return has


def _has_set_num_updates(m: nn.Module) -> bool:
    """``hasattr(m, "set_num_updates")`` without raising: the class, the instance, or a parameter, buffer or
    submodule of that name (where ``nn.Module.__getattr__`` would find it)."""
    return (_class_has(type(m)) or NAME in m.__dict__ or NAME in m._parameters or NAME in m._buffers
            or NAME in m._modules)


def pass_num_updates(root: nn.Module, num_updates: int) -> None:
    """fairseq's ``set_num_updates`` of ``root``: the call goes to each of its submodules (``root`` excepted) that has
    the method, in ``root.modules()`` order."""
    for m in modules_of(root)[1:]:
        if _has_set_num_updates(m):
            m.set_num_updates(num_updates)


class TrainerCalls:
    """Mix into a plugin model or encoder before its fairseq base class."""

    def train(self, mode: bool = True):
        if (mode is True or mode is False) and all(
                m.training is mode and type(m).train in PLAIN_TRAIN and "train" not in m.__dict__
                for m in modules_of(self)):
            return self  # nn.Module.train would set every flag to the value it has
        return super().train(mode)

    def set_num_updates(self, num_updates):
        pass_num_updates(self, num_updates)


# train() methods that only set the flags: nn.Module's, and the one above, which calls it or changes nothing
PLAIN_TRAIN = (nn.Module.train, TrainerCalls.train)
