"""The language models' loss two ways side by side on one GPU: fairseq's (``log_softmax`` in fp32, then ``nll_loss``:
what ``--criterion cross_entropy`` and fairseq's ``masked_lm`` without apex compute) and the fused one of
``--criterion tnn_cross_entropy`` and ``tnn_masked_lm`` (``fairseq_tnn/ops/cross_entropy.py``: one pass over the
logits each way), at the
wt103 recipes' shapes: the rows a causal 8 x 512 update scores, and the 15% of a masked 16 x 512 one, against the
50,264-symbol dictionary.

    python benchmarks/cross_entropy.py --out results/cross-entropy            # on a CUDA GPU (some 20 s)
    TRITON_INTERPRET=1 python benchmarks/cross_entropy.py --quick --device cpu --out /tmp/ce   # the test's smoke run

For each shape (logits in ``--dtype``, fp16 by default on CUDA, a few rows padding), each way's forward and forward
with backward in interleaved rounds, timed by CUDA events (the CPU's clock on the CPU), their medians and least
times, the ratio fairseq / fused of the medians, the memory each way's forward and backward allocates beyond the
logits at its peak (CUDA), and the fused way's loss and gradient against fairseq's. Writes ``cross_entropy.json``
and ``cross_entropy.md``.
"""
import argparse
import os
import sys
from typing import Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.measure import (add_device_options, add_out_options, checked_dtype, interleaved_rounds,  # noqa: E402
                                refuse_overwrite, triton_run, write_results)
from benchmarks.toeplitz_direct import _clock  # noqa: E402

VOCAB = 50264  # Wikitext-103's dictionary (GPT-2 BPE), fairseq's 4 specials included (benchmarks/trainer.py)
PAD = 1
# (label, rows scored, vocabulary)
SHAPES = [("causal 8 x 512", 8 * 512, VOCAB), ("masked 16 x 512, 15% scored", round(0.15 * 16 * 512), VOCAB)]
QUICK_SHAPES = [("quick 33 rows", 33, 300)]
WAYS = ("fairseq", "fused")


def _inputs(rows: int, vocab: int, dtype, device: str):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device=device, dtype=dtype)
    target = torch.randint(4, vocab, (rows,), generator=g)
    target[-max(1, rows // 50):] = PAD  # a few padding rows, as a causal batch's last sequence can have
    return logits, target.to(device)


def _loss(way: str):
    from fairseq_tnn.ops import cross_entropy
    return cross_entropy.reference_cross_entropy_sum if way == "fairseq" else cross_entropy.cross_entropy_sum


def _peak_mib(device: str, fn) -> float:
    """MiB that ``fn()`` allocates at its peak beyond what was allocated before it (None off CUDA)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


def measure(label: str, rows: int, vocab: int, dtype, device: str, rounds: int) -> Dict:
    logits, target = _inputs(rows, vocab, dtype, device)
    leaf = logits.detach().clone().requires_grad_()
    timed = _clock(device)
    steps = {way: {"forward": lambda f=_loss(way): f(logits, target, PAD),
                   "forward_backward": lambda f=_loss(way): torch.autograd.grad(f(leaf, target, PAD), leaf)}
             for way in WAYS}
    for way in WAYS:
        steps[way]["forward_backward"]()  # the first call: Triton's compilation for the fused way
    row: Dict = {"shape": label, "rows": rows, "vocab": vocab, **interleaved_rounds(steps, timed, rounds)}
    for way in WAYS:
        row[way]["peak_mib"] = _peak_mib(device, steps[way]["forward_backward"])
    row["fairseq_over_fused"] = {part: row["fairseq"][part]["median_ms"] / row["fused"][part]["median_ms"]
                                 for part in ("forward", "forward_backward")}
    ref_loss, (ref_grad,) = steps["fairseq"]["forward"](), steps["fairseq"]["forward_backward"]()
    loss, (grad,) = steps["fused"]["forward"](), steps["fused"]["forward_backward"]()
    row["differences"] = {
        "loss": (abs(loss.double() - ref_loss.double()) / abs(ref_loss.double())).item(),
        "grad": ((grad.double() - ref_grad.double()).abs().max() / ref_grad.double().abs().max()).item()}
    return row


def markdown(result: Dict) -> str:
    out = [f"# The loss, fairseq's and fused ({result['dtype']}, {result['device_name']})", "",
           f"torch {result['torch']}, triton {result['triton']}; median of {result['rounds']} interleaved rounds, ms; "
           "`python benchmarks/cross_entropy.py`", "",
           "| shape | way | forward / with backward | fairseq / fused | peak MiB beyond the logits | fused - fairseq: "
           "loss, gradient |", "|---|---|---|---|---:|---|"]
    for r in result["rows"]:
        for way in WAYS:
            cells = f"{r[way]['forward']['median_ms']:.3f} / {r[way]['forward_backward']['median_ms']:.3f}"
            ratio = r["fairseq_over_fused"]
            peak = "-" if r[way]["peak_mib"] is None else f"{r[way]['peak_mib']:,.0f}"
            out.append(f"| {r['shape']} | {way} | {cells} | "
                       + (f"{ratio['forward']:.2f} / {ratio['forward_backward']:.2f}" if way == "fused" else "1")
                       + f" | {peak} | "
                       + (f"{r['differences']['loss']:.1e}, {r['differences']['grad']:.1e} |" if way == "fused"
                          else "- |"))
    return "\n".join(out) + "\n"


def main(argv=None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a tiny shape (a smoke test; on the CPU under TRITON_INTERPRET=1)")
    add_device_options(p, rounds=20)
    add_out_options(p, "results/cross-entropy")
    a = p.parse_args(argv)
    name, dtype = checked_dtype(p, a)
    from fairseq_tnn.ops import cross_entropy, toeplitz_direct
    kept = cross_entropy.CPU_INTERPRETED
    cross_entropy.CPU_INTERPRETED = a.device == "cpu"  # the CPU only under the interpreter (checked next)
    try:
        if not cross_entropy.supports(torch.empty(0, device=a.device, dtype=dtype)):
            p.error(f"--device={a.device} --dtype={name}: the fused loss needs Triton and a CUDA device, or the CPU "
                    f"under Triton's interpreter (TRITON_INTERPRET=1); Triton is "
                    f"{'there' if toeplitz_direct.AVAILABLE else 'not installed'}")
        refuse_overwrite(p, a, "cross_entropy.json")
        os.makedirs(a.out, exist_ok=True)
        rows = [measure(label, max(1, r // a.batch_scale), v, dtype, a.device, a.rounds)
                for label, r, v in (QUICK_SHAPES if a.quick else SHAPES)]
    finally:
        cross_entropy.CPU_INTERPRETED = kept
    result = {"rows": rows, **triton_run(a, name)}
    md = markdown(result)
    write_results(a.out, "cross_entropy", result, md)
    print(md)
    return result


if __name__ == "__main__":
    main()
