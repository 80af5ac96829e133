"""The Toeplitz product two ways side by side on one GPU: by FFT (``fft_conv``, what the TNOs run) and by direct
summation on tensor cores (``direct_conv``, ``fairseq_tnn/ops/toeplitz_direct.py``), at the paper's shapes (issue 39:
the FFT product's mixing is 41-61 times its floor).

    python benchmarks/toeplitz_direct.py --out results/toeplitz-direct          # on a CUDA GPU (about a minute)
    TRITON_INTERPRET=1 python benchmarks/toeplitz_direct.py --quick --device cpu --out /tmp/td   # the test's smoke run

For each shape (a TNO's channels, the per-GPU batch, the length; x in ``--dtype``, fp16 by default on CUDA, a
random kernel, causal at the causal shape, where the direct product sums T's lower triangle), the FFT product and the
direct one with each ``--rows-per-program`` (``ROWS_PER_PROGRAM``: how many rows, sequences times
output tiles, a program stacks beside each tile of T it gathers; 32 and 64 by default) at the module's ``LOAD_BYTES``,
and with each ``--load-bytes`` (``LOAD_BYTES``: the bytes of T's tile a thread loads at once, from as many shifted
copies of the coefficients' layout; 2, 8 and 16 by default) at the module's rows, each way's forward and forward
with backward (x's and the operand's gradients) in interleaved rounds, timed by CUDA events (the CPU's clock on the
CPU), with their medians and least times, the ratio FFT / direct of the medians, the first call's seconds (Triton's
compilation, on the first shape), and the largest differences of each direct way's output and gradients (x's, and the
kernel's coefficients' through the spectrum) from the FFT's, relative to the FFT's largest value. Writes
``toeplitz_direct.json`` and ``toeplitz_direct.md``.

``--operand``: what the product is handed, as a TNO hands it. ``kernel`` (the default; TNN's and causal FD-TNN's,
whose stacks hand the direct product their kernels in time): the FFT way transforms the kernel (``KernelRfft``) and
takes the FFT product, the direct way sums the kernel as it is (``direct_toeplitz``; causal: the lags 0 .. n - 1,
bidirectional: the circulant column). ``spectrum`` (bidirectional FD-TNN's, whose RPE gives the spectrum itself): the
FFT product of the spectrum against ``direct_conv``, which takes the spectrum back to the column by an irfft first.
"""
import argparse
import os
import sys
import time
from typing import Callable, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.measure import (add_device_options, add_out_options, checked_dtype, interleaved_rounds,  # noqa: E402
                                refuse_overwrite, spelled, triton_run, write_results)

# (label, channels, batch, n, causal): the causal TNO at the paper's 8 x 512 (the direct product sums T's lower
# triangle), the bidirectional at 16 x 512 and 4 x 2048, and a length between
SHAPES = [("causal 8 x 512, d 1536", 1536, 8, 512, True), ("16 x 512, d 2304", 2304, 16, 512, False),
          ("8 x 1024, d 2304", 2304, 8, 1024, False), ("4 x 2048, d 2304", 2304, 4, 2048, False)]
QUICK_SHAPES = [("causal 2 x 40, d 3", 3, 2, 40, True), ("17 x 70, d 2", 2, 17, 70, False)]

# --operand: what the product is handed, as the markdown names it
OPERANDS = {"kernel": "kernel in time (TNN, causal FD-TNN)", "spectrum": "spectrum (bidirectional FD-TNN)"}


def _ways(rows_per_program: List[int], load_bytes: List[int]) -> List[str]:
    """"fft", then "direct/M/B" (M rows a program, B bytes a load) for each M of ``--rows-per-program`` at the
    module's ``LOAD_BYTES`` and each B of ``--load-bytes`` at its ``ROWS_PER_PROGRAM``, each once."""
    from fairseq_tnn.ops import toeplitz_direct
    ways = [f"direct/{m}/{toeplitz_direct.LOAD_BYTES}" for m in rows_per_program]
    ways += [f"direct/{toeplitz_direct.ROWS_PER_PROGRAM}/{b}" for b in load_bytes]
    return ["fft"] + list(dict.fromkeys(ways))


def _operand(pos, neg, size: int, operand: str):
    """What the product is handed (``--operand``) for the kernel's coefficients pos (d, n) and neg (d, n - 1) (None
    where causal): the kernel in time (pos where causal, the circulant column otherwise), or its spectrum."""
    from fairseq_tnn.ops import toeplitz
    if operand == "spectrum":
        return toeplitz.kernel_spectrum(pos, neg, size, layout="dbn")
    return pos if neg is None else toeplitz.circulant_column(pos, neg, size)


def _inputs(d: int, b: int, n: int, causal: bool, dtype, device, operand: str):
    """x and its output's gradient (d, b, n), the kernel's coefficients pos (d, n) and neg (d, n - 1) (None where
    causal), the product's operand (``_operand``), and the FFT size."""
    from fairseq_tnn.ops import toeplitz
    g = torch.Generator().manual_seed(0)
    size = toeplitz.next_fast_len(2 * n - 1)
    decay = torch.exp(-torch.arange(n) / (n / 4))
    pos = (torch.randn(d, n, generator=g) * decay / n ** 0.5).to(device)
    neg = None if causal else (torch.randn(d, n - 1, generator=g) * decay[1:] / n ** 0.5).to(device)
    x = torch.randn(d, b, n, generator=g).to(device=device, dtype=dtype)
    cot = torch.randn(d, b, n, generator=g).to(device=device, dtype=dtype)
    return x, cot, pos, neg, _operand(pos, neg, size, operand), size


def _product(way: str, causal: bool, operand: str) -> Callable:
    """The product of ``way`` on ``operand`` (``--operand``): "fft", or "direct/M/B", the direct one with
    ``ROWS_PER_PROGRAM`` M and ``LOAD_BYTES`` B (set at each call: its backward reads them too, within the call)."""
    from fairseq_tnn.ops import toeplitz, toeplitz_direct
    if way == "fft":
        if operand == "spectrum":
            return lambda x, s, size: toeplitz.fft_conv(x, s, size, layout="dbn")
        return lambda x, k, size: toeplitz.fft_conv(x, toeplitz.KernelRfft.apply(k, size), size, layout="dbn")
    rows, load_bytes = map(int, way.split("/")[1:])

    def direct(x, s, size):
        toeplitz_direct.ROWS_PER_PROGRAM, toeplitz_direct.LOAD_BYTES = rows, load_bytes
        if operand == "spectrum":
            return toeplitz_direct.direct_conv(x, s, size, causal)
        return toeplitz_direct.direct_toeplitz(x, s, causal)
    return direct


def _clock(device: str):
    """A function that times ``fn()`` in ms on ``device``."""
    def timed(fn) -> float:
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return timed


def _differences(way: str, x, cot, pos, neg, size, causal, operand: str) -> Dict[str, float]:
    """A direct way's output and the gradients of x and of the kernel's coefficients (through the operand, as a
    TNO's parameters get theirs) against the FFT's: max |direct - fft| / max |fft|."""
    results = []
    for product in ("fft", way):
        leaves = [t.detach().clone().requires_grad_() for t in (x, pos, neg) if t is not None]
        handed = _operand(leaves[1], leaves[2] if neg is not None else None, size, operand)
        y = _product(product, causal, operand)(leaves[0], handed, size)
        gx, *gk = torch.autograd.grad(y, leaves, cot)
        results.append((y, gx, torch.cat([g.flatten() for g in gk])))
    return {name: ((direct.double() - fft.double()).abs().max() / fft.double().abs().max()).item()
            for name, fft, direct in zip(("output", "x_grad", "kernel_grad"), *results)}


def measure(label: str, d: int, b: int, n: int, causal: bool, dtype, device: str, rounds: int,
            ways: List[str], operand: str = "kernel") -> Dict:
    x, cot, pos, neg, handed, size = _inputs(d, b, n, causal, dtype, device, operand)
    timed = _clock(device)
    row: Dict = {"shape": label, "channels": d, "batch": b, "n": n, "causal": causal, "size": size}
    xg, hg = x.detach().clone().requires_grad_(), handed.detach().clone().requires_grad_()
    steps = {}
    for way in ways:
        product = _product(way, causal, operand)
        steps[way] = {
            "forward": lambda product=product: product(x, handed, size),
            "forward_backward": lambda product=product: torch.autograd.grad(product(xg, hg, size), (xg, hg), cot),
        }
        t = time.perf_counter()
        steps[way]["forward_backward"]()  # the first call: Triton's compilation for the direct way
        if device == "cuda":
            torch.cuda.synchronize()
        row.setdefault("first_call_s", {})[way] = time.perf_counter() - t
    row.update(interleaved_rounds(steps, timed, rounds))
    row["fft_over_direct"] = {way: {part: row["fft"][part]["median_ms"] / row[way][part]["median_ms"]
                                    for part in ("forward", "forward_backward")} for way in ways[1:]}
    row["differences"] = {way: _differences(way, x, cot, pos, neg, size, causal, operand) for way in ways[1:]}
    return row


def markdown(result: Dict) -> str:
    out = [f"# The Toeplitz product by FFT and by direct summation ({result['dtype']}, {result['device_name']}, "
           f"handed the {OPERANDS[result['operand']]})", "",
           f"torch {result['torch']}, triton {result['triton']}; median of {result['rounds']} interleaved rounds, ms; "
           "`python benchmarks/toeplitz_direct.py`", "",
           "| shape | way (direct/M/B: M rows a program, B bytes a load) | forward / with backward | FFT / this way | "
           "this - FFT: output, x grad, kernel grad |",
           "|---|---|---|---|---|"]
    for r in result["rows"]:
        for way in result["ways"]:
            cells = f"{r[way]['forward']['median_ms']:.3f} / {r[way]['forward_backward']['median_ms']:.3f}"
            ratio = r["fft_over_direct"].get(way)
            diff = r["differences"].get(way)
            out.append(f"| {r['shape']} | {way} | {cells} | "
                       + (f"{ratio['forward']:.2f} / {ratio['forward_backward']:.2f} | " if ratio else "1 | ")
                       + (f"{diff['output']:.1e}, {diff['x_grad']:.1e}, {diff['kernel_grad']:.1e} |" if diff else "- |"))
    return "\n".join(out) + "\n"


def main(argv=None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test; on the CPU under TRITON_INTERPRET=1)")
    p.add_argument("--rows-per-program", type=int, nargs="+", metavar="M",
                   help="the direct product's rows per program (toeplitz_direct.ROWS_PER_PROGRAM), each a way of its "
                        "own at the module's LOAD_BYTES (default 32 64; powers of 2 from 16 to 128)")
    p.add_argument("--load-bytes", type=int, nargs="+", metavar="B",
                   help="the bytes of T's tile a thread loads at once (toeplitz_direct.LOAD_BYTES: 2, 4, 8 or 16, "
                        "from 1, 2, 4 or 8 shifted copies of the fp16 layout), each a way of its own at the "
                        "module's ROWS_PER_PROGRAM (default 2 8 16)")
    p.add_argument("--module-way", action="store_true",
                   help="the direct product only as the module runs it (its ROWS_PER_PROGRAM and LOAD_BYTES), beside "
                        "the FFT's; not with --rows-per-program or --load-bytes")
    p.add_argument("--operand", choices=sorted(OPERANDS), default="kernel",
                   help="what the product is handed: kernel (in time, as TNN's and causal FD-TNN's stacks hand it; "
                        "the FFT way transforms it) or spectrum (as a bidirectional FD-TNN hands it; the direct way "
                        "takes it back by an irfft)")
    add_device_options(p, rounds=20)
    add_out_options(p, "results/toeplitz-direct")
    a = p.parse_args(argv)
    name, dtype = checked_dtype(p, a)
    from fairseq_tnn.ops import toeplitz_direct
    if a.module_way:
        if a.rows_per_program or a.load_bytes:
            p.error("--module-way times the module's own rows and load width: not with --rows-per-program or "
                    "--load-bytes")
        a.rows_per_program, a.load_bytes = [toeplitz_direct.ROWS_PER_PROGRAM], []
    a.rows_per_program = [32, 64] if a.rows_per_program is None else a.rows_per_program
    a.load_bytes = [2, 8, 16] if a.load_bytes is None else a.load_bytes
    bad = [m for m in a.rows_per_program if m not in (16, 32, 64, 128)]
    if bad:
        p.error(f"--rows-per-program={' '.join(map(str, bad))}: each must be 16, 32, 64 or 128")
    bad = [b for b in a.load_bytes if b not in toeplitz_direct.LOAD_BYTES_CHOICES]
    if bad:
        p.error(f"--load-bytes={' '.join(map(str, bad))}: each must be {spelled(toeplitz_direct.LOAD_BYTES_CHOICES)}")
    probe = torch.empty(0, device=a.device, dtype=dtype)
    if not toeplitz_direct.supports(probe):
        p.error(f"--device={a.device} --dtype={name}: the direct product needs Triton and a CUDA device, or the CPU "
                f"under Triton's interpreter (TRITON_INTERPRET=1); Triton is "
                f"{'there' if toeplitz_direct.AVAILABLE else 'not installed'}")
    refuse_overwrite(p, a, "toeplitz_direct.json")
    os.makedirs(a.out, exist_ok=True)
    ways = _ways(a.rows_per_program, a.load_bytes)
    default = toeplitz_direct.ROWS_PER_PROGRAM, toeplitz_direct.LOAD_BYTES
    try:
        rows = [measure(label, d, max(1, b // a.batch_scale), n, causal, dtype, a.device, a.rounds, ways, a.operand)
                for label, d, b, n, causal in (QUICK_SHAPES if a.quick else SHAPES)]
    finally:
        toeplitz_direct.ROWS_PER_PROGRAM, toeplitz_direct.LOAD_BYTES = default
    result = {"rows": rows, "ways": ways, "operand": a.operand, **triton_run(a, name)}
    md = markdown(result)
    write_results(a.out, "toeplitz_direct", result, md)
    print(md)
    return result


if __name__ == "__main__":
    main()
