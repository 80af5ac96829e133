"""The output layer's GEMMs two ways side by side: ``F.linear`` over the vocabulary as it is, and ``vocab_linear``
over the next multiple of 8 (``fairseq_tnn/ops/logits.py``), at the wt103 recipes' shapes with the masked recipes'
odd dictionary (50,264 symbols and ``<mask>``): the 15% of a masked 16 x 512 update's tokens at width 768, and a
causal 8 x 512 update's 4,096 rows at width 512 (a causal model with a dictionary of that size).

    python benchmarks/vocab_linear.py --out results/vocab-linear      # on a CUDA GPU (some 10 s)
    python benchmarks/vocab_linear.py --quick --device cpu --out /tmp/vl   # the test's smoke run

Each way's forward and forward with backward (the features' and the weight's gradients), interleaved rounds, timed
by CUDA events (the CPU's clock on the CPU), their medians, the ratio plain / padded, and the padded way's logits and
gradients against the plain way's. On the CPU the padding is asked for (``ALIGN``), which it is not by default.
Writes ``vocab_linear.json`` and ``vocab_linear.md``.
"""
import argparse
import os
import sys
from typing import Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.measure import (add_device_options, add_out_options, checked_dtype, interleaved_rounds,  # noqa: E402
                                refuse_overwrite, write_results)
from benchmarks.toeplitz_direct import _clock  # noqa: E402

VOCAB = 50264 + 1  # the GPT-2 dictionary with fairseq's 4 specials (benchmarks/trainer.py), and the masked LM's <mask>
# (label, rows scored, width)
SHAPES = [("masked 16 x 512, 15% scored", round(0.15 * 16 * 512), 768), ("causal 8 x 512", 8 * 512, 512)]
QUICK_SHAPES = [("quick 300 rows", 300, 32)]
QUICK_VOCAB = 301
WAYS = ("plain", "padded")


def _way(way: str):
    from fairseq_tnn.ops.logits import vocab_linear
    return F.linear if way == "plain" else vocab_linear


def measure(label: str, rows: int, dim: int, vocab: int, dtype, device: str, rounds: int) -> Dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, dim, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(vocab, dim, generator=g) * dim ** -0.5).to(device=device, dtype=dtype)
    cot = torch.randn(rows, vocab, generator=g).to(device=device, dtype=dtype)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    timed = _clock(device)
    steps = {way: {"forward": lambda f=_way(way): f(x, w),
                   "forward_backward": lambda f=_way(way): torch.autograd.grad(f(xl, wl), (xl, wl), cot)}
             for way in WAYS}
    for way in WAYS:
        steps[way]["forward_backward"]()  # cuBLAS's first call of each shape
    timings = interleaved_rounds(steps, timed, rounds)
    row: Dict = {"shape": label, "rows": rows, "dim": dim, "vocab": vocab}
    for way in WAYS:
        row[way] = {part: t["median_ms"] for part, t in timings[way].items()}
    row["plain_over_padded"] = {part: row["plain"][part] / row["padded"][part] for part in ("forward", "forward_backward")}
    ref = (steps["plain"]["forward"](), *steps["plain"]["forward_backward"]())
    got = (steps["padded"]["forward"](), *steps["padded"]["forward_backward"]())
    row["differences"] = [((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
                          for a, b in zip(got, ref)]
    return row


def markdown(result: Dict) -> str:
    out = [f"# The output layer's GEMMs, plain and padded to a multiple of 8 ({result['dtype']}, "
           f"{result['device_name']})", "",
           f"torch {result['torch']}; median of {result['rounds']} interleaved rounds, ms; "
           "`python benchmarks/vocab_linear.py`", "",
           "| shape | rows x width x vocabulary | way | forward / with backward | plain / padded | padded - plain: "
           "logits, features' and weight's gradients |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        for way in WAYS:
            ratio = r["plain_over_padded"]
            out.append(f"| {r['shape']} | {r['rows']:,} x {r['dim']} x {r['vocab']:,} | {way} | "
                       f"{r[way]['forward']:.3f} / {r[way]['forward_backward']:.3f} | "
                       + (f"{ratio['forward']:.2f} / {ratio['forward_backward']:.2f} | "
                          + ", ".join(f"{d:.1e}" for d in r["differences"]) if way == "padded" else "1 | -")
                       + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny shape (a smoke test)")
    add_device_options(p, rounds=20)
    add_out_options(p, "results/vocab-linear")
    a = p.parse_args(argv)
    name, dtype = checked_dtype(p, a)
    refuse_overwrite(p, a, "vocab_linear.json")
    from fairseq_tnn.ops import logits
    os.makedirs(a.out, exist_ok=True)
    kept_align, kept_rows = dict(logits.ALIGN), logits.MIN_ROWS
    logits.ALIGN[a.device] = 8  # the CPU's too, where it is not asked for by default
    try:
        vocab = QUICK_VOCAB if a.quick else VOCAB
        rows = []
        for label, r, dim in (QUICK_SHAPES if a.quick else SHAPES):
            r = max(1, r // a.batch_scale)
            logits.MIN_ROWS = min(kept_rows, r)  # a scaled batch's rows padded for as the whole batch's are
            rows.append(measure(label, r, dim, vocab, dtype, a.device, a.rounds))
    finally:
        logits.ALIGN.clear()
        logits.ALIGN.update(kept_align)
        logits.MIN_ROWS = kept_rows
    result = {"rows": rows, "torch": torch.__version__, "dtype": name, "device": a.device, "rounds": a.rounds,
              "device_name": torch.cuda.get_device_name() if a.device == "cuda" else "CPU"}
    md = markdown(result)
    write_results(a.out, "vocab_linear", result, md)
    print(md)
    return result


if __name__ == "__main__":
    main()
