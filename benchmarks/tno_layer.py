"""Forward + backward time of one TNO layer (TNN, FD, SKI), side by side in one run.

    .venv/bin/python benchmarks/tno_layer.py [--lengths 512 2048] [--rounds 15] [--batch 4] [--dim 1536]

Shapes follow the paper's layers: activations (batch, n, d1) with d1 = 3 x 512 = 1536,
RPE width 64 (TNN: 6 layers, FD: 3 layers), SKI r = 32, m = 17. The operators run
interleaved (A B C A B C ...) after warm-up, and the median and interquartile range
of each are reported. glibc is told to keep freed memory (FACTS.md section 4):
the script re-executes itself with MALLOC_MMAP_MAX_=0 and a large trim threshold.
"""
import argparse
import json
import os
import statistics
import sys
import time

if os.environ.get("MALLOC_MMAP_MAX_") != "0":
    os.environ.update(MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_="68719476736")
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fairseq_tnn.modules.tno import FdTno, SkiTno, TnnTno  # noqa: E402


def operators(d1: int, causal: bool):
    ops = {"tnn (rpe 6)": TnnTno(d1, causal, 64, 6), "fd (rpe 3)": FdTno(d1, causal, 64, 3)}
    if not causal:
        ops["ski (r 32, m 17)"] = SkiTno(d1, False, 32, 17, 0.99)
    return ops


def step(op, x):
    y = op(x)
    y.backward(torch.ones_like(y))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dim", type=int, default=1536)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    for name in ("lengths", "rounds", "batch", "dim", "threads"):
        values = getattr(a, name) if isinstance(getattr(a, name), list) else [getattr(a, name)]
        if any(v < 1 for v in values):
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    results = []
    print(f"torch {torch.__version__}, {a.threads} threads, batch {a.batch}, d1 {a.dim}, "
          f"median of {a.rounds} interleaved rounds (forward + backward, ms)")
    for causal in (True, False):
        for n in a.lengths:
            ops = operators(a.dim, causal)
            x = torch.randn(a.batch, n, a.dim, requires_grad=True)
            times = {k: [] for k in ops}
            for r in range(a.warmup + a.rounds):
                for k, op in ops.items():
                    t = time.perf_counter()
                    step(op, x)
                    if r >= a.warmup:
                        times[k].append((time.perf_counter() - t) * 1000)
                    x.grad = None
                    op.zero_grad(set_to_none=True)
            base = statistics.median(times["tnn (rpe 6)"])
            for k, ts in times.items():
                q = statistics.quantiles(ts, n=4)
                med = statistics.median(ts)
                results.append(dict(direction="causal" if causal else "bidirectional", n=n, op=k, median_ms=med,
                                    q1_ms=q[0], q3_ms=q[2], speedup_vs_tnn=base / med))
                print(f"{results[-1]['direction']:>13} n={n:<5} {k:<17} {med:8.1f} ms  "
                      f"(IQR {q[0]:.1f}-{q[2]:.1f})  x{base / med:.2f} vs tnn")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
