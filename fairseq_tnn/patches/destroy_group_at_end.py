"""The process group destroyed when a rank's training ends (the ``destroy-process-group`` row of the table in
``__init__``).

fairseq's ``distributed_main`` runs a rank's ``main``, waits for the other ranks at a barrier and returns, leaving
torch.distributed's process group alive until the interpreter finalizes. With gloo (every CPU rank, and the
launcher's and train.sbatch's CPU runs) that is a race: a gloo worker thread may still hold a finished collective's
work, with its tensors, when the main thread reaches the end of the program; once CPython finalizes, that thread's
release of a tensor asks for the GIL, CPython ends the thread with ``pthread_exit``, and its forced unwind through
torch's ``noexcept`` C++ aborts the process: "terminate called without an active exception", exit 134, after
training finished. CI saw it once on a two-node SLURM job's rank 1. torch's documentation asks every trainer to call
``destroy_process_group()`` when its communication is done; measured with torch 2.13 (five gloo ranks that each wait
for one all-gather and return, 40 runs each way): without it, some of the runs lose a rank to that abort; with it,
none (docs/reliability.md).

:func:`distributed_main` runs fairseq's and, once it has returned (the barrier passed on every rank), destroys the
process group. Only then: a rank that fails leaves the group alone, since destroying a group while other ranks may
still wait in a collective can hang (NCCL). It is a module-level function, so that ``torch.multiprocessing.spawn``
(fairseq's start of one process per GPU) pickles it by name; it calls fairseq's function as the caller's process
holds it at that moment.
"""
import torch

from .base import resolve

DISTRIBUTED_MAIN = "fairseq.distributed.utils:distributed_main"


def distributed_main(i, main, cfg, kwargs):
    """fairseq's ``distributed_main(i, main, cfg, kwargs)``, then ``torch.distributed.destroy_process_group()``."""
    resolve(DISTRIBUTED_MAIN)(i, main, cfg, kwargs)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
