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
    part in training later. Under torch.compile (which folds such constants itself) and with the
    references on, it is built anew at every call."""
    if not _enabled or compiling():
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
