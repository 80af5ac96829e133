"""SKI-TNO's band (its m-tap depthwise convolution) applied each way the operator can, side by side in one process:
the banded GEMM over blocks of 16, 32, 64 and 128 positions (``method="gemm"``, which copies each block's window of
the input, about (B + m - 1) / B times the input for blocks of B), torch's depthwise convolution
(``method="conv1d"``) and the direct summation in Triton kernels (``method="triton"``, ``ops/band_direct.py``; on a
GPU only: Triton's interpreter, the CPU's way to run them, takes seconds a step); then the whole SKI-TNO with each
method, the direct band's twice: with the low rank in its kernels (``ski.FUSE_LOWRANK``, the default) and after them. Which one a device type runs is
``fairseq_tnn.ops.ski.BAND_METHOD`` (the GEMM with blocks of 16 unless it says otherwise; the convolution on a GPU
since the fifth GPU run), decided by this measurement.

    python benchmarks/ski_band.py --device cuda --compiled --out $OUT/ski-band   # on a GPU, fp16 (about a minute)
    python benchmarks/ski_band.py --device cpu --batch-scale 4 --out results/ski-band   # the CPU, fp32

At ski_tnn_mlm_wt103's width (d1 = 3 x 768 channels, m = 17 taps, r = 32) and the paper's masked per-GPU shapes
(16 x 512 and 4 x 2048), channel-major as the layers hand it the input, for each variant: the time of a forward and
backward (input and taps' gradients) with the device synchronised around it, and per step of 20 queued back to back
(on a GPU, the kernels' throughput with the launches hidden), median of interleaved rounds (``--compiled``: at
the last shape the whole SKI-TNO also compiled with each method, the GPU recipe's path, where inductor fuses the GEMM's
window copies); the operations it
dispatches (``benchmarks/opcount.py``'s count); on a GPU its peak memory above the input's; and the largest
difference of its output and gradients from the 16-block GEMM's, relative to their largest value. ``--batch-scale``
divides the batches (a short CPU run; the counts do not depend on it, but for a batch of one, where the convolution's
taps need no copy); ``--quick``: d1 = 48 and short sequences (a smoke test, seconds). Writes ``ski_band.json`` and
``ski_band.md``.
"""
import argparse
import json
import os
import statistics
import sys
from typing import Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.measure import (add_device_options, add_out_options, checked_dtype, refuse_overwrite,  # noqa: E402
                                write_results)
from benchmarks.trainer import _sync, queued_ms as _ms  # noqa: E402

# (label, batch, n) at d1 channels: the masked presets' per-GPU shapes
SHAPES = [("masked 16 x 512", 16, 512), ("masked 4 x 2048", 4, 2048)]
QUICK_SHAPES = [("quick 4 x 64", 4, 64), ("quick 2 x 200", 2, 200)]
D1, QUICK_D1, TAPS, RANK, LAMBDA = 3 * 768, 48, 17, 32, 0.99
# (label, band_conv's method, block)
BANDS = [("GEMM, blocks of 16", "gemm", 16), ("GEMM, blocks of 32", "gemm", 32), ("GEMM, blocks of 64", "gemm", 64),
         ("GEMM, blocks of 128", "gemm", 128), ("depthwise conv1d", "conv1d", None),
         ("direct, Triton, blocks of 256", "triton", 256), ("direct, Triton, blocks of 1,024", "triton", 1024)]
# the whole SKI-TNO's rows with the direct band: (label, ``ski.FUSE_LOWRANK``)
DIRECT_VARIANTS = [("band by triton, low rank fused", True), ("band by triton, low rank after", False)]
QUEUED = 20
WARMUP = 2


def _rel_diff(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    return max(float((p.double() - q.double()).abs().max() / q.double().abs().max().clamp_min(1e-30))
               for p, q in zip(a, b))


def measure(steps: Dict[str, Callable[[], List[torch.Tensor]]], device: str, rounds: int, reference: str,
            compiled=()) -> Dict:
    """For each named step (forward and backward, returning output and gradients): operations (eager ones: not for
    the steps named in ``compiled``, None there), times, peak memory and the largest relative difference from
    ``reference``'s results."""
    from benchmarks.opcount import count
    out = {}
    results = {name: step() for name, step in steps.items()}  # builds what each caches (constants)
    for name, step in steps.items():
        ops = None if name in compiled else count(step)[1].total
        out[name] = {"ops": ops, "sync_ms": [], "queued_ms": [],
                     "rel_diff": _rel_diff(results[name], results[reference])}
        if device == "cuda":
            _sync(device)
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            _sync(device)
            out[name]["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    del results
    names = list(steps)
    for r in range(WARMUP + rounds):
        for name in (names if r % 2 else names[::-1]):
            sync_ms, queued_ms = _ms(steps[name], device, 1), _ms(steps[name], device, QUEUED)
            if r >= WARMUP:
                out[name]["sync_ms"].append(sync_ms)
                out[name]["queued_ms"].append(queued_ms)
    for v in out.values():
        v["median_sync_ms"] = statistics.median(v["sync_ms"])
        v["median_queued_ms"] = statistics.median(v["queued_ms"])
    return out


def run_shape(d1: int, batch: int, n: int, device: str, dtype, rounds: int, compiled: bool = False) -> Dict:
    """The band's variants alone and the whole SKI-TNO with each method at one shape; with ``compiled``, the whole
    SKI-TNO also ``torch.compile``d with each method (a compilation each)."""
    from fairseq_tnn.modules import build_tno
    from fairseq_tnn.ops import band_direct, ski
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(d1, batch, n, generator=g).to(device, dtype).requires_grad_()
    grad = torch.randn(d1, batch, n, generator=g).to(device, dtype)
    taps = (torch.randn(d1, TAPS, generator=g) / TAPS ** 0.5).to(device, dtype).requires_grad_()

    def band_step(method, block):
        def step():
            x.grad = taps.grad = None
            kept = band_direct.BLOCK_MAX
            if method == "triton":  # the direct band's positions a program (``BLOCK_MAX``; the GEMM's block otherwise)
                band_direct.BLOCK_MAX = block
            try:
                y = ski.band_conv(x, taps, block=block, method=method)
                y.backward(grad)  # its blocks too
            finally:
                band_direct.BLOCK_MAX = kept
            return [y.detach(), x.grad, taps.grad]
        return step

    # the direct band where its kernels run (a GPU; on the CPU only where a test lets the interpreter run them, and
    # not compiled there: the interpreter's kernels are no custom operators)
    methods = [m for m in ski.BAND_METHODS if m != "triton" or band_direct.supports(x, taps)]
    compilable = [m for m in methods if m != "triton" or band_direct.TRITON_OPS]
    bands = measure({label: band_step(method, block) for label, method, block in BANDS if method in methods}, device,
                    rounds, BANDS[0][0])
    torch.manual_seed(0)
    tno = build_tno("ski", d1, False, ski_rank=RANK, ski_taps=TAPS, ski_warp_decay=LAMBDA, training_length=n)
    tno = tno.to(device, dtype)
    with torch.no_grad():  # knots away from zero ('mean' starts them there), so the low rank takes part
        tno.knots.normal_(0.0, RANK ** -0.5)

    def tno_step(method, fuse, forward=tno):
        def step():
            tno.zero_grad(set_to_none=True)
            x.grad = None
            saved, saved_fuse = ski.BAND_METHOD.get(device), ski.FUSE_LOWRANK
            ski.BAND_METHOD[device], ski.FUSE_LOWRANK = method, fuse
            try:
                y = forward(x, layout="dbn")
            finally:
                ski.FUSE_LOWRANK = saved_fuse
                if saved is None:
                    del ski.BAND_METHOD[device]
                else:
                    ski.BAND_METHOD[device] = saved
            y.backward(grad)
            return [y.detach(), x.grad, tno.conv_weight.grad, tno.knots.grad]
        return step

    # the direct band with the low rank in its kernels (``ski.FUSE_LOWRANK``) and after them
    variants = [(f"band by {m}", m, False) for m in methods if m != "triton"]
    if "triton" in methods:
        variants += [(label, "triton", fuse) for label, fuse in DIRECT_VARIANTS]
    steps = {f"SKI-TNO, {label}": tno_step(m, fuse) for label, m, fuse in variants}
    names = []
    for label, m, fuse in variants if compiled else ():  # one torch.compile each, tracing the method it names
        if m in compilable:
            names.append(f"SKI-TNO compiled, {label}")
            steps[names[-1]] = tno_step(m, fuse, torch.compile(tno, fullgraph=True))
    tnos = measure(steps, device, rounds, f"SKI-TNO, band by {ski.BAND_METHODS[0]}", names)
    return {"bands": bands, "tnos": tnos}


# The whole SKI-TNO's eager rows the choice compares (``band_choice``), by the band method and low rank they run
CHOICES = {"SKI-TNO, band by conv1d": ("conv1d", None),
           **{f"SKI-TNO, {label}": ("triton", "fused" if fuse else "after") for label, fuse in DIRECT_VARIANTS}}
SAME = 2e-2  # the largest relative difference from the first row a variant may have and still be chosen (16 bits)


def band_choice(rows: List[Dict]) -> Optional[Dict]:
    """The band a GPU's SKI-TNN should train with, by these rows' whole eager SKI-TNOs (None without the direct band's
    rows, or with fewer than both shapes measured: a run cut short): the direct band (with the low rank fused or after
    it, the faster of the two in all) where it is faster than the convolution at every shape, queued, and computes the
    same (``SAME``); the convolution otherwise. As gpu_run.sh's targets call takes it: SKI_BAND and SKI_LOWRANK."""
    if len(rows) < len(SHAPES) or not all(name in r["tnos"] for r in rows for name in CHOICES):
        return None
    queued = {name: [r["tnos"][name]["median_queued_ms"] for r in rows] for name in CHOICES}
    conv1d, *direct = CHOICES
    faster = [name for name in direct if all(a < b for a, b in zip(queued[name], queued[conv1d]))
              and all(r["tnos"][name]["rel_diff"] < SAME for r in rows)]
    best = min(faster, key=lambda name: sum(queued[name])) if faster else conv1d
    band, lowrank = CHOICES[best]
    return {"ski_band": band, "ski_lowrank": lowrank, "row": best, "queued_ms": queued,
            "shapes": [f"{r['batch']} x {r['n']}" for r in rows]}


def choice_line(choice: Optional[Dict], tests_passed: bool = True) -> str:
    """The line that tells the next call how to run: the environment of ``bash benchmarks/gpu_run.sh targets``."""
    if choice is None:
        return "SKI band: no direct band's rows at both shapes; the targets call keeps BAND_METHOD's"
    if choice["ski_band"] == "triton" and not tests_passed:
        return "SKI band: the direct band's tests failed; the targets call keeps BAND_METHOD's"
    env = f"SKI_BAND={choice['ski_band']}" + (f" SKI_LOWRANK={choice['ski_lowrank']}" if choice["ski_lowrank"] else "")
    times = "; ".join(f"{name.split(', ', 1)[1]}: " + ", ".join(f"{t:.3f}" for t in ts)
                      for name, ts in choice["queued_ms"].items())
    return (f"SKI band: {env} bash benchmarks/gpu_run.sh targets (the whole SKI-TNO queued, ms at "
            f"{', '.join(choice['shapes'])}: {times})")


def markdown(result: Dict) -> str:
    meta = result["meta"]
    out = [f"# SKI-TNO's band, each way ({meta['machine']}; torch {meta['torch']})", "",
           f"{meta['dtype']}, d1 = {meta['d1']}, m = {TAPS} taps, r = {RANK}; batches divided by {meta['batch_scale']}; forward "
           f"and backward (input and taps' gradients); median of {meta['rounds']} interleaved rounds; *synchronised*: "
           f"one step with the device synchronised around it; *queued*: per step of {QUEUED} back to back; rel. diff: "
           f"the largest difference of output and gradients from the first row's, relative to their largest value; "
           f"the band methods as `BAND_METHOD` had them: {meta['band_method']}; `{meta['command']}`.", "",
           "| shape | variant | ms synchronised | ms queued | ops | peak MiB | rel. diff |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        for part in ("bands", "tnos"):
            for name, v in r[part].items():
                peak = f"{v['peak_mib']:.0f}" if "peak_mib" in v else "-"
                ops = "-" if v["ops"] is None else v["ops"]
                out.append(f"| {r['label']} ({r['batch']} x {r['n']}) | {name} | {v['median_sync_ms']:.3f} | "
                           f"{v['median_queued_ms']:.3f} | {ops} | {peak} | {v['rel_diff']:.1e} |")
    if result.get("choice"):
        out += ["", choice_line(result["choice"])]
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_options(p, rounds=7)
    p.add_argument("--quick", action="store_true", help="d1 = 48 and short sequences (a smoke test, seconds)")
    p.add_argument("--compiled", action="store_true",
                   help="at the last shape, the whole SKI-TNO compiled with each method as well (the GPU recipe's path; "
                        "two compilations)")
    add_out_options(p, "results/ski-band")
    p.add_argument("--choice", metavar="JSON",
                   help="only print the band the targets call should train with, from this ski_band.json of a GPU run "
                        "(band_choice), and exit")
    p.add_argument("--tests-failed", action="store_true",
                   help="with --choice: the direct band's tests failed, so it is not chosen")
    a = p.parse_args(argv)
    if a.choice:
        if not os.path.isfile(a.choice):
            p.error(f"--choice {a.choice}: no such file (a ski_band.json)")
        with open(a.choice) as f:
            print(choice_line(band_choice(json.load(f)["rows"]), not a.tests_failed))
        return
    dtype_name, dtype = checked_dtype(p, a)
    refuse_overwrite(p, a, "ski_band.json")
    os.makedirs(a.out, exist_ok=True)
    from benchmarks.measure import _machine
    from fairseq_tnn.ops import ski
    d1 = QUICK_D1 if a.quick else D1
    shapes = QUICK_SHAPES if a.quick else SHAPES
    meta = {"device": a.device, "dtype": dtype_name, "d1": d1, "quick": a.quick, "rounds": a.rounds, "batch_scale": a.batch_scale,
            "torch": torch.__version__, "band_method": dict(ski.BAND_METHOD),
            "machine": torch.cuda.get_device_name(0) if a.device == "cuda" else _machine(),
            "command": "python benchmarks/ski_band.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    rows: List[Dict] = []
    for label, batch, n in shapes:
        batch = max(1, batch // a.batch_scale)
        compiled = a.compiled and (label, n) == (shapes[-1][0], shapes[-1][2])
        row = {"label": label, "batch": batch, "n": n, **run_shape(d1, batch, n, a.device, dtype, a.rounds, compiled)}
        rows.append(row)
        for part in ("bands", "tnos"):
            for name, v in row[part].items():
                print(f"{label:<16} {name:<26} {v['median_sync_ms']:8.3f} ms synchronised, {v['median_queued_ms']:8.3f} "
                      f"ms queued, {v['ops'] or '-':>3} ops, rel. diff {v['rel_diff']:.1e}", flush=True)
        if a.device == "cuda":
            torch.cuda.empty_cache()
        result = {"meta": meta, "rows": rows, "choice": band_choice(rows)}
        write_results(a.out, "ski_band", result, markdown(result))
    print(markdown({"meta": meta, "rows": rows}))
    print(choice_line(result["choice"]))


if __name__ == "__main__":
    main()
