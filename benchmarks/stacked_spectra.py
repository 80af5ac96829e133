"""A model's layers' TNO spectra computed together (``fairseq_tnn.modules.layers.layer_spectra``: the RPEs of all
layers as one batched MLP) against each layer computing its own, side by side in one process: the operations a
training forward and backward dispatch (``benchmarks/opcount.py``'s count; on a GPU each costs 10-25 microseconds
of host time, eagerly) and the CPU time of one, for the Wikitext-103 presets whose TNOs have an RPE.

    .venv/bin/python benchmarks/stacked_spectra.py [--width 64] [--rounds 9] [--threads 1] [--compile]

Each preset at its published depth, at ``--width`` (the counts do not depend on it) and batch 1 x 512, eager,
fp32, dropout 0. Each round times one forward and backward of each path, the order alternating; the median
process CPU time of the rounds is printed, in ms.

``--compile``: the layers compiled (``--tnn-compile strict``), where "each its own" computes each layer's spectrum
inside its compiled graph (what compiled layers do on the CPU) and "together" hands them the spectra computed
together (what they do on a GPU, ``SPECTRA_FROM_THE_MODEL`` in ``fairseq_tnn/models/compile.py``). No operations
are counted then (dynamo runs a compiled function eagerly while a dispatch mode counts); instead each path's compile time is measured in a process of its own with inductor's cache in a new
folder (cold; in one process the second path would reuse the first's kernels): a training update (forward and
backward) and then a validation forward (no gradients), the first call of each, which compiles its graphs; and the
kernel calls in the code inductor generated for them (the graphs of one layer, which every layer of the stack runs:
fused C++ kernels, GEMMs, and the FFTs and complex products it leaves to aten; on a GPU each is a launch, and
Triton's kernels are more).
"""
import argparse
import glob
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Tuple
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.opcount import count  # noqa: E402

ARCHS = ["tnn_lm_wt103", "tnn_lm_wt103_rpe3", "fd_tnn_lm_wt103", "tnn_mlm_wt103", "fd_tnn_mlm_wt103"]


def per_layer():
    """Patches under which the models' stacks let each layer compute its own spectrum."""
    def each_its_own(layers, *args, **kwargs):
        return [None] * len(layers)
    return (mock.patch.multiple("fairseq_tnn.models.compile", layer_spectra=each_its_own),)


def together():
    """Patches under which the models' stacks hand their layers the spectra computed together, compiled layers on the
    CPU included (``SPECTRA_FROM_THE_MODEL``; eager layers take them anyway)."""
    return (mock.patch.multiple("fairseq_tnn.models.compile", SPECTRA_FROM_THE_MODEL=("cpu", "cuda")),)


def patches_of(path: str):
    return per_layer() if path == "own" else together()


def step(model, tokens):
    model.zero_grad(set_to_none=True)
    model(tokens)[0].float().pow(2).mean().backward()


def _build(arch: str, width: int, compiled: bool):
    from fairseq_tnn.models.build import build_arch
    causal = "_mlm_" not in arch
    torch.manual_seed(0)
    return build_arch(arch, 1000, dropout=0.0, tnn_compile="strict" if compiled else False,
                      **{"decoder_embed_dim" if causal else "encoder_embed_dim": width, "glu_dim": width})


# a kernel call in the ``call`` function of inductor's generated CPU code: a fused C++ kernel, an extern kernel (GEMMs)
# or an aten operation inductor does not generate code for (FFTs, complex products)
KERNEL_CALL = re.compile(r"\b(?:cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.aten\.\w+\.\w+)\(")


def generated_kernel_calls(cache: str) -> int:
    """The kernel calls of the graphs inductor generated under ``cache`` (its cache folder), summed over graphs."""
    total = 0
    for path in glob.glob(os.path.join(cache, "**", "*.py"), recursive=True):
        with open(path) as f:
            code = f.read()
        start = re.search(r"def call\((?:self, )?args\)", code)
        if start:
            end = code.find("def benchmark_compiled_module", start.end())
            total += len(KERNEL_CALL.findall(code[start.end():end if end > 0 else None]))
    return total


def compile_seconds(arch: str, width: int, path: str) -> Tuple[float, float]:
    """In this process (a new one, see ``cold_compile``): the seconds of the first compiled training update
    and of the first validation forward of ``arch`` along ``path``."""
    torch.compile(lambda t: t * 2)(torch.ones(2))  # inductor's first compilation loads its own code: no path's
    model = _build(arch, width, True)
    tokens = torch.randint(4, 1000, (1, 512))
    patches = patches_of(path)
    for patch in patches:
        patch.start()
    t = time.perf_counter()
    step(model, tokens)
    update = time.perf_counter() - t
    model.eval()
    t = time.perf_counter()
    with torch.no_grad():
        model(tokens)
    return update, time.perf_counter() - t


def cold_compile(arch: str, width: int, threads: int, path: str) -> Tuple[float, float, int]:
    """``compile_seconds`` in a child process with inductor's cache in a new, empty folder, and the kernel calls of
    the graphs it generated there (``generated_kernel_calls``: a layer's, shared by the stack's layers)."""
    with tempfile.TemporaryDirectory(prefix="stacked-spectra-inductor-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--width", str(width), "--threads",
                              str(threads), "--archs", arch, "--compile-seconds-of", path],
                             env=env, capture_output=True, text=True, check=True).stdout
        kernels = generated_kernel_calls(cache)
    update, valid = out.strip().splitlines()[-1].split()
    return float(update), float(valid), kernels


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=64, help="embedding width (default 64; the counts do not depend on it)")
    p.add_argument("--rounds", type=int, default=9, help="timed rounds (default 9)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--archs", nargs="+", default=ARCHS, help=f"presets (default: {' '.join(ARCHS)})")
    p.add_argument("--compile", action="store_true", help="compiled layers (--tnn-compile strict), see above")
    p.add_argument("--compile-seconds-of", choices=["own", "together"], help=argparse.SUPPRESS)  # the child's
    a = p.parse_args(argv)
    for name, value, least in (("--width", a.width, 1), ("--rounds", a.rounds, 1), ("--threads", a.threads, 1)):
        if value < least:
            p.error(f"{name}={value} is invalid: must be an integer >= {least}")
    from fairseq_tnn import register
    register()
    torch.set_num_threads(a.threads)
    if a.compile_seconds_of:
        print(*compile_seconds(a.archs[0], a.width, a.compile_seconds_of))
        return
    compiled = "compiled layers" if a.compile else "eager"
    print(f"torch {torch.__version__}, {a.threads} thread(s); batch 1 x 512, width {a.width}, fp32, {compiled}, "
          f"forward and backward; CPU ms: median of {a.rounds} rounds")
    extra = (" compile s (update + validation), each its own | the same, together | a layer's graphs' kernel calls, "
             "each its own | the same, together |") if a.compile else ""
    print(f"| preset | ops, each layer its own | ops, together | CPU ms, each its own | CPU ms, together |{extra}")
    print("|---|---:|---:|---:|---:|" + ("---:|---:|---:|---:|" if a.compile else ""))
    for arch in a.archs:
        compile_s = {path: cold_compile(arch, a.width, a.threads, path) for path in ("own", "together")
                     if a.compile}
        model = _build(arch, a.width, a.compile)
        tokens = torch.randint(4, 1000, (1, 512))
        ops, times = {}, {"own": [], "together": []}
        for r in range(a.rounds + 1):
            for path in (["own", "together"] if r % 2 else ["together", "own"]):
                patches = patches_of(path)
                for patch in patches:
                    patch.start()
                try:
                    if r == 0:
                        step(model, tokens)  # compiles this path's graphs under --compile
                        ops[path] = "-" if a.compile else f"{count(lambda: step(model, tokens))[1].total:,}"
                        continue
                    t = time.process_time()
                    step(model, tokens)
                    times[path].append((time.process_time() - t) * 1e3)
                finally:
                    for patch in patches:
                        patch.stop()
        own, together = (statistics.median(times[k]) for k in ("own", "together"))
        extra = "".join(f" {u:.1f} + {v:.1f} |" for u, v, _ in compile_s.values())
        extra += "".join(f" {k} |" for _, _, k in compile_s.values())
        print(f"| {arch} | {ops['own']} | {ops['together']} | {own:.1f} | {together:.1f} |{extra}", flush=True)


if __name__ == "__main__":
    main()
