"""fairseq reads every checkpoint through ``checkpoint_utils.load_checkpoint_to_cpu``: old-style checkpoints load
with torch >= 2.6, and a checkpoint that cannot be loaded is reported by name and cause (the
``checkpoint-loader`` row of the table in ``__init__``). fairseq-train's resume (``checkpoint_utils.load_checkpoint``)
goes on from the newest readable checkpoint when ``checkpoint_last.pt`` is unreadable or missing (the
``resume-from-readable`` row; :func:`resume_from_readable`)."""
import argparse
import functools
import glob
import inspect
import logging
import os
import pickle
import re

import torch

logger = logging.getLogger(__name__)


class CheckpointReadError(RuntimeError):
    """A checkpoint file that torch.load could not read (truncated, corrupted, empty, not a checkpoint); ``path``
    names it."""

    def __init__(self, message, path=None):
        super().__init__(message)
        self.path = path


class CheckpointRefusedError(CheckpointReadError):
    """A checkpoint holding an object that ``torch.load(weights_only=True)`` refuses to rebuild."""


def older_checkpoints(path: str):
    """The other checkpoint files beside ``path``, newest first."""
    folder = os.path.dirname(os.path.abspath(path))
    others = [p for p in glob.glob(os.path.join(folder, "checkpoint*.pt")) if os.path.abspath(p) != os.path.abspath(path)]
    return sorted(others, key=os.path.getmtime, reverse=True)


# torch.load's own code: a frame running it on an error's traceback means the error came from reading the file
_TORCH_LOAD_CODE = inspect.unwrap(torch.serialization.load).__code__
# what torch.load (2.6 to 2.13 at least) says when its weights-only unpickler meets a global it does not allow
_REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+) was not an allowed global")


def raised_reading(err: BaseException) -> bool:
    """Whether ``err`` was raised while ``torch.load`` ran (torch.load's frame is on its traceback), i.e. by
    reading the file, rather than by what fairseq's loader does with the state afterwards."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is _TORCH_LOAD_CODE:
            return True
        tb = tb.tb_next
    return False


def refused_global(err: BaseException):
    """The global (``"module.name"``) that ``torch.load(weights_only=True)`` refused, if that is what ``err``
    reports; None for any other error."""
    found = _REFUSED_GLOBAL.search(str(err)) if isinstance(err, pickle.UnpicklingError) else None
    return found.group(1) if found else None


def read_error(path: str, err: BaseException) -> CheckpointReadError:
    """The error to raise for ``err``, raised while torch.load read the checkpoint ``path``."""
    refused = refused_global(err)
    if refused:
        return CheckpointRefusedError(
            f"cannot load checkpoint {path}: it holds an object made by {refused}, which torch.load refuses "
            "with weights_only=True (torch's default since 2.6, with which fairseq loads every checkpoint); "
            "checkpoints written by other fairseq versions can hold such objects, numpy values among them. The "
            "file was read up to that object: it is not damaged. "
            "Loading it without the restriction lets the file run any code it names, so do it only if you trust "
            "the file (you or someone you trust wrote it): run the same command with "
            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 in its environment (for that process, torch then loads every "
            "file without the restriction). Otherwise do not load it.", path)
    message = (f"cannot read checkpoint {path} ({type(err).__name__}: {err}); the file is truncated or "
               "corrupted (e.g. the run or the disk failed while it was written).")
    candidates = older_checkpoints(path)
    if candidates:
        message += (" To resume from an older checkpoint, pass it with --restore-file, e.g. --restore-file "
                    f"{candidates[0]} (others here: {', '.join(os.path.basename(c) for c in candidates[1:4]) or 'none'}).")
    return CheckpointReadError(message, path)


def checkpoint_loader(load):
    """``load_checkpoint_to_cpu`` wrapped for two things, during its own call only:

    1. An old-style checkpoint, whose configuration is an ``argparse.Namespace`` under ``"args"`` (fairseq
       before its hydra configs), loads with torch >= 2.6 (``weights_only=True`` by default, "Unsupported
       global: GLOBAL argparse.Namespace"): the loader runs inside ``torch.serialization.safe_globals
       ([argparse.Namespace])``. A Namespace is a plain attribute bag (nothing runs when it is rebuilt), so
       the file is still loaded with ``weights_only=True`` and everything else still refused; no other
       ``torch.load`` of the process accepts it.
    2. An error raised while ``torch.load`` reads the file (:func:`raised_reading`) is re-raised naming the
       file and its cause (:func:`read_error`). An object that ``weights_only=True`` refuses (a numpy scalar,
       say) is a :class:`CheckpointRefusedError` naming that object and what the user can do. Anything else
       is a truncated or corrupted file (with torch 2.13: a RuntimeError "PytorchStreamReader failed reading
       zip archive: failed finding central directory" or "not a ZIP archive" for a cut zip file, EOFError
       for an empty one, pickle.UnpicklingError "Weights only load failed ... Unsupported operand" for
       garbage bytes, a RuntimeError "unexpected EOF" for a cut legacy file): a :class:`CheckpointReadError`
       that, when the file is in a checkpoint directory, names the older checkpoints that can be passed to
       ``--restore-file``. fairseq's loader then applies ``arg_overrides`` (``--model-overrides``), builds
       the OmegaConf config and upgrades the state; the errors of those steps, like a missing file (raised
       by ``open`` before torch.load) or a MemoryError, go through unchanged. Nothing is written or deleted.
    """
    @functools.wraps(load)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        try:
            with torch.serialization.safe_globals([argparse.Namespace]):
                return load(path, *args, **kwargs)
        except Exception as err:
            if isinstance(err, MemoryError) or not raised_reading(err):
                raise
            raise read_error(path, err) from err

    return load_checkpoint_to_cpu


def resume_from_readable(load_checkpoint):
    """fairseq-train's resume, ``checkpoint_utils.load_checkpoint``, when it resumes from ``checkpoint_last.pt``
    (the default ``--restore-file``, without ``--finetune-from-model``, ``--continue-once``,
    ``--no-last-checkpoints`` or a checkpoint suffix) and that file is unreadable (:class:`CheckpointReadError`)
    or missing while older checkpoints are beside it: the run resumes from the newest of them (by modification
    time) that can be read, with a warning naming both, and trains the updates after it again. fairseq would
    stop at an unreadable file and start from update 0 without one, overwriting the older checkpoints. Every
    save replaces its files whole (``atomic_save``), so neither comes from a killed save; a file damaged later
    (a disk, a copy, a hand) or a run killed between the first file of its first save and the copy to
    ``checkpoint_last.pt`` does. Since a resume trains exactly the uninterrupted run's updates
    (``fairseq_tnn/tasks/batches.py``), only time is lost. When no checkpoint there can be read the run stops
    with a :class:`CheckpointReadError` naming each file and why; a refused object
    (:class:`CheckpointRefusedError`) stops it at once, as before. The damaged ``checkpoint_last.pt`` stays as
    it is until the resumed run's next save replaces it.

    Several processes: each looks at the same directory and makes the same choice; only rank 0 reads the file
    (fairseq broadcasts its state), so when it moves on to an older file the other ranks, still waiting for
    that broadcast, receive the older file's state.
    """
    @functools.wraps(load_checkpoint)
    def resume(cfg, trainer, **passthrough_args):
        last = os.path.join(cfg.save_dir, "checkpoint_last.pt")
        if (cfg.restore_file != "checkpoint_last.pt" or trainer.checkpoint_suffix or cfg.finetune_from_model
                or getattr(cfg, "continue_once", None) or cfg.no_last_checkpoints):
            return load_checkpoint(cfg, trainer, **passthrough_args)
        unreadable = []  # the CheckpointReadError of each file tried, in order
        if os.path.exists(last):
            try:
                return load_checkpoint(cfg, trainer, **passthrough_args)
            except CheckpointReadError as err:
                if isinstance(err, CheckpointRefusedError) or err.path != last:
                    raise
                unreadable.append(err)
        restore_file = cfg.restore_file
        for i, older in enumerate(older_checkpoints(last)):
            why = f"cannot read it ({cause(unreadable[-1])})" if unreadable else "it does not exist"
            logger.warning(f"{unreadable[-1].path if unreadable else last}: {why}; resuming from {older} instead, "
                           f"the {'next ' if i else ''}newest checkpoint beside it; the updates after it are "
                           "trained again")
            cfg.restore_file = older
            try:
                return load_checkpoint(cfg, trainer, **passthrough_args)
            except CheckpointReadError as err:
                if isinstance(err, CheckpointRefusedError) or err.path != older:
                    raise
                unreadable.append(err)
            finally:
                cfg.restore_file = restore_file
        if unreadable:
            causes = "; ".join(f"{os.path.basename(err.path)}: {cause(err)}" for err in unreadable)
            raise CheckpointReadError(
                f"cannot resume from {os.path.dirname(os.path.abspath(last))}: no checkpoint there can be read "
                f"({causes}). Start the run again: in a new --save-dir, or with FORCE=1 for scripts/train.sh",
                last) from unreadable[0]
        return load_checkpoint(cfg, trainer, **passthrough_args)  # no checkpoint at all: fairseq's fresh start

    return resume


def cause(err: CheckpointReadError) -> str:
    """What torch.load raised for the file of ``err``: its type and the first sentence of its message."""
    inner = err.__cause__
    if inner is None:
        return str(err)
    first = str(inner).strip().splitlines()[0].split(". ")[0] if str(inner).strip() else ""
    return f"{type(inner).__name__}: {first}" if first else type(inner).__name__
