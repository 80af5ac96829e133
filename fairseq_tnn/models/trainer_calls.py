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
from typing import List

from torch import nn

NAME = "set_num_updates"


def modules_of(root: nn.Module) -> List[nn.Module]:
    """``list(root.modules())`` (pre-order, each module once) without building the prefix strings of
    ``named_modules``, which were half its time."""
    out, seen = [root], {id(root)}

    def visit(m):
        for child in m._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                out.append(child)
                visit(child)
    visit(root)
    return out


def _has_set_num_updates(m: nn.Module) -> bool:
    """``hasattr(m, "set_num_updates")`` without raising: the class, the instance, or a parameter, buffer or
    submodule of that name (where ``nn.Module.__getattr__`` would find it)."""
    return (hasattr(type(m), NAME) or NAME in m.__dict__ or NAME in m._parameters or NAME in m._buffers
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
