"""The bytes the FFT Toeplitz product moves per element of its input, by the operations it dispatches (issue 39: on a
GPU the product is bound by the bytes it moves, and no GPU is needed to count them).

    python benchmarks/fft_bytes.py --out results/fft-bytes            # the table of docs/performance.md (~10 s)

``ByteCounter`` (a ``TorchDispatchMode``) adds, for each operation that is not a view, the bytes of the tensors it
reads (its tensor arguments) and writes (its outputs; a fill or a zeroed buffer writes only), plus, for a
complex-to-real FFT, the copy of its input ATen makes on CUDA before cuFFT runs (cuFFT may overwrite it), which the
CPU does not show. A composite operation counts once: torch's padding (``constant_pad_nd``) is one operation, though
it zeroes a buffer and copies into it, so the count cannot show what the one-pass padded FFT (``padded_rfft``)
saves. An FFT counts its input and output once, whatever passes cuFFT makes.

For the product of each shape (the TNOs' channels and the paper's per-GPU batches, half-precision x as ``--fp16``
trains), with x's output gradient: the forward alone and forward with backward (input and spectrum gradients), three
ways side by side: the reference (``fast.references()``: x cast, then padded by torch), the rows one by one through
real FFTs (the CPU's and an eager product's path), and two rows as one complex FFT where ``pair_dim`` pairs them as a
GPU does in a forward a CUDA graph records (forced here, eagerly, so that the operations are counted: from
``PAIRED_FORWARD_MIN_ROWS`` rows per kernel; the backward counted so is the eager one, whose spectrum-sized operations
inductor fuses where a GPU pairs it, compiled). Writes ``fft_bytes.json`` and ``fft_bytes.md``.
"""
import argparse
import contextlib
import os
import sys
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.measure import add_out_options, refuse_overwrite, write_results  # noqa: E402

# (label, channels d1, batch, n, causal): the causal TNO at the paper's 8 x 512, the bidirectional at 16 x 512, 4 x 2048
SHAPES = [("causal 8 x 512", 1536, 8, 512, True), ("bidirectional 16 x 512", 2304, 16, 512, False),
          ("bidirectional 4 x 2048", 2304, 4, 2048, False)]
QUICK_SHAPES = [("causal 2 x 32", 8, 2, 32, True), ("bidirectional 2 x 32", 8, 2, 32, False)]
WAYS = ["reference", "real", "paired"]
_WRITE_ONLY = ("zeros", "zero_", "fill_", "ones", "full")


def _bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class ByteCounter(TorchDispatchMode):
    """The bytes the operations dispatched in its scope read and write (see the module's docstring)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in ("empty", "empty_strided"):
            return out
        written = sum(_bytes(t) for t in torch.utils._pytree.tree_leaves(out))
        read = 0 if name in _WRITE_ONLY else sum(_bytes(t) for t in torch.utils._pytree.tree_leaves((args, kwargs)))
        if name == "_fft_c2r":
            read += 2 * _bytes(args[0])  # ATen's copy of the input on CUDA: read and written once more
        self.total += read + written
        return out


def count(d: int, b: int, n: int, causal: bool, way: str) -> Dict[str, float]:
    """Bytes per element of x (d, b, n), fp16, of the product's forward and of its forward and backward."""
    from fairseq_tnn.ops import fast, toeplitz
    saved = toeplitz.PAIRED_FFT_DEVICES, toeplitz.PAIR_EAGERLY
    paired = way == "paired"
    toeplitz.PAIRED_FFT_DEVICES, toeplitz.PAIR_EAGERLY = frozenset({"cpu"} if paired else ()), paired
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(d, b, n, generator=g).half().requires_grad_()
        pos = torch.randn(d, n, generator=g) / n
        neg = None if causal else torch.randn(d, n - 1, generator=g) / n
        cot = torch.randn(d, b, n, generator=g).half()
        size = toeplitz.next_fast_len(2 * n - 1)
        with fast.references() if way == "reference" else contextlib.nullcontext():
            spectrum = toeplitz.kernel_spectrum(pos, neg, size, layout="dbn").detach().requires_grad_()
            # once uncounted: the constants the fast paths keep (fast.constant) are made then, not counted
            torch.autograd.grad(toeplitz.fft_conv(x, spectrum, size, layout="dbn"), (x, spectrum), cot)
            with ByteCounter() as counter:
                y = toeplitz.fft_conv(x, spectrum, size, layout="dbn")
                forward = counter.total
                torch.autograd.grad(y, (x, spectrum), cot)
        elements = d * b * n
        return {"forward": forward / elements, "forward_backward": counter.total / elements}
    finally:
        toeplitz.PAIRED_FFT_DEVICES, toeplitz.PAIR_EAGERLY = saved


def run(shapes) -> Dict:
    rows: List[Dict] = []
    for label, d, b, n, causal in shapes:
        rows.append({"shape": label, "channels": d, **{way: count(d, b, n, causal, way) for way in WAYS}})
    return {"rows": rows, "torch": torch.__version__}


def markdown(result: Dict) -> str:
    out = ["# Bytes the FFT Toeplitz product moves per element of x (fp16 x, by the operations dispatched)", "",
           f"torch {result['torch']}; `python benchmarks/fft_bytes.py`", "",
           "| shape | channels | reference: forward / with backward | real FFTs | paired rows |",
           "|---|---:|---|---|---|"]
    for r in result["rows"]:
        cells = [f"{r[w]['forward']:.1f} / {r[w]['forward_backward']:.1f}" for w in WAYS]
        out.append(f"| {r['shape']} | {r['channels']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    add_out_options(p, "results/fft-bytes")
    a = p.parse_args(argv)
    refuse_overwrite(p, a, "fft_bytes.json")
    os.makedirs(a.out, exist_ok=True)
    result = run(QUICK_SHAPES if a.quick else SHAPES)
    md = markdown(result)
    write_results(a.out, "fft_bytes", result, md)
    print(md)
    return result


if __name__ == "__main__":
    main()
