"""The plugin's only patches to fairseq 0.12, each as narrow as its failure, installed by :func:`install`
when the plugin registers its models and tasks with fairseq (``fairseq_tnn.plugin.register``); importing
this module changes nothing.

A. Checkpoint loading with torch >= 2.6 (``weights_only=True`` by default), below.
B. One log-file handler: ``fairseq.logging.progress_bar.progress_bar`` adds a new
   ``logging.FileHandler`` for ``--log-file`` to its module's logger every time it builds a
   progress bar (``fairseq_cli/train.py`` builds one per epoch), so epoch k's training and
   validation lines were written k times to the log file. :func:`progress_bar_one_file_handler`
   wraps it and passes ``log_file`` on only when that logger has no handler for that file yet;
   everything else is fairseq's own function.
C. numpy 2 (see below).
D. Unreadable checkpoints (see the end of this docstring).
E. fairseq's data-prefetch threads stopped before the interpreter exits (:func:`stop_background_consumers`).
F. ``--fp16``'s copies between the model and the flat fp32 master copy, one multi-tensor copy each
   (:func:`sync_fp16_grads_to_fp32`, :func:`sync_fp32_params_to_fp16`).

A. Make fairseq 0.12's checkpoint loading work with torch >= 2.6.

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
every file the process loads; this module never does that.

C. numpy 2. ``TokenBlockDataset._build_slice_indices`` (fairseq/data/token_block_dataset.py) builds its block index
for ``break_mode="eos"`` with ``np.compat.long``, an alias numpy 2 removed. That path is taken by every
prompt (``build_dataset_for_inference``: fairseq-interactive and the hub
interface's ``sample``/``score``/``generate``) and by training with ``--sample-break-mode eos``. Pinning
numpy < 2 would hold back every other package; instead that one module's ``np`` is replaced by
:data:`NUMPY_FOR_TOKEN_BLOCK`, numpy plus ``compat.long = numpy.int64`` (what the alias meant on the
64-bit platforms fairseq supports). numpy itself is not touched, nor is any other fairseq module (the
other removed aliases in fairseq 0.12, ``np.int``/``np.float``/``np.compat.long`` in data_utils'
wav2vec masking, dynamic CRF and the translation dataset, are on paths no TNN model or task takes).
tests/models/test_generation.py fails if fairseq's code there changes, so the shim is revisited then.

D. A clear message for a checkpoint that cannot be read.

fairseq reads every checkpoint through ``fairseq.checkpoint_utils.load_checkpoint_to_cpu``
(resuming in fairseq-train, loading in fairseq-eval-lm / fairseq-validate). A truncated or
corrupted file makes torch raise a low-level error ("failed finding central directory",
EOFError, ...). This wraps that one function so the error names the file and, when it is
in a checkpoint directory, the older checkpoints that can be passed to ``--restore-file``.
Nothing is written or deleted: the failed attempt leaves every checkpoint as it was.

``install()`` applies every fix; applying them again changes nothing.
"""
import argparse
import atexit
import functools
import glob
import io
import logging
import os
import queue
import threading
import time
import types

import numpy

import torch
from fairseq import checkpoint_utils
from fairseq.data import iterators as iterators_module
from fairseq.distributed import utils as distributed_utils
from fairseq.logging import progress_bar as progress_bar_module
from fairseq.optim import fp16_optimizer


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


class _NumpyWithCompatLong(types.ModuleType):
    """numpy, as seen by one fairseq module, with the ``np.compat.long`` alias numpy 2 removed."""

    compat = types.SimpleNamespace(long=numpy.int64)

    def __getattr__(self, name):
        return getattr(numpy, name)


NUMPY_FOR_TOKEN_BLOCK = _NumpyWithCompatLong("numpy")


class CheckpointReadError(RuntimeError):
    pass


def older_checkpoints(path: str):
    """The other checkpoint files beside ``path``, newest first."""
    folder = os.path.dirname(os.path.abspath(path))
    others = [p for p in glob.glob(os.path.join(folder, "checkpoint*.pt")) if os.path.abspath(p) != os.path.abspath(path)]
    return sorted(others, key=os.path.getmtime, reverse=True)


def _readable_checkpoint_errors(load):
    if getattr(load, "_fairseq_tnn_wrapped", False):
        return load

    @functools.wraps(load)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        try:
            return load(path, *args, **kwargs)
        except (FileNotFoundError, KeyboardInterrupt, MemoryError):
            raise
        except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError, ... for a bad file
            message = (f"cannot read checkpoint {path} ({type(err).__name__}: {err}); the file is truncated or "
                       "corrupted (e.g. the run or the disk failed while it was written).")
            candidates = older_checkpoints(path)
            if candidates:
                message += (" To resume from an older checkpoint, pass it with --restore-file, e.g. --restore-file "
                            f"{candidates[0]} (others here: {', '.join(os.path.basename(c) for c in candidates[1:4]) or 'none'}).")
            raise CheckpointReadError(message) from err

    load_checkpoint_to_cpu._fairseq_tnn_wrapped = True
    return load_checkpoint_to_cpu


def stop_background_consumers(timeout: float = 10.0) -> None:
    """E. Stop fairseq's data-prefetch threads before the interpreter finalizes.

    ``BufferedIterator`` (``--data-buffer-size``, default 10) fills its queue from a daemon
    ``BackgroundConsumer`` thread. An iterator left unfinished (``--max-valid-steps``, or an epoch cut
    by ``--max-update``) leaves that thread building batches when ``fairseq-train`` returns. Once
    CPython finalizes, a daemon thread that asks for the GIL is ended with ``pthread_exit``; when that
    happens inside torch's C++ (a ``torch.from_numpy`` storage's deleter re-acquiring the GIL under
    ``~TensorImpl``), the forced unwind crosses a ``noexcept`` destructor and the process aborts with
    "terminate called without an active exception" (exit code 134) after training has finished (seen
    intermittently with stock fairseq 0.12 and torch 2.13 too). atexit handlers run before
    finalization: each live consumer is told to stop after its current item (``_max_len = 0``, which
    fairseq checks after every put) and its queue is drained until it ends, ``timeout`` seconds at most.
    """
    consumers = [t for t in threading.enumerate()
                 if isinstance(t, iterators_module.BackgroundConsumer) and t.is_alive()]
    deadline = time.monotonic() + timeout
    for consumer in consumers:
        consumer._max_len = 0
        while consumer.is_alive() and time.monotonic() < deadline:
            try:
                while True:  # unblock a put() waiting on a full queue
                    consumer._queue.get_nowait()
            except queue.Empty:
                pass
            consumer.join(0.01)


# F. FP16Optimizer (``--fp16``) keeps the fp32 master weights and their gradients in one flat tensor per
# device, so Adam and gradient clipping see one parameter. Its two syncs with the fp16 model, the gradients
# before every step and the weights after it, copy parameter by parameter in a Python loop: about 2 x 170
# copies per update for the Wikitext-103 models, each a kernel launch on a GPU and a few microseconds of
# host time. Training on a GPU is bound by the host launching work (docs/performance.md), so the flat-params
# case is replaced by one ``torch._foreach_copy_`` per direction and device over cached views of the flat
# tensors: the same copies, in the same order and dtypes. Measured on the meta device (host time only,
# tnn_lm_wt103's 171 parameters): 1.9 + 1.7 ms per update before, 0.12 + 0.12 ms after. The other
# case (``--fp16-no-flatten-grads``) is fairseq's own code.
_FP16_SYNCS = (fp16_optimizer._FP16OptimizerMixin._sync_fp16_grads_to_fp32,
               fp16_optimizer._FP16OptimizerMixin._sync_fp32_params_to_fp16)


def _flat_views(optimizer, key: str, flat: torch.Tensor, params) -> list:
    """Views of ``flat`` shaped like ``params``, laid end to end (FP16Optimizer's flat layout), cached on
    the optimizer for as long as ``flat`` keeps its storage."""
    cache = optimizer.__dict__.setdefault("_tnn_flat_views", {})
    hit = cache.get(key)
    if hit is None or hit[0] != flat.data_ptr() or len(hit[1]) != len(params):
        views, offset = [], 0
        for p in params:
            views.append(flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
        hit = cache[key] = (flat.data_ptr(), views)
    return hit[1]


def _flat(optimizer) -> bool:
    return isinstance(optimizer.fp32_params, dict) and optimizer.has_flat_params


def sync_fp16_grads_to_fp32(self):
    if not (self._needs_sync and _flat(self)):
        return _FP16_SYNCS[0](self)
    with torch.no_grad():
        for device, flat in self.fp32_params.items():
            params = [p for p in self.fp16_params if p.requires_grad and p.device.index == device]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            torch._foreach_copy_(_flat_views(self, f"grad{device}", flat.grad, params), grads)
    self._needs_sync = False


def sync_fp32_params_to_fp16(self):
    if not _flat(self):
        return _FP16_SYNCS[1](self)
    with torch.no_grad():
        for device, flat in self.fp32_params.items():
            params = [p for p in self.fp16_params if p.device.index == device]
            torch._foreach_copy_(params, _flat_views(self, f"param{device}", flat, params))


def install():
    """Install every fix (idempotent)."""
    atexit.unregister(stop_background_consumers)  # registered once however often installed
    atexit.register(stop_background_consumers)
    distributed_utils._broadcast_object_slow = broadcast_object_slow
    fp16_optimizer._FP16OptimizerMixin._sync_fp16_grads_to_fp32 = sync_fp16_grads_to_fp32
    fp16_optimizer._FP16OptimizerMixin._sync_fp32_params_to_fp16 = sync_fp32_params_to_fp16
    if not getattr(progress_bar_module.progress_bar, "tnn_one_file_handler", False):
        progress_bar_module.progress_bar = _one_file_handler(progress_bar_module.progress_bar)
    if hasattr(torch.serialization, "add_safe_globals"):  # torch >= 2.4
        torch.serialization.add_safe_globals([argparse.Namespace])
    if not hasattr(numpy, "compat"):  # numpy >= 2
        from fairseq.data import token_block_dataset
        token_block_dataset.np = NUMPY_FOR_TOKEN_BLOCK
    checkpoint_utils.load_checkpoint_to_cpu = _readable_checkpoint_errors(checkpoint_utils.load_checkpoint_to_cpu)

