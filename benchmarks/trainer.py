"""Whole fairseq updates through fairseq's own Trainer, eager vs compiled, on a GPU (or the CPU).

    python benchmarks/run.py --device cuda [--quick] [--out results/bench-gpu] [--force]
    python benchmarks/trainer.py --device cpu --quick --out /tmp/t     # the same suite, directly
    python benchmarks/run.py --device cuda --precision bf16 --modes compiled --configs tnn6 fd3 ski transformer

What a user's ``fairseq-train`` step costs: ``Trainer.train_step`` with the optimizer, the fp16 handling
(``--fp16``: fairseq's FP16Optimizer with its fp32 master weights and loss scaler; ``--bf16-autocast``:
the plugin's bf16 autocast; fp32 on CPU), gradient clipping and the task's ``train_step``, on synthetic
batches of the paper's per-GPU sizes (causal 8 x 512; masked 16 x 512 and 4 x 2048) with Wikitext-103's
50,264-symbol dictionary; in the causal group also fairseq's own ``transformer_lm`` of the same width and
depth (7 x 512, FFN 2048, 8 heads, tied embeddings: what a user would pick instead; eager only, there is no
TNN layer to compile). For every configuration, eager and ``--tnn-compile strict`` (a compiled row is never an
eager one in disguise; ``--modes``, ``--configs`` choose a subset):

* wall time per update (the device synchronised before and after), median of the timed updates, which
  run in interleaved rounds over the configurations (order reversed every round);
* CUDA kernel time per update from torch.profiler (the sum of the kernels' device durations), the
  ratio wall / kernel time (1.0 = the GPU never waits for the host), and kernels launched per update
  (on CPU: operator time and operators per update instead);
* the operations an update dispatches in eager mode (training forward, forward and backward, the whole
  ``Trainer.train_step``; ``benchmarks/opcount.py``), which set its host time on a GPU;
* peak memory of its build and warm-up updates (``torch.cuda.max_memory_allocated``, with fairseq's reset of it
  at the end of each ``train_step`` held off, less what the configurations built before it still hold: the model's
  own parameters, optimizer state and update; CPU: not measured here, see run.py);
* speed-ups over the group's TNN baseline, beside the SKI paper's A100 ratios, and the bounds: the TNN
  model with its TNOs replaced by a fixed precomputed spectrum (the FFT convolution alone) and by the
  identity (no token mixing at all).

Writes ``trainer.json``, ``trainer.md`` and ``trainer.png`` into ``--out``.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.measure import add_out_options, peak_memory_held, refuse_overwrite, write_results  # noqa: E402
from fairseq_tnn import recipe  # noqa: E402
from fairseq_tnn.patches import bf16  # noqa: E402
from fairseq_tnn.patches.masked_positions import add_masked_positions  # noqa: E402

VOCAB = 50264  # Wikitext-103's dictionary (GPT-2 BPE), fairseq's 4 specials included
QUICK_VOCAB = 1000
MASKED_FRACTION = 0.15

# (section, n, batch) groups and their configurations: (key, arch, model overrides, bound)
FULL_GROUPS = [("causal", 512, 8), ("masked", 512, 16), ("masked", 2048, 4)]
QUICK_GROUPS = [("causal", 32, 2), ("masked", 32, 2)]
SECTIONS = ("causal", "masked")
QUICK_KEYS = {"tnn6", "fd3", "ski", "bound_identity"}
CONFIGS = {
    "causal": [("tnn6", "tnn_lm_wt103", {}, None), ("tnn3", "tnn_lm_wt103_rpe3", {}, None),
               ("fd3", "fd_tnn_lm_wt103", {}, None), ("bound_fixed", "tnn_lm_wt103", {}, "fixed"),
               ("bound_identity", "tnn_lm_wt103", {}, "identity"), ("transformer", "transformer_lm", {}, None)],
    "masked": [("tnn6", "tnn_mlm_wt103", {}, None), ("tnn3", "tnn_mlm_wt103_rpe3", {}, None),
               ("fd3", "fd_tnn_mlm_wt103", {}, None),
               ("ski", "ski_tnn_mlm_wt103", {}, None), ("bound_fixed", "tnn_mlm_wt103", {}, "fixed"),
               ("bound_identity", "tnn_mlm_wt103", {}, "identity")],
}
QUICK_MODEL = {"causal": dict(decoder_embed_dim=32, decoder_layers=1, rpe_dim=8, glu_dim=32),
               "masked": dict(encoder_embed_dim=32, encoder_layers=1, glu_dim=32)}
# fairseq's transformer_lm as wide and deep as tnn_lm_wt103 (FFN 4 x width, 64-wide heads), and its quick size
TRANSFORMER = dict(decoder_layers=7, decoder_embed_dim=512, decoder_ffn_embed_dim=2048, decoder_attention_heads=8)
QUICK_TRANSFORMER = dict(decoder_layers=1, decoder_embed_dim=32, decoder_ffn_embed_dim=128, decoder_attention_heads=1)
# The TNN authors' own figures on a GPU in fp16: words per second of their causal TNN over a Transformer's,
# with their CUDA TNO kernel and with their plain FFT path (docs/references.md)
AUTHORS_VS_TRANSFORMER = "0.72x (their CUDA kernel), 0.45x (their FFT path)"
MODES = {"eager": False, "compiled": True}
# The SKI paper's whole-step figures on an A100 (speed-up over TNN; memory as a fraction of TNN's)
PAPER = {("causal", 512, "fd3", "tnn6"): "1.15x", ("causal", 512, "fd3", "tnn3"): "1.10x",
         ("masked", 512, "fd3", "tnn6"): "1.35-1.8x", ("masked", 2048, "fd3", "tnn6"): "1.35-1.8x",
         ("masked", 512, "ski", "tnn6"): "1.25x, memory 0.83x", ("masked", 2048, "ski", "tnn6"): "1.3x, memory 0.58x"}
LABELS = {"tnn6": "TNN (RPE 6)", "tnn3": "TNN (RPE 3)", "fd3": "FD-TNN (RPE 3)", "ski": "SKI-TNN",
          "bound_fixed": "bound: fixed spectrum", "bound_identity": "bound: no token mixing",
          "transformer": "transformer_lm"}
ALL_KEYS = list(dict.fromkeys(k for configs in CONFIGS.values() for k, *_ in configs))


def _dictionary_dir(tmp: str, vocab: int) -> str:
    from fairseq_tnn.models.build import dictionary_of_size
    dictionary_of_size(vocab).save(os.path.join(tmp, "dict.txt"))
    return tmp


# The compiled mode with CUDA graphs (--tnn-cuda-graphs: the whole stack's forward and backward, each one graph)
GRAPHS = "graphs"


# Each precision's fairseq-train options: fp16 weights with fp32 master weights and a loss scaler; fp32 weights under
# bf16 autocast (the recipe's PRECISION=bf16); bf16 weights with fp32 master weights (fairseq's own --bf16, which the
# plugin trains off a TPU: fairseq_tnn/patches/bf16.py); fp16 autocast with torch's gradient scaler; fp32.
PRECISION_OPTIONS = {"fp16": ["--fp16"], "bf16": ["--bf16-autocast"], "bf16w": ["--bf16"], "amp": ["--amp"],
                     "fp32": [], "fp16host": ["--fp16"]}
# fp16host: --fp16 with fairseq's overflow check on the host, as without the plugin's device_overflow patch


# Further fairseq-train options of an arch for a whole run, after the configuration's own (gpu_profile's
# --ski-backward sets SKI-TNN's): {arch: [option, value, ...]}
ARCH_OPTIONS: Dict[str, List[str]] = {}


def build_trainer(section: str, arch: str, bound, n: int, device: str, precision: str, compiled,
                  data: str, quick: bool, width: int = None, extra=()):
    """fairseq's Trainer for one configuration, built from a fairseq-train command line. ``width``: the model's
    width instead of the preset's (embedding and GLU; a transformer's FFN 4x, 64-wide heads), depth unchanged.
    ``compiled``: False, True (``--tnn-compile strict``) or :data:`GRAPHS` (``--tnn-compile strict
    --tnn-cuda-graphs``). ``extra``: further fairseq-train options, last (after the arch's ``ARCH_OPTIONS``)."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    causal = section == "causal"
    argv = [data, *recipe.fairseq_options(recipe.benchmark(section, arch, n))]  # the paper's optimizer
    argv += PRECISION_OPTIONS[precision]
    if device == "cpu":
        argv.append("--cpu")
    if compiled:  # the bounds too: with no token mixing the layers' projections, gate and norms still compile
        argv += ["--tnn-compile", "strict"]  # a failure to compile stops the benchmark, never times eager layers
        if compiled == GRAPHS:
            argv.append("--tnn-cuda-graphs")
    if arch == "transformer_lm":
        sizes = {**TRANSFORMER, **(QUICK_TRANSFORMER if quick else {}), "share_decoder_input_output_embed": True}
    else:
        sizes = QUICK_MODEL[section] if quick else {}
    if width:
        if arch == "transformer_lm":
            sizes = {**sizes, "decoder_embed_dim": width, "decoder_ffn_embed_dim": 4 * width,
                     "decoder_attention_heads": max(1, width // 64)}
        else:
            sizes = {**sizes, ("decoder_embed_dim" if causal else "encoder_embed_dim"): width, "glu_dim": width}
    for k, v in sizes.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    argv += [str(o) for o in [*ARCH_OPTIONS.get(arch, []), *extra]]
    parser = options.get_training_parser()
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(parser, argv))
    bf16.bf16_leaves_tpu_off(cfg, argv)  # what fairseq-train's launch does with --bf16 (patches/bf16.py)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    if bound:
        from benchmarks.measure import FixedSpectrumTno, IdentityTno
        from fairseq_tnn.models.compile import compile_layers
        layers = model.decoder.layers if causal else model.encoder.layers
        for layer in layers:
            layer.gtu.tno = FixedSpectrumTno(layer.gtu.tno, n) if bound == "fixed" else IdentityTno()
        if compiled and bound == "fixed":
            torch._dynamo.reset()
            compile_layers(layers)
    trainer = Trainer(cfg, task, model, task.build_criterion(cfg.criterion))
    if precision == "fp16host":
        from fairseq_tnn.patches import device_overflow
        setattr(trainer, device_overflow.HOST_CHECK, True)
    return trainer


def synthetic_sample(section: str, n: int, batch: int, vocab: int, seed: int = 0, device: str = "cpu") -> Dict:
    """A batch as fairseq-train's data loader hands it to the Trainer, on the CPU: for ``device`` "cuda" its tensors in
    pinned memory, as fairseq's DataLoader (``pin_memory=True``) leaves them, so that the Trainer's move to the GPU is
    asynchronous. From pageable memory CUDA may first wait for the kernels queued before the copy (the previous update's
    optimizer step), a wait fairseq-train does not have."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, vocab, (batch, n), generator=g)
    if section == "causal":
        target = torch.randint(4, vocab, (batch, n), generator=g)
    else:  # masked_lm criterion: the target is the padding symbol (1) except at the masked positions
        masked = torch.rand(batch, n, generator=g) < MASKED_FRACTION
        masked[:, 0] = True
        target = torch.where(masked, torch.randint(4, vocab, (batch, n), generator=g), torch.ones_like(tokens))
    sample = {"id": torch.arange(batch), "nsentences": batch, "ntokens": int((target != 1).sum()),
              "net_input": {"src_tokens": tokens, "src_lengths": torch.full((batch,), n)}, "target": target}
    # as tnn_masked_lm collates its batches: with the masked positions, found on the CPU
    sample = sample if section == "causal" else add_masked_positions(sample, 1)
    if device == "cuda":
        from fairseq.utils import apply_to_sample
        sample = apply_to_sample(lambda t: t.pin_memory(), sample)
    return sample


# each section's preset whose recipe knobs set the tokens of an update (every preset of a kind has the same)
RECIPE_PRESET = {"causal": "tnn_lm_wt103", "masked": "tnn_mlm_wt103"}


def recipe_update_freq(section: str, n: int, batch: int) -> int:
    """The micro-batches of ``batch`` x ``n`` tokens one update accumulates for the recipe's tokens per update on one
    GPU (the knobs' defaults SEQS_PER_UPDATE x TOKENS_PER_SAMPLE, fairseq_tnn/recipe.py): 16 causal at 8 x 512, 32
    masked at 16 x 512 and at 4 x 2048. A ValueError where the shape does not divide them."""
    knobs = recipe.read(RECIPE_PRESET[section], env={})
    tokens = int(knobs["SEQS_PER_UPDATE"]) * int(knobs["TOKENS_PER_SAMPLE"])
    if tokens % (batch * n):
        raise ValueError(f"{batch} x {n} tokens do not divide the {section} recipe's {tokens} tokens per update")
    return tokens // (batch * n)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def queued_ms(fn, device: str, calls: int) -> float:
    """Milliseconds per call of ``calls`` calls of ``fn`` back to back, the device synchronised before the first and
    after the last only, so that the host's work on one call runs while the device still works on the one before."""
    _sync(device)
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - t) * 1000.0 / calls


def _is_annotation(e, annotated) -> bool:
    """A profiler event that is a ``record_function`` range (fairseq's "forward", "optimizer", "clip-grads" ...),
    which torch.profiler also lays over the device's timeline: a span around kernels, not a kernel."""
    return bool(getattr(e, "is_user_annotation", False)) or "annotation" in str(getattr(e, "activity_type", "")).lower() \
        or e.name in annotated


def profiled(trainer, sample, device, updates: int):
    """From one torch.profiler run of ``updates`` training updates: (kernels, host), where ``kernels`` is the
    (name, microseconds) of every kernel (CUDA; ``record_function`` spans left out) or outermost aten operator
    (CPU: those not called inside another one, their CPU time), and ``host`` the (name, self CPU microseconds)
    of every host-side event (operators, CUDA runtime calls such as ``cudaLaunchKernel``; annotations left
    out): what the host spends its time on."""
    return profiled_calls(lambda: trainer.train_step([sample]), device, updates)


def profiled_calls(fn, device, calls: int):
    """:func:`profiled` of ``calls`` calls of ``fn`` (anything that runs on ``device``)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _sync(device)
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        _sync(device)
    events = prof.events()
    cpu = torch.autograd.DeviceType.CPU
    on_host = [e for e in events if getattr(e, "device_type", cpu) == cpu]
    annotated = {e.name for e in on_host if getattr(e, "is_user_annotation", False)}
    host = [(e.name, e.self_cpu_time_total) for e in on_host if not _is_annotation(e, annotated)]
    if device == "cuda":
        kernels = [(e.name, e.device_time) for e in events
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and not _is_annotation(e, annotated)]
        return kernels, host

    def outer(e):
        return e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    return [(e.name, e.cpu_time_total) for e in events if outer(e)], host


def profiled_kernels(trainer, sample, device, updates: int) -> List:
    """(name, microseconds) of every kernel (CUDA) or outermost aten operator (CPU), as :func:`profiled`."""
    return profiled(trainer, sample, device, updates)[0]


def _profile(trainer, sample, device, updates: int) -> Dict:
    """Kernel (CUDA) or operator (CPU) time and count per update."""
    kernels = profiled_kernels(trainer, sample, device, updates)
    busy_us = sum(t for _, t in kernels)
    return {"kernel_ms": busy_us / 1000.0 / updates, "kernels": len(kernels) / updates}


def selected(key: str, compiled: bool, quick: bool, keys, modes) -> bool:
    """Whether a configuration runs: its key among ``keys`` (default: all, or QUICK_KEYS with --quick) and
    its mode among ``modes``; fairseq's transformer has no TNN layer to compile: eager only."""
    if key == "transformer" and compiled:
        return False
    return key in (keys or (QUICK_KEYS if quick else ALL_KEYS)) and compiled in [MODES[m] for m in modes]


def run_suite(device: str, precision: str, quick: bool, rounds: int, per_round: int, warmup: int, log,
              keys=None, modes=("eager", "compiled"), sections=SECTIONS, batch_size=None) -> List[Dict]:
    """``batch_size``: every group's batch (default: the paper's per-GPU batches, or the quick ones)."""
    groups = []
    with tempfile.TemporaryDirectory() as tmp:
        data = _dictionary_dir(tmp, QUICK_VOCAB if quick else VOCAB)
        for section, n, batch in (QUICK_GROUPS if quick else FULL_GROUPS):
            if section not in sections:
                continue
            batch = batch_size or batch
            sample = synthetic_sample(section, n, batch, QUICK_VOCAB if quick else VOCAB, device=device)
            configs = []
            for key, arch, _, bound in CONFIGS[section]:
                for compiled in (False, True):
                    if not selected(key, compiled, quick, keys, modes):
                        continue
                    torch.manual_seed(1)
                    t0 = time.time()
                    if device == "cuda":  # the trainers built before this one stay allocated (interleaved rounds)
                        others = torch.cuda.memory_allocated()
                    with peak_memory_held():  # fairseq resets the peak at the end of each train_step
                        trainer = build_trainer(section, arch, bound, n, device, precision, compiled, data, quick)
                        for _ in range(warmup):  # compiles, allocates the optimizer state
                            trainer.train_step([sample])
                        _sync(device)
                    c = {"key": key, "label": LABELS[key] + (" compiled" if compiled else ""), "arch": arch,
                         "compiled": compiled, "bound": bound, "warmup_s": round(time.time() - t0, 1), "ms": []}
                    if device == "cuda":
                        c["peak_mib"] = (torch.cuda.max_memory_allocated() - others) / 2 ** 20  # this model's own
                    c.update(_profile(trainer, sample, device, max(1, per_round)))
                    if not compiled:  # a dispatch mode would make dynamo recompile; the eager count is the one that costs
                        from benchmarks.opcount import trainer_counts
                        c["ops"] = {k: v for k, v in trainer_counts(trainer, sample).items() if not k.endswith("_ops")}
                    configs.append((c, trainer))
                    log(f"[{section} {batch}x{n}] built {c['label']} in {c['warmup_s']} s")
            for r in range(rounds):
                order = configs if r % 2 == 0 else configs[::-1]
                for c, trainer in order:
                    for _ in range(per_round):
                        _sync(device)
                        t = time.perf_counter()
                        trainer.train_step([sample])
                        _sync(device)
                        c["ms"].append((time.perf_counter() - t) * 1000.0)
            if not configs:
                continue
            result = [c for c, _ in configs]
            for c in result:
                c["median_ms"] = statistics.median(c["ms"])
                c["wall_over_kernel"] = c["median_ms"] / c["kernel_ms"] if c["kernel_ms"] else None
            groups.append({"section": section, "n": n, "batch": batch, "configs": result})
            del configs, trainer
            if device == "cuda":
                torch.cuda.empty_cache()
            for c in result:
                log(f"[{section} {batch}x{n}] {c['label']:<36} {c['median_ms']:9.2f} ms/update, "
                    f"{c['kernel_ms']:8.2f} ms {'kernels' if device == 'cuda' else 'operators'} "
                    f"({c['kernels']:.0f}), peak {c.get('peak_mib', float('nan')):.0f} MiB")
    return groups


def _get(group, key, compiled):
    return next((c for c in group["configs"] if c["key"] == key and c["compiled"] == compiled), None)


def ratios(groups) -> List[Dict]:
    """Speed-ups over the TNN baseline (same mode), memory ratios, and the paper's figure where it has one."""
    rows = []
    for g in groups:
        for compiled in (False, True):
            for c in g["configs"]:
                if c["compiled"] != compiled or c["key"] in ("tnn6", "transformer"):
                    continue
                for base in ("tnn6", "tnn3"):
                    b = _get(g, base, compiled)
                    if b is None or (base == "tnn3" and c["key"] != "fd3"):
                        continue
                    row = {"section": g["section"], "n": g["n"], "batch": g["batch"], "key": c["key"], "base": base,
                           "compiled": compiled, "speedup": b["median_ms"] / c["median_ms"],
                           "paper": PAPER.get((g["section"], g["n"], c["key"], base), "")}
                    if "peak_mib" in c and "peak_mib" in b:
                        row["memory_ratio"] = c["peak_mib"] / b["peak_mib"]
                    rows.append(row)
    return rows


def memory_bounds(groups) -> List[Dict]:
    """Each model's peak memory against the same model with no token mixing (same mode): issue 10's target
    is 1.15x at most at 4 x 2048 (benchmarks/memory.py explains what stays above 1.0)."""
    rows = []
    for g in groups:
        for compiled in (False, True):
            bound = _get(g, "bound_identity", compiled)
            for c in g["configs"]:
                if c["compiled"] == compiled and not c["bound"] and c["key"] != "transformer" and bound \
                        and "peak_mib" in c and "peak_mib" in bound:
                    rows.append({"section": g["section"], "n": g["n"], "batch": g["batch"], "key": c["key"],
                                 "compiled": compiled, "vs_no_mixing": c["peak_mib"] / bound["peak_mib"]})
    return rows


def against_transformer(groups) -> List[Dict]:
    """Each TNN model's tokens per second over fairseq's transformer_lm (eager) in the same group: the
    transformer's time per update over the model's (above 1: the TNN is faster). The target: tnn_lm_wt103
    (tnn6) at least 1.0 at 512 tokens."""
    rows = []
    for g in groups:
        t = _get(g, "transformer", False)
        if t is None:
            continue
        for c in g["configs"]:
            if c["key"] != "transformer" and not c["bound"]:
                rows.append({"section": g["section"], "n": g["n"], "batch": g["batch"], "key": c["key"],
                             "compiled": c["compiled"], "tokens_per_s_ratio": t["median_ms"] / c["median_ms"]})
    return rows


def markdown(result) -> str:
    meta = result["meta"]
    unit = "kernels" if meta["device"] == "cuda" else "operators"
    out = [f"# Whole fairseq updates through fairseq's Trainer ({meta['device']}, {meta['precision']})", "",
           f"{meta['machine']}; torch {meta['torch']}, CUDA {meta['cuda']}; vocabulary {meta['vocab']}; "
           f"{meta['rounds']} rounds x {meta['per_round']} updates per configuration, interleaved.", "",
           "Operations dispatched (eager, views and metadata left out; benchmarks/opcount.py): the training forward "
           "(model and criterion), forward and backward, and the whole update (Trainer.train_step).", "",
           f"| section | batch x n | configuration | ms / update | {unit} ms / update | wall / {unit} | "
           f"{unit} / update | ops: forward | ops: fwd + bwd | ops: update | peak MiB |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g in result["groups"]:
        for c in g["configs"]:
            ratio = "" if c["wall_over_kernel"] is None else f"{c['wall_over_kernel']:.2f}"
            peak = f"{c['peak_mib']:.0f}" if "peak_mib" in c else "-"
            ops = c.get("ops")
            counts = " | ".join(f"{ops[k]:,}" if ops else "-" for k in ("forward", "forward_backward", "update"))
            out.append(f"| {g['section']} | {g['batch']} x {g['n']} | {c['label']} | {c['median_ms']:.2f} | "
                       f"{c['kernel_ms']:.2f} | {ratio} | {c['kernels']:.0f} | {counts} | {peak} |")
    out += ["", "## Ratios against TNN (same mode)", "",
            "| section | batch x n | configuration | vs | compiled | speed-up | memory | paper (A100) |",
            "|---|---|---|---|---|---:|---:|---|"]
    for r in result["ratios"]:
        mem = f"{r['memory_ratio']:.2f}x" if "memory_ratio" in r else "-"
        out.append(f"| {r['section']} | {r['batch']} x {r['n']} | {LABELS[r['key']]} | {LABELS[r['base']]} | "
                   f"{'yes' if r['compiled'] else 'no'} | {r['speedup']:.2f}x | {mem} | {r['paper']} |")
    if result.get("against_transformer"):
        out += ["", "## Tokens per second against fairseq's transformer_lm of the same width and depth (eager)", "",
                f"Above 1.0 the TNN model is faster; target for TNN (RPE 6) at 512 tokens: 1.0 or more. The TNN "
                f"authors' figures (fp16, their causal TNN): {AUTHORS_VS_TRANSFORMER}.", "",
                "| section | batch x n | configuration | compiled | tokens/s vs transformer_lm |", "|---|---|---|---|---:|"]
        for r in result["against_transformer"]:
            out.append(f"| {r['section']} | {r['batch']} x {r['n']} | {LABELS[r['key']]} | "
                       f"{'yes' if r['compiled'] else 'no'} | {r['tokens_per_s_ratio']:.2f}x |")
    if result.get("memory_bounds"):
        out += ["", "## Peak memory against the same model with no token mixing (target at 4 x 2048: 1.15x at most)", "",
                "| section | batch x n | configuration | compiled | peak vs no mixing |", "|---|---|---|---|---:|"]
        for r in result["memory_bounds"]:
            out.append(f"| {r['section']} | {r['batch']} x {r['n']} | {LABELS[r['key']]} | "
                       f"{'yes' if r['compiled'] else 'no'} | {r['vs_no_mixing']:.2f}x |")
    return "\n".join(out) + "\n"


def plot(result, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = result["groups"]
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, g in zip(axes[0], groups):
        keys = list(dict.fromkeys(c["key"] for c in g["configs"]))
        for i, compiled in enumerate((False, True)):
            vals = [(_get(g, k, compiled) or {}).get("median_ms", 0.0) for k in keys]
            ax.bar([j + 0.4 * i for j in range(len(keys))], vals, width=0.4, label="compiled" if compiled else "eager")
        ax.set_xticks([j + 0.2 for j in range(len(keys))])
        ax.set_xticklabels([LABELS[k] for k in keys], rotation=30, ha="right", fontsize=7)
        ax.set_title(f"{g['section']} {g['batch']} x {g['n']}")
        ax.set_ylabel("ms per update")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", choices=["fp16", "bf16", "fp32"],
                   help="fp16 (--fp16, default on cuda), bf16 (--bf16-autocast) or fp32 (default on cpu)")
    p.add_argument("--quick", action="store_true", help="tiny models and sizes (a smoke test)")
    add_out_options(p, "results/bench-trainer")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5, quick 2)")
    p.add_argument("--per-round", type=int, default=None, help="updates per configuration and round (default 4, quick 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed updates first (default 5, quick 2)")
    p.add_argument("--configs", nargs="+", choices=ALL_KEYS, metavar="KEY",
                   help=f"only these configurations, where a group has them (of {', '.join(ALL_KEYS)}; default: all, "
                        f"with --quick {', '.join(sorted(QUICK_KEYS))})")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                   help="eager, compiled (--tnn-compile strict) or both (default)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                   help="the causal (tnn_language_modeling) or masked (tnn_masked_lm) groups, or both (default)")
    p.add_argument("--batch", type=int, help="sequences per update in every group (default: the paper's per-GPU "
                                              "batches; 1 keeps a CPU run of the full-size models short)")
    p.add_argument("--no-plots", action="store_true", help="no trainer.png (and no need for matplotlib)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible to torch (use --device cpu)")
    precision = a.precision or ("fp16" if a.device == "cuda" else "fp32")
    if a.device == "cpu" and precision == "fp16":
        p.error("--precision fp16 needs --device cuda (fairseq's --fp16 on CPU is not a supported training mode)")
    rounds = a.rounds if a.rounds is not None else (2 if a.quick else 5)
    per_round = a.per_round if a.per_round is not None else (1 if a.quick else 4)
    warmup = a.warmup if a.warmup is not None else (2 if a.quick else 5)
    for name, v, lo in (("rounds", rounds, 1), ("per-round", per_round, 1), ("warmup", warmup, 1),
                        ("batch", a.batch if a.batch is not None else 1, 1)):
        if v < lo:
            p.error(f"--{name}={v} must be >= {lo}")
    if not any(selected(key, compiled, a.quick, a.configs, a.modes) for section, _, _ in (QUICK_GROUPS if a.quick else FULL_GROUPS)
               if section in a.sections for key, *_ in CONFIGS[section] for compiled in MODES.values()):
        p.error(f"--configs {' '.join(a.configs or [])} with --modes {' '.join(a.modes)} and --sections "
                f"{' '.join(a.sections)}: no configuration to run (transformer runs eager only and causal only; "
                f"ski is masked only)")
    refuse_overwrite(p, a, "trainer.json")
    os.makedirs(a.out, exist_ok=True)
    import fairseq_tnn
    fairseq_tnn.register()  # registers the models and tasks
    from benchmarks.measure import _machine
    t0 = time.time()
    groups = run_suite(a.device, precision, a.quick, rounds, per_round, warmup, lambda m: print(m, flush=True),
                       keys=a.configs, modes=a.modes, sections=a.sections, batch_size=a.batch)
    gpu = torch.cuda.get_device_name(0) if a.device == "cuda" else None
    meta = {"device": a.device, "precision": precision, "vocab": QUICK_VOCAB if a.quick else VOCAB, "machine": gpu or _machine(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "rounds": rounds, "per_round": per_round, "warmup": warmup,
            "command": "python benchmarks/trainer.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "seconds": round(time.time() - t0, 1)}
    result = {"meta": meta, "groups": groups, "ratios": ratios(groups), "memory_bounds": memory_bounds(groups),
              "against_transformer": against_transformer(groups)}
    md = markdown(result)
    write_results(a.out, "trainer", result, md)
    if not a.no_plots:
        plot(result, os.path.join(a.out, "trainer.png"))
    print(md)
    return result


if __name__ == "__main__":
    main()
