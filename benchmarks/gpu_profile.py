"""Where each millisecond of a fairseq update goes on a GPU, and the floor of the token mixing (issue 39).

    python benchmarks/gpu_profile.py --out results/gpu-profile                   # one GPU, fp16: about 4 minutes (budget: under 8)
    python benchmarks/gpu_profile.py --device cpu --quick --out /tmp/profile     # the same path on CPU, toy sizes

One run, every figure side by side, each configuration built alone (so its peak memory is its own), through
fairseq's own ``Trainer.train_step`` (``benchmarks/trainer.py`` builds it from a fairseq-train command line):
the seven Wikitext-103 presets at the paper's per-GPU shapes (causal 8 x 512; masked 16 x 512 and 4 x 2048),
fairseq's ``transformer_lm`` of the causal models' width and depth, and the no-mixing bound (the TNN model with
its TNOs replaced by the identity). For each, eager:

* update time (median and least of ``--timed`` updates, the device synchronised around each) and tokens per
  second, after a warm-up that lasts until fp16's loss scale stops falling (an overflowing update is skipped,
  optimizer and all, and is cheaper), with the timed updates that still overflowed counted; and the time an update
  of as many more run back to back, synchronised before the first and after the last only (``queued``: as
  fairseq-train runs them, one update's host work beside the GPU's work on the one before); for the configurations
  of ``--accumulated`` (by default the main target's two sides, TNN and transformer_lm causal at 8 x 512) also
  updates of ``--update-freq`` micro-batches, the recipe's gradient accumulation on one GPU (16 causal, 32 masked),
  synchronised, queued and split, where the optimizer step and the Trainer's rest weigh per token what they weigh in
  training (an update of one micro-batch pays them 16-32 times as often) and the CUDA graphs' copy of the gradients
  accumulated so far runs;
* kernel time per update (the kernels' device time; fairseq's ``record_function`` spans, which torch.profiler
  also lays over the device's timeline, left out) and kernels launched per update (torch.profiler; on CPU:
  the outermost operators), and the host's kernel-launch calls;
* the operations the update dispatches (``benchmarks/opcount.py``; what sets the host time);
* the update split into the training forward (model and criterion), the backward, the optimizer step and the
  rest of the Trainer (clipping, loss scaling, bookkeeping), from separate updates with the device
  synchronised at each boundary (so their sum can exceed the plain update's time, which overlaps them); the
  rest split again by the Trainer methods it calls (the seed, zeroing the gradients, moving the sample to the
  device, clipping with fp16's gradient copy and overflow check, the metrics) and the other;
* peak memory of an update (``torch.cuda.max_memory_allocated``; not on CPU), beside what stays allocated between
  updates (``resting``: the weights, fp16's master copy, the optimizer's state), which benchmarks/memory.py predicts,
  and the peak the allocator reserved (``torch.cuda.max_memory_reserved``): the memory of CUDA graphs, recorded in
  a pool of their own whose replays hand out tensors the allocator does not count as allocated, shows only there,
  so the memory target compares reserved peaks for the stack's graphs;
* the 15 longest kernels of one TNN, one FD-TNN and one SKI-TNN update, with their share of the kernel time,
  and the 15 host-side events (operators, CUDA runtime calls) with the most self time in the same update;
* the host's waits on the GPU in one update (CUDA only): each operation that synchronises the host with the
  device (an ``.item()``, a tensor's truth value, a copy from pageable memory without ``non_blocking``), counted by
  the Python line that called it, under ``torch.cuda.set_sync_debug_mode("warn")``. After such a wait the GPU
  idles until the host launches more work, so the host time that follows the update's last wait (the optimizer
  step, the metrics, the next batch, the next forward's launches) adds to the update's time instead of hiding
  behind the GPU's.

Compiled (``--tnn-compile strict``), and compiled with CUDA graphs (``--tnn-cuda-graphs`` as well; the no-mixing
bound too, whose layers' projections, gate and norms compile: TNN's time over the bound's in the same mode is the
ceiling of any speed-up over TNN there, printed beside each such target): the update
time and the compile time (the first two updates less two steady ones) with its longest phases
(``torch._dynamo.utils.compile_times``: tracing, AOT autograd, inductor's code generation, Triton's or the C++
compiler's), the graphs dynamo compiled while the
updates were timed (0 unless something recompiles at every step), for the configurations of ``--compiled`` and
``--graphs``, each compiled and then with CUDA graphs before the next one, as long as ``--compile-budget`` seconds
of compiling are left (a cold compile
took 12-52 s on an H200, a warm one, from inductor's cache, 4-9 s). A configuration that fails is reported and
the run goes on. The configurations of ``--bf16-weights`` are measured again with fairseq's own ``--bf16``, as the
recipe's ``PRECISION=bf16`` trains (bf16 weights and FP16Optimizer's fp32 master copy, no loss scaler:
``fairseq_tnn/patches/bf16.py``), right after their compiled runs, eager and in each compiled mode they were measured
in, each against the same mode in the run's precision (the issue's target: within 1.1x of fp16's update time; by
default TNN causal on CUDA in fp16); those of ``--bf16`` likewise in bf16 autocast (``--bf16-autocast``: fp32
weights, the recipe's ``PRECISION=bf16-autocast``), and those of ``--amp`` with fairseq's ``--amp`` (fp32 weights,
fp16 autocast, torch's gradient scaler) instead of its FP16Optimizer (fp16 weights, fp32 master copy), which the
issue named as a candidate, against the same 1.1x.

The floor of the mixing: for each TNO at each shape, the least bytes its forward and backward must move (the
input and output forward, the output gradient, the saved input and the input gradient backward: 5 x d1 x b x
n activations; the kernel, made from a few thousand RPE weights, could stay on chip) and the time that
takes at the bandwidth a plain device-to-device copy reaches on the same GPU, beside the measured mixing
time: one TNN layer's forward and backward less the same layer's with no token mixing, by the clock and by the
device time of its kernels (which a launch-bound layer does not inflate), eager and, for the configurations
compiled, with the layers compiled; and that kernel time by kind, with the kernels of each (cuFFT's transforms,
matrix products, the direct product's Triton kernels, inductor's kernels, copies and fills, reductions and norms,
the other elementwise kernels: ``KERNEL_KINDS``), the layer's less its no-mixing copy's; and each TNO's mixing in the
whole update (its update's kernel time less the bound's in the same mode, the stack's CUDA graphs included) over its
layers' floors, by kind. The 15 longest kernels and host events are listed again for the first configuration run
with CUDA graphs (what is left once the launches are gone). Last, on a GPU (``--direct-floor``), the same floors
of the spectral TNOs (TNN, FD-TNN) again with their Toeplitz products by direct summation (the Triton kernels of
``fairseq_tnn/ops/toeplitz_direct.py``, off by default in the models until a GPU run shows them faster), eager, with
the layer's output and input gradient against the FFT product's: the one candidate for issue 39's "mixing within 3x
of its floor", measured side by side with the FFT product's floor in the same run, and last, so that a fault of
kernels no earlier GPU run ran costs nothing else.

Results are written after every configuration (``gpu_profile.json`` and ``gpu_profile.md`` in ``--out``), so
a run stopped at a time limit still reports what it measured; the JSON names the run in progress (``running``), so
that a process that crashes (the ninth GPU run lost FD-TNN's rows and every row after them to a segmentation fault
in a compiled backward) can be resumed by the same command with ``--resume``: the runs measured are kept, the one
that ended its process is reported as failed, and the rest are measured in the new process.
"""
import argparse
import collections
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Dict, List, Optional, Tuple

# This process's start, before torch's import: a resumed run charges the run that ended the process before it with
# the compile seconds from that run's start to this one's (the restart and imports in between are not compiling)
PROCESS_STARTED = time.time()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks import trainer as tr  # noqa: E402
from benchmarks.measure import (KERNEL_KINDS, IdentityTno, add_out_options, kernel_kind,  # noqa: E402
                                peak_memory_held, refuse_overwrite, write_results)
from fairseq_tnn.models import compile as compiling  # noqa: E402
from fairseq_tnn.patches import device_overflow  # noqa: E402

TOP_KERNELS = 15
COMPILE_PHASES = 10  # the longest phases of a compilation kept per configuration
TOP_OF = ("tnn6", "fd3", "ski")  # the models whose longest kernels are listed (first group that has each)
# compiled, in this order while the budget lasts: the causal targets first, with the no-mixing bound (the ceiling of
# every speed-up over TNN in that mode), then SKI and FD at 4 x 2048
COMPILED_DEFAULT = ["causal/512/tnn6", "causal/512/fd3", "causal/512/bound_identity", "causal/512/tnn3",
                    "masked/2048/ski", "masked/2048/tnn6", "masked/2048/bound_identity", "masked/2048/fd3",
                    "masked/512/ski", "masked/512/fd3", "masked/512/tnn6"]
QUICK_COMPILED_DEFAULT: List[str] = []
# compiled with CUDA graphs (--tnn-cuda-graphs, the recipe's default on a GPU), each right after its compiled run: every
# configuration one of issue 39's targets compares (``targets``; benchmarks/gpu_run.sh's targets call), in that order
GRAPHS_DEFAULT = [key for key in COMPILED_DEFAULT if key != "masked/512/ski"]
# timed again with the recipe's gradient accumulation on one GPU (``--accumulated``, ``--update-freq``): the main
# target's two sides, whose optimizer step and Trainer overhead updates of one micro-batch weigh 16 times too much
ACCUMULATED_DEFAULT = ["causal/512/tnn6", "causal/512/transformer"]
# measured again in bf16 as the recipe's PRECISION=bf16 trains (fairseq's --bf16: --bf16-weights) in each mode the
# main precision measured them (issue 39: bf16 within 1.1x of fp16); bf16 autocast (--bf16) on request only
BF16_DEFAULT = ["causal/512/tnn6"]
# how the rows of another precision than the run's are labelled
PRECISION_LABELS = {"bf16": "bf16 autocast", "bf16w": "bf16 weights", "amp": "amp", "fp16host": "fairseq's overflow check"}
KEYS = {"causal": ["tnn6", "tnn3", "fd3", "transformer", "bound_identity"],
        "masked": ["tnn6", "tnn3", "fd3", "ski", "bound_identity"]}
# the TNOs whose floor is measured, per section: the layer of this configuration
FLOOR_KEYS = {"causal": ["tnn6", "tnn3", "fd3"], "masked": ["tnn6", "fd3", "ski"]}
# and again with the direct product, at the end of the run (``--direct-floor``): the spectral TNOs of FLOOR_KEYS
DIRECT_FLOOR_KEYS = {s: [k for k in keys if k != "ski"] for s, keys in FLOOR_KEYS.items()}


_sync = tr._sync


def timed_updates(trainer, update, device, timed: int) -> Tuple[List[float], int, float]:
    """``timed`` calls of ``update`` (one train_step) with the device synchronised around each, then ``timed`` back to
    back, as fairseq-train runs its updates (nothing waits for the GPU between them but what an update itself waits
    for): their milliseconds, how many of the synchronised ones overflowed under fp16 (an update fairseq skips and
    does not count; the last one's overflow learnt outside the timed calls), and the queued milliseconds a call."""
    updates_before = trainer.get_num_updates()
    ms = _timed(update, device, timed)
    device_overflow.learn(trainer)
    overflows = timed - (trainer.get_num_updates() - updates_before)
    return ms, overflows, tr.queued_ms(update, device, timed)


def _timed(fn, device, n: int) -> List[float]:
    """Milliseconds of ``n`` calls of fn, the device synchronised around each."""
    out = []
    for _ in range(n):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        out.append((time.perf_counter() - t) * 1000.0)
    return out


# The parts of the Trainer's rest timed apart (each a Trainer method train_step calls once per update, outside the
# criterion's forward and the optimizer's backward and step): what is left is the rest's "other" (model.train(),
# the metrics' start time, sample-size handling, the grad-norm check, set_num_updates)
REST_PARTS = (("_set_seed", "seed"), ("zero_grad", "zero_grad"), ("_prepare_sample", "prepare_sample"),
              ("clip_grad_norm", "clip"), ("_reduce_and_log_stats", "logging"))


def split_update(trainer, sample, device: str, n: int, sync: bool = True, update_freq: int = 1) -> Dict[str, float]:
    """Mean ms (so that the parts add up to the total) of the training forward, the backward, the optimizer step and
    the rest of ``train_step``, from ``n`` updates with the device synchronised at each boundary: the criterion's
    forward, the optimizer's ``backward`` and ``step`` are wrapped for the time (on this trainer only). The rest is
    split further into the Trainer methods of :data:`REST_PARTS` (the seed, zeroing the gradients, moving the
    sample to the device, clipping with fp16's gradient copy and overflow check, the metrics) and the other, under
    ``rest_parts``.

    ``sync=False``: the host's own time in each part instead, nothing synchronised inside the update (the device is
    synchronised before each one, as between timed updates): ``total`` is then the host's time in ``train_step``,
    and ``drain`` the wait for the device after it returned (about 0 where the host is the longer of the two).
    ``update_freq``: micro-batches (copies of ``sample``) per update, their forwards and backwards each summed."""
    samples = [sample] * update_freq
    spent = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    parts = {name: 0.0 for _, name in REST_PARTS}
    criterion, optimizer = trainer.criterion, trainer.optimizer
    wrapped = [(criterion, "forward", spent, "forward"), (optimizer, "backward", spent, "backward"),
               (optimizer, "step", spent, "optimizer")] + [(trainer, attr, parts, name) for attr, name in REST_PARTS]

    def wrap(obj, attr, into, phase):
        inner = getattr(obj, attr)

        def timed(*args, **kwargs):
            if sync:
                _sync(device)
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if sync:
                    _sync(device)
                into[phase] += (time.perf_counter() - t) * 1000.0
        setattr(obj, attr, timed)

    for obj, attr, into, phase in wrapped:
        wrap(obj, attr, into, phase)
    rows = []
    try:
        for _ in range(n):
            for d in (spent, parts):
                for k in d:
                    d[k] = 0.0
            drain = {}
            if sync:
                total = _timed(lambda: trainer.train_step(samples), device, 1)[0]
            else:
                _sync(device)
                t = time.perf_counter()
                trainer.train_step(samples)
                total = (time.perf_counter() - t) * 1000.0
                _sync(device)
                drain = {"drain": (time.perf_counter() - t) * 1000.0 - total}
            rest = total - sum(spent.values())
            rows.append({**spent, "rest": rest, "total": total, **drain,
                         "rest_parts": {**parts, "other": rest - sum(parts.values())}})
    finally:
        for obj, attr, _, _ in wrapped:
            del obj.__dict__[attr]  # the class's method again
    out = {k: statistics.fmean(r[k] for r in rows) for k in rows[0] if k != "rest_parts"}
    out["rest_parts"] = {k: statistics.fmean(r["rest_parts"][k] for r in rows) for k in rows[0]["rest_parts"]}
    return out


# At most this many updates of each kind (synchronised, queued) with the recipe's gradient accumulation: each is
# --update-freq micro-batches (16 causal, 32 masked), as long as 16-32 plain updates
ACCUMULATED_TIMED = 3


def accumulated(trainer, sample, device: str, update_freq: int, timed: int, batch_tokens: int) -> Dict:
    """Updates of ``update_freq`` micro-batches (copies of ``sample``, ``batch_tokens`` tokens each), as fairseq-train
    runs them with ``--update-freq`` on one GPU (the recipe's 16 causal, 32 masked): one untimed (the accumulated
    gradients' first copies, graphs mode's included), ``timed`` synchronised around each and ``timed`` back to back,
    and one split as :func:`split_update` splits an update. The optimizer step and the Trainer's rest are paid once
    per update, the forwards and backwards ``update_freq`` times, so their share per token is what training pays."""
    samples = [sample] * update_freq
    skips, graphs = _cudagraph_skips(), _graphs()
    trainer.train_step(samples)
    device_overflow.learn(trainer)
    ms, overflows, queued = timed_updates(trainer, lambda: trainer.train_step(samples), device, timed)
    split = split_update(trainer, sample, device, 1, update_freq=update_freq)
    tokens = update_freq * batch_tokens
    steady = statistics.median(ms)
    return {"update_freq": update_freq, "update_ms": steady, "ms": ms, "tokens_per_s": tokens / (steady / 1000.0),
            "queued_ms": queued, "queued_tokens_per_s": tokens / (queued / 1000.0), "overflows_timed": overflows,
            "rest_ms": split.pop("rest_parts"), "split_ms": split, "graphs_compiled_while_timed": _graphs() - graphs,
            "cudagraph_skips": _cudagraph_skips() - skips}


def _top(rows, total_us: float, updates: int) -> List[Dict]:
    by: Dict[str, List[float]] = {}
    for name, t in rows:
        by.setdefault(name, []).append(t)
    top = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
    return [{"name": name, "ms": sum(ts) / 1000.0 / updates, "calls": len(ts) / updates,
             "share": sum(ts) / total_us if total_us else 0.0} for name, ts in top]


def kernel_profile(trainer, sample, device: str, updates: int, top: bool) -> Dict:
    """Kernel time and launches per update (CPU: outermost operators; ``record_function`` spans such as fairseq's
    "forward" are no kernels and are left out), the host's kernel-launch calls, and with ``top`` the longest
    kernels by total time per update and the host-side events with the most self time, with their count and share."""
    kernels, host = tr.profiled(trainer, sample, device, updates)
    busy_us = sum(t for _, t in kernels)
    host_us = sum(t for _, t in host)
    launches = [(n, t) for n, t in host if "LaunchKernel" in n or n.startswith("cudaGraphLaunch")]
    result = {"kernel_ms": busy_us / 1000.0 / updates, "kernels": len(kernels) / updates,
              "kinds": kinds_of(kernels, updates),
              "launch_calls": len(launches) / updates, "launch_ms": sum(t for _, t in launches) / 1000.0 / updates,
              "graph_launches": sum(n.startswith("cudaGraphLaunch") for n, _ in launches) / updates,
              "host_self_ms": host_us / 1000.0 / updates}
    if top:
        result["top_kernels"] = _top(kernels, busy_us, updates)
        result["top_host"] = _top(host, host_us, updates)
    return result


def copy_bandwidth(device: str, mib: int) -> float:
    """Bytes per second of a plain device-to-device copy of ``mib`` MiB (read once, written once): the median of five
    rounds of 10 copies back to back, the device synchronised around each round only (a synchronisation around each
    copy, some 20 us beside its 0.5 ms on a GPU, would read the bandwidth a few percent low)."""
    src = torch.empty(mib * 2 ** 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = statistics.median(tr.queued_ms(lambda: dst.copy_(src), device, 10) for _ in range(5))
    return 2 * src.numel() / (ms / 1000.0)


def _as_in_the_model(layer, x):
    """``layer``'s forward on x as the model's loop calls it (``run_layers``): handed its TNO's spectrum as
    ``stack_spectra`` computes it for the model (outside compiled layers' graphs on a GPU), so that a compiled layer
    runs, and is timed in, the graphs the model compiled for it, not a graph of its own that computes the spectrum
    inside (a compile more, charged to the run's compile budget)."""
    (spectrum,) = compiling.stack_spectra([layer], x)
    return layer(x, None, None, spectrum)


def layer_time(layer, x, device: str, n: int) -> Dict[str, float]:
    """One layer's forward and backward (input and parameter gradients) on x (b, n, dim), its spectrum computed as the
    model computes it (:func:`_as_in_the_model`): the median ms of ``n`` calls, the device synchronised around each
    (``ms``), and the device time of their kernels per call from one profiled run of ``n`` calls (``kernel_ms``; CPU:
    the outermost operators' time), which a GPU's launch-bound small layer does not inflate."""
    x = x.detach().requires_grad_(True)
    g = torch.randn_like(x)

    def step():
        _as_in_the_model(layer, x).backward(g)
        layer.zero_grad(set_to_none=True)
        x.grad = None
    for _ in range(2):
        step()
    ms = statistics.median(_timed(step, device, n))
    kernels, _ = tr.profiled_calls(step, device, n)
    return {"ms": ms, "kernel_ms": sum(t for _, t in kernels) / 1000.0 / n, "kernels": len(kernels) / n,
            "kinds": kinds_of(kernels, n)}


def kinds_of(kernels, calls: int) -> Dict[str, Dict[str, float]]:
    """The kernels' (name, microseconds) of ``calls`` calls by ``kernel_kind``: {kind: {"ms": ms per call, "count":
    kernels per call}} for every kind of ``KERNEL_KINDS``."""
    kinds = {kind: {"ms": 0.0, "count": 0.0} for kind in KERNEL_KINDS}
    for name, t in kernels:
        kind = kinds[kernel_kind(name)]
        kind["ms"] += t / 1000.0 / calls
        kind["count"] += 1.0 / calls
    return kinds


def kinds_less(a: Dict, b: Dict) -> Dict[str, Dict[str, float]]:
    """``kinds_of`` figures ``a`` less ``b``, kind by kind."""
    return {kind: {v: a[kind][v] - b[kind][v] for v in ("ms", "count")} for kind in KERNEL_KINDS}


def _first_layer(model, section: str):
    """The first TNN layer of a causal (decoder) or masked (encoder) model."""
    return (model.decoder if section == "causal" else model.encoder).layers[0]


def _layers(model, section: str) -> int:
    """How many layers a causal (decoder) or masked (encoder) model has."""
    return len((model.decoder if section == "causal" else model.encoder).layers)


def mixing_floor(model, section: str, batch: int, n: int, device: str, dtype, bandwidth: float, timed: int) -> Dict:
    """The measured mixing time of the model's first layer (its time less its no-mixing copy's), by the clock and by
    its kernels' device time, and the floor of its TNO: 5 x d1 x b x n activations of ``dtype`` at the copy
    bandwidth. A compiled layer is measured compiled (its no-mixing copy compiles a graph of its own)."""
    layer = _first_layer(model, section)
    bare = copy.deepcopy(layer)
    bare.gtu.tno = IdentityTno()
    dim, d1 = layer.gtu.uv_proj.in_features, layer.gtu.d1
    x = torch.randn(batch, n, dim, device=device, dtype=dtype)
    with_mixing, without = layer_time(layer, x, device, timed), layer_time(bare, x, device, timed)
    elem = torch.empty(0, dtype=dtype).element_size()
    least = 5 * d1 * batch * n * elem
    floor_ms = least / bandwidth * 1000.0
    mixing = with_mixing["ms"] - without["ms"]
    mixing_kernels = with_mixing["kernel_ms"] - without["kernel_ms"]
    # where the mixing's kernel time goes: the layer's kernels of each kind less the no-mixing layer's
    kinds = kinds_less(with_mixing["kinds"], without["kinds"])
    return {"layer_ms": with_mixing["ms"], "no_mixing_layer_ms": without["ms"], "mixing_ms": mixing,
            "layer_kernel_ms": with_mixing["kernel_ms"], "no_mixing_layer_kernel_ms": without["kernel_ms"],
            "mixing_kernel_ms": mixing_kernels, "mixing_kernels": with_mixing["kernels"] - without["kernels"],
            "mixing_kinds": kinds, "least_bytes": least, "floor_ms": floor_ms,
            "mixing_over_floor": mixing / floor_ms if floor_ms > 0 else None,
            "mixing_kernels_over_floor": mixing_kernels / floor_ms if floor_ms > 0 else None}


def direct_floor(model, section: str, batch: int, n: int, device: str, dtype, bandwidth: float, timed: int) -> Dict:
    """``mixing_floor`` of the model's first layer with its Toeplitz products by direct summation
    (``toeplitz.DIRECT_MAX_N`` = n: the Triton kernels of ``ops/toeplitz_direct.py``, eager), and how far the layer's
    output and input gradient are from the FFT product's on the same input (the largest difference over the largest
    magnitude): the direct product's worth against the floor, and its function, on this device, without making it the
    default."""
    from benchmarks.opcount import count
    from fairseq_tnn.ops import toeplitz
    layer = _first_layer(model, section)
    x = torch.randn(batch, n, layer.gtu.uv_proj.in_features, device=device, dtype=dtype)
    g = torch.randn_like(x)
    before = toeplitz.DIRECT_MAX_N
    runs, ffts = [], {}

    def forward_backward(xi):
        with torch.random.fork_rng(devices=[x.device] if device == "cuda" else []):
            torch.manual_seed(0)  # the same dropout masks in both
            y = _as_in_the_model(layer, xi)
        y.backward(g)
        layer.zero_grad(set_to_none=True)
        return y
    try:
        for limit, way in ((0, "fft"), (n, "direct")):
            toeplitz.DIRECT_MAX_N = limit
            xi = x.detach().requires_grad_(True)
            y, counter = count(lambda: forward_backward(xi))
            runs.append((y.detach().float(), xi.grad.float()))
            # the FFTs each way dispatched, forward and backward: none where the direct product sums the kernel in
            # time (TNN's), the Hilbert transform's where it makes the kernel (causal FD-TNN's)
            ffts[way] = sum(v for k, v in counter.counts.items() if "fft" in k)
        # DIRECT_MAX_N = n still, from the loop's last run
        floor = mixing_floor(model, section, batch, n, device, dtype, bandwidth, timed)
    finally:
        toeplitz.DIRECT_MAX_N = before
    (y_fft, gx_fft), (y_direct, gx_direct) = runs
    floor["ffts"] = ffts
    floor["difference"] = {
        "output": ((y_direct - y_fft).abs().max() / y_fft.abs().max().clamp_min(1e-30)).item(),
        "x_grad": ((gx_direct - gx_fft).abs().max() / gx_fft.abs().max().clamp_min(1e-30)).item()}
    return floor


SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's message under set_sync_debug_mode("warn")


def host_syncs(update, set_mode, events=()) -> Dict:
    """The host's waits on the device during ``update()``: {"count": n, "sites": [{"where": "path:line", "calls":
    k}, ...]}, most calls first, path relative to site-packages or the repository. ``set_mode``:
    ``torch.cuda.set_sync_debug_mode``, under whose "warn" torch warns at each synchronising operation, the warning
    attributed to the Python line that called it. ``events``: classes whose ``synchronize`` is a wait torch does not
    warn of (``torch.cuda.Event``: the step metrics' and the fp16 overflow flag's waits, each for work an update
    old), each call counted by the line that called it with the ms it waited, under ``event_waits`` ({"count",
    "ms", "sites": [{"where", "calls", "ms"}]})."""
    waits: Dict[str, List[float]] = collections.defaultdict(list)
    patched = []
    for cls in events:
        inner = cls.synchronize
        patched.append((cls, cls.__dict__.get("synchronize")))

        def synchronize(self, _inner=inner):
            caller = sys._getframe(1)
            t = time.perf_counter()
            try:
                return _inner(self)
            finally:
                waits[_site(caller.f_code.co_filename, caller.f_lineno)].append((time.perf_counter() - t) * 1000.0)
        cls.synchronize = synchronize
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            set_mode("warn")
            try:
                update()
            finally:
                set_mode("default")
    finally:
        for cls, own in patched:
            if own is None:
                del cls.synchronize  # the base class's again
            else:
                cls.synchronize = own
    sites = collections.Counter()
    for w in caught:
        if SYNC_WARNING in str(w.message):
            sites[_site(w.filename, w.lineno)] += 1
    out = {"count": sum(sites.values()), "sites": [{"where": k, "calls": v} for k, v in sites.most_common()]}
    if events:
        ranked = sorted(waits.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        out["event_waits"] = {"count": sum(len(v) for v in waits.values()),
                              "ms": sum(sum(v) for v in waits.values()),
                              "sites": [{"where": k, "calls": len(v), "ms": sum(v)} for k, v in ranked]}
    return out


def _site(filename: str, line: int) -> str:
    """``path:line``, the path relative to site-packages or the repository."""
    path = filename.split("site-packages" + os.sep)[-1]
    return f"{os.path.relpath(path, ROOT) if path.startswith(ROOT) else path}:{line}"


HOST_FUNCTIONS = 20  # the host's Python functions listed per profiled configuration, by self and by cumulative time


def _where(filename: str, line: int, func: str) -> str:
    """A cProfile entry as ``path:line(function)``, the path relative to site-packages or the repository."""
    return f"{_site(filename, line)}({func})"


def host_python(update, device: str, n: int, out_dir: str, stem: str) -> Dict:
    """Where the host's time goes in ``n`` calls of ``update()``, function by function (cProfile): the
    :data:`HOST_FUNCTIONS` functions with the most self time and with the most cumulative time, per update (ms,
    calls), with the total self time profiled. cProfile's own cost inflates Python-heavy code, so the shares are what
    to read. Saved in ``out_dir`` to read later without the GPU: the raw statistics (``{stem}.pstats``, for
    ``pstats.Stats``) and one torch.profiler trace of two more updates with Python stacks, the host's events and the
    device's kernels on one timeline (``{stem}.trace.json.gz``, for Perfetto or chrome://tracing)."""
    import cProfile
    import gzip
    import pstats
    import shutil
    from torch.profiler import ProfilerActivity, profile
    prof = cProfile.Profile()
    _sync(device)
    prof.enable()
    for _ in range(n):
        update()
    _sync(device)
    prof.disable()
    prof.dump_stats(os.path.join(out_dir, stem + ".pstats"))
    rows = [{"where": _where(*k), "calls": nc / n, "self_ms": tt * 1000.0 / n, "cum_ms": ct * 1000.0 / n}
            for k, (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _sync(device)
    with profile(activities=acts, with_stack=True) as traced:
        for _ in range(2):
            update()
        _sync(device)
    raw = os.path.join(out_dir, stem + ".trace.json")
    traced.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    return {"updates": n, "self_ms": sum(r["self_ms"] for r in rows), "pstats": stem + ".pstats",
            "trace": stem + ".trace.json.gz",
            "by_self": sorted(rows, key=lambda r: -r["self_ms"])[:HOST_FUNCTIONS],
            "by_cumulative": sorted(rows, key=lambda r: -r["cum_ms"])[:HOST_FUNCTIONS]}


def _loss_scale(trainer) -> Optional[float]:
    """The dynamic fp16 loss scale: fairseq's (--fp16) or torch's gradient scaler's (--amp); None without one (bf16,
    fp32, or a scaler torch disabled)."""
    scaler = getattr(trainer.optimizer, "scaler", None)
    if scaler is None:
        return None
    if hasattr(scaler, "get_scale"):  # torch's GradScaler
        return float(scaler.get_scale()) if scaler.is_enabled() else None
    return float(scaler.loss_scale)


def _compile_phases() -> Dict[str, float]:
    """Seconds torch has spent so far in this process in each phase of compiling (dynamo, AOT autograd, inductor's
    code generation, Triton or C++ compilation), by the name ``torch._dynamo.utils.compile_times`` gives it."""
    from torch._dynamo.utils import compile_times
    names, values = compile_times(repr="csv", aggregate=True)
    return {n: float(v) for n, v in zip(names, values) if v not in ("", None)}


# How the mode with CUDA graphs is labelled
GRAPH_SUFFIX = {tr.GRAPHS: " compiled + CUDA graphs"}


def _mode_label(compiled) -> str:
    """A mode as the targets name it: eager, compiled, or compiled + CUDA graphs."""
    return {False: "eager", True: "compiled", **GRAPH_SUFFIX}[compiled].strip()


def _graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def in_fairseq_trains_aggregators(trainer) -> None:
    """Each of ``trainer``'s updates from here on inside the metrics aggregators fairseq-train opens around it
    (``fairseq_cli/train.py``): "train", the epoch's, and "train_inner", the update's, beside the default one. Every
    value the update logs updates a meter in each active aggregator, which on a GPU is a few small operations on
    device tensors, so an update measured outside them costs the host less than fairseq-train's."""
    from fairseq import metrics
    step = trainer.train_step

    def train_step(samples, *args, **kwargs):
        with metrics.aggregate("train"), metrics.aggregate("train_inner"):
            return step(samples, *args, **kwargs)
    trainer.train_step = train_step


def _cudagraph_skips() -> int:
    """Compiled graphs inductor has run without CUDA graphs in this process so far (an input it mutates, a CPU
    tensor, too many re-recordings: ``counters["inductor"]["cudagraph_skips"]``): a row of the stack's graphs with
    one of these timed plain compiled code for some of its update."""
    from torch._dynamo.utils import counters
    return int(counters["inductor"]["cudagraph_skips"])


def not_all_graphs(result) -> List[str]:
    """A line for each row of the stack's graphs that launched fewer graphs an update than the stack's two, or whose
    compiled graphs inductor ran without CUDA graphs: its times are partly plain compiled code's."""
    lines = []
    for g in result["groups"]:
        for c in g["configs"]:
            short = c.get("graph_launches") is not None and c["graph_launches"] < GRAPH_LAUNCHES_EXPECTED
            if c["compiled"] == tr.GRAPHS and (short or c.get("cudagraph_skips")):
                lines.append(f"Not all CUDA graphs: {g['section']} {g['batch']} x {g['n']} {c['label']} launched "
                             f"{c.get('graph_launches', 0):.1f} graphs an update (the stack's graphs are "
                             f"{GRAPH_LAUNCHES_EXPECTED}), and inductor ran {c.get('cudagraph_skips', 0)} of its "
                             "graphs without CUDA graphs: its times are partly plain compiled code's.")
    return lines


# A row of the stack's graphs runs two graphs an update (the forward's and the backward's; more with gradient
# accumulation or another length): fewer, or skips, and the row timed something else than its label says
GRAPH_LAUNCHES_EXPECTED = 2


MAX_WARMUP = 30  # updates at most, until fp16's loss scale stops falling


def measure(key: str, arch: str, bound, section: str, n: int, batch: int, device: str, precision: str, quick: bool,
            data: str, timed: int, compiled, top: bool, floor_bw: Optional[float], log,
            host_dir: Optional[str] = None, accumulate: int = 0) -> Dict:
    """Every figure of one configuration, eager, compiled (True) or compiled with CUDA graphs (``tr.GRAPHS``; see
    the module docstring); with ``host_dir``, where the host's time goes too: each part of the update by the host's
    own clock, nothing synchronised inside it (:func:`split_update`), and function by function
    (:func:`host_python`, its files written to ``host_dir``). Under fp16 the warm-up runs until fairseq's loss scale
    stops falling (an update whose gradients overflow is skipped, optimizer step and all, and would time a cheaper
    update); the timed updates that still overflowed are counted. ``accumulate``: above 0, updates of that many
    micro-batches too (:func:`accumulated`, under ``accumulated``)."""
    from benchmarks.opcount import trainer_counts
    sample = tr.synthetic_sample(section, n, batch, tr.QUICK_VOCAB if quick else tr.VOCAB, device=device)
    torch.manual_seed(1)
    skips = _cudagraph_skips()
    t0 = time.time()
    trainer = tr.build_trainer(section, arch, bound, n, device, precision, compiled, data, quick)
    in_fairseq_trains_aggregators(trainer)
    build_s = time.time() - t0
    phases = _compile_phases()
    first = _timed(lambda: trainer.train_step([sample]), device, 2)  # compiles (compiled), allocates optimizer state
    phases = {k: v - phases.get(k, 0.0) for k, v in _compile_phases().items()}
    warmup = 2
    for _ in range(MAX_WARMUP):
        before = _loss_scale(trainer)
        trainer.train_step([sample])
        device_overflow.learn(trainer)  # the plugin reads an update's overflow at the next one's start: now
        warmup += 1
        if warmup >= 4 and _loss_scale(trainer) == before:
            break
    if device == "cuda":
        resting = torch.cuda.memory_allocated()  # between updates: weights, master copy, optimizer state, the sample
    graphs = _graphs()
    with peak_memory_held():  # the peak of the timed updates (fairseq resets it at the end of each)
        ms, overflows, queued = timed_updates(trainer, lambda: trainer.train_step([sample]), device, timed)
        if device == "cuda":  # read here: every update after these resets it again
            peak, reserved_peak = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    steady = statistics.median(ms)
    suffix = {False: "", True: " compiled", **GRAPH_SUFFIX}[compiled]
    c = {"key": key, "label": tr.LABELS[key] + suffix, "arch": arch, "compiled": compiled, "precision": precision,
         "criterion": trainer.cfg.criterion._name, "layers": _layers(trainer.model, section),
         "build_s": round(build_s, 2), "update_ms": steady, "min_ms": min(ms), "ms": ms,
         "tokens_per_s": batch * n / (steady / 1000.0), "queued_ms": queued,
         "queued_tokens_per_s": batch * n / (queued / 1000.0), "warmup_updates": warmup, "overflows_timed": overflows,
         "loss_scale": _loss_scale(trainer), "graphs_compiled_while_timed": _graphs() - graphs,
         "cudagraph_skips": _cudagraph_skips() - skips}
    if device == "cuda":
        c["peak_mib"] = peak / 2 ** 20
        c["reserved_peak_mib"] = reserved_peak / 2 ** 20
        c["resting_mib"] = resting / 2 ** 20
    if compiled:
        c["compile_s"] = max(0.0, (sum(first) - 2 * steady) / 1000.0)
        # where it went (phases nest: an outer phase's time includes its inner ones')
        c["compile_phases"] = dict(sorted(((k, round(v, 2)) for k, v in phases.items() if v >= 0.05),
                                          key=lambda kv: -kv[1])[:COMPILE_PHASES])
    else:
        c["first_updates_ms"] = first
    if accumulate:
        c["accumulated"] = accumulated(trainer, sample, device, accumulate, min(timed, ACCUMULATED_TIMED), batch * n)
    c.update(kernel_profile(trainer, sample, device, 2, top))
    c["wall_over_kernel"] = steady / c["kernel_ms"] if c["kernel_ms"] else None
    split = split_update(trainer, sample, device, 3)
    c["rest_ms"] = split.pop("rest_parts")
    c["split_ms"] = split
    if device == "cuda":
        c["syncs"] = host_syncs(lambda: trainer.train_step([sample]), torch.cuda.set_sync_debug_mode,
                                (torch.cuda.Event,))
    if host_dir is not None:
        host = split_update(trainer, sample, device, timed, sync=False)
        c["host_rest_ms"] = host.pop("rest_parts")
        c["host_split_ms"] = host
        mode = {False: "eager", True: "compiled", tr.GRAPHS: "graphs"}[compiled]
        c["host_python"] = host_python(lambda: trainer.train_step([sample]), device, timed, host_dir,
                                       f"host-{section}-{n}-{key}-{mode}-{precision}")
    if not compiled:
        c["ops"] = {k: v for k, v in trainer_counts(trainer, sample).items() if not k.endswith("_ops")}
    if floor_bw is not None and compiled != tr.GRAPHS:  # eager and compiled layers (not the stack's graphs)
        dtype = next(trainer.model.parameters()).dtype
        c["floor"] = mixing_floor(trainer.model, section, batch, n, device, dtype, floor_bw, timed)
    log(f"[{section} {batch}x{n}] {c['label']:<34} {steady:8.2f} ms/update (min {c['min_ms']:.2f}), kernels "
        f"{c['kernel_ms']:8.2f} ms ({c['kernels']:.0f}), launches {c['launch_calls']:.0f}, split "
        + ", ".join(f"{k} {v:.1f}" for k, v in c["split_ms"].items())
        + " (rest: " + ", ".join(f"{k} {v:.1f}" for k, v in c["rest_ms"].items()) + ")"
        + (f", compile {c['compile_s']:.0f} s, graphs while timed {c['graphs_compiled_while_timed']}" if compiled else "")
        + (f", overflows while timed {overflows} (loss scale {c['loss_scale']})" if c["loss_scale"] else "")
        + (f"; update-freq {accumulate}: {c['accumulated']['update_ms']:.1f} ms/update, queued "
           f"{c['accumulated']['queued_ms']:.1f}" if accumulate else ""))
    del trainer
    if device == "cuda":
        torch.cuda.empty_cache()
    return c


DIRECT_FLOOR = "direct-floor"  # the run of a configuration's floor with the direct product (``--direct-floor``)


def _mode(how) -> str:
    """A run's mode as its row's ``compiled`` holds it (False, True or ``tr.GRAPHS``), by name."""
    return {False: "eager", True: "compiled", tr.GRAPHS: "graphs", DIRECT_FLOOR: DIRECT_FLOOR}[how]


def _done(result) -> set:
    """The runs a result already holds, measured or failed, as (SECTION/N/KEY, mode, precision)."""
    done = {(f"{g['section']}/{g['n']}/{c['key']}", _mode(c["compiled"]), c["precision"])
            for g in result["groups"] for c in g["configs"]}
    done |= {(d["id"], DIRECT_FLOOR, d["precision"]) for d in result.get("direct_floor", [])}
    return done | {(f["id"], f["mode"], f["precision"]) for f in result.get("failed", [])}


def _resumed(previous: Dict, precision: str):
    """What a run resumed from ``previous`` (its gpu_profile.json) starts from: its groups, failures and bandwidth;
    the run it was in when its process ended (``running``: a crash, as FD-TNN's segmentation fault as the third
    model of a process in the ninth GPU run, or a kill) recorded as failed and never run again; the compile seconds
    spent, that run's included (from its start to now, if it compiled); and the models whose longest kernels were
    listed already."""
    result = {"groups": previous["groups"], "bandwidth_gbs": previous["bandwidth_gbs"],
              "failed": list(previous.get("failed", [])), "direct_floor": list(previous.get("direct_floor", []))}
    spent = previous.get("compile_spent_s", 0.0)
    cut = previous.get("running")
    if cut:
        result["failed"].append({**{k: cut[k] for k in ("id", "how", "mode", "precision")},
                                 "error": "its process ended while it ran (a crash or a kill; the log says which), "
                                          "and the run was resumed without it"})
        if cut["mode"] in ("compiled", "graphs"):
            spent += max(0.0, PROCESS_STARTED - cut["started"])
    topped = set()
    for g in result["groups"]:
        for c in g["configs"]:
            if c.get("top_kernels"):
                main = c["precision"] == precision
                topped.add(c["key"] if c["compiled"] is False and main
                           else (c["key"], c["compiled"] if main else c["precision"]))
    return result, spent, topped


def run(device: str, precision: str, quick: bool, timed: int, compiled_ids: List[str], budget: float, keys, write,
        log, graphs_ids: List[str] = (), bf16_ids: List[str] = (), amp_ids: List[str] = (),
        bf16w_ids: List[str] = (), host_ids: List[str] = (), shapes: List[str] = (), host_profile_ids: List[str] = (),
        host_dir: Optional[str] = None, previous: Optional[Dict] = None, direct_floor_ids: List[str] = (),
        accumulated_ids: List[str] = (), update_freq: Optional[int] = None) -> Dict:
    """Every configuration in each of its modes (the module docstring), written after each (``write``); those of
    ``accumulated_ids`` (in the run's precision) also with updates of ``update_freq`` micro-batches (default: the
    recipe's on one GPU, ``tr.recipe_update_freq``); with
    ``previous`` (the gpu_profile.json of the same command, whose process ended early), the runs it holds are kept
    and the others measured (``--resume``)."""
    import fairseq_tnn
    fairseq_tnn.register()
    if previous is None:
        result = {"groups": [], "bandwidth_gbs": None}
        bw = copy_bandwidth(device, 64 if quick else 1024)
        result["bandwidth_gbs"] = bw / 1e9
        topped, compile_spent = set(), 0.0
    else:
        result, compile_spent, topped = _resumed(previous, precision)
        bw = result["bandwidth_gbs"] * 1e9
        log(f"resumed: {sum(len(g['configs']) for g in result['groups'])} runs kept" + (f", {previous['running']['id']} "
                                                          f"({previous['running']['mode']}) ended its process"
                                                          if previous.get("running") else ""))
    log(f"copy bandwidth: {bw / 1e9:.1f} GB/s")
    done = _done(result)

    def accumulate(cid, g, prec):
        if cid not in accumulated_ids or prec != precision:
            return 0
        return update_freq or tr.recipe_update_freq(g["section"], g["n"], g["batch"])

    def measured(cid, how, prec, fn):
        """fn()'s row, the run named in the result while it runs, so that a process that ends inside it (a crash)
        leaves the result saying which run it was (``--resume`` goes on without it)."""
        result["running"] = {"id": cid, "how": str(how), "mode": _mode(how), "precision": prec,
                             "started": time.time()}
        write(result)
        try:
            return fn()
        finally:
            del result["running"]

    with tempfile.TemporaryDirectory() as tmp:
        data = tr._dictionary_dir(tmp, tr.QUICK_VOCAB if quick else tr.VOCAB)
        groups = tr.QUICK_GROUPS if quick else tr.FULL_GROUPS
        arch_of = {(s, k): (a, b) for s, configs in tr.CONFIGS.items() for k, a, _, b in configs}
        for section, n, batch in groups:  # eager: every configuration
            if shapes and f"{section}/{n}" not in shapes:
                continue
            g = _group_of(result, f"{section}/{n}/")
            if g is None:
                g = {"section": section, "n": n, "batch": batch, "configs": []}
                result["groups"].append(g)
            for key in KEYS[section]:
                cid = f"{section}/{n}/{key}"
                if (keys and key not in keys) or (cid, "eager", precision) in done:
                    continue
                arch, bound = arch_of[(section, key)]
                top = key in TOP_OF and key not in topped
                if top:
                    topped.add(key)
                floor = bw if key in FLOOR_KEYS[section] else None
                host = host_dir if cid in host_profile_ids else None
                g["configs"].append(measured(cid, False, precision, lambda: measure(
                    key, arch, bound, section, n, batch, device, precision, quick, data, timed, False, top, floor,
                    log, host, accumulate(cid, g, precision))))
                write(result)
        # while the compile budget lasts: each configuration compiled, then with CUDA graphs, then in bf16 in the modes
        # it ran in, before the next configuration (so that the first ones of the lists, the targets', get every
        # mode); a configuration that fails is reported
        runs = []
        for c in list(dict.fromkeys([*compiled_ids, *graphs_ids, *host_ids, *bf16_ids, *bf16w_ids, *amp_ids])):
            modes = [True] if c in compiled_ids else []
            modes += [tr.GRAPHS] if c in graphs_ids else []
            runs += [(c, how, precision) for how in modes]
            for other, ids in (("fp16host", host_ids), ("bf16", bf16_ids), ("bf16w", bf16w_ids), ("amp", amp_ids)):
                if c in ids:
                    runs += [(c, how, other) for how in [False, *modes]]
        for cid, how, prec in runs:
            section, _, key = cid.split("/")
            g = _group_of(result, cid)
            if g is None or (keys and key not in keys) or (cid, _mode(how), prec) in done:
                continue
            last = max([c.get("compile_s", 0.0) for gg in result["groups"] for c in gg["configs"]] + [0.0])
            if how and compile_spent + last > budget:
                log(f"compile budget ({budget:.0f} s) spent: {cid} ({how}) and the rest not compiled")
                result.setdefault("not_compiled", []).append(cid + (f" ({GRAPH_SUFFIX[how].strip()})"
                                                                    if how == tr.GRAPHS else ""))
                continue
            arch, bound = arch_of[(section, key)]
            t0 = time.time()
            torch._dynamo.reset()  # each model compiles afresh, never against the recompile limit of the ones before
            if device == "cuda":  # and the graphs' pools the reset freed leave the reserved memory (its own peak)
                torch.cuda.empty_cache()
            # the longest kernels and host events of the first TNN configuration with CUDA graphs (what is left
            # once the launches are gone) and of its eager update in the other precision (bf16's kernels took 2.9
            # times fp16's in the fourth GPU run, docs/performance.md: which ones?); the floor of the mixing again
            # with the layers compiled
            mark = (key, how if prec == precision else prec)
            top = key in TOP_OF and mark not in topped and (how == tr.GRAPHS if prec == precision else how is False)
            if top:
                topped.add(mark)
            floor = bw if how is True and key in FLOOR_KEYS[section] and prec == precision else None
            try:
                c = measured(cid, how, prec, lambda: measure(
                    key, arch, bound, section, g["n"], g["batch"], device, prec, quick, data, timed, how, top, floor,
                    log, host_dir if cid in host_profile_ids and prec == precision else None,
                    accumulate(cid, g, prec)))
                if prec != precision:
                    c["label"] += f" ({PRECISION_LABELS.get(prec, prec)})"
                g["configs"].append(c)
            except Exception as err:  # one configuration's failure is a result, not the end of the run
                first = (str(err).strip().splitlines() or [""])[0][:300]
                log(f"[{section} {g['batch']}x{g['n']}] {tr.LABELS[key]} ({how}) failed: {type(err).__name__}: {first}")
                result.setdefault("failed", []).append({"id": cid, "how": str(how), "mode": _mode(how),
                                                        "precision": prec, "error": f"{type(err).__name__}: {first}"})
                if device == "cuda":
                    torch.cuda.empty_cache()
            if how:
                compile_spent += time.time() - t0
                result["compile_spent_s"] = compile_spent
            write(result)
        # last, as the one part that runs kernels no earlier GPU run ran (a fault of theirs that ends the process or
        # its CUDA context costs only this): the floor again with the direct product, eager
        for cid in direct_floor_ids:
            section, _, key = cid.split("/")
            g = _group_of(result, cid)
            if g is None or (keys and key not in keys) or (cid, DIRECT_FLOOR, precision) in done:
                continue
            arch, bound = arch_of[(section, key)]
            row = {"id": cid, "label": tr.LABELS[key], "precision": precision}
            try:
                def floor():
                    trainer = tr.build_trainer(section, arch, bound, g["n"], device, precision, False, data, quick)
                    dtype = next(trainer.model.parameters()).dtype
                    return direct_floor(trainer.model, section, g["batch"], g["n"], device, dtype, bw, timed)
                row["floor"] = measured(cid, DIRECT_FLOOR, precision, floor)
                if device == "cuda":
                    torch.cuda.empty_cache()
                f = row["floor"]
                log(f"[{section} {g['batch']}x{g['n']}] {row['label']} with the direct product: mixing "
                    f"{f['mixing_ms']:.3f} ms, kernels {f['mixing_kernel_ms']:.3f} ms, "
                    f"{f['mixing_kernels_over_floor']:.1f}x its floor by kernel time; against the FFT product's "
                    f"output {f['difference']['output']:.1e}, input gradient {f['difference']['x_grad']:.1e}")
            except Exception as err:  # reported, as a configuration's failure is
                row["error"] = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"
                log(f"[{section} {g['batch']}x{g['n']}] {row['label']} with the direct product failed: {row['error']}")
            result.setdefault("direct_floor", []).append(row)
            write(result)
    return result


def _get(g, key, compiled=False, precision=None):
    """The configuration ``key`` of group ``g`` in that mode, in ``precision`` (default: the run's main one)."""
    main = g["configs"][0].get("precision") if g["configs"] else None
    return next((c for c in g["configs"] if c["key"] == key and c["compiled"] == compiled
                 and c.get("precision") == (precision or main)), None)


def update_mixing(result) -> List[Dict]:
    """The mixing of each TNO in the whole update: the update's kernel time less the no-mixing bound's in the same
    mode and precision (every kernel the TNOs add, the stack's shared work included, as the recipe trains), beside its
    layers' floors (the layer count times the eager floor of the same TNO and shape), and that difference by kernel
    kind; one row per TNO of ``FLOOR_KEYS`` and mode where both sides ran."""
    rows = []
    for g in result["groups"]:
        for compiled in (False, True, tr.GRAPHS):
            bare = _get(g, "bound_identity", compiled)
            for key in FLOOR_KEYS[g["section"]]:
                c, eager = _get(g, key, compiled), _get(g, key, False)
                if not (c and bare and eager and eager.get("floor") and c.get("layers") and c.get("kinds")
                        and bare.get("kinds")):
                    continue
                floor_ms = c["layers"] * eager["floor"]["floor_ms"]
                mixing = c["kernel_ms"] - bare["kernel_ms"]
                rows.append({"group": g, "config": c, "mode": _mode_label(compiled), "mixing_kernel_ms": mixing,
                             "mixing_kernels": c["kernels"] - bare["kernels"], "floor_ms": floor_ms,
                             "over_floor": mixing / floor_ms if floor_ms > 0 else None,
                             "kinds": kinds_less(c["kinds"], bare["kinds"])})
    return rows


def targets(result) -> List[Dict]:
    """The issue's targets as measured ratios (met or not), where both sides were measured. A speed-up over TNN
    comes with its ceiling where the no-mixing bound ran in the same mode: TNN's update time over the bound's, the
    most any TNO could gain over TNN there (a target above it cannot be met by a TNO)."""
    rows = []

    def add(what, ratio, bound, higher=True, ceiling=None):
        if ratio is not None:
            row = {"target": what, "ratio": ratio, "bound": bound, "met": ratio >= bound if higher else ratio <= bound}
            if ceiling is not None:
                row["ceiling"] = ceiling
            rows.append(row)

    for g in result["groups"]:
        shape = f"{g['section']} {g['batch']} x {g['n']}"
        main = g["configs"][0].get("precision") if g["configs"] else None
        for compiled in (False, True, tr.GRAPHS):
            mode = _mode_label(compiled)
            tnn6, tnn3, fd3, ski, bare = (_get(g, k, compiled) for k in ("tnn6", "tnn3", "fd3", "ski", "bound_identity"))
            trans = _get(g, "transformer", False)

            def ceiling(tnn, field="update_ms"):
                return tnn[field] / bare[field] if bare and bare.get(field) else None

            def speedup(what, tnn, fast, bound):
                """``fast`` over ``tnn`` by the clock, and by the kernels' device time where both have one (the
                steadier figure on a host whose update times vary by a third from update to update)."""
                add(f"{shape}: {what}, {mode}", tnn["update_ms"] / fast["update_ms"], bound, ceiling=ceiling(tnn))
                if tnn.get("kernel_ms") and fast.get("kernel_ms"):
                    add(f"{shape}: {what}, {mode}, by kernel time", tnn["kernel_ms"] / fast["kernel_ms"], bound,
                        ceiling=ceiling(tnn, "kernel_ms"))
            if tnn6 and trans:
                add(f"{shape}: TNN (RPE 6) {mode} tokens/s vs transformer_lm (eager)", trans["update_ms"] / tnn6["update_ms"], 1.0)
                if tnn6.get("queued_ms") and trans.get("queued_ms"):  # as fairseq-train runs updates: back to back
                    add(f"{shape}: TNN (RPE 6) {mode} tokens/s vs transformer_lm (eager), updates queued",
                        trans["queued_ms"] / tnn6["queued_ms"], 1.0)
                a, b = tnn6.get("accumulated"), trans.get("accumulated")
                if a and b and a["update_freq"] == b["update_freq"]:  # as the recipe trains on one GPU
                    add(f"{shape}: TNN (RPE 6) {mode} tokens/s vs transformer_lm (eager), update-freq "
                        f"{a['update_freq']}, updates queued", b["queued_ms"] / a["queued_ms"], 1.0)
            if tnn6 and fd3:
                speedup("FD-TNN vs TNN (RPE 6)", tnn6, fd3, 1.25 if g["section"] == "causal" else 1.5)
            if tnn3 and fd3 and g["section"] == "causal":
                speedup("FD-TNN vs TNN (RPE 3)", tnn3, fd3, 1.15)
            if tnn6 and ski and g["n"] == 2048:
                speedup("SKI-TNN vs TNN (RPE 6)", tnn6, ski, 1.5)
                # the stack's graphs keep their memory in a pool of their own, which only the reserved peak counts
                field, what = (("reserved_peak_mib", "reserved peak memory") if compiled == tr.GRAPHS
                               else ("peak_mib", "peak memory"))
                if field in ski and field in tnn6:
                    # its ceiling (a floor here): the no-mixing bound's peak over TNN's, the least any TNO could reach
                    add(f"{shape}: SKI-TNN {what} vs TNN (RPE 6), {mode}", ski[field] / tnn6[field], 0.85,
                        higher=False, ceiling=(bare[field] / tnn6[field] if bare and bare.get(field) else None))
            for c in g["configs"]:
                other = _get(g, c["key"], compiled)
                if c["compiled"] == compiled and c.get("precision") in ("bf16", "bf16w") and other and other is not c:
                    add(f"{shape}: {c['label']} vs {other['precision']}, {mode} update time",
                        c["update_ms"] / other["update_ms"], 1.1, higher=False)
                if c["compiled"] == compiled and c.get("precision") == "fp16host" and other and other is not c:
                    add(f"{shape}: {tr.LABELS[c['key']]} update time with fairseq's overflow check over the device's, "
                        f"{mode}", c["update_ms"] / other["update_ms"], 1.0)
                if c["compiled"] == compiled and "compile_s" in c:
                    add(f"{shape}: {c['label']} compile time, s", c["compile_s"], 30.0, higher=False)
                if c["compiled"] == compiled and c.get("floor") and c.get("precision") == main:
                    f = c["floor"]
                    if not compiled:  # eager by the clock (a lone eager layer waits on its launches)
                        add(f"{shape}: {c['label']} mixing over its floor", f["mixing_over_floor"], 3.0, higher=False)
                    add(f"{shape}: {c['label']} mixing over its floor, by kernel time",
                        f["mixing_kernels_over_floor"], 3.0, higher=False)
    for m in update_mixing(result):
        g = m["group"]
        add(f"{g['section']} {g['batch']} x {g['n']}: {tr.LABELS[m['config']['key']]} mixing in the update over its "
            f"layers' floors, by kernel time, {m['mode']}", m["over_floor"], 3.0, higher=False)
    for d in result.get("direct_floor", []):
        g = _group_of(result, d["id"])
        if d.get("floor") and g:
            add(f"{g['section']} {g['batch']} x {g['n']}: {d['label']} mixing over its floor, by kernel time, with the "
                "direct product (eager)", d["floor"]["mixing_kernels_over_floor"], 3.0, higher=False)
    return rows


def _group_of(result, cid: str) -> Optional[Dict]:
    """The group of the shape of ``cid`` (SECTION/N/KEY) in ``result``, if it ran."""
    section, n_s, _ = cid.split("/")
    return next((g for g in result["groups"] if g["section"] == section and g["n"] == int(n_s)), None)


def _top_table(what: str, rows: List[Dict]) -> List[str]:
    """A markdown table of ``_top``'s rows (names shortened to 90 characters)."""
    out = [f"| {what} | ms / update | calls | share |", "|---|---:|---:|---:|"]
    for k in rows:
        name = k["name"].replace("|", "/")
        name = name if len(name) <= 90 else name[:87] + "..."
        out.append(f"| `{name}` | {k['ms']:.3f} | {k['calls']:.0f} | {100 * k['share']:.1f}% |")
    return out


def _kinds_table(meta, floors, directs, unit: str) -> List[str]:
    """The markdown section of the mixing's kernel time by kind (``mixing_floor``'s ``mixing_kinds``) for the floors
    measured (``floors``: (group, configuration); ``directs``: (group, ``--direct-floor`` row)) in the run of ``meta``;
    none where none has them (results of a gpu_profile before the kinds were counted)."""
    direct_max_n = meta.get("direct_max_n") or 0  # a run whose products are direct where n is at most this

    def product(g):
        return "direct" if g["n"] <= direct_max_n else "FFT"
    rows = [(g, tr.LABELS[c["key"]], "compiled" if c["compiled"] else "eager", product(g), c["floor"])
            for g, c in floors]
    rows += [(g, d["label"], "eager", "direct", d["floor"]) for g, d in directs]
    rows = [r for r in rows if r[-1].get("mixing_kinds")]
    if not rows:
        return []
    out = ["", "## Where the mixing's kernel time goes", "",
           f"The mixing's {unit} (the first layer's forward and backward less the same layer's with no token mixing, as "
           f"in the floors above) by kind, ms per forward and backward with the number of {unit} in brackets: cuFFT's "
           "transforms; matrix products (cuBLAS, CUTLASS); the direct product's Triton kernels; inductor's generated "
           "kernels (a compiled layer); copies, casts and fills; reductions and norms; the other elementwise kernels (the "
           "RPE's activations, the spectra's complex products). Product: the Toeplitz product the layer ran, by FFT or "
           "by direct summation (`--direct-floor`, or a run's `--direct-max-n`). A negative figure: the no-mixing "
           "layer's kernels of that kind that the layer with its mixing does not run.", "",
           f"| shape | TNO of | mode | product | mixing {unit} ms | {unit} | " + " | ".join(KERNEL_KINDS) + " |",
           "|---|---|---|---|---:|---:|" + "---:|" * len(KERNEL_KINDS)]
    for g, label, mode, product, f in rows:
        kinds = f["mixing_kinds"]
        out.append(f"| {g['section']} {g['batch']} x {g['n']} | {label} | {mode} | {product} | "
                   f"{f['mixing_kernel_ms']:.3f} | {f['mixing_kernels']:.0f} | "
                   + " | ".join(f"{kinds[k]['ms']:.3f} ({kinds[k]['count']:.0f})" for k in KERNEL_KINDS) + " |")
    return out


def _accumulated_table(groups) -> List[str]:
    """The rows measured with the recipe's gradient accumulation (``accumulated``) beside their plain updates."""
    rows = [(g, c) for g in groups for c in g["configs"] if c.get("accumulated")]
    if not rows:
        return []
    out = ["", "## Updates as the recipe accumulates them on one GPU", "",
           "Each update `--update-freq` micro-batches of the shape (the recipe's tokens per update on one GPU), as "
           "fairseq-train runs them: the forwards and backwards paid per micro-batch, the optimizer step and the rest "
           "of the Trainer once per update. ms / update: median of the updates synchronised around each; queued: "
           "back to back; tokens/s vs update-freq 1: the queued tokens per second over the plain updates' queued ones; "
           "split: one update synchronised at each phase (forward and backward summed over the micro-batches); step "
           "share: the optimizer and rest's part of that update, against their part of a plain one.", "",
           "| shape | configuration | update-freq | ms / update | queued ms | tokens/s (queued) | "
           "tokens/s vs update-freq 1 | forward ms | backward ms | optimizer ms | rest ms | step share | "
           "step share at update-freq 1 | overflowed |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def share(split):
        return (split["optimizer"] + split["rest"]) / split["total"] if split["total"] else 0.0
    for g, c in rows:
        a, s = c["accumulated"], c["accumulated"]["split_ms"]
        gain = f"{a['queued_tokens_per_s'] / c['queued_tokens_per_s']:.2f}x" if c.get("queued_tokens_per_s") else "-"
        out.append(f"| {g['section']} {g['batch']} x {g['n']} | {c['label']} | {a['update_freq']} | "
                   f"{a['update_ms']:.1f} | {a['queued_ms']:.1f} | {a['queued_tokens_per_s']:,.0f} | {gain} | "
                   f"{s['forward']:.1f} | {s['backward']:.1f} | {s['optimizer']:.2f} | {s['rest']:.2f} | "
                   f"{share(s):.1%} | {share(c['split_ms']):.1%} | {a['overflows_timed']} |")
    return out


def _syncs_table(groups) -> List[str]:
    """The markdown section of the configurations' ``host_syncs`` (none where no configuration has them)."""
    synced = [(g, c) for g in groups for c in g["configs"] if c.get("syncs")]
    if not synced:
        return []
    out = ["", "## The host's waits on the GPU", "",
           "Operations of one update that synchronise the host with the device "
           "(`torch.cuda.set_sync_debug_mode(\"warn\")`), by the line that called them: after the update's last "
           "one, the GPU idles while the host runs what follows until it launches the next kernels. Event waits: "
           "CUDA events' `synchronize`, which torch does not warn of, by the line that called it, with the ms the "
           "host waited in them (the step metrics' and the fp16 overflow flag's, each for work an update old).", "",
           "| shape | configuration | waits | where (calls) | event waits | event ms | where (calls, ms) |",
           "|---|---|---:|---|---:|---:|---|"]
    for g, c in synced:
        where = ", ".join(f"`{s['where']}` ({s['calls']})" for s in c["syncs"]["sites"])
        ev = c["syncs"].get("event_waits")
        ev_cells = (f"{ev['count']} | {ev['ms']:.3f} | "
                    + ", ".join(f"`{s['where']}` ({s['calls']}, {s['ms']:.3f})" for s in ev["sites"])
                    if ev else "- | - | -")
        out.append(f"| {g['section']} {g['batch']} x {g['n']} | {c['label']} | {c['syncs']['count']} | {where} | "
                   f"{ev_cells} |")
    return out


def _host_tables(groups) -> List[str]:
    """The markdown section of the configurations' host breakdown (``--host-profile``; none where none has one)."""
    hosted = [(g, c) for g in groups for c in g["configs"] if c.get("host_split_ms")]
    if not hosted:
        return []
    names = list(hosted[0][1]["host_rest_ms"])
    out = ["", "## The host's time in an update", "",
           "Each part of the update by the host's own clock, ms (mean of the timed updates): nothing is synchronised "
           "inside the update, so a part's time is the host's (its Python and launches), and drain is the wait for the "
           "device after `train_step` returned (about 0 where the host is the longer of the two). The rest is split "
           "as in the table above.", "",
           "| shape | configuration | update ms | host ms | drain ms | forward | backward | optimizer | rest | "
           + " | ".join(names) + " |", "|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(names)]
    for g, c in hosted:
        h = c["host_split_ms"]
        out.append(f"| {g['section']} {g['batch']} x {g['n']} | {c['label']} | {c['update_ms']:.2f} | {h['total']:.2f} | "
                   f"{h['drain']:.2f} | {h['forward']:.2f} | {h['backward']:.2f} | {h['optimizer']:.2f} | {h['rest']:.2f} | "
                   + " | ".join(f"{c['host_rest_ms'][k]:.2f}" for k in names) + " |")
    for g, c in hosted:
        py = c["host_python"]
        out += ["", f"### The host's Python in one {c['label']} update ({g['section']} {g['batch']} x {g['n']})", "",
                f"cProfile over {py['updates']} updates ({py['self_ms']:.2f} ms of profiled self time per update, "
                f"cProfile's own cost included); raw statistics `{py['pstats']}`, a trace of two updates with Python "
                f"stacks `{py['trace']}`. By self time, then by cumulative time:", ""]
        for by in ("by_self", "by_cumulative"):
            out += ["| function | calls / update | self ms | cumulative ms |", "|---|---:|---:|---:|"]
            for r in py[by]:
                where = r["where"].replace("|", "/")
                where = where if len(where) <= 100 else "..." + where[-97:]
                out.append(f"| `{where}` | {r['calls']:.0f} | {r['self_ms']:.3f} | {r['cum_ms']:.3f} |")
            out.append("")
        out.pop()
    return out


def _criteria(result) -> str:
    """The markdown's sentence on the losses the configurations trained with (fairseq's ``transformer_lm`` fairseq's
    own, the plugin's models the recipe's: ``recipe.benchmark``)."""
    used: Dict[str, List[str]] = {}
    for g in result["groups"]:
        for c in g["configs"]:
            if c.get("criterion"):
                labels = used.setdefault(c["criterion"], [])
                if tr.LABELS[c["key"]] not in labels:
                    labels.append(tr.LABELS[c["key"]])
    return (" Criteria: " + "; ".join(f"`{name}` ({', '.join(labels)})" for name, labels in used.items()) + "."
            if used else "")


def markdown(result) -> str:
    meta = result["meta"]
    unit = "kernels" if meta["device"] == "cuda" else "operators"
    out = [f"# Where an update's time goes ({meta['device']}, {meta['precision']})", "",
           f"{meta['machine']}; torch {meta['torch']}, CUDA {meta['cuda']}; `{meta['command']}`; {meta['seconds']} s. "
           + ("" if not meta.get("graphs") else "The stack's CUDA graphs compile each layer as one region. "
              if meta.get("stack_regions") else "The stack's CUDA graphs compile every layer's operations (no regions). ")
           + ("" if not meta.get("graphs") else "They hold the model's edges (embedding, final norm, output layer). "
              if meta.get("graph_edges") else "The model's edges run eagerly around them (no edges). ")
           + (f"SKI-TNN: `--ski-backward {meta['ski_backward']}`"
              + (f", its band by {meta['ski_band']}" if meta.get("ski_band") else "")
              + (", the low rank in the band's kernels" if meta.get("ski_band") == "triton"
                 and meta.get("ski_lowrank_fused") else "") + ". "
              if meta.get("ski_backward") and any(c["key"] == "ski" for g in result["groups"] for c in g["configs"])
              else "")
           + f"Plain copy: {result['bandwidth_gbs']:.1f} GB/s. Update: median of {meta['timed']} updates (min beside it), "
           "after a warm-up that lasts until fp16's loss scale stops falling; split: mean of 3 updates synchronised at "
           f"each phase. {unit.capitalize()} ms: the device time of the kernels alone (fairseq's record_function spans "
           "left out); launches: the host's kernel-launch calls per update; overflowed: timed updates whose fp16 "
           "gradients overflowed (skipped by fairseq)."
           + _criteria(result)
           + (f" Resumed {meta['resumed']} time(s) in a new process (`--resume`) after the one before ended early: "
              "the rows measured after that are that process's, on the same machine." if meta.get("resumed") else ""),
           "",
           f"| shape | configuration | ms / update | min ms | queued ms | tokens/s | {unit} ms | wall / {unit} | "
           f"{unit} / update | "
           "launches | ops dispatched | forward ms | backward ms | optimizer ms | rest ms | resting MiB | peak MiB | "
           "reserved peak MiB | compile s | overflowed |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g in result["groups"]:
        for c in g["configs"]:
            s = c["split_ms"]
            ops = f"{c['ops']['update']:,}" if c.get("ops") else "-"
            ratio = f"{c['wall_over_kernel']:.2f}" if c.get("wall_over_kernel") else "-"
            peak = f"{c['peak_mib']:.0f}" if "peak_mib" in c else "-"
            resting = f"{c['resting_mib']:.0f}" if "resting_mib" in c else "-"
            reserved = f"{c['reserved_peak_mib']:.0f}" if "reserved_peak_mib" in c else "-"
            compile_s = f"{c['compile_s']:.0f}" if "compile_s" in c else "-"
            queued = f"{c['queued_ms']:.2f}" if "queued_ms" in c else "-"  # rows of results before it existed
            out.append(f"| {g['section']} {g['batch']} x {g['n']} | {c['label']} | {c['update_ms']:.2f} | "
                       f"{c['min_ms']:.2f} | {queued} | {c['tokens_per_s']:,.0f} | {c['kernel_ms']:.2f} | {ratio} | "
                       f"{c['kernels']:.0f} | {c['launch_calls']:.0f} | {ops} | "
                       f"{s['forward']:.2f} | {s['backward']:.2f} | {s['optimizer']:.2f} | {s['rest']:.2f} | "
                       f"{resting} | {peak} | {reserved} | {compile_s} | {c['overflows_timed']} |")
    if result.get("not_compiled"):
        out += ["", "Not compiled (the compile budget was spent): " + ", ".join(result["not_compiled"]) + "."]
    for f in result.get("failed", []):
        out += ["", f"Failed: {f['id']} ({f['how']}): {f['error']}"]
    for line in not_all_graphs(result):
        out += ["", line]
    if result.get("running"):  # these results are the last a process wrote before it ended (or still runs)
        r = result["running"]
        out += ["", f"Running when these results were written: {r['id']} ({r['mode']}, {r['precision']}); a process that "
                    "ended there left it unmeasured (`--resume` goes on without it)."]
    floors = [(g, c) for g in result["groups"] for c in g["configs"] if c.get("floor")]
    if floors:
        out += ["", "## The floor of the mixing", "",
                "Least bytes a TNO's forward and backward must move: 5 x d1 x b x n activations (input and output; output "
                "gradient, saved input, input gradient); floor = those bytes at the plain copy's bandwidth. Mixing = the "
                "first layer's forward + backward less the same layer's with no token mixing, by the clock and by the "
                f"device time of its {unit} (which a launch-bound layer does not inflate); a compiled configuration's "
                "layers compiled.", "",
                f"| shape | TNO of | layer ms | no-mixing layer ms | mixing ms | layer {unit} ms | no-mixing {unit} ms | "
                f"mixing {unit} ms | least MB | floor ms | mixing / floor | mixing {unit} / floor |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

        def ratio(v):
            return f"{v:.1f}" if v is not None else "-"
        for g, c in floors:
            f = c["floor"]
            out.append(f"| {g['section']} {g['batch']} x {g['n']} | {c['label']} | {f['layer_ms']:.3f} | "
                       f"{f['no_mixing_layer_ms']:.3f} | {f['mixing_ms']:.3f} | {f['layer_kernel_ms']:.3f} | "
                       f"{f['no_mixing_layer_kernel_ms']:.3f} | {f['mixing_kernel_ms']:.3f} | "
                       f"{f['least_bytes'] / 1e6:.1f} | {f['floor_ms']:.3f} | {ratio(f['mixing_over_floor'])} | "
                       f"{ratio(f['mixing_kernels_over_floor'])} |")
    directs = [(_group_of(result, d["id"]), d) for d in result.get("direct_floor", [])]
    if directs:
        out += ["", "## The floor of the mixing with the direct product", "",
                "The same layer and floor with its Toeplitz products by direct summation (`--direct-floor`: "
                "`toeplitz.DIRECT_MAX_N` = n, the Triton kernels of `fairseq_tnn/ops/toeplitz_direct.py`), eager, "
                "measured last; difference: the largest difference of the layer's output and input gradient from the "
                "FFT product's on the same input, over their largest magnitude; FFTs: those the layer's forward and "
                "backward dispatched with each product.", "",
                f"| shape | TNO of | layer ms | mixing ms | layer {unit} ms | mixing {unit} ms | floor ms | "
                f"mixing / floor | mixing {unit} / floor | output difference | input gradient difference | FFTs "
                "(FFT product / direct) |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for g, d in directs:
            f = d.get("floor")
            if g is None:
                continue
            if not f:
                out.append(f"| {g['section']} {g['batch']} x {g['n']} | {d['label']} | failed: {d.get('error')} |"
                           + " |" * 10)
                continue
            out.append(f"| {g['section']} {g['batch']} x {g['n']} | {d['label']} | {f['layer_ms']:.3f} | "
                       f"{f['mixing_ms']:.3f} | {f['layer_kernel_ms']:.3f} | {f['mixing_kernel_ms']:.3f} | "
                       f"{f['floor_ms']:.3f} | {f['mixing_over_floor']:.1f} | {f['mixing_kernels_over_floor']:.1f} | "
                       f"{f['difference']['output']:.1e} | {f['difference']['x_grad']:.1e} | "
                       f"{f['ffts']['fft']} / {f['ffts']['direct']} |")
    out += _kinds_table(meta, floors, [(g, d) for g, d in directs if g is not None and d.get("floor")], unit)
    mixings = update_mixing(result)
    if mixings:
        out += ["", "## The mixing in the update, by kind", "",
                f"Each TNO's mixing as the update runs it: the update's {unit} time less the no-mixing bound's in the "
                "same mode (with the stack's CUDA graphs, each layer's RPE evaluated with the others' and every kernel "
                "the TNOs add to the stack's), beside its layers' floors (the layers times the eager floor above), "
                f"and that difference by kind as in the table above, ms per update ({unit} in brackets).", "",
                f"| shape | configuration | mixing {unit} ms | {unit} | layers | layers' floor ms | mixing / floor | "
                + " | ".join(KERNEL_KINDS) + " |", "|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(KERNEL_KINDS)]
        for m in mixings:
            g, c, kinds = m["group"], m["config"], m["kinds"]
            ratio = f"{m['over_floor']:.1f}" if m["over_floor"] is not None else "-"
            out.append(f"| {g['section']} {g['batch']} x {g['n']} | {c['label']} | {m['mixing_kernel_ms']:.3f} | "
                       f"{m['mixing_kernels']:.0f} | {c['layers']} | {m['floor_ms']:.3f} | {ratio} | "
                       + " | ".join(f"{kinds[k]['ms']:.3f} ({kinds[k]['count']:.0f})" for k in KERNEL_KINDS) + " |")
    out += _accumulated_table(result["groups"])
    rests = [(g, c) for g in result["groups"] for c in g["configs"] if c.get("rest_ms")]
    if rests:
        names = list(rests[0][1]["rest_ms"])
        out += ["", "## The rest of the Trainer", "",
                "The update's rest (all but the training forward, the backward and the optimizer step) split by the "
                "Trainer methods it calls, ms, the device synchronised around each: the seed, zeroing the gradients, "
                "moving the sample to the device, clipping (with fp16's gradient copy and overflow check), the "
                "metrics; other: the rest of train_step.", "",
                "| shape | configuration | rest ms | " + " | ".join(names) + " |",
                "|---|---|---:|" + "---:|" * len(names)]
        for g, c in rests:
            out.append(f"| {g['section']} {g['batch']} x {g['n']} | {c['label']} | {c['split_ms']['rest']:.2f} | "
                       + " | ".join(f"{c['rest_ms'][k]:.2f}" for k in names) + " |")
    out += _syncs_table(result["groups"])
    out += _host_tables(result["groups"])
    for g in result["groups"]:
        for c in g["configs"]:
            if c.get("top_kernels"):
                mode = "" if c["compiled"] else ", eager"
                out += ["", f"## The {TOP_KERNELS} longest {unit} of one {c['label']} update ({g['section']} "
                            f"{g['batch']} x {g['n']}{mode})", "", *_top_table(unit[:-1], c["top_kernels"])]
            if c.get("top_host"):
                out += ["", f"The host's {TOP_KERNELS} largest self times in the same update ({c['host_self_ms']:.2f} ms "
                            f"of host self time per update; launches: {c['launch_calls']:.0f} calls, "
                            f"{c['launch_ms']:.2f} ms):", "", *_top_table("host event", c["top_host"])]
    compiled = [(g, c) for g in result["groups"] for c in g["configs"] if c.get("compile_phases")]
    if compiled:
        out += ["", "## Where the compile time went", "",
                f"The {COMPILE_PHASES} longest phases of each compiled configuration's first two updates "
                "(`torch._dynamo.utils.compile_times`; phases nest, so an outer one includes its inner ones, and a phase "
                "that runs in parallel workers, as the C++ compiler's `compile_file`, adds up their times).", "",
                "| shape | configuration | compile s | longest phases (s) |", "|---|---|---:|---|"]
        for g, c in compiled:
            phases = ", ".join(f"{k} {v:.1f}" for k, v in c["compile_phases"].items())
            out.append(f"| {g['section']} {g['batch']} x {g['n']} | {c['label']} | {c['compile_s']:.0f} | {phases} |")
    if result.get("targets"):
        out += ["", "## The targets (issue 39), as measured in this run", "",
                "Ceiling: for a speed-up over TNN, TNN's update time (or kernel time) over the no-mixing bound's in the "
                "same mode, the most any token mixing could gain there; for SKI-TNN's peak memory, the bound's peak "
                "over TNN's, the least any token mixing could reach.", "",
                "| target | measured | bound | ceiling | met |", "|---|---:|---:|---:|---|"]
        for t in result["targets"]:
            ceiling = f"{t['ceiling']:.2f}" if "ceiling" in t else "-"
            out.append(f"| {t['target']} | {t['ratio']:.2f} | {t['bound']} | {ceiling} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(out) + "\n"


def _previous_run(p: argparse.ArgumentParser, out: str) -> Dict:
    """The result ``--resume`` goes on with: --out's gpu_profile.json, refused with a message where there is none."""
    path = os.path.join(out, "gpu_profile.json")
    try:
        with open(path) as f:
            previous = json.load(f)
    except (OSError, ValueError) as err:
        p.error(f"--resume: no run to go on with in --out={out} ({path}: {err})")
    if "meta" not in previous or "groups" not in previous:
        p.error(f"--resume: {path} is not a gpu_profile.py result (no meta or groups)")
    return previous


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", choices=["fp16", "bf16", "fp32"],
                   help="fp16 (--fp16, default on cuda), bf16 (--bf16-autocast) or fp32 (default on cpu)")
    p.add_argument("--quick", action="store_true", help="tiny models and shapes (a smoke test)")
    add_out_options(p, "results/gpu-profile")
    p.add_argument("--timed", type=int, help="timed updates per configuration (default 10, quick 2)")
    p.add_argument("--configs", nargs="+", choices=tr.ALL_KEYS, metavar="KEY",
                   help=f"only these configurations (of {', '.join(tr.ALL_KEYS)}; default: all)")
    ids = [f"{s}/{n}/{k}" for s, n, _ in tr.FULL_GROUPS + tr.QUICK_GROUPS for k in KEYS[s] if k != "transformer"]
    direct_ids = [f"{s}/{n}/{k}" for s, n, _ in tr.FULL_GROUPS + tr.QUICK_GROUPS for k in DIRECT_FLOOR_KEYS[s]]
    p.add_argument("--compiled", nargs="*", metavar="SECTION/N/KEY", choices=sorted(set(ids)),
                   help="configurations also compiled, in this order while the budget lasts (default: "
                        f"{' '.join(COMPILED_DEFAULT)}; quick: none; none: --compiled with no value)")
    p.add_argument("--graphs", nargs="*", metavar="SECTION/N/KEY", choices=sorted(set(ids)),
                   help="configurations also compiled with CUDA graphs (--tnn-cuda-graphs; CUDA only), each right after "
                        "its --compiled run, while the budget lasts (default: "
                        f"{' '.join(GRAPHS_DEFAULT)}; on the CPU or with --quick: none; none: --graphs with no value)")
    p.add_argument("--bf16", nargs="*", metavar="SECTION/N/KEY", choices=sorted(set(ids)),
                   help="configurations measured again in bf16 autocast (--bf16-autocast: fp32 weights), eager and "
                        "in each compiled mode they were measured in, right after those (default: none; the recipe's "
                        "PRECISION=bf16 is --bf16-weights)")
    p.add_argument("--amp", nargs="*", metavar="SECTION/N/KEY", choices=sorted(set(ids)), default=[],
                   help="configurations measured again with fairseq's --amp (fp32 weights, fp16 autocast, torch's "
                        "gradient scaler) instead of --fp16's FP16Optimizer, as --bf16 does (default: none)")
    p.add_argument("--bf16-weights", nargs="*", metavar="SECTION/N/KEY", choices=sorted(set(ids)),
                   help="configurations measured again with fairseq's --bf16, as the recipe's PRECISION=bf16 trains "
                        "(bf16 weights, FP16Optimizer's fp32 master copy, no loss scaler; fairseq_tnn/patches/bf16.py), "
                        "eager and in each compiled mode they were measured in, right after those (default on CUDA in "
                        f"fp16: {' '.join(BF16_DEFAULT)}; none: --bf16-weights with no value)")
    p.add_argument("--host-overflow", nargs="*", metavar="SECTION/N/KEY", choices=sorted(set(ids)), default=[],
                   help="configurations measured again with --fp16's overflow checked on the host as fairseq does "
                        "(without fairseq_tnn/patches/device_overflow.py), eager and in each compiled mode they were "
                        "measured in, right after those (--precision fp16 on CUDA; default: none)")
    shapes = sorted({f"{s}/{n}" for s, n, _ in tr.FULL_GROUPS + tr.QUICK_GROUPS})
    p.add_argument("--shapes", nargs="+", metavar="SECTION/N", choices=shapes,
                   help=f"only the groups of these shapes (of {', '.join(shapes)}; default: every shape of the run)")
    p.add_argument("--host-profile", nargs="*", metavar="SECTION/N/KEY", choices=sorted(set(ids)), default=[],
                   help="configurations whose host time is broken down too, in each mode they are measured in (the "
                        "run's precision): each part of the update by the host's own clock with nothing synchronised "
                        "inside it, and function by function (cProfile), with the raw statistics (.pstats) and a "
                        "torch.profiler trace with Python stacks (.trace.json.gz) written to --out (default: none)")
    p.add_argument("--no-stack-regions", action="store_true",
                   help="compile the stack's CUDA graphs with every layer's operations in the one graph, as before "
                        "each layer became a region compiled once (fairseq_tnn.models.compile.STACK_REGIONS): the "
                        "compile time and update time it costs, measured against a run without this option")
    p.add_argument("--no-graph-edges", action="store_true",
                   help="compile the stack's CUDA graphs without the model's edges (its embedding before the stack, "
                        "its final norm and output layer after it), which then run eagerly around them, as before the "
                        "graphs held them (fairseq_tnn.models.compile.GRAPH_EDGES): the update time they save, "
                        "measured against a run without this option")
    p.add_argument("--direct-max-n", type=int, default=0, metavar="N",
                   help="the TNOs' Toeplitz products of up to N positions by direct summation on tensor cores instead "
                        "of FFTs (fairseq_tnn.ops.toeplitz.DIRECT_MAX_N, Triton's kernels; CUDA only), in every "
                        "configuration of the run: measured against a run without this option (default 0: FFTs)")
    p.add_argument("--direct-floor", nargs="*", metavar="SECTION/N/KEY", choices=sorted(set(direct_ids)),
                   help="configurations whose mixing floor is measured again at the end of the run with the Toeplitz "
                        "products by direct summation (eager; the Triton kernels of fairseq_tnn/ops/toeplitz_direct.py), "
                        "beside the FFT product's, with the two's differences (default on CUDA with Triton and no "
                        f"--direct-max-n: {', '.join(f'{s}/{k}' for s, k in DIRECT_FLOOR_KEYS.items())} at each "
                        "shape of the run; otherwise none)")
    acc_ids = sorted(set(ids) | {f"{s}/{n}/transformer" for s, n, _ in tr.FULL_GROUPS + tr.QUICK_GROUPS
                                 if "transformer" in KEYS[s]})
    p.add_argument("--accumulated", nargs="*", metavar="SECTION/N/KEY", choices=acc_ids,
                   help="configurations also timed with updates of --update-freq micro-batches, in each mode they are "
                        "measured in (the run's precision), as fairseq-train on one GPU runs the recipe (default: "
                        f"{' '.join(ACCUMULATED_DEFAULT)}, the main target's two sides; quick: none; none: "
                        "--accumulated with no value)")
    p.add_argument("--update-freq", type=int, metavar="K",
                   help="micro-batches per update of the --accumulated rows (default: the recipe's on one GPU, its "
                        "tokens per update over the shape's: 16 causal at 8 x 512, 32 masked)")
    p.add_argument("--ski-backward", choices=["recompute", "keep"],
                   help="SKI-TNN's --ski-backward for the run (default: its preset's, recompute: the GTU keeps its "
                        "projection alone and computes the gate again in the backward); keep: the gate kept for the "
                        "backward, measured against a run without this option (the memory saved, the time it costs)")
    p.add_argument("--ski-band", choices=["conv1d", "triton"],
                   help="how SKI-TNO's band runs on the GPU for the run (fairseq_tnn/ops/ski.py BAND_METHOD; default: "
                        "its setting, conv1d: cuDNN's depthwise convolution); triton: the direct band's Triton kernels "
                        "(ops/band_direct.py), measured against a run without this option")
    p.add_argument("--ski-lowrank", choices=["fused", "after"],
                   help="where the direct band runs (--ski-band triton), whether SKI-TNO's low rank runs in its kernels "
                        "(fairseq_tnn/ops/ski.py FUSE_LOWRANK; default: its setting, fused) or after them (after)")
    p.add_argument("--compile-budget", type=float, default=180.0,
                   help="seconds of building and measuring compiled configurations; the next one starts only where the "
                        "longest compile so far still fits (default 180)")
    p.add_argument("--resume", action="store_true",
                   help="go on with the run of the same command whose gpu_profile.json --out holds, after its process "
                        "ended early (a crash or a kill): the runs it holds are kept, the one it was in when its process "
                        "ended is reported as failed and not run again, and the others are measured "
                        "(benchmarks/gpu_run.sh resumes a profile whose process a signal ended)")
    a = p.parse_args(argv)
    if a.resume and a.force:
        p.error("--resume and --force: --resume goes on with the results in --out, --force overwrites them")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible to torch (use --device cpu)")
    precision = a.precision or ("fp16" if a.device == "cuda" else "fp32")
    if a.device == "cpu" and precision == "fp16":
        p.error("--precision fp16 needs --device cuda (fairseq's --fp16 on CPU is not a supported training mode)")
    timed = a.timed if a.timed is not None else (2 if a.quick else 10)
    if timed < 1:
        p.error(f"--timed={timed} must be >= 1")
    accumulated_ids = a.accumulated if a.accumulated is not None else ([] if a.quick else ACCUMULATED_DEFAULT)
    if a.update_freq is not None and a.update_freq < 2:
        p.error(f"--update-freq={a.update_freq} must be >= 2 (every row's plain updates are update-freq 1 already)")
    if a.update_freq is not None and not accumulated_ids:
        p.error(f"--update-freq={a.update_freq}: no --accumulated configuration to time with it")
    if a.quick and accumulated_ids and a.update_freq is None:
        p.error("--accumulated with --quick needs --update-freq (the recipe's tokens per update over a quick shape's "
                "is a thousand micro-batches)")
    if a.compile_budget < 0:
        p.error(f"--compile-budget={a.compile_budget} must be >= 0")
    compiled = a.compiled if a.compiled is not None else (QUICK_COMPILED_DEFAULT if a.quick else COMPILED_DEFAULT)
    graphs = a.graphs if a.graphs is not None else ([] if a.quick or a.device == "cpu" else GRAPHS_DEFAULT)
    bf16 = a.bf16 or []
    bf16_weights = a.bf16_weights if a.bf16_weights is not None else (
        BF16_DEFAULT if a.device == "cuda" and precision == "fp16" and not a.quick else [])
    if bf16 and precision == "bf16":
        p.error("--bf16: the run's precision is bf16 already; these rows compare another precision with bf16")
    if a.amp and (precision != "fp16" or a.device != "cuda"):
        p.error(f"--amp: fairseq's --amp trains on a GPU, and these rows compare it with --fp16 (here --device "
                f"{a.device}, --precision {precision})")
    if a.host_overflow and (precision != "fp16" or a.device != "cuda"):
        p.error(f"--host-overflow: these rows compare fairseq's --fp16 overflow check with the device's, on a GPU (here "
                f"--device {a.device}, --precision {precision})")
    if graphs and a.device == "cpu":
        p.error("--graphs: CUDA graphs need --device cuda (fairseq-train refuses --tnn-cuda-graphs without a GPU)")
    if a.no_stack_regions and not graphs:
        p.error("--no-stack-regions: the regions are the stack's CUDA graphs' (--graphs names none here)")
    if a.no_graph_edges and not graphs:
        p.error("--no-graph-edges: the edges are the stack's CUDA graphs' (--graphs names none here)")
    groups = tr.QUICK_GROUPS if a.quick else tr.FULL_GROUPS
    if a.shapes and not any(f"{s}/{n}" in a.shapes for s, n, _ in groups):
        p.error(f"--shapes {' '.join(a.shapes)}: none of them is a shape of this run (of "
                f"{', '.join(f'{s}/{n}' for s, n, _ in groups)}{' with --quick' if a.quick else ''})")
    if a.direct_max_n < 0 or (a.direct_max_n and a.device != "cuda"):
        p.error(f"--direct-max-n={a.direct_max_n}: an integer >= 0, and above 0 only with --device cuda (the direct "
                "product's Triton kernels run on a GPU)")
    from fairseq_tnn.ops import toeplitz_direct
    direct_runs = toeplitz_direct.supports_on(torch.float32, a.device)  # Triton, and CUDA or its CPU interpreter
    if a.direct_floor is None:
        direct_floor = ([f"{s}/{n}/{k}" for s, n, _ in groups for k in DIRECT_FLOOR_KEYS[s]
                         if not a.shapes or f"{s}/{n}" in a.shapes]
                        if a.device == "cuda" and direct_runs and not a.direct_max_n and not a.quick else [])
    else:
        direct_floor = a.direct_floor
        if direct_floor and a.direct_max_n:
            p.error(f"--direct-floor with --direct-max-n={a.direct_max_n}: the run's products are direct already, and "
                    "so is its floor")
        if direct_floor and not direct_runs:
            p.error(f"--direct-floor {' '.join(direct_floor)}: the direct product's Triton kernels cannot run on "
                    f"--device {a.device} here (" + ("Triton is not installed" if not toeplitz_direct.AVAILABLE else
                                                      "a CPU runs them only under TRITON_INTERPRET=1") + ")")
    if a.direct_max_n:
        from fairseq_tnn.ops import toeplitz
        if not toeplitz_direct.AVAILABLE:
            p.error(f"--direct-max-n={a.direct_max_n}: Triton is not installed (a CUDA build of torch brings it)")
        toeplitz.DIRECT_MAX_N = a.direct_max_n  # every product of the run
    previous = _previous_run(p, a.out) if a.resume else None
    if not a.resume:
        refuse_overwrite(p, a, "gpu_profile.json")
    if a.no_stack_regions:
        compiling.STACK_REGIONS = False  # the stacks built from here on
    if a.no_graph_edges:
        compiling.GRAPH_EDGES = False  # the stacks built from here on
    from fairseq_tnn.modules.tno.ski import SkiSettings  # its default: the preset's
    if a.ski_backward:
        ski_arch = next(arch for key, arch, _, _ in tr.CONFIGS["masked"] if key == "ski")
        tr.ARCH_OPTIONS[ski_arch] = ["--ski-backward", a.ski_backward]  # the trainers built from here on
    from fairseq_tnn.ops import band_direct, ski
    if a.ski_band:
        if a.ski_band == "triton" and (a.device != "cuda" or not band_direct.AVAILABLE):
            p.error("--ski-band=triton: the direct band's kernels need --device cuda and Triton (a CUDA build of torch "
                    "brings it)")
        ski.BAND_METHOD[a.device] = a.ski_band  # every SKI-TNO of the run
    if a.ski_lowrank:
        ski.FUSE_LOWRANK = a.ski_lowrank == "fused"
    os.makedirs(a.out, exist_ok=True)
    from benchmarks.measure import _machine
    t0 = time.time()
    meta = {"device": a.device, "precision": precision, "quick": a.quick, "timed": timed, "compiled": compiled,
            "graphs": graphs, "bf16": bf16, "bf16_weights": bf16_weights, "amp": a.amp,
            "host_overflow": a.host_overflow, "shapes": a.shapes or [], "host_profile": a.host_profile,
            "stack_regions": compiling.STACK_REGIONS, "graph_edges": compiling.GRAPH_EDGES,
            "direct_max_n": a.direct_max_n, "direct_floor": direct_floor, "accumulated": accumulated_ids,
            "update_freq": a.update_freq, "ski_backward": a.ski_backward or SkiSettings.ski_backward,
            "ski_band": ski.BAND_METHOD.get(a.device, "gemm"), "ski_lowrank_fused": ski.FUSE_LOWRANK,
            "compile_budget_s": a.compile_budget, "torch": torch.__version__, "cuda": torch.version.cuda,
            "machine": torch.cuda.get_device_name(0) if a.device == "cuda" else _machine(),
            "command": "python benchmarks/gpu_profile.py " + " ".join(
                arg for arg in (sys.argv[1:] if argv is None else argv) if arg != "--resume")}
    before = 0.0
    if previous is not None:
        differs = [k for k in meta if k != "command" and previous["meta"].get(k) != meta[k]]
        if differs:
            p.error(f"--resume: {a.out}/gpu_profile.json is another run's: its " + ", ".join(
                f"{k} {previous['meta'].get(k)!r}" for k in differs) + " against this command's " + ", ".join(
                f"{meta[k]!r}" for k in differs) + " (resume with the command that made it)")
        before = previous["meta"]["seconds"]
        meta["resumed"] = previous["meta"].get("resumed", 0) + 1

    def write(result):
        result["meta"] = {**meta, "seconds": round(before + time.time() - t0, 1)}
        result["targets"] = targets(result)
        write_results(a.out, "gpu_profile", result, markdown(result))

    result = run(a.device, precision, a.quick, timed, compiled, a.compile_budget, a.configs, write,
                 lambda m: print(m, flush=True), graphs, bf16, a.amp, bf16_weights, a.host_overflow, a.shapes or [],
                 a.host_profile, a.out, previous, direct_floor, accumulated_ids, a.update_freq)
    write(result)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
