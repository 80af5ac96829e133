"""How many operations a model dispatches in eager mode: the count that sets an update's host time on a GPU.

Every operation eager PyTorch runs goes through the dispatcher, and on a GPU each one costs 10-25
microseconds of host time, whatever its size. ``OpCounter`` (a ``TorchDispatchMode``) counts the
operations that reach the kernels: views (reshape, transpose, slicing, ``detach``) and metadata queries
(``promote_types``, sizes) are left out, as they launch nothing. The count does not depend on the
device, the batch or the vocabulary, so it is taken on the CPU at batch 1, and it shows progress when no
GPU is at hand.

    python benchmarks/opcount.py --out results/opcount          # the table of docs/performance.md (~1 min)
    python benchmarks/opcount.py --quick --out /tmp/ops         # tiny models (a smoke test)

For each of the seven Wikitext-103 presets, fairseq's ``transformer_lm`` of the causal models' width and
depth and the no-mixing bound (the TNN model with its TNOs replaced by the identity), it counts the
operations of the training forward (model and criterion, as fairseq's task runs them), of forward and
backward, and of a whole ``Trainer.train_step`` (clipping, the optimizer and fairseq's bookkeeping
included), each beside the CPU time of one update at that size; and one TNO of the paper's width (d1 =
1536) alone, forward and backward. With the fast paths (``fairseq_tnn/ops/fast.py``) and with their
references, side by side in one run: ``--paths fast reference``. ``--precision bf16`` counts the models'
updates under ``--bf16-autocast`` (fp32 weights, every Linear's weights and inputs cast to bf16 as it runs; fp16's
half weights need a GPU for fairseq's FP16Optimizer), ``--precision bf16w`` under fairseq's own ``--bf16`` (bf16
weights and FP16Optimizer's fp32 master copy, per parameter on the CPU, flat on a GPU: ``fairseq_tnn/patches/bf16.py``).
Writes ``opcount.json`` and ``opcount.md``.
"""
import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.measure import KERNEL_KINDS, add_out_options, kernel_kind, refuse_overwrite, write_results  # noqa: E402

PRESETS = [("causal", "tnn_lm_wt103"), ("causal", "tnn_lm_wt103_rpe3"), ("causal", "fd_tnn_lm_wt103"),
           ("causal", "transformer_lm"), ("causal", "bound_identity"),
           ("masked", "tnn_mlm_wt103"), ("masked", "tnn_mlm_wt103_rpe3"), ("masked", "fd_tnn_mlm_wt103"),
           ("masked", "ski_tnn_mlm_wt103"), ("masked", "bound_identity")]
# one TNO alone: (label, --tno-type, causal, settings)
TNOS = [("TNN TNO (RPE 6), causal", "tnn", True, {}), ("TNN TNO (RPE 3), causal", "tnn", True, {"rpe_layers": 3}),
        ("FD-TNO (RPE 3), causal", "fd", True, {}), ("TNN TNO (RPE 6), bidirectional", "tnn", False, {}),
        ("FD-TNO (RPE 3), bidirectional", "fd", False, {}), ("SKI-TNO, bidirectional", "ski", False, {})]
PATHS = ("fast", "reference")
PRECISIONS = {"fp32": "fp32", "bf16": "bf16 autocast (--bf16-autocast)",
              "bf16w": "bf16 weights with an fp32 master copy (fairseq's --bf16; per parameter on the CPU)"}


def _is_metadata(func, out) -> bool:
    """Views (aliases of their input) and operations that neither return a tensor nor write one (dtype promotion,
    sizes); in-place multi-tensor operations (``_foreach_add_``, ``_fused_adam_``) return nothing and count."""
    if func.is_view:
        return True
    flat = out if isinstance(out, (tuple, list)) else (out,)
    return not any(isinstance(o, torch.Tensor) for o in flat) and not func._schema.is_mutable


# Operations that hand a tensor's values to the host, so that on a GPU the host waits until the device has computed
# them: a scalar read (``.item()``, ``bool()``, ``float()``, a tensor in an ``if``), the operations whose output size
# depends on the values, and indexing by a boolean mask (which finds the mask's nonzeros)
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
              "unique_consecutive", "equal"}
MASK_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}
TORCH_DIR = os.path.dirname(torch.__file__)


def _reads_values(func, args) -> bool:
    name = func.overloadpacket.__name__
    if name in HOST_READS:
        return True
    if name in MASK_INDEXING and len(args) > 1 and isinstance(args[1], (list, tuple)):
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return False


def _caller() -> str:
    """The innermost Python line outside torch and this file, as site-packages' or the repository's relative path."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH_DIR)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename.split("site-packages" + os.sep)[-1]
    if path.startswith(ROOT + os.sep):
        path = os.path.relpath(path, ROOT)
    return f"{path}:{frame.f_lineno}"


class OpCounter(TorchDispatchMode):
    """Counts the operations dispatched while active (on every thread autograd runs the backward on), by
    name, views and metadata left out; ``total`` is their sum; ``phases``: the same per ``phase`` that was set;
    ``host_reads``: the operations among them that hand values to the host (:data:`HOST_READS`, boolean-mask
    indexing), by the Python line that called them (on a GPU, each a wait of the host for the device)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.phase = None  # while set, operations are also counted under it in ``phases``
        self.phases: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.host_reads: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not _is_metadata(func, out):
            name = str(func.overloadpacket.__name__)
            self.counts[name] += 1
            if self.phase is not None:
                self.phases[self.phase][name] += 1
        if _reads_values(func, args):
            self.host_reads[_caller()] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def count(fn: Callable[[], object]) -> Tuple[object, OpCounter]:
    """(fn(), the counter of the operations it dispatched)."""
    with OpCounter() as c:
        result = fn()
    return result, c


def paths(name: str):
    """The context of a path: the fast paths (the default) or their references."""
    from fairseq_tnn.ops import fast
    import contextlib
    return contextlib.nullcontext() if name == "fast" else fast.references()


def tno_counts(tno_type: str, causal: bool, settings: Dict, d1: int, n: int, timed: int = 0) -> Dict:
    """Operations of one TNO's forward and backward (input and parameter gradients), batch 1, and the median CPU
    time of ``timed`` forwards and backwards."""
    from fairseq_tnn.modules import build_tno
    torch.manual_seed(0)
    tno = build_tno(tno_type, d1, causal, **settings)
    x = torch.randn(d1, 1, n, requires_grad=True)
    tno(x, layout="dbn").sum().backward()  # builds the constants the fast paths keep: the counts are a steady step's
    tno.zero_grad(set_to_none=True)  # as fairseq's optimizer leaves them: no accumulation into earlier gradients
    x.grad = None
    y, fwd = count(lambda: tno(x, layout="dbn"))
    g = torch.randn_like(y)
    _, bwd = count(lambda: y.backward(g))
    ms = []
    for _ in range(timed):
        tno.zero_grad(set_to_none=True)
        t = time.perf_counter()
        tno(x, layout="dbn").backward(g)
        ms.append((time.perf_counter() - t) * 1000.0)
    return {"forward": fwd.total, "backward": bwd.total, "ms": statistics.median(ms) if ms else None,
            "forward_ops": dict(fwd.counts), "backward_ops": dict(bwd.counts)}


def trainer_counts(trainer, sample) -> Dict:
    """Operations of one ``Trainer.train_step`` on ``sample`` (clipping, optimizer, bookkeeping included), and of
    its training forward (the criterion's forward: model and loss, in the task's precision context) and its
    backward (the optimizer's ``backward``: loss scaling and autograd), attributed by wrapping those two calls on
    this trainer. Run it after a first update (which builds the optimizer state and the constants of the length)."""
    criterion, optimizer = trainer.criterion, trainer.optimizer
    counter = OpCounter()

    def wrap(obj, attr, phase):
        inner = getattr(obj, attr)

        def attributed(*args, **kwargs):
            outer, counter.phase = counter.phase, phase
            try:
                return inner(*args, **kwargs)
            finally:
                counter.phase = outer
        setattr(obj, attr, attributed)

    wrap(criterion, "forward", "forward")
    wrap(optimizer, "backward", "backward")
    try:
        with counter:
            trainer.train_step([sample])
    finally:
        del criterion.__dict__["forward"], optimizer.__dict__["backward"]  # the classes' methods again
    fwd, bwd = counter.phases["forward"], counter.phases["backward"]
    return {"forward": sum(fwd.values()), "forward_backward": sum(fwd.values()) + sum(bwd.values()),
            "update": counter.total, "forward_ops": dict(fwd), "backward_ops": dict(bwd),
            "host_reads": sum(counter.host_reads.values()), "host_read_sites": dict(counter.host_reads.most_common())}


def model_counts(section: str, key: str, n: int, data: str, quick: bool, timed: int, vocab: int, width=None,
                 precision: str = "fp32") -> Dict:
    """``trainer_counts`` of one model at batch 1 x n on the CPU (``width``: instead of the preset's; ``precision``:
    fp32, bf16 (``--bf16-autocast``) or bf16w (``--bf16``)), and the median time of ``timed`` updates."""
    from benchmarks import trainer as tr
    arch = {"bound_identity": "tnn_lm_wt103" if section == "causal" else "tnn_mlm_wt103"}.get(key, key)
    bound = "identity" if key == "bound_identity" else None
    torch.manual_seed(1)
    trainer = tr.build_trainer(section, arch, bound, n, "cpu", precision, False, data, quick, width)
    sample = tr.synthetic_sample(section, n, 1, vocab)
    trainer.train_step([sample])  # allocates the optimizer state: the counts below are a steady update's
    result = trainer_counts(trainer, sample)
    ms = []
    for _ in range(timed):
        t = time.perf_counter()
        trainer.train_step([sample])
        ms.append((time.perf_counter() - t) * 1000.0)
    result["update_ms"] = statistics.median(ms) if ms else None
    return result


LABELS = {"bound_identity": "bound: no token mixing", "transformer_lm": "transformer_lm (same width and depth)"}


MODEL_IDS = [f"{section}/{key}" for section, key in PRESETS]
TNO_IDS = [f"{t}-{'causal' if c else 'bidirectional'}{'-rpe' + str(s['rpe_layers']) if s else ''}" for _, t, c, s in TNOS]


def run(quick: bool, path_names, n: int, d1: int, timed: int, log, models=None, tno_ids=None, vocab=None,
        width=None, precision: str = "fp32") -> Dict:
    """``vocab``: the dictionary's size (default: Wikitext-103's, or the quick one); the counts do not depend on it."""
    import fairseq_tnn
    fairseq_tnn.register()
    from benchmarks import trainer as tr
    rows, tnos = [], []
    with tempfile.TemporaryDirectory() as tmp:
        vocab = vocab or (tr.QUICK_VOCAB if quick else tr.VOCAB)
        data = tr._dictionary_dir(tmp, vocab)
        for section, key in PRESETS:
            if models is not None and f"{section}/{key}" not in models:
                continue
            row = {"section": section, "model": key, "id": f"{section}/{key}", "label": LABELS.get(key, key)}
            for p in path_names:
                with paths(p):
                    row[p] = model_counts(section, key, n, data, quick, timed, vocab, width, precision)
                log(f"[{section}] {row['label']:<40} {p:<9} forward {row[p]['forward']:5d}, forward + backward "
                    f"{row[p]['forward_backward']:5d}, update {row[p]['update']:5d}, {row[p]['update_ms'] or 0:8.1f} ms")
            rows.append(row)
    for tno_id, (label, tno_type, causal, settings) in zip(TNO_IDS, TNOS):
        if tno_ids is not None and tno_id not in tno_ids:
            continue
        row = {"label": label, "id": tno_id}
        for p in path_names:
            with paths(p):
                row[p] = tno_counts(tno_type, causal, settings, d1, n, 5 * timed)
            log(f"[tno] {label:<34} {p:<9} forward {row[p]['forward']:4d}, backward {row[p]['backward']:4d}, "
                f"{row[p]['ms'] or 0:.2f} ms")
        tnos.append(row)
    return {"models": rows, "tnos": tnos}


def markdown(result: Dict) -> str:
    meta = result["meta"]
    ps = meta["paths"]
    out = [f"# Operations dispatched per update, eager ({meta['machine']}; torch {meta['torch']})", "",
           f"Batch 1 x {meta['n']}, CPU, {PRECISIONS[meta.get('precision', 'fp32')]}, {'quick sizes' if meta['quick'] else 'the presets at their published sizes'}, "
           f"vocabulary {meta['vocab']:,}" + (f", width {meta['width']} (depth as published)" if meta.get("width") else "")
           + "; "
           "views and metadata left out. forward: the model and fairseq's criterion; update: a whole "
           "`Trainer.train_step` (clipping, Adam, bookkeeping). Time: median CPU time of an update at that size, "
           f"{meta['threads']} threads.", ""]
    head = "| model | task | " + " | ".join(f"{p}: forward | {p}: fwd + bwd | {p}: update | {p}: host reads | "
                                            f"{p}: ms / update" for p in ps) + " |"
    out += [head, "|---|---|" + "---:|" * (5 * len(ps))]
    for r in result["models"]:
        cells = [r["section"]]
        for p in ps:
            c = r[p]
            cells += [str(c["forward"]), f"{c['forward_backward']:,}", f"{c['update']:,}", str(c["host_reads"]),
                      "" if c["update_ms"] is None else f"{c['update_ms']:.1f}"]
        out.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    if result["models"]:
        p = ps[0]
        out += ["", f"Host reads: the update's operations that hand a tensor's values to the host (`.item()`, a tensor in "
                    f"an `if`, boolean-mask indexing, `nonzero`), each a wait of the host for the device on a GPU, by the "
                    f"line that called them ({p} path):", "",
                "| model | task | host reads | where |", "|---|---|---:|---|"]
        for r in result["models"]:
            sites = ", ".join(f"`{k}`" + (f" x{v}" if v > 1 else "") for k, v in r[p]["host_read_sites"].items())
            out.append(f"| {r['label']} | {r['section']} | {r[p]['host_reads']} | {sites} |")
    if result["tnos"]:
        out += ["", f"One TNO alone, d1 = {meta['d1']}, batch 1 x {meta['n']}, fp32 (ms: median CPU time of a forward "
                    "and backward):", "",
                "| TNO | " + " | ".join(f"{p}: forward | {p}: backward | {p}: ms" for p in ps) + " |",
                "|---|" + "---:|" * (3 * len(ps))]
    for r in result["tnos"]:
        out.append(f"| {r['label']} | " + " | ".join(
            f"{r[p]['forward']} | {r[p]['backward']} | " + ("" if r[p]["ms"] is None else f"{r[p]['ms']:.2f}") for p in ps) + " |")
    if result["tnos"]:
        p = ps[0]
        out += ["", f"The same TNOs' forward and backward operations by kind ({p} path; on a GPU each is a kernel at "
                    "least, so these counts bound how few kernels an eager TNO launches):", "",
                "| TNO | operations | " + " | ".join(KERNEL_KINDS) + " |", "|---|---:|" + "---:|" * len(KERNEL_KINDS)]
        for r in result["tnos"]:
            kinds = ops_by_kind(r[p]["forward_ops"], r[p]["backward_ops"])
            out.append(f"| {r['label']} | {r[p]['forward'] + r[p]['backward']} | "
                       + " | ".join(str(kinds[k]) for k in KERNEL_KINDS) + " |")
    return "\n".join(out) + "\n"


def ops_by_kind(*counts: Dict[str, int]) -> Dict[str, int]:
    """The operations of ``counts`` (name: count, as ``OpCounter`` counts them), summed by ``kernel_kind``."""
    kinds = dict.fromkeys(KERNEL_KINDS, 0)
    for c in counts:
        for name, k in c.items():
            kinds[kernel_kind(name)] += k
    return kinds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny models (a smoke test, seconds)")
    add_out_options(p, "results/opcount")
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS),
                   help="count with the fast paths, their references, or both side by side (default)")
    p.add_argument("--models", nargs="+", choices=MODEL_IDS, metavar="SECTION/MODEL",
                   help=f"only these models (of {', '.join(MODEL_IDS)}; default: all)")
    p.add_argument("--tnos", nargs="*", choices=TNO_IDS, metavar="TNO",
                   help=f"only these TNOs alone (of {', '.join(TNO_IDS)}; default: all; none: --tnos with no value)")
    p.add_argument("--timed", type=int, default=3, help="updates timed per model and path (default 3; 0: none)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32",
                   help="the models' updates in fp32 (default), under --bf16-autocast (bf16) or fairseq's --bf16 (bf16w: "
                        "bf16 weights, fp32 master copy); the TNOs alone: fp32")
    p.add_argument("--width", type=int, help="every model this wide (embedding and GLU) instead of its preset's, depth "
                                             "unchanged: the counts do not depend on it, the time does (a short CPU run)")
    p.add_argument("--vocab", type=int, help="dictionary size (default: Wikitext-103's 50,264, quick 1,000); the counts do "
                                             "not depend on it, the time does (the output layer)")
    a = p.parse_args(argv)
    if a.timed < 0:
        p.error(f"--timed={a.timed} must be >= 0")
    if a.threads < 1:
        p.error(f"--threads={a.threads} must be >= 1")
    if a.width is not None and a.width < 8:
        p.error(f"--width={a.width} must be >= 8")
    if a.vocab is not None and a.vocab < 8:
        p.error(f"--vocab={a.vocab} must be >= 8 (fairseq's 4 special symbols and some words)")
    refuse_overwrite(p, a, "opcount.json")
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(a.threads)
    from benchmarks.measure import _machine
    n, d1 = (32, 48) if a.quick else (512, 1536)
    t0 = time.time()
    result = run(a.quick, a.paths, n, d1, a.timed, lambda m: print(m, flush=True), a.models, a.tnos, a.vocab, a.width,
                 a.precision)
    result["meta"] = {"machine": _machine(), "torch": torch.__version__, "threads": a.threads, "n": n, "d1": d1,
                      "precision": a.precision,
                      "vocab": a.vocab or (1000 if a.quick else 50264), "width": a.width,
                      "quick": a.quick, "paths": a.paths, "seconds": round(time.time() - t0, 1),
                      "command": "python benchmarks/opcount.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    md = markdown(result)
    write_results(a.out, "opcount", result, md)
    print(md)
    return result


if __name__ == "__main__":
    main()
