"""The plugin's patches to fairseq 0.12, listed in one table, :data:`PATCHES`, that :func:`install` walks.

:func:`install` runs when the plugin registers its models and tasks with fairseq
(``fairseq_tnn.plugin.register``: ``--user-dir``, importing ``fairseq_tnn.models`` / ``.tasks``, or
``fairseq_tnn.register()``); importing this module, the package or its ops and modules changes nothing.
The fp16-*-sync patches are speed fixes that act on the plugin's models only (:data:`PLUGIN_PARAMETER`);
every other patch fixes fairseq for any model. Each :class:`Patch` names the fairseq code it was written
against and that code's fingerprint (:func:`fingerprint`: a sha256 of its source). Before a patch rebinds
anything it checks the fingerprint of the code installed; when that differs (another fairseq release, a
fairseq that fixed the bug itself) it logs a warning naming the patch, the code and both fingerprints,
and then skips or still applies, as its ``on_mismatch`` says. Installing again changes nothing.

docs/design.md ("Patches to fairseq") has the same table for readers; tests/reliability/test_patches.py
checks that the fingerprints match the installed fairseq, that the table there lists exactly these
patches, the warning, and that install is idempotent. Each fix's own tests: tests/reliability/
test_fp16_syncs.py, test_distributed.py and test_reliability.py, tests/cli/test_cli.py and
test_generation.py.
"""
import argparse
import atexit
import dataclasses
import functools
import glob
import hashlib
import importlib
import inspect
import io
import logging
import os
import queue
import textwrap
import threading
import time
import types
from typing import Any, Callable, Optional

import numpy
import torch
from fairseq.data import iterators as iterators_module
from fairseq.distributed import utils as distributed_utils
from fairseq.logging import progress_bar as progress_bar_module

logger = logging.getLogger(__name__)

MARK = "fairseq_tnn_patch"  # attribute of every object install() binds: the name of its patch
ORIGINAL = "fairseq_tnn_original"  # ... and the fairseq object it replaced


def fingerprint(obj) -> str:
    """The first 16 hex digits of the sha256 of ``obj``'s source, dedented, with trailing spaces and
    blank lines dropped (so re-indenting or blank lines do not count; any other edit does)."""
    lines = textwrap.dedent(inspect.getsource(obj)).splitlines()
    text = "\n".join(line.rstrip() for line in lines if line.strip())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _owner_and_name(path: str):
    """``"fairseq.module:Class.attr"`` -> (the object holding ``attr``, ``"attr"``)."""
    module, _, qualname = path.partition(":")
    *parents, name = qualname.split(".")
    owner = importlib.import_module(module)
    for part in parents:
        owner = getattr(owner, part)
    return owner, name


def resolve(path: str):
    """The object at ``"module:qualname"``; for one a patch replaced, fairseq's original."""
    owner, name = _owner_and_name(path)
    obj = getattr(owner, name)
    return getattr(obj, ORIGINAL, obj) if getattr(obj, MARK, None) else obj


@dataclasses.dataclass(frozen=True)
class Patch:
    """One fix of fairseq.

    ``checks``: the fairseq code (``"module:qualname"``) the fix was written against; ``fingerprint``: its
    :func:`fingerprint` in the fairseq release named in ``versions``. ``replaces``: what install() rebinds
    to ``replacement(original)``; ``None`` for a fix that rebinds nothing of fairseq's, whose ``action``
    then does it (idempotent itself). ``on_mismatch``: ``"skip"`` (fairseq's own code keeps running) or
    ``"apply"`` (the fix does not depend on the code it checks). ``needed``: False where the fix has
    nothing to do (e.g. numpy < 2 still has the alias).
    """
    name: str
    why: str
    versions: str
    checks: str
    fingerprint: str
    on_mismatch: str
    replaces: Optional[str] = None
    replacement: Optional[Callable[[Any], Any]] = None
    action: Optional[Callable[[], None]] = None
    needed: Callable[[], bool] = lambda: True

    def __post_init__(self):
        if self.on_mismatch not in ("skip", "apply"):
            raise ValueError(f"patch {self.name}: on_mismatch={self.on_mismatch!r}; allowed: 'skip', 'apply'")
        rebinds = self.replaces is not None and self.replacement is not None and self.action is None
        acts = self.replaces is None and self.replacement is None and self.action is not None
        if not (rebinds or acts):
            raise ValueError(f"patch {self.name}: give replaces with replacement, or action alone")

    def installed(self) -> bool:
        if self.replaces is None:
            return False  # an action is idempotent: installing it again changes nothing
        owner, name = _owner_and_name(self.replaces)
        return getattr(getattr(owner, name, None), MARK, None) == self.name

    def install(self) -> str:
        """Check and apply this fix; returns what happened: "installed", "already installed", "not needed",
        "skipped" (the code differs and on_mismatch is "skip", or it is missing) or "installed despite a
        mismatch"."""
        if not self.needed():
            return "not needed"
        if self.installed():
            return "already installed"
        try:
            found = fingerprint(resolve(self.checks))
        except (ImportError, AttributeError, OSError, TypeError) as err:
            logger.warning("fairseq_tnn patch %s not installed: cannot read %s (%s: %s); it was written for %s",
                           self.name, self.checks, type(err).__name__, err, self.versions)
            return "skipped"
        mismatch = found != self.fingerprint
        if mismatch:
            logger.warning(
                "fairseq_tnn patch %s: %s is not the code it was written for (source fingerprint %s, expected %s; "
                "written for %s; installed: fairseq %s, torch %s, numpy %s); %s", self.name, self.checks, found,
                self.fingerprint, self.versions, _version("fairseq"), torch.__version__, numpy.__version__,
                "not installed: fairseq's own code runs" if self.on_mismatch == "skip" else "installed anyway")
            if self.on_mismatch == "skip":
                return "skipped"
        if self.replaces is None:
            self.action()
        else:
            owner, name = _owner_and_name(self.replaces)
            original = getattr(owner, name)
            new = self.replacement(original)
            setattr(new, MARK, self.name)
            setattr(new, ORIGINAL, original)
            setattr(owner, name, new)
        return "installed despite a mismatch" if mismatch else "installed"


def _version(package: str) -> str:
    return getattr(importlib.import_module(package), "__version__", "unknown")


# broadcast-unpickle: fairseq's broadcast of Python objects between the ranks of one job.
def broadcast_object_slow(obj, src_rank, group, dist_device):
    """Broadcast a picklable object from ``src_rank``; every rank returns it.

    Replaces fairseq's ``distributed_utils._broadcast_object_slow`` (same arguments, same messages on the
    wire: a length, then the ``torch.save`` bytes), except that the receivers unpickle with
    ``weights_only=False``. With torch >= 2.6 fairseq's ``torch.load`` there refuses what resuming a
    multi-process run sends: rank 0 reads the checkpoint and ``Trainer.load_checkpoint`` broadcasts it
    after the loader has turned ``state["cfg"]`` into an OmegaConf ``DictConfig`` ("Unsupported global:
    GLOBAL omegaconf.dictconfig.DictConfig"); the same function carries fairseq's other broadcasts
    (sharded optimizer state, FSDP). Its contract is to carry any Python object between the processes of
    one job, and its sender is rank ``src_rank`` of this same job running this same code, not a file from
    elsewhere; torch's own ``broadcast_object_list`` unpickles without restriction for the same reason.
    An allowlist instead would tie the fix to what a config happens to contain (OmegaConf's node and
    metadata classes, ``typing.Any``, fairseq's private placeholder, every typed node of a converted old
    checkpoint). ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` would turn the protection off for every file the
    process loads; this module never does that.
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


# checkpoint-loader: fairseq reads every checkpoint through checkpoint_utils.load_checkpoint_to_cpu.
class CheckpointReadError(RuntimeError):
    pass


def older_checkpoints(path: str):
    """The other checkpoint files beside ``path``, newest first."""
    folder = os.path.dirname(os.path.abspath(path))
    others = [p for p in glob.glob(os.path.join(folder, "checkpoint*.pt")) if os.path.abspath(p) != os.path.abspath(path)]
    return sorted(others, key=os.path.getmtime, reverse=True)


# torch.load's own code: a frame running it on an error's traceback means the error came from reading the file
_TORCH_LOAD_CODE = inspect.unwrap(torch.serialization.load).__code__


def raised_reading(err: BaseException) -> bool:
    """Whether ``err`` was raised while ``torch.load`` ran (torch.load's frame is on its traceback), i.e. by
    reading the file, rather than by what fairseq's loader does with the state afterwards."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is _TORCH_LOAD_CODE:
            return True
        tb = tb.tb_next
    return False


def _checkpoint_loader(load):
    """``load_checkpoint_to_cpu`` wrapped for two things, during its own call only:

    1. An old-style checkpoint, whose configuration is an ``argparse.Namespace`` under ``"args"`` (fairseq
       before its hydra configs), loads with torch >= 2.6 (``weights_only=True`` by default, "Unsupported
       global: GLOBAL argparse.Namespace"): the loader runs inside ``torch.serialization.safe_globals
       ([argparse.Namespace])``. A Namespace is a plain attribute bag (nothing runs when it is rebuilt), so
       the file is still loaded with ``weights_only=True`` and everything else still refused; no other
       ``torch.load`` of the process accepts it.
    2. A truncated or corrupted file makes ``torch.load`` raise a low-level error (with torch 2.13: a
       RuntimeError "PytorchStreamReader failed reading zip archive: failed finding central directory" or
       "not a ZIP archive" for a cut zip file, EOFError for an empty one, pickle.UnpicklingError "Weights
       only load failed ... Unsupported operand" for garbage bytes, a RuntimeError "unexpected EOF" for a
       cut legacy file): it is re-raised as :class:`CheckpointReadError` naming the file and, when it is in
       a checkpoint directory, the older checkpoints that can be passed to ``--restore-file``. Only errors
       raised while torch.load runs (:func:`raised_reading`) are reported so; fairseq's loader then applies
       ``arg_overrides`` (``--model-overrides``), builds the OmegaConf config and upgrades the state, and
       the errors of those steps, like a missing file (raised by ``open`` before torch.load) or a
       MemoryError, go through unchanged. Nothing is written or deleted.
    """
    @functools.wraps(load)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        try:
            with torch.serialization.safe_globals([argparse.Namespace]):
                return load(path, *args, **kwargs)
        except Exception as err:
            if isinstance(err, MemoryError) or not raised_reading(err):
                raise
            message = (f"cannot read checkpoint {path} ({type(err).__name__}: {err}); the file is truncated or "
                       "corrupted (e.g. the run or the disk failed while it was written).")
            candidates = older_checkpoints(path)
            if candidates:
                message += (" To resume from an older checkpoint, pass it with --restore-file, e.g. --restore-file "
                            f"{candidates[0]} (others here: {', '.join(os.path.basename(c) for c in candidates[1:4]) or 'none'}).")
            raise CheckpointReadError(message) from err

    return load_checkpoint_to_cpu


# progress-bar-log-file: one --log-file handler however many progress bars.
def _has_file_handler(log: logging.Logger, path: str) -> bool:
    target = os.path.abspath(path)
    return any(isinstance(h, logging.FileHandler) and getattr(h, "baseFilename", None) == target
               for h in log.handlers)


def _one_file_handler(original):
    """fairseq's ``progress_bar`` adds a new ``logging.FileHandler`` for ``--log-file`` to its module's
    logger every time it builds a progress bar (``fairseq_cli/train.py`` builds one per epoch), so epoch
    k's lines were written k times to the log file. This passes ``log_file`` on only when that logger has
    no handler for that file yet; everything else is fairseq's own function."""
    @functools.wraps(original)
    def progress_bar(iterator, log_format=None, log_interval=100, log_file=None, *args, **kwargs):
        if log_file is not None and _has_file_handler(progress_bar_module.logger, log_file):
            log_file = None  # already written to: a second handler would duplicate every line
        return original(iterator, log_format, log_interval, log_file, *args, **kwargs)

    return progress_bar


# numpy2-compat-long: token_block_dataset's np.
class _NumpyWithCompatLong(types.ModuleType):
    """numpy, as seen by one fairseq module, with the ``np.compat.long`` alias numpy 2 removed (what the
    alias meant on the 64-bit platforms fairseq supports)."""

    compat = types.SimpleNamespace(long=numpy.int64)

    def __getattr__(self, name):
        return getattr(numpy, name)


NUMPY_FOR_TOKEN_BLOCK = _NumpyWithCompatLong("numpy")


# stop-prefetch-at-exit: fairseq's data-prefetch threads.
def stop_background_consumers(timeout: float = 10.0) -> None:
    """Stop fairseq's data-prefetch threads before the interpreter finalizes.

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


def _stop_background_consumers_at_exit() -> None:
    atexit.unregister(stop_background_consumers)  # registered once however often installed
    atexit.register(stop_background_consumers)


# fp16-*-sync: FP16Optimizer (--fp16) keeps the fp32 master weights and their gradients in one flat tensor
# per device, so Adam and gradient clipping see one parameter. Its two syncs with the fp16 model, the
# gradients before every step and the weights after it, copy parameter by parameter in a Python loop: about
# 2 x 170 copies per update for the Wikitext-103 models, each a kernel launch on a GPU and a few microseconds
# of host time. Training on a GPU is bound by the host launching work (docs/performance.md), so the
# flat-params case is one ``torch._foreach_copy_`` per direction and device over cached views of the flat
# tensors: the same copies, in the same order and dtypes. Measured on the meta device (host time only,
# tnn_lm_wt103's 171 parameters): 1.9 + 1.7 ms per update before, 0.12 + 0.12 ms after. The other case
# (--fp16-no-flatten-grads) runs fairseq's own code, and so does every optimizer of a model that is not the
# plugin's: these are speed fixes for the plugin's models, and fairseq's own models (transformer_lm, the
# benchmarks' baseline) train exactly as without the plugin. A model is the plugin's when one of the
# optimizer's parameters carries PLUGIN_PARAMETER, which build_layers (fairseq_tnn/models/blocks.py) sets on
# every parameter of the TNN layers it builds.
PLUGIN_PARAMETER = "fairseq_tnn_model"


def mark_plugin_parameters(module: torch.nn.Module) -> None:
    """Mark ``module``'s parameters as the plugin's: an FP16Optimizer holding one of them takes the fp16-*-sync
    fast path (a plain attribute of each Parameter: ``.half()``, ``.to()`` and loading a state dict keep it; a
    deep copy drops it, and fairseq's own code then runs, which computes the same values)."""
    for p in module.parameters():
        setattr(p, PLUGIN_PARAMETER, True)


def _fast_path(optimizer) -> bool:
    """Whether the fp16-*-sync fixes handle ``optimizer``'s syncs: flat master weights (fairseq's default) of a
    model of the plugin's (decided at the first sync, then cached on the optimizer)."""
    plugin = optimizer.__dict__.get("_tnn_plugin_model")
    if plugin is None:
        plugin = optimizer.__dict__["_tnn_plugin_model"] = any(
            getattr(p, PLUGIN_PARAMETER, False) for p in optimizer.fp16_params)
    return plugin and isinstance(optimizer.fp32_params, dict) and optimizer.has_flat_params


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


def _flat_grad_sync(original):
    def _sync_fp16_grads_to_fp32(self):
        if not (self._needs_sync and _fast_path(self)):
            return original(self)
        with torch.no_grad():
            for device, flat in self.fp32_params.items():
                params = [p for p in self.fp16_params if p.requires_grad and p.device.index == device]
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                torch._foreach_copy_(_flat_views(self, f"grad{device}", flat.grad, params), grads)
        self._needs_sync = False

    return _sync_fp16_grads_to_fp32


def _flat_param_sync(original):
    def _sync_fp32_params_to_fp16(self):
        if not _fast_path(self):
            return original(self)
        with torch.no_grad():
            for device, flat in self.fp32_params.items():
                params = [p for p in self.fp16_params if p.device.index == device]
                torch._foreach_copy_(params, _flat_views(self, f"param{device}", flat, params))

    return _sync_fp32_params_to_fp16


FAIRSEQ = "fairseq 0.12.3.1 (fairseq-fixed)"

PATCHES = (
    Patch(
        name="broadcast-unpickle",
        why="resuming a multi-process run with torch >= 2.6: fairseq's receiving ranks torch.load the broadcast "
            "checkpoint with weights_only=True and refuse its OmegaConf config; they unpickle what their own "
            "job's rank sent with weights_only=False (broadcast_object_slow)",
        versions=f"{FAIRSEQ}; torch >= 2.6; any numpy",
        checks="fairseq.distributed.utils:_broadcast_object_slow",
        fingerprint="d76415381eb2472c",
        on_mismatch="skip",
        replaces="fairseq.distributed.utils:_broadcast_object_slow",
        replacement=lambda original: broadcast_object_slow,
    ),
    Patch(
        name="checkpoint-loader",
        why="old-style checkpoints (an argparse.Namespace config) load with torch >= 2.6, with Namespace "
            "allowed during fairseq's checkpoint loads only; an unreadable checkpoint is named with the older "
            "ones to --restore-file from (_checkpoint_loader)",
        versions=f"{FAIRSEQ}; torch >= 2.6 (Namespace), any torch (errors); any numpy",
        checks="fairseq.checkpoint_utils:load_checkpoint_to_cpu",
        fingerprint="58ce6e637a5284ee",
        on_mismatch="apply",  # it only wraps the call: any loader still gets the allowlist and the clear error
        replaces="fairseq.checkpoint_utils:load_checkpoint_to_cpu",
        replacement=_checkpoint_loader,
    ),
    Patch(
        name="progress-bar-log-file",
        why="fairseq adds a --log-file handler per progress bar (one per epoch), writing epoch k's lines k "
            "times; the file gets one handler (_one_file_handler)",
        versions=f"{FAIRSEQ}; any torch; any numpy",
        checks="fairseq.logging.progress_bar:progress_bar",
        fingerprint="607974d1f80a77ab",
        on_mismatch="skip",
        replaces="fairseq.logging.progress_bar:progress_bar",
        replacement=_one_file_handler,
    ),
    Patch(
        name="numpy2-compat-long",
        why="TokenBlockDataset's eos block index (every prompt, --sample-break-mode eos) uses np.compat.long, "
            "which numpy 2 removed; that one module's np is numpy plus the alias (NUMPY_FOR_TOKEN_BLOCK)",
        versions=f"{FAIRSEQ}; any torch; numpy >= 2",
        checks="fairseq.data.token_block_dataset:TokenBlockDataset._build_slice_indices",
        fingerprint="4fc566fde3f632fe",
        on_mismatch="apply",  # numpy plus one alias changes nothing for code that no longer uses it
        replaces="fairseq.data.token_block_dataset:np",
        replacement=lambda original: NUMPY_FOR_TOKEN_BLOCK,
        needed=lambda: not hasattr(numpy, "compat"),
    ),
    Patch(
        name="stop-prefetch-at-exit",
        why="a data-prefetch thread still running at interpreter exit can abort the finished process (exit "
            "134); an atexit handler stops and drains each one (stop_background_consumers)",
        versions=f"{FAIRSEQ}; torch 2.x (seen with 2.13); any numpy",
        checks="fairseq.data.iterators:BackgroundConsumer",
        fingerprint="d67f79570225f44d",
        on_mismatch="skip",
        action=_stop_background_consumers_at_exit,
    ),
    Patch(
        name="fp16-grads-sync",
        why="--fp16, the plugin's models: the gradients' copy into the flat fp32 master copy as one "
            "torch._foreach_copy_ per device instead of one copy per parameter (the same values; host-bound GPU "
            "training); fairseq's own models keep fairseq's loop",
        versions=f"{FAIRSEQ}; torch >= 2.1 (_foreach_copy_); any numpy",
        checks="fairseq.optim.fp16_optimizer:_FP16OptimizerMixin._sync_fp16_grads_to_fp32",
        fingerprint="d36b84abf6260889",
        on_mismatch="skip",
        replaces="fairseq.optim.fp16_optimizer:_FP16OptimizerMixin._sync_fp16_grads_to_fp32",
        replacement=_flat_grad_sync,
    ),
    Patch(
        name="fp16-params-sync",
        why="--fp16, the plugin's models: the master weights' copy back into the fp16 model as one "
            "torch._foreach_copy_ per device instead of one copy per parameter (the same values); fairseq's own "
            "models keep fairseq's loop",
        versions=f"{FAIRSEQ}; torch >= 2.1 (_foreach_copy_); any numpy",
        checks="fairseq.optim.fp16_optimizer:_FP16OptimizerMixin._sync_fp32_params_to_fp16",
        fingerprint="015196491a1f430a",
        on_mismatch="skip",
        replaces="fairseq.optim.fp16_optimizer:_FP16OptimizerMixin._sync_fp32_params_to_fp16",
        replacement=_flat_param_sync,
    ),
)


def install() -> dict:
    """Check and install every patch of :data:`PATCHES` (idempotent); returns {name: what happened}."""
    return {patch.name: patch.install() for patch in PATCHES}
