"""The process groups released when a rank's training ends (the ``destroy-process-group`` row of the table in
``__init__``).

fairseq's ``distributed_main`` runs a rank's ``main``, waits for the other ranks at a barrier and returns, leaving
torch.distributed's process groups alive until the interpreter finalizes. With gloo (every CPU rank, and the
launcher's and train.sbatch's CPU runs) that is a race: a gloo worker thread may still hold a finished collective's
work, with its tensors, when the main thread reaches the end of the program; once CPython finalizes, that thread's
release of a tensor asks for the GIL, CPython ends the thread with ``pthread_exit``, and its forced unwind through
torch's ``noexcept`` C++ aborts the process: "terminate called without an active exception", exit 134, after
training finished. CI saw it twice on a two-node SLURM job. Measured with torch 2.13 (five gloo ranks that each
wait for one all-gather and return, 40 runs each way): with the group left alive, some runs lose a rank to that
abort; with it released, none (docs/reliability.md).

Destroying the group (``destroy_process_group()``, as torch's documentation asks of every trainer) is not enough
inside fairseq-train: it unregisters the groups, but a gloo group's worker threads stop only when its last
reference goes, and three references outlive it there:

- ``torch.distributed.nn.functional`` evaluates ``group.WORLD`` into the default arguments of its functions when it
  is first imported, and torch._dynamo imports it (through FSDP) when fairseq builds the first optimizer, after the
  default group exists: ten references to that group for the rest of the process. Imported before the group
  exists, the defaults are None.
- fairseq's ``get_global_group`` keeps the group it makes (``dist.new_group()``) on the function, for good.
- the trainer and its model (legacy DDP holds that group) are in reference cycles, freed by the next collection.

:func:`distributed_main` imports ``torch.distributed.nn`` first, runs fairseq's ``distributed_main``, and once that
has returned (the barrier passed on every rank) destroys the groups, drops fairseq's cached group and collects the
cycles: the groups' threads have stopped before the interpreter finalizes (``tests/reliability/
test_distributed.py`` and ``test_patches.py`` look for them at exit, with
``fairseq_tnn.distributed.threads``). Only then: a rank that fails leaves its groups
alone, since destroying a group while other ranks may still wait in a collective can hang (NCCL). It is a
module-level function, so that ``torch.multiprocessing.spawn`` (fairseq's start of one process per GPU) pickles it
by name; it calls fairseq's function as the caller's process holds it at that moment.
"""
import gc
import importlib
import sys

import torch

from .base import resolve

DISTRIBUTED_MAIN = "fairseq.distributed.utils:distributed_main"


def distributed_main(i, main, cfg, kwargs):
    """fairseq's ``distributed_main(i, main, cfg, kwargs)`` with ``torch.distributed.nn`` imported before the process
    group exists, then :func:`release_process_groups`."""
    if torch.distributed.is_available():
        importlib.import_module("torch.distributed.nn")  # its defaults: None, not the group (the docstring)
    resolve(DISTRIBUTED_MAIN)(i, main, cfg, kwargs)
    release_process_groups()


def release_process_groups() -> None:
    """Destroy torch.distributed's process groups, drop the one fairseq's ``get_global_group`` keeps, and collect
    the reference cycles that hold one (the trainer, the model)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    fairseq_utils = sys.modules.get("fairseq.distributed.utils")
    cached = getattr(fairseq_utils, "get_global_group", None)
    if cached is not None and hasattr(cached, "_global_group"):
        del cached._global_group
    gc.collect()
