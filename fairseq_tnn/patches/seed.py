"""The per-update seed of fairseq's Trainer without formatting Python stacks (the ``direct-seed`` row of the table in
``__init__``).

``Trainer._set_seed`` runs at the start of every update: it seeds torch's generators with the run's seed plus the update
number (so that a resumed run draws what the uninterrupted one did) through ``utils.set_torch_seed``. That records every
generator's state, for a ``with`` block ``_set_seed`` never opens, and calls ``torch.manual_seed``, which seeds the CPU's
generator and CUDA's, and for each backend not initialised in the process (XPU and MTIA on a CUDA machine; CUDA too on
a machine without it) queues the seed for that backend's initialisation together with ``traceback.format_stack()``, the
Python stack of the call read from the source files (for the message should that initialisation fail). On an H200 the
seed took 0.5-0.8 ms of every update's host time (``benchmarks/gpu_profile.py``'s split of the Trainer's rest, in
docs/performance.md), 2-4% of a CUDA-graph update (time in which a GPU that has finished the previous update's kernels
waits for the next).

The fix seeds the generators that draw this run's random numbers with the same seed, directly: the CPU's, and each
CUDA device's where CUDA is initialised (what ``torch.cuda.manual_seed_all`` does then). Where anything else could
draw them it calls fairseq's own: a TPU (torch_xla), an initialised XPU or MTIA, MPS, a custom backend, CUDA present
but not yet initialised, or a process forked after CUDA started. The numbers drawn are the same
(tests/reliability/test_seed.py).
"""
import torch


def _only_cpu_and_cuda() -> bool:
    """Whether the CPU and, if initialised, CUDA are the only backends whose generators this process can use."""
    from fairseq import utils
    if getattr(utils, "xm", None) is not None:
        return False
    if torch.cuda._is_in_bad_fork() or (torch.cuda.is_available() and not torch.cuda.is_initialized()):
        return False
    if torch.backends.mps.is_available() or torch._C._get_privateuse1_backend_name() != "privateuseone":
        return False
    return not any(getattr(torch, name).is_initialized() for name in ("xpu", "mtia") if hasattr(torch, name))


def seed_generators(seed: int) -> None:
    """The CPU's generator and, where CUDA is initialised, every CUDA device's, seeded with ``seed``."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():  # initialised: _only_cpu_and_cuda
        for generator in torch.cuda.default_generators:
            generator.manual_seed(seed)


def set_seed(original):
    def _set_seed(self):
        if not _only_cpu_and_cuda():
            return original(self)
        seed_generators(self.cfg.common.seed + self.get_num_updates())

    return _set_seed
