"""The switch between the operators' fast paths and their references, and the cache of constant tensors.

Eager PyTorch pays host time for every operation it dispatches (10-25 microseconds each on a GPU, more
than many of the TNO's small kernels take). The fast paths dispatch fewer operations for the same
function: the RPE MLP as one operator with a hand-written backward (``ops/rpe.py``), all the layers' RPEs of a
stack as one batched MLP (``modules/layers.py``, ``layer_spectra``), the layers' RMS norm as one operator
(``ops/norm.py``), SKI's band blocks and low-rank spectrum each as one GEMM of its parameters (``ops/ski.py``), and the tensors that depend on nothing but a length (positions, frequency grids, decay
factors, bin multiplicities, masks) built once per length and device instead of once per layer and step
(``constant``).

Each fast path keeps its reference beside it, and ``references()`` turns every one of them off, so the
tests compare the two (tests/ops/test_fast_paths.py) and the benchmark counts both in one process
(benchmarks/opcount.py).
"""
import contextlib
from collections import OrderedDict
from typing import Callable, Hashable

import torch

_enabled = True
# Constants per (key, device); a few lengths per model (training, validation, generation), so a small bound
_CACHE: "OrderedDict" = OrderedDict()
CACHE_SIZE = 64
# Whether the calls running now are the stack's CUDA graphs' (``cuda_graphs``)
_in_cuda_graphs = False


def enabled() -> bool:
    """Whether the fast paths are on (the default)."""
    return _enabled


@contextlib.contextmanager
def references():
    """Within this block, every operator computes by its reference path (and builds its constants anew)."""
    global _enabled
    saved = _enabled
    _enabled = False
    try:
        yield
    finally:
        _enabled = saved


@contextlib.contextmanager
def cuda_graphs():
    """Around the calls of the stack's CUDA graphs (models/compile.py, ``run_layers``): each graph's warm-up runs and
    its recording alike, where the operators that run as dispatched (a custom operator's forward) allocate from the
    graphs' private memory pool. Inside, ``constant`` builds its tensors anew at every call, and caches none: a
    cached tensor made there would live on in the pool, which the graphs' replays overwrite and the graph trees refuse
    ("Detected 1 tensor(s) in the cudagraph pool not tracked as outputs", the ninth GPU run), and one cached before
    and evicted later would leave the recorded graph reading freed memory. So the graph records the few kernels that
    build it.
    The Toeplitz product pairs its rows there (ops/toeplitz.py, ``pair_dim``)."""
    global _in_cuda_graphs
    saved, _in_cuda_graphs = _in_cuda_graphs, True
    try:
        yield
    finally:
        _in_cuda_graphs = saved


def in_cuda_graphs() -> bool:
    """Whether the calls running now are the stack's CUDA graphs' (``cuda_graphs``)."""
    return _in_cuda_graphs


def compiling() -> bool:
    """Whether torch.compile is tracing the code that asks: dynamo (``torch.compiler.is_compiling``; False on a torch
    without it), or AOT autograd, which traces the backward of a custom operator (``ops/toeplitz.py``,
    ``spectral_conv``) with fake tensors under a proxy mode, outside dynamo. Either way the tensors are not real, so
    ``constant`` must not cache them, and the operators take the paths written for the compiler."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling():
        return True
    return any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES)


# The dispatch modes AOT autograd traces under (``torch._C._TorchDispatchModeKey``: FAKE and PROXY, torch >= 2.1)
_TRACING_MODES = tuple(getattr(torch._C._TorchDispatchModeKey, name) for name in ("FAKE", "PROXY")
                       if hasattr(getattr(torch._C, "_TorchDispatchModeKey", None), name))


def constant(key: Hashable, device, make: Callable[[], torch.Tensor]):
    """``make()``, a tensor (or tuple of tensors) that depends on ``key`` and ``device`` only, built once and
    then returned from the cache. The caller must not modify it in place.

    Built outside inference mode and without autograd, so a tensor first made during generation can take
    part in training later. Under torch.compile (which folds such constants itself), inside the stack's CUDA
    graphs (``cuda_graphs``) and with the references on, it is built anew at every call.

    ``make`` may run while a CUDA graph records (a custom operator's forward runs its operations inside the stack's
    graphs, and a path taken only there builds its constants there): it must build on the device, from ``full``,
    ``arange`` and the like, with single elements set by ``fill_``. A Python number assigned to one element of a CUDA
    tensor (``t[0] = 1.0``) is copied from the host as a 0-dim CPU tensor, and so is ``torch.tensor([...],
    device=...)``: a copy from pageable memory, which a capture refuses ("Cannot copy between CPU and CUDA tensors
    during CUDA graph capture", the ninth GPU run; tests/ops/test_fast_paths.py)."""
    if not _enabled or compiling() or _in_cuda_graphs:
        return make()
    full_key = (key, str(torch.device(device) if device is not None else torch.device("cpu")))
    hit = _CACHE.get(full_key)
    if hit is None:
        with torch.inference_mode(False), torch.no_grad():
            hit = make()
        _CACHE[full_key] = hit
        if len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(full_key)
    return hit
