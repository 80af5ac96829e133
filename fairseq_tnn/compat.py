"""Two narrow fixes to fairseq 0.12.

A. Checkpoint loading with torch >= 2.6 (``weights_only=True`` by default), below.
B. One log-file handler: ``fairseq.logging.progress_bar.progress_bar`` adds a new
   ``logging.FileHandler`` for ``--log-file`` to its module's logger every time it builds a
   progress bar (``fairseq_cli/train.py`` builds one per epoch), so epoch k's training and
   validation lines were written k times to the log file. :func:`progress_bar_one_file_handler`
   wraps it and passes ``log_file`` on only when that logger has no handler for that file yet;
   everything else is fairseq's own function.

A. Make fairseq 0.12's checkpoint loading work with torch >= 2.6 (``weights_only=True`` by default).

Since torch 2.6, ``torch.load`` unpickles only tensors, primitive containers and an allowlist of
classes unless told ``weights_only=False``. fairseq 0.12 calls ``torch.load`` without the argument,
which breaks in two places:

1. Resuming a multi-process run. Rank 0 reads the checkpoint (``checkpoint_utils.
   load_checkpoint_to_cpu``, which passes: a checkpoint file holds only tensors and primitives)
   and ``Trainer.load_checkpoint`` sends it to the other ranks with ``distributed_utils.
   broadcast_object``. That pickles the state with ``torch.save`` after the loader has turned
   ``state["cfg"]`` into an OmegaConf ``DictConfig`` and the tensors into fairseq's
   ``_TensorPlaceholder``s; ``_broadcast_object_slow`` (fairseq/distributed/utils.py) then
   ``torch.load``s the bytes on every other rank, which fails with "Unsupported global: GLOBAL
   omegaconf.dictconfig.DictConfig". The same function carries fairseq's other broadcasts
   (sharded optimizer state, FSDP).
2. Loading an old-style checkpoint, whose configuration is an ``argparse.Namespace`` under
   ``"args"`` (fairseq before its hydra configs): "Unsupported global: GLOBAL argparse.Namespace".

The fixes, each as narrow as the failure:

1. ``_broadcast_object_slow`` is replaced by :func:`broadcast_object_slow`: the same protocol (a
   length, then the ``torch.save`` bytes, broadcast from ``src_rank``), but the receiving ranks
   unpickle with ``weights_only=False``. Its contract is to carry *any* Python object between the
   processes of one job, and its sender is rank ``src_rank`` of this same job running this same
   code, not a file from elsewhere; torch's own ``broadcast_object_list`` unpickles without
   restriction for the same reason. Allowlisting classes instead would tie the fix to what a
   config happens to contain (OmegaConf's node and metadata classes, ``typing.Any``, fairseq's
   private placeholder, and for a converted old checkpoint every typed node and enum of fairseq's
   dataclasses) and would widen what every *file* load accepts.
2. ``argparse.Namespace`` is added to torch's safe globals. It is a plain attribute bag (nothing
   runs when it is rebuilt), so checkpoint files are still loaded with ``weights_only=True`` and
   everything else still refused.

Setting ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` would also work, but turns the protection off for
every file the process loads; this module never does that. Importing it (``fairseq_tnn`` does)
applies both fixes; applying them again changes nothing.
"""
import argparse
import functools
import io
import logging
import os

import torch
from fairseq.distributed import utils as distributed_utils
from fairseq.logging import progress_bar as progress_bar_module


def broadcast_object_slow(obj, src_rank, group, dist_device):
    """Broadcast a picklable object from ``src_rank``; every rank returns it.

    Drop-in for fairseq's ``distributed_utils._broadcast_object_slow`` (same arguments, same
    messages on the wire), except that the receivers unpickle with ``weights_only=False``.
    """
    if distributed_utils.get_rank(group) == src_rank:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(dist_device)
        length = torch.tensor([payload.numel()], dtype=torch.long, device=dist_device)
        distributed_utils.broadcast(length, src=src_rank, group=group)
        distributed_utils.broadcast(payload, src=src_rank, group=group)
        return obj
    length = torch.zeros(1, dtype=torch.long, device=dist_device)
    distributed_utils.broadcast(length, src=src_rank, group=group)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=dist_device)
    distributed_utils.broadcast(payload, src=src_rank, group=group)
    # trusted: the bytes were written by torch.save on rank src_rank of this job (see the docstring)
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location="cpu", weights_only=False)


def _has_file_handler(log: logging.Logger, path: str) -> bool:
    target = os.path.abspath(path)
    return any(isinstance(h, logging.FileHandler) and getattr(h, "baseFilename", None) == target
               for h in log.handlers)


def _one_file_handler(original):
    @functools.wraps(original)
    def progress_bar_one_file_handler(iterator, log_format=None, log_interval=100, log_file=None, *args, **kwargs):
        if log_file is not None and _has_file_handler(progress_bar_module.logger, log_file):
            log_file = None  # already written to: a second handler would duplicate every line
        return original(iterator, log_format, log_interval, log_file, *args, **kwargs)

    progress_bar_one_file_handler.tnn_one_file_handler = True
    return progress_bar_one_file_handler


def apply():
    """Install the fixes (idempotent)."""
    distributed_utils._broadcast_object_slow = broadcast_object_slow
    if not getattr(progress_bar_module.progress_bar, "tnn_one_file_handler", False):
        progress_bar_module.progress_bar = _one_file_handler(progress_bar_module.progress_bar)
    if hasattr(torch.serialization, "add_safe_globals"):  # torch >= 2.4
        torch.serialization.add_safe_globals([argparse.Namespace])


apply()
