"""Speed and memory of the TNN models on CPU: whole training steps and single TNO layers, side by side.

    .venv/bin/python benchmarks/run.py [--quick] [--out results/bench] [--sections causal bidirectional rpe layer]
                                       [--force]

With ``--device cuda`` (or ``--device cpu``) it runs ``benchmarks/trainer.py`` instead: whole updates
through fairseq's Trainer, eager vs compiled, with kernel time and count per update (see that file).

Writes ``results.json``, ``results.md`` (tables of ratios with the papers' figures beside ours, and the
speed and memory targets, met or missed) and PNG plots into ``--out``. Sections:

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
  column, the two floors timed beside the authors' operators, docs/references.md#the-authors-operators-on-cpu,
  for calibrating against them).
  Causal SKI (the paper's appendix, two implementations) is timed against the FFT TNN here.

Method. The script re-executes itself with ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736`` so
that glibc keeps freed memory instead of returning it to the OS and faulting it in again every step.
Within a group (one length), all configurations are built in one process, warmed
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

Modules: ``benchmarks/plan.py`` (sizes, labels, the groups of configurations), ``benchmarks/measure.py``
(building, timing, memory), ``benchmarks/report.py`` (targets, Markdown, plots), ``benchmarks/published.py``
(the papers' and the authors' figures, with their sources); this file is the command line.
"""
import argparse
import multiprocessing as mp
import os
import sys
import time

MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "68719476736"}
if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
    os.environ.update(MALLOC_ENV)
    os.execv(sys.executable, [sys.executable] + sys.argv)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.measure import _machine, add_out_options, memory_child, refuse_overwrite, time_group, write_results  # noqa: E402
from benchmarks.plan import FULL, QUICK, plan  # noqa: E402
from benchmarks.report import markdown, plots, targets  # noqa: E402


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
    add_out_options(p, "results/bench")
    p.add_argument("--sections", nargs="+", default=["causal", "bidirectional", "rpe", "layer"],
                   choices=["causal", "bidirectional", "rpe", "layer"])
    p.add_argument("--rounds", type=int, help="timed rounds per group (default 5, quick 3)")
    p.add_argument("--warmup", type=int, help="warm-up rounds per group (default 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-memory", action="store_true", help="skip the memory measurements")
    p.add_argument("--no-plots", action="store_true")
    a = p.parse_args(argv)
    refuse_overwrite(p, a, "results.json")
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
        # The fork server imports torch, the plugin and ``benchmarks.measure`` (which then starts the profiler
        # once: ~2 s per process otherwise); each configuration runs in a fresh fork of it.
        os.environ["_TNN_BENCH_FORKSERVER"] = "1"
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "fairseq_tnn", "benchmarks.ski_causal",
                                    "fairseq.models.transformer_lm", "benchmarks.measure"])
        log("memory (fresh process per configuration):")
        with ctx.Pool(1, maxtasksperchild=1) as pool:
            for g in groups:
                if g["section"] == "rpe":
                    continue
                for c in g["configs"]:
                    spec = {k: v for k, v in c.items() if k not in ("wall_ms", "user_ms", "sys_ms", "speedup", "paired_speedup")}
                    t0 = time.time()
                    c["memory"] = pool.apply(memory_child, (spec, sizes, a.threads))
                    c["memory"]["seconds"] = round(time.time() - t0, 2)
                    log(f"  [{g['section']}] {g['direction']} n={g['n']} {c['label']:<48} "
                        f"tensors {c['memory']['tensor_peak_mib']:8.1f} MiB (step {c['memory']['step_peak_mib']:.1f}), "
                        f"RSS {c['memory']['rss_peak_mib']:8.1f} MiB")
    result = dict(meta=meta, groups=groups)
    result["targets"] = targets(groups)
    result["plots"] = [] if a.no_plots else plots(result, a.out)
    meta["seconds"] = round(time.time() - t_start, 1)
    md = markdown(result)
    write_results(a.out, "results", result, md)
    log(md)
    log(f"done in {meta['seconds']} s; wrote {a.out}/results.json, results.md" + (", *.png" if result["plots"] else ""))
    logf.close()
    return result


if __name__ == "__main__":
    main()
