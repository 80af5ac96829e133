"""How the benchmark measures: building each configuration's training step (whole models and single TNO
layers), timing a group of them in interleaved rounds, and the memory of one configuration in a fresh process.
See benchmarks/run.py for the method."""
import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import resource
import statistics
import tempfile
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

MIB = 2.0 ** 20

def add_out_options(parser: argparse.ArgumentParser, default: str) -> None:
    """--out DIR and --force, shared by the benchmark scripts."""
    parser.add_argument("--out", default=default, help="output directory")
    parser.add_argument("--force", action="store_true", help="overwrite the results of an earlier run in --out")


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def add_device_options(parser: argparse.ArgumentParser, rounds: int) -> None:
    """--device, --dtype, --rounds and --batch-scale, shared by the benchmarks that time one operator side by side on a
    GPU or the CPU (``checked_dtype`` checks them)."""
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="the modules' and activations' dtype (default: fp16 on "
                                                                "cuda, fp32 on cpu)")
    parser.add_argument("--rounds", type=int, default=rounds, help=f"timed rounds (default {rounds})")
    parser.add_argument("--batch-scale", type=int, default=1, help="divide every batch by this (default 1)")


def checked_dtype(parser: argparse.ArgumentParser, args) -> Tuple[str, torch.dtype]:
    """The name and dtype ``add_device_options``' arguments ask for, after stopping with an error, before any work, at
    a CUDA device torch cannot see, rounds or batch scale below 1, or fp16 on the CPU (which has no fp16 FFT)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    if args.rounds < 1 or args.batch_scale < 1:
        parser.error(f"--rounds={args.rounds} and --batch-scale={args.batch_scale} must be integers >= 1")
    name = args.dtype or ("fp16" if args.device == "cuda" else "fp32")
    if args.device == "cpu" and name == "fp16":
        parser.error("--dtype fp16 needs --device cuda (the CPU has no fp16 FFT)")
    return name, DTYPES[name]


def interleaved_rounds(steps: Dict[str, Dict[str, Callable[[], object]]], timed: Callable[[Callable], float],
                       rounds: int) -> Dict[str, Dict[str, Dict[str, float]]]:
    """Side by side: ``steps`` {way: {part: fn}} (each way's "forward" and "forward_backward"), timed by ``timed`` (ms)
    in ``rounds`` rounds, each running every way's parts once, in order; per way and part the median and least ms."""
    times = {way: {part: [] for part in parts} for way, parts in steps.items()}
    for _ in range(rounds):
        for way, parts in steps.items():
            for part, fn in parts.items():
                times[way][part].append(timed(fn))
    return {way: {part: {"median_ms": statistics.median(v), "least_ms": min(v)} for part, v in parts.items()}
            for way, parts in times.items()}


def triton_run(args, dtype_name: str) -> Dict:
    """What a benchmark of Triton kernels (``add_device_options``' arguments) records of its run: torch's and Triton's
    versions, the dtype, the device (its name on CUDA; on the CPU Triton's interpreter) and the rounds."""
    import triton
    return {"torch": torch.__version__, "triton": triton.__version__, "dtype": dtype_name, "device": args.device,
            "rounds": args.rounds,
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "CPU, Triton's interpreter"}


def spelled(values) -> str:
    """Allowed values as an error message names them: "2, 4, 8 or 16"."""
    return ", ".join(map(str, values[:-1])) + f" or {values[-1]}"


def refuse_overwrite(parser: argparse.ArgumentParser, args, result_file: str) -> None:
    """Stop with an error, before any work, when --out already holds ``result_file`` and --force is not given."""
    if os.path.exists(os.path.join(args.out, result_file)) and not args.force:
        parser.error(f"--out={args.out} already holds {result_file}; refusing to overwrite it (--force, or another --out)")


# The kinds a layer's kernels (CUDA), outermost operators (CPU's profiles) or dispatched operations (``opcount``) are
# counted in, by name (``kernel_kind``): cuFFT's transforms; cuBLAS's and CUTLASS's matrix products; the direct
# Toeplitz product's Triton kernels (fairseq_tnn/ops/toeplitz_direct.py); inductor's generated kernels (a compiled
# layer); copies, casts and fills; reductions and norms; the other elementwise kernels (the RPE's activations, the
# spectra's complex products)
KERNEL_KINDS = ("FFT", "GEMM", "direct product", "inductor", "copies and fills", "reductions and norms",
                "elementwise and other")
# (``_scale_kernel``: the coefficients' kernel of the GPU runs before 2026-12-04, ``_layout_kernel`` since)
DIRECT_KERNELS = ("_apply_kernel", "_lag_grad_kernel", "_layout_kernel", "_scale_kernel")
GEMM_KERNELS = ("gemm", "cutlass", "cublas", "nvjet", "xmma")
GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mv", "addmv"}
COPY_KERNELS = ("copy", "fill", "memcpy", "memset", "zero")
COPY_OPS = {"cat", "stack", "clone", "constant_pad_nd", "full", "full_like", "ones", "ones_like", "new_ones"}
REDUCTION_OPS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "var", "var_mean", "std"}


def kernel_kind(name: str) -> str:
    """Which of ``KERNEL_KINDS`` the kernel or operator ``name`` is (a CUDA kernel's name, ``aten::NAME``, or an
    operation's name as the dispatcher calls it), the first that its name matches."""
    low = name.lower()
    op = low[len("aten::"):] if low.startswith("aten::") else low
    op = op.split(".")[0]
    if "fft" in low:
        return "FFT"
    if any(k in name for k in DIRECT_KERNELS):
        return "direct product"
    if op in GEMM_OPS or any(k in low for k in GEMM_KERNELS):
        return "GEMM"
    if low.startswith("triton_"):
        return "inductor"
    if op in COPY_OPS or any(k in low for k in COPY_KERNELS):
        return "copies and fills"
    if op in REDUCTION_OPS or "norm" in low or "reduce" in low:
        return "reductions and norms"
    return "elementwise and other"


@contextlib.contextmanager
def peak_memory_held():
    """The allocator's peak statistics reset once, on entry, and held for the block: fairseq's Trainer resets them at
    the end of every ``train_step`` (after reading them for its ``gb_free`` meter), and the plugin's step metrics at
    the start of each update, so that a peak read after a few updates would otherwise be only what was allocated
    since the last one ended. Inside the block ``torch.cuda.reset_peak_memory_stats`` does nothing; after it
    ``torch.cuda.max_memory_allocated()`` is the peak of everything the block ran. CUDA only on entry: on a machine
    without it nothing is reset."""
    reset = torch.cuda.reset_peak_memory_stats
    if torch.cuda.is_available():
        reset()
    torch.cuda.reset_peak_memory_stats = lambda device=None: None
    try:
        yield
    finally:
        torch.cuda.reset_peak_memory_stats = reset


def write_results(out: str, stem: str, result: Dict, md: str) -> None:
    """``<out>/<stem>.json`` (the whole result) and ``<out>/<stem>.md`` (its tables)."""
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write(md)


# ----------------------------------------------------------------------------
# Building the models and operators (in the timing process and in the memory children)
# ----------------------------------------------------------------------------


def build_tnn(arch: str, vocab: int, **overrides):
    """A registered tnn_lm / tnn_mlm model, built as fairseq builds it (arch preset, then the dataclass)."""
    import fairseq_tnn
    fairseq_tnn.register()  # registers the models
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
    recompute_gate = False  # the GTU keeps what it keeps for every TNO but SKI's (Tno.recompute_gate)

    def __init__(self, tno, n: int):
        super().__init__()
        with torch.no_grad():
            spec, self.size = tno.spectrum(n)
        self.register_buffer("spec", spec)  # (d, F)

    def forward(self, x, layout="dbn"):
        from fairseq_tnn.ops.toeplitz import fft_conv
        return fft_conv(x, self.spec, self.size, layout)


class IdentityTno(torch.nn.Module):
    """Bound: no token mixing at all."""

    layout = "dbn"
    recompute_gate = False

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

    from benchmarks import ski_causal
    from fairseq_tnn.modules.tno import build_tno
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
        module = build_tno(tno_type, d1, causal)
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


def _warm_profiler():
    """Initialise the profiler (about 2 s the first time in a process) in the fork server, not in every child."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        torch.ones(1).add_(1)


if __name__ == "benchmarks.measure" and os.environ.get("_TNN_BENCH_FORKSERVER") == "1":
    _warm_profiler()  # imported by the memory children's fork server
