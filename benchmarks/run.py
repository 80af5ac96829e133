"""Speed and memory of the TNN models on CPU: whole training steps and single TNO layers, side by side.

    .venv/bin/python benchmarks/run.py [--quick] [--out results/bench] [--sections causal bidirectional rpe layer]
                                       [--force]

With ``--device cuda`` (or ``--device cpu``) it runs ``benchmarks/trainer.py`` instead: whole updates
through fairseq's Trainer, eager vs compiled, with kernel time and count per update (see that file).

Writes ``results.json``, ``results.md`` (tables of ratios with the papers' figures beside ours, and the
issue's targets, met or missed) and PNG plots into ``--out``. Sections:

* ``causal``: one training step (forward, backward, gradient clipping, Adam step) of the registered
  ``tnn_lm`` models, TNN (RPE 6 and 3 layers) and FD-TNN (RPE 3), against fairseq's ``transformer_lm`` of
  the same width and depth, at n = 512 .. 4096; plus two bounds built from the TNN model: its TNOs replaced
  by a fixed precomputed spectrum (the FFT convolution alone: no RPE, no kernel FFT, no kernel gradient)
  and by the identity (no token mixing at all). No operator that convolves the activations by FFT can
  beat the first; no token mixer at all can beat the second.
* ``bidirectional``: the ``tnn_mlm`` models (TNN with the 6-layer RPE the SKI paper compares SKI-TNN
  against, FD-TNN, SKI-TNN, the same bounds) at n = 512 and 2048,
  scored like fairseq's masked_lm criterion (logits on the 15% masked positions only).
* ``rpe``: the causal models at n = 512 with RPE depths 1 .. 6 (TNN and FD-TNN).
* ``layer``: each TNO alone, forward + backward (gradients for the input and the TNO's parameters), at
  the paper's layer size (b = 4, d1 = 1536), against its floor, the bare FFT convolution of the same
  activations with a precomputed kernel spectrum: channel-major with our hand-written backward (the
  fastest found), with torch's autograd, and along dim -2 (the authors' layout; with the previous
  column, the two floors FACTS.md section 4 measured, for calibrating against the authors' operators).
  Causal SKI (the paper's appendix, two implementations) is timed against the FFT TNN here.

Method. The script re-executes itself with ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736`` so
that glibc keeps freed memory instead of returning it to the OS and faulting it in again every step
(FACTS.md section 4). Within a group (one length), all configurations are built in one process, warmed
up, then timed in interleaved rounds, the order reversed every round (A B C, C B A, ...); we report the
median step time with its quartiles, the user and system CPU time of the process per step beside the wall
time, and each configuration's speed-up over the group's baseline both as a ratio of medians and as the
median (with quartiles) of the per-round ratios, which cancels drifts of the shared machine's load.

Memory is measured in a fresh process per configuration (forked from a server that has only imported
torch and fairseq, so every configuration starts from the same state): after one warm-up step (which
allocates the optimizer state), one step runs under torch.profiler with memory profiling, and the peak of
the allocator's running total of live tensor bytes gives the step's high-water mark above the resting
state; adding the resting tensors (parameters, optimizer state, inputs) gives the "peak tensor memory".
That is exact, allocator-agnostic (it counts tensor bytes, not glibc's heap) and comparable to
``torch.cuda.max_memory_allocated``. The child's peak resident set size (VmHWM, reset at the start, minus
the RSS at the start) is reported beside it: it also counts MKL/oneDNN workspaces and heap fragmentation.
"""
import argparse
import dataclasses
import gc
import importlib
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from typing import Dict, List

MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "68719476736"}
if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
    os.environ.update(MALLOC_ENV)
    os.execv(sys.executable, [sys.executable] + sys.argv)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MIB = 2.0 ** 20

# ----------------------------------------------------------------------------
# The papers' figures (FACTS.md sections 2 and 4) printed beside ours
# ----------------------------------------------------------------------------

PAPER = {
    # SKI paper, A100, whole training steps (speed-up over the TNN baseline; memory as a fraction of it)
    ("causal", "fd3", 512, "tnn6"): "1.15x (A100, 15% faster)",
    ("causal", "fd3", 512, "tnn3"): "1.10x (A100, 10% faster)",
    ("bidirectional", "fd3", None, "tnn6"): "1.35-1.8x (A100, 35-80% faster)",
    ("bidirectional", "ski", 512, "tnn6"): "1.25x, memory 0.83x (A100)",
    ("bidirectional", "ski", 2048, "tnn6"): "1.3x, memory 0.58x (A100)",
}
# The authors' operators on this kind of 2-core machine (FACTS.md section 4): b = 4, d1 = 1536, fwd + bwd, ms
AUTHORS_MS = {
    ("causal", 512): {"tnn": 139, "fd": 149, "floor_dim2": 92, "floor_autograd": 55},
    ("causal", 2048): {"tnn": 641, "fd": 673, "floor_dim2": 494, "floor_autograd": 211},
    ("bidirectional", 512): {"tnn": 188, "fd": 178, "ski": 230, "floor_dim2": 130, "floor_autograd": 63},
    ("bidirectional", 2048): {"tnn": 647, "fd": 655, "ski": 905, "floor_dim2": 455, "floor_autograd": 208},
}
AUTHORS_MIB_2048_BI = {"tnn": 950, "fd": 916, "ski": 288, "floor_dim2": 864, "floor_autograd": 672}

# ----------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------

FULL = dict(
    causal_dim=512, bi_dim=768, layers=2, vocab=2000, tokens=1024,
    causal_lengths=[512, 1024, 2048, 4096], bi_lengths=[512, 2048], rpe_length=512, rpe_depths=[1, 2, 3, 4, 5, 6],
    layer_dim=1536, layer_batch=4, layer_lengths=[512, 2048], rounds=5, warmup=1,
)
QUICK = dict(
    causal_dim=32, bi_dim=32, layers=1, vocab=64, tokens=128,
    causal_lengths=[32, 64], bi_lengths=[32, 64], rpe_length=32, rpe_depths=[1, 2, 3, 4, 5, 6],
    layer_dim=48, layer_batch=2, layer_lengths=[64], rounds=2, warmup=1,
)

LABELS = {
    "tnn6": "TNN (RPE 6)", "tnn3": "TNN (RPE 3)", "fd3": "FD-TNN (RPE 3)", "ski": "SKI-TNN (r 32, m 17)",
    "transformer": "transformer_lm", "bound_fixed": "bound: TNN with a fixed spectrum",
    "bound_identity": "bound: no token mixing",
    "tnn": "TNN TNO (RPE 6)", "fd": "FD-TNO (RPE 3)", "ski_op": "SKI-TNO (r 32, m 17)",
    "ski_causal_local": "causal SKI, local sums (ours)", "ski_causal_cumsum": "causal SKI, appendix cumsum",
    "floor": "floor: FFT conv, channel-major, custom backward",
    "floor_autograd": "floor: FFT conv, channel-major, torch autograd",
    "floor_dim2": "floor: FFT conv along dim -2, torch autograd",
    "floor_trainable": "floor + a trainable spectrum (kernel gradient)",
}

# ----------------------------------------------------------------------------
# Building the models and operators (in the timing process and in the memory children)
# ----------------------------------------------------------------------------


def build_tnn(arch: str, vocab: int, **overrides):
    """A registered tnn_lm / tnn_mlm model, built as fairseq builds it (arch preset, then the dataclass)."""
    import fairseq_tnn  # noqa: F401  (registers the models)
    from fairseq_tnn.models.build import build_arch
    return build_arch(arch, vocab, **overrides)


def build_transformer_lm(dim: int, layers: int, vocab: int, n: int):
    """fairseq's transformer_lm of width dim (embed, input and output dims) and depth layers, tied embeddings."""
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY
    from fairseq.models.transformer_lm import TransformerLanguageModelConfig
    defaults = TransformerLanguageModelConfig()
    args = argparse.Namespace(**{f.name: getattr(defaults, f.name) for f in dataclasses.fields(defaults)})
    overrides = dict(decoder_embed_dim=dim, decoder_input_dim=dim, decoder_output_dim=dim, decoder_layers=layers,
                     decoder_ffn_embed_dim=4 * dim, decoder_attention_heads=max(1, dim // 64),
                     share_decoder_input_output_embed=True, tokens_per_sample=n, max_target_positions=n,
                     add_bos_token=False, tpu=False, dropout=0.1)
    for k, v in overrides.items():
        setattr(args, k, v)
    ARCH_CONFIG_REGISTRY["transformer_lm"](args)
    from fairseq_tnn.models.build import VocabTask, dictionary_of_size
    return ARCH_MODEL_REGISTRY["transformer_lm"].build_model(args, VocabTask(dictionary_of_size(vocab)))


class FixedSpectrumTno(torch.nn.Module):
    """Bound: the FFT convolution of the activations with a spectrum computed once (no kernel work per step)."""

    layout = "dbn"

    def __init__(self, tno, n: int):
        super().__init__()
        with torch.no_grad():
            spec, self.size = tno.spectrum(n)
        self.register_buffer("spec", spec.unsqueeze(1))  # (d, 1, F)

    def forward(self, x, layout="dbn"):
        from fairseq_tnn.ops.toeplitz import SpectralConv
        return SpectralConv.apply(x, self.spec, self.size)


class IdentityTno(torch.nn.Module):
    """Bound: no token mixing at all."""

    layout = "dbn"

    def forward(self, x, layout="dbn"):
        return x


def _model_step(cfg: Dict, sizes: Dict):
    """(step function, tensors alive between steps) for one whole-model configuration."""
    n, b, dim, vocab = cfg["n"], cfg["batch"], cfg["dim"], sizes["vocab"]
    key = cfg["key"]
    causal = cfg["direction"] == "causal"
    layers_key = "decoder_layers" if causal else "encoder_layers"
    if key == "transformer":
        model = build_transformer_lm(dim, sizes["layers"], vocab, n)
    else:
        base = "tnn_lm_wt103" if causal else "tnn_mlm_wt103"
        over = {layers_key: sizes["layers"], ("decoder_embed_dim" if causal else "encoder_embed_dim"): dim}
        if key.startswith("tnn") or key.startswith("bound"):
            over.update(tno_type="tnn", rpe_layers=cfg.get("rpe_layers", 6))
        elif key.startswith("fd"):
            over.update(tno_type="fd", rpe_layers=cfg.get("rpe_layers", 3))
        elif key == "ski":
            over.update(tno_type="ski")
        model = build_tnn(base, vocab, **over)
        if key.startswith("bound"):
            layers = model.decoder.layers if causal else model.encoder.layers
            for layer in layers:
                layer.gtu.tno = FixedSpectrumTno(layer.gtu.tno, n) if key == "bound_fixed" else IdentityTno()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-4, betas=(0.9, 0.98))
    g = torch.Generator().manual_seed(cfg.get("seed", 0))
    tokens = torch.randint(4, vocab, (b, n), generator=g)
    target = torch.randint(4, vocab, (b, n), generator=g)
    mask = None if causal else torch.rand(b, n, generator=g) < 0.15
    if mask is not None:
        mask[:, 0] = True

    def step():
        if causal:
            logits, _ = model(tokens)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), target.view(-1))
        else:
            logits, _ = model(tokens, masked_tokens=mask)
            loss = F.cross_entropy(logits.float(), target[mask])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def resting():
        ts = list(model.parameters()) + list(model.buffers()) + [tokens, target]
        for state in opt.state.values():
            ts += [v for v in state.values() if torch.is_tensor(v)]
        return ts

    return step, resting


def _layer_step(cfg: Dict, sizes: Dict):
    """(step function, tensors alive between steps) for one TNO layer alone, forward + backward."""
    from argparse import Namespace

    from fairseq_tnn.modules.tno import build_tno
    from fairseq_tnn.ops import ski_causal
    from fairseq_tnn.ops.toeplitz import SpectralConv, next_fast_len
    n, b, d1, key = cfg["n"], cfg["batch"], cfg["dim"], cfg["key"]
    causal = cfg["direction"] == "causal"
    g = torch.Generator().manual_seed(cfg.get("seed", 0))
    size = next_fast_len(2 * n - 1)
    shape = (b, n, d1) if key == "floor_dim2" else (d1, b, n)
    x = torch.randn(*shape, generator=g).requires_grad_(True)
    grad = torch.randn(*shape, generator=g)
    module, params = None, []
    spec = torch.randn(d1, size // 2 + 1, generator=g, dtype=torch.complex64) / math.sqrt(n)
    if key in ("tnn", "fd", "ski_op"):
        tno_type = {"tnn": "tnn", "fd": "fd", "ski_op": "ski"}[key]
        module = build_tno(tno_type, d1, causal, Namespace())
        params = list(module.parameters())

        def fn():
            return module(x, layout="dbn")
    elif key.startswith("ski_causal"):
        m, r = 17, 32
        conv_weight = (torch.randn(d1, m, generator=g) / math.sqrt(m)).requires_grad_(True)
        knots = (torch.randn(2 * r, d1, generator=g) / math.sqrt(r)).requires_grad_(True)
        params = [conv_weight, knots]
        impl = ski_causal.ski_causal_local if key == "ski_causal_local" else ski_causal.ski_causal_cumsum

        def fn():
            return impl(x, conv_weight, knots, 0.99)
    elif key == "floor":
        s = spec.unsqueeze(1)

        def fn():
            return SpectralConv.apply(x, s, size)
    elif key == "floor_trainable":
        s = spec.unsqueeze(1).requires_grad_(True)  # a leaf: the kernel gradient any trainable operator pays
        params = [s]

        def fn():
            return SpectralConv.apply(x, s, size)
    elif key == "floor_autograd":
        s = spec.unsqueeze(1)

        def fn():
            return torch.fft.irfft(torch.fft.rfft(x, n=size) * s, n=size)[..., :n]
    elif key == "floor_dim2":
        s = spec.t()

        def fn():
            return torch.fft.irfft(torch.fft.rfft(x, n=size, dim=-2) * s, n=size, dim=-2)[:, :n]
    else:
        raise ValueError(key)
    leaves = [x] + params

    def step():
        torch.autograd.grad(fn(), leaves, grad)

    def resting():
        return [x, grad, spec] + params

    return step, resting


def make_runner(cfg: Dict, sizes: Dict):
    return (_layer_step if cfg["section"] == "layer" else _model_step)(cfg, sizes)


# ----------------------------------------------------------------------------
# Memory: one fresh process per configuration
# ----------------------------------------------------------------------------


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return 0


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _peak_allocated(prof) -> int:
    """Highest running total of live tensor bytes during a profile, relative to its start."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            events = json.load(g)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max([0] + totals)


def memory_child(cfg: Dict, sizes: Dict, threads: int) -> Dict:
    torch.set_num_threads(threads)
    try:  # reset the high-water mark to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    rss0 = _proc_status_kib("VmRSS:")
    step, resting = make_runner(cfg, sizes)
    step()  # warm-up: optimizer state, lazily initialised libraries
    rest = _tensor_bytes(resting())
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    peak = _peak_allocated(prof)
    hwm = _proc_status_kib("VmHWM:")  # after two steps
    return dict(tensor_peak_mib=(rest + peak) / MIB, step_peak_mib=peak / MIB, resting_mib=rest / MIB,
                rss_peak_mib=(hwm - rss0) / 1024.0)


# ----------------------------------------------------------------------------
# Timing: one process per group, interleaved rounds
# ----------------------------------------------------------------------------


def _stats(values: List[float]) -> Dict:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return dict(median=statistics.median(values), q1=q[0], q3=q[2], min=min(values), max=max(values),
                all=[round(v, 3) for v in values])


def time_group(cfgs: List[Dict], sizes: Dict, log) -> None:
    torch.manual_seed(0)
    runners = [make_runner(c, sizes)[0] for c in cfgs]
    wall = [[] for _ in cfgs]
    user = [[] for _ in cfgs]
    sys_ = [[] for _ in cfgs]
    for _ in range(sizes["warmup"]):
        for run in runners:
            run()
    for r in range(sizes["rounds"]):
        order = list(range(len(cfgs)))
        if r % 2:
            order.reverse()
        gc.collect()
        for i in order:
            ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            runners[i]()
            t1, ru1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            wall[i].append((t1 - t0) * 1e3)
            user[i].append((ru1.ru_utime - ru0.ru_utime) * 1e3)
            sys_[i].append((ru1.ru_stime - ru0.ru_stime) * 1e3)
    base = 0
    cfgs[base]["is_baseline"] = True
    for i, c in enumerate(cfgs):
        c["wall_ms"], c["user_ms"], c["sys_ms"] = _stats(wall[i]), _stats(user[i]), _stats(sys_[i])
        paired = [wall[base][k] / wall[i][k] for k in range(len(wall[i]))]
        c["speedup"] = cfgs[base]["wall_ms"]["median"] / c["wall_ms"]["median"] if i != base else 1.0
        c["paired_speedup"] = _stats(paired)
        log(f"  {c['label']:<48} {c['wall_ms']['median']:9.1f} ms [{c['wall_ms']['q1']:.1f}-{c['wall_ms']['q3']:.1f}]"
            f"  user {c['user_ms']['median']:8.1f}  sys {c['sys_ms']['median']:6.1f}"
            f"  x{c['paired_speedup']['median']:.3f} vs {cfgs[base]['label']}")
    del runners
    gc.collect()


# ----------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------


def plan(sections: List[str], s: Dict) -> List[Dict]:
    """Groups of configurations; the first of each group is the baseline its ratios refer to."""
    groups = []
    rpe_of = {"tnn6": 6, "tnn3": 3, "fd3": 3, "bound_fixed": 6, "bound_identity": 6}

    def cfg(section, direction, key, n, batch, dim, label=None, **kw):
        if key in rpe_of and "rpe_layers" not in kw:
            kw["rpe_layers"] = rpe_of[key]
        return dict(section=section, direction=direction, key=key, label=label or LABELS[key], n=n, batch=batch,
                    dim=dim, **kw)

    def group(section, direction, n, batch, configs):
        groups.append(dict(section=section, direction=direction, n=n, batch=batch, configs=configs))

    def batch_for(n):
        return max(1, s["tokens"] // n)

    if "causal" in sections:
        for n in s["causal_lengths"]:
            keys = ["tnn6", "tnn3", "fd3", "transformer", "bound_fixed", "bound_identity"]
            group("causal", "causal", n, batch_for(n),
                  [cfg("causal", "causal", k, n, batch_for(n), s["causal_dim"]) for k in keys])
    if "bidirectional" in sections:
        for n in s["bi_lengths"]:
            keys = ["tnn6", "fd3", "ski", "bound_fixed", "bound_identity"]
            group("bidirectional", "bidirectional", n, batch_for(n),
                  [cfg("bidirectional", "bidirectional", k, n, batch_for(n), s["bi_dim"]) for k in keys])
    if "rpe" in sections:
        n = s["rpe_length"]
        group("rpe", "causal", n, batch_for(n), [
            cfg("rpe", "causal", key, n, batch_for(n), s["causal_dim"], label=f"{name} (RPE {depth})", rpe_layers=depth)
            for key, name in (("tnn_rpe", "TNN"), ("fd_rpe", "FD-TNN")) for depth in s["rpe_depths"]])
    if "layer" in sections:
        for direction in ("causal", "bidirectional"):
            for n in s["layer_lengths"]:
                keys = ["tnn", "fd"] + (["ski_op"] if direction == "bidirectional" else
                                        ["ski_causal_local", "ski_causal_cumsum"])
                keys += ["floor", "floor_trainable", "floor_autograd", "floor_dim2"]
                group("layer", direction, n, s["layer_batch"],
                      [cfg("layer", direction, k, n, s["layer_batch"], s["layer_dim"]) for k in keys])
    return groups


# ----------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------


def _find(groups, section, direction, n, key):
    for grp in groups:
        if grp["section"] == section and grp["direction"] == direction and grp["n"] == n:
            for c in grp["configs"]:
                if c["key"] == key:
                    return c
    return None


def _speedup(fast, slow):
    """slow / fast: the median of the per-round ratios when slow is the group's baseline, else of the medians."""
    if fast is None or slow is None:
        return None
    if fast is not slow and slow.get("is_baseline"):
        return fast["paired_speedup"]["median"]
    return slow["wall_ms"]["median"] / fast["wall_ms"]["median"]


def _mem_ratio(a, b):
    if a is None or b is None or "memory" not in a or "memory" not in b:
        return None
    return a["memory"]["tensor_peak_mib"] / b["memory"]["tensor_peak_mib"]


def targets(groups) -> List[Dict]:
    """The issue's targets, each with the measured value and whether it is met."""
    out = []

    def add(name, value, ok, detail=""):
        out.append(dict(target=name, value=value, met=None if value is None else bool(ok), detail=detail))

    def model(direction, n, key):
        return _find(groups, direction, direction, n, key)

    if model("causal", 512, "fd3") is not None:
        fd, fixed = model("causal", 512, "fd3"), model("causal", 512, "bound_fixed")
        for base, want in (("tnn6", 1.2), ("tnn3", 1.1)):
            v = _speedup(fd, model("causal", 512, base))
            add(f"FD-TNN causal >= {want}x faster than {LABELS[base]}, whole step, n = 512", v, v is not None and v >= want,
                f"upper bound for any operator that FFT-convolves the activations ({LABELS[base]} / "
                f"fixed-spectrum model): x{_fmt(_speedup(fixed, model('causal', 512, base)), '.3f')}")
    if model("bidirectional", 512, "fd3") is not None:
        fd, tnn6 = model("bidirectional", 512, "fd3"), model("bidirectional", 512, "tnn6")
        v = _speedup(fd, tnn6)
        add("FD-TNN bidirectional >= 1.5x faster than TNN (RPE 6), whole step, n = 512", v, v is not None and v >= 1.5,
            f"upper bound for FFT-convolving operators: x{_fmt(_speedup(model('bidirectional', 512, 'bound_fixed'), tnn6), '.3f')}")
    if model("bidirectional", 2048, "ski") is not None:
        ski, tnn6, ident = (model("bidirectional", 2048, k) for k in ("ski", "tnn6", "bound_identity"))
        v = _speedup(ski, tnn6)
        add("SKI-TNN >= 1.4x faster than TNN (RPE 6), whole step, n = 2048", v, v is not None and v >= 1.4,
            f"upper bound for any token mixer (TNN / model without token mixing): x{_fmt(_speedup(ident, tnn6), '.3f')}")
        m = _mem_ratio(ski, tnn6)
        add("SKI-TNN peak tensor memory <= 0.7x TNN's, whole step, n = 2048", m, m is not None and m <= 0.7,
            f"model without token mixing: {_fmt(_mem_ratio(ident, tnn6), '.3f')}x")
    for direction in ("causal", "bidirectional"):
        fd, floor = _find(groups, "layer", direction, 2048, "fd"), _find(groups, "layer", direction, 2048, "floor")
        if fd is not None and floor is not None:
            v = fd["wall_ms"]["median"] / floor["wall_ms"]["median"]
            add(f"FD-TNO {direction} within 1.25x of its FFT floor, n = 2048 (time / floor)", v, v <= 1.25)
    ski, floor = _find(groups, "layer", "bidirectional", 2048, "ski_op"), _find(groups, "layer", "bidirectional", 2048, "floor")
    if ski is not None and floor is not None:
        v = ski["wall_ms"]["median"] / floor["wall_ms"]["median"]
        add("SKI-TNO below its FFT floor, n = 2048 (time / floor)", v, v < 1.0)
    for direction in ("causal", "bidirectional"):
        fa = _find(groups, "layer", direction, 2048, "floor_autograd")
        for key, akey in (("tnn", "tnn"), ("fd", "fd"), ("ski_op", "ski")):
            ours = _find(groups, "layer", direction, 2048, key)
            authors = AUTHORS_MS.get((direction, 2048), {}).get(akey)
            if ours is None or authors is None or fa is None:
                continue
            raw = authors / ours["wall_ms"]["median"]
            # both relative to the same floor (channel-major FFT conv, torch autograd), measured in both runs
            cal = (authors / AUTHORS_MS[(direction, 2048)]["floor_autograd"]) / (ours["wall_ms"]["median"] / fa["wall_ms"]["median"])
            add(f"{LABELS[key]} {direction} >= 2x faster than the authors', n = 2048 (their time / ours, calibrated)",
                cal, cal >= 2.0, f"raw: authors' {authors} ms (FACTS) / ours {ours['wall_ms']['median']:.0f} ms here = x{raw:.2f}")
    if ski is not None and "memory" in ski:
        v = ski["memory"]["step_peak_mib"]
        fa = _find(groups, "layer", "bidirectional", 2048, "floor_autograd")
        check = "" if fa is None or "memory" not in fa else (
            f"measured like FACTS (tensor bytes above the input and output gradient): our autograd floor "
            f"{fa['memory']['step_peak_mib']:.0f} MiB vs FACTS' {AUTHORS_MIB_2048_BI['floor_autograd']} MiB")
        add("SKI-TNO peak tensor memory <= the authors' 288 MiB, n = 2048 bidirectional (MiB)", v, v <= 288, check)
    return out


def _fmt(v, spec=".2f", suffix=""):
    return "-" if v is None else f"{v:{spec}}{suffix}"


def markdown(result: Dict) -> str:
    meta, groups = result["meta"], result["groups"]
    lines = ["# fairseq-tnn CPU benchmark", "",
             f"`{meta['command']}`", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}, {meta['threads']} threads; "
             f"glibc malloc: {meta['malloc']}. Median of {meta['sizes']['rounds']} interleaved rounds after "
             f"{meta['sizes']['warmup']} warm-up rounds; [q1-q3] quartiles. Speed-up = baseline time / time "
             "(median of the per-round ratios; > 1 is faster). Memory, in a fresh process per configuration "
             "(see benchmarks/run.py): step peak = the highest live tensor bytes during one step above the "
             "resting state (for a layer: above its input, output gradient and parameters, as FACTS.md "
             "measured the authors' operators); total peak = step peak + resting tensors (parameters, "
             "optimizer state, inputs); memory vs baseline compares total peaks (step peaks for layers); "
             "RSS = the process's peak resident set growth (also MKL/oneDNN workspaces, heap "
             "fragmentation). "
             "The papers' figures are from an A100 (the SKI paper) and, for single operators, the authors' "
             "code on this kind of 2-core machine (FACTS.md section 4).", ""]
    sizes = meta["sizes"]
    for section, title in (("causal", "Causal LM, whole training step"), ("bidirectional", "Masked LM, whole training step"),
                           ("rpe", "RPE depth sweep, causal, whole training step"), ("layer", "One TNO layer alone, forward + backward")):
        sg = [g for g in groups if g["section"] == section]
        if not sg:
            continue
        lines += [f"## {title}", ""]
        if section in ("causal", "bidirectional", "rpe"):
            dim = sizes["causal_dim"] if section != "bidirectional" else sizes["bi_dim"]
            lines += [f"{sizes['layers']} layers x {dim}, expand 3 (d1 = {3 * dim}), RPE width 64, vocabulary "
                      f"{sizes['vocab']}, batch = max(1, {sizes['tokens']} // n) sequences of n tokens, dropout 0.1, "
                      "Adam, clip 1.0.", ""]
        else:
            lines += [f"Activations (b = {sizes['layer_batch']}, n, d1 = {sizes['layer_dim']}), channel-major for "
                      "ours; gradients for the input and the operator's parameters. Authors' times: FACTS.md "
                      "section 4 (their machine state; compare through the floors measured in both runs).", ""]
        ratio_head = "time / floor" if section == "layer" else "speed-up vs baseline [q1-q3]"
        lines += [f"| n | batch | configuration | ms [q1-q3] | user / sys ms | {ratio_head} | papers | "
                  "step peak MiB | total peak MiB | memory vs baseline | RSS MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for g in sg:
            base = g["configs"][0]
            floor = next((c for c in g["configs"] if c["key"] == "floor"), None)
            for c in g["configs"]:
                w, p = c["wall_ms"], c["paired_speedup"]
                mem, bm = c.get("memory", {}), base.get("memory", {})
                field = "step_peak_mib" if section == "layer" else "tensor_peak_mib"
                mr = mem[field] / bm[field] if mem and bm else None
                paper = PAPER.get((section, c["key"], g["n"], base["key"])) or PAPER.get((section, c["key"], None, base["key"])) or ""
                if section == "layer":
                    akey = {"ski_op": "ski"}.get(c["key"], c["key"])
                    a = AUTHORS_MS.get((g["direction"], g["n"]), {}).get(akey)
                    if a is not None:
                        paper = f"authors: {a} ms"
                        if g["n"] == 2048 and g["direction"] == "bidirectional":
                            paper += f", {AUTHORS_MIB_2048_BI[akey]} MiB"
                    ratio = f"{w['median'] / floor['wall_ms']['median']:.3f}"
                else:
                    ratio = "baseline" if c is base else f"{p['median']:.3f} [{p['q1']:.3f}-{p['q3']:.3f}]"
                name = c["label"] + (f" ({g['direction']})" if section == "layer" and c is base else "")
                lines.append(
                    f"| {g['n']} | {g['batch']} | {name} | {w['median']:.1f} [{w['q1']:.1f}-{w['q3']:.1f}] | "
                    f"{c['user_ms']['median']:.0f} / {c['sys_ms']['median']:.0f} | {ratio} | {paper} | "
                    f"{_fmt(mem.get('step_peak_mib'), '.0f')} | {_fmt(mem.get('tensor_peak_mib'), '.0f')} | "
                    f"{_fmt(mr, '.3f')} | {_fmt(mem.get('rss_peak_mib'), '.0f')} |")
        lines.append("")
    tg = result.get("targets", [])
    if tg:
        lines += ["## The issue's targets", "", "| target | measured | met | note |", "|---|---|---|---|"]
        for t in tg:
            met = "-" if t["met"] is None else ("yes" if t["met"] else "**no**")
            lines.append(f"| {t['target']} | {_fmt(t['value'], '.3f')} | {met} | {t['detail']} |")
        lines.append("")
    if result.get("plots"):
        lines += ["## Plots", ""] + [f"- `{p}`" for p in result["plots"]] + [""]
    return "\n".join(lines)


def plots(result: Dict, out: str) -> List[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    made = []
    groups = result["groups"]

    def save(fig, name):
        path = os.path.join(out, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)

    for section in ("causal", "bidirectional"):
        sg = [g for g in groups if g["section"] == section]
        if not sg:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        keys = [c["key"] for c in sg[0]["configs"]]
        for key in keys:
            xs = [g["n"] for g in sg]
            cs = [next(c for c in g["configs"] if c["key"] == key) for g in sg]
            lab = cs[0]["label"]
            axes[0].plot(xs, [c["wall_ms"]["median"] / g["batch"] for c, g in zip(cs, sg)], "o-", label=lab)
            axes[1].plot(xs, [c["paired_speedup"]["median"] for c in cs], "o-", label=lab)
            if all("memory" in c and "memory" in g["configs"][0] for c, g in zip(cs, sg)):
                axes[2].plot(xs, [c["memory"]["tensor_peak_mib"] / g["configs"][0]["memory"]["tensor_peak_mib"]
                                  for c, g in zip(cs, sg)], "o-", label=lab)
        axes[0].set(xscale="log", yscale="log", xlabel="n", ylabel="ms per sequence", title=f"{section}: step time")
        axes[1].set(xscale="log", xlabel="n", ylabel=f"speed-up vs {sg[0]['configs'][0]['label']}", title="speed-up")
        axes[2].set(xscale="log", xlabel="n", ylabel="peak tensor memory / baseline", title="memory")
        if section == "bidirectional":
            axes[1].axhspan(1.35, 1.8, color="gray", alpha=0.15, label="paper FD (A100)")
            axes[1].plot([512, 2048], [1.25, 1.3], "k*", label="paper SKI (A100)")
            axes[2].plot([512, 2048], [0.83, 0.58], "k*", label="paper SKI (A100)")
        else:
            axes[1].plot([512], [1.15], "k*", label="paper FD vs TNN6 (A100)")
        lengths = sorted({g["n"] for g in sg})
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.set_xticks(lengths)
            ax.set_xticklabels([str(x) for x in lengths])
            ax.minorticks_off()
        axes[1].legend(fontsize=7)
        save(fig, f"{section}.png")
    sg = [g for g in groups if g["section"] == "rpe"]
    if sg:
        fig, ax = plt.subplots(figsize=(6, 4))
        for kind, lab in (("tnn_rpe", "TNN"), ("fd_rpe", "FD-TNN")):
            cs = [c for c in sg[0]["configs"] if c["key"] == kind]
            ax.plot([c["rpe_layers"] for c in cs], [c["wall_ms"]["median"] for c in cs], "o-", label=lab)
        ax.set(xlabel="RPE layers", ylabel="step ms", title=f"RPE depth, causal, n = {sg[0]['n']}")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "rpe.png")
    sg = [g for g in groups if g["section"] == "layer"]
    if sg:
        fig, ax = plt.subplots(figsize=(11, 4.5))
        labels, vals, authors = [], [], []
        for g in sg:
            floor = next(c for c in g["configs"] if c["key"] == "floor")
            fa = next(c for c in g["configs"] if c["key"] == "floor_autograd")
            for c in g["configs"]:
                if c["key"].startswith("floor"):
                    continue
                short = {"ski_op": "SKI", "tnn": "TNN", "fd": "FD", "ski_causal_local": "causal SKI\nlocal",
                         "ski_causal_cumsum": "causal SKI\ncumsum"}.get(c["key"], c["key"])
                labels.append(f"{short}\n{'causal' if g['direction'] == 'causal' else 'bidir'} {g['n']}")
                vals.append(c["wall_ms"]["median"] / floor["wall_ms"]["median"])
                a = AUTHORS_MS.get((g["direction"], g["n"]), {}).get({"ski_op": "ski"}.get(c["key"], c["key"]))
                # the authors' operator on the same scale: its time / their autograd floor, times ours / our floor
                authors.append(None if a is None else a / AUTHORS_MS[(g["direction"], g["n"])]["floor_autograd"]
                               * fa["wall_ms"]["median"] / floor["wall_ms"]["median"])
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], vals, width=0.4, label="ours")
        ax.bar([x + 0.2 for x in xs], [a or 0 for a in authors], width=0.4, label="authors' (calibrated)")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set(ylabel="time / FFT floor (channel-major, custom backward)", yscale="log", title="TNO layer vs its floor")
        ax.legend()
        ax.grid(alpha=0.3, axis="y")
        save(fig, "layer.png")
    return made


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f", {int(f.readline().split()[1]) / 2 ** 20:.0f} GiB RAM"
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores{mem}, {platform.system()} {platform.release()}"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--device" in argv or any(a.startswith("--device=") for a in argv):
        # whole fairseq updates through fairseq's Trainer, eager vs compiled (benchmarks/trainer.py)
        from benchmarks.trainer import main as trainer_main
        return trainer_main(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="--device cuda|cpu [--quick] [--out DIR] [--force]: whole fairseq updates "
                                       "through fairseq's Trainer, eager vs compiled (see benchmarks/trainer.py)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test, seconds)")
    p.add_argument("--out", default="results/bench", help="output directory")
    p.add_argument("--sections", nargs="+", default=["causal", "bidirectional", "rpe", "layer"],
                   choices=["causal", "bidirectional", "rpe", "layer"])
    p.add_argument("--rounds", type=int, help="timed rounds per group (default 5, quick 3)")
    p.add_argument("--warmup", type=int, help="warm-up rounds per group (default 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-memory", action="store_true", help="skip the memory measurements")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--force", action="store_true", help="overwrite the results of an earlier run in --out")
    a = p.parse_args(argv)
    if os.path.exists(os.path.join(a.out, "results.json")) and not a.force:
        p.error(f"--out={a.out} already holds results.json; refusing to overwrite it (--force, or another --out)")
    sizes = dict(QUICK if a.quick else FULL)
    for k in ("rounds", "warmup"):
        if getattr(a, k) is not None:
            if getattr(a, k) < (1 if k == "rounds" else 0):
                p.error(f"--{k} must be >= {1 if k == 'rounds' else 0}")
            sizes[k] = getattr(a, k)
    if a.threads < 1:
        p.error("--threads must be >= 1")
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(a.threads)
    log_path = os.path.join(a.out, "log.txt")
    logf = open(log_path, "w")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    t_start = time.time()
    groups = plan(a.sections, sizes)
    meta = dict(command="python benchmarks/run.py " + " ".join(argv),
                machine=_machine(), torch=torch.__version__, threads=a.threads, sizes=sizes,
                malloc=" ".join(f"{k}={os.environ.get(k)}" for k in MALLOC_ENV),
                started=time.strftime("%Y-%m-%d %H:%M:%S"))
    log(f"{meta['machine']}; torch {meta['torch']}, {a.threads} threads; {meta['malloc']}")
    for g in groups:
        log(f"[{g['section']}] {g['direction']} n={g['n']} batch={g['batch']}")
        time_group(g["configs"], sizes, log)
    if not a.no_memory:
        # The fork server imports torch, the plugin and this file as ``benchmarks.run`` (which then starts
        # the profiler once: ~2 s per process otherwise); each configuration runs in a fresh fork of it.
        child = importlib.import_module("benchmarks.run").memory_child
        os.environ["_TNN_BENCH_FORKSERVER"] = "1"
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "fairseq_tnn", "fairseq_tnn.ops.ski_causal",
                                    "fairseq.models.transformer_lm", "benchmarks.run"])
        log("memory (fresh process per configuration):")
        with ctx.Pool(1, maxtasksperchild=1) as pool:
            for g in groups:
                if g["section"] == "rpe":
                    continue
                for c in g["configs"]:
                    spec = {k: v for k, v in c.items() if k not in ("wall_ms", "user_ms", "sys_ms", "speedup", "paired_speedup")}
                    t0 = time.time()
                    c["memory"] = pool.apply(child, (spec, sizes, a.threads))
                    c["memory"]["seconds"] = round(time.time() - t0, 2)
                    log(f"  [{g['section']}] {g['direction']} n={g['n']} {c['label']:<48} "
                        f"tensors {c['memory']['tensor_peak_mib']:8.1f} MiB (step {c['memory']['step_peak_mib']:.1f}), "
                        f"RSS {c['memory']['rss_peak_mib']:8.1f} MiB")
    result = dict(meta=meta, groups=groups)
    result["targets"] = targets(groups)
    result["plots"] = [] if a.no_plots else plots(result, a.out)
    meta["seconds"] = round(time.time() - t_start, 1)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(md)
    log(md)
    log(f"done in {meta['seconds']} s; wrote {a.out}/results.json, results.md" + (", *.png" if result["plots"] else ""))
    logf.close()
    return result


def _warm_profiler():
    """Initialise the profiler (about 2 s the first time in a process) in the fork server, not in every child."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        torch.ones(1).add_(1)


if __name__ == "benchmarks.run" and os.environ.get("_TNN_BENCH_FORKSERVER") == "1":
    _warm_profiler()  # imported by the memory children's fork server

if __name__ == "__main__":
    main()
