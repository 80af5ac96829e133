"""One TNO's forward and backward, as this checkout computes it and as an earlier commit did, side by side in one
process (issue 39: the masked FD-TNN and SKI-TNN measured faster at commit 23edccf; did the code change, or the
harness?).

    python benchmarks/tno_versions.py --rev 23edccf --out results/tno-versions                # on the CPU, fp32
    python benchmarks/tno_versions.py --rev 23edccf --device cuda --out $OUT/tno-versions     # on a GPU, fp16

The commit's ``fairseq_tnn/modules`` and ``fairseq_tnn/ops`` are read with ``git archive`` (or, where the checkout
has no git history, as on a GPU machine that receives a copy of the working tree, from ``--from DIR``, a
directory made beforehand with ``mkdir -p DIR && git archive 23edccf fairseq_tnn/modules fairseq_tnn/ops |
tar -x -C DIR``) and imported under another package name (nothing of the commit registers with fairseq). For
each TNO of the Wikitext-103 presets (TNN with its 6-layer RPE, FD-TNN with its 3-layer RPE, SKI-TNN; each with
the preset's settings, the same in both versions) at the paper's per-GPU shapes (d1 = 3 x 512 channels causal
at 8 x 512; 3 x 768 bidirectional at 16 x 512 and 4 x 2048), both versions get the same input in the layout the layers hand them (channel-major) and
the same output gradient, and report: the median time of a forward and backward (rounds interleaved, the device
synchronised), the operations each dispatches (``benchmarks/opcount.py``'s count) and the FFTs among them, and,
on a GPU, the peak memory above the input's. ``--dtype fp16`` casts both modules as fairseq's ``--fp16`` does
(``.half()``: the current code keeps its RPE in fp32, the commit's did not), the default on a GPU.
``--batch-scale`` divides the batches (a short CPU run; the operation counts do not depend on it). ``--compiled``
measures both versions through ``torch.compile`` (inductor; the first calls, which compile, are not timed): the
operations are not counted then (under a dispatch mode the compiled code would run eagerly).

    python benchmarks/tno_versions.py --rev 8ed981e --only tnn --compiled --batch-scale 4 --out results/tno-compiled
"""
import argparse
import importlib
import io
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import types
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.measure import (add_device_options, add_out_options, checked_dtype, refuse_overwrite,  # noqa: E402
                                write_results)

# (label, TNO type, causal, d1, batch, n): the presets' TNOs at the paper's per-GPU shapes
SHAPES = [("TNN (RPE 6)", "tnn", True, 1536, 8, 512), ("FD-TNN (RPE 3)", "fd", True, 1536, 8, 512),
          ("TNN (RPE 6)", "tnn", False, 2304, 16, 512), ("FD-TNN (RPE 3)", "fd", False, 2304, 16, 512),
          ("SKI-TNN", "ski", False, 2304, 16, 512),
          ("TNN (RPE 6)", "tnn", False, 2304, 4, 2048), ("FD-TNN (RPE 3)", "fd", False, 2304, 4, 2048),
          ("SKI-TNN", "ski", False, 2304, 4, 2048)]
# each preset's TNO settings, as the commit's and the current code's constructors take them
SETTINGS = {"tnn": {"rpe_dim": 64, "rpe_layers": 6, "rpe_activation": "relu", "decay": 0.99},
            "fd": {"rpe_dim": 64, "rpe_layers": 3, "rpe_activation": "relu"},
            "ski": {"rank": 32, "taps": 17, "decay": 0.99}}
CURRENT_NAMES = {"tnn": {}, "fd": {}, "ski": {"rank": "ski_rank", "taps": "ski_taps", "decay": "ski_warp_decay"}}
WARMUP = 2


def _own_operators(source: str, namespace: str) -> None:
    """The custom operators of the commit's copy under ``source`` (``torch.library``'s ``fairseq_tnn::NAME``, the
    FFT product's and the direct product's) renamed into ``namespace``, apart from the current code's, which registers
    the same names. With one name registered twice in the process, a run that compiled both versions' FD-TNOs died by
    a segmentation fault inside dynamo's fake-tensor run of an operator (on the CPU, 2026-12-02; which registration
    the dispatcher kept was not examined)."""
    for folder, _, files in os.walk(os.path.join(source, "fairseq_tnn")):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                with open(path) as f:
                    text = f.read()
                renamed = text.replace('"fairseq_tnn::', f'"{namespace}::')
                if renamed != text:
                    with open(path, "w") as f:
                        f.write(renamed)


def load_commit(rev: str, tmp: str, source: str = None):
    """The ``modules`` package of ``fairseq_tnn`` at ``rev``, imported as ``fairseq_tnn_at_<rev>.modules`` from a
    ``git archive`` of the commit into ``tmp``, or from ``source`` (a directory holding the commit's
    ``fairseq_tnn/modules`` and ``fairseq_tnn/ops``); the package's ``__init__``, which registers with fairseq, is
    not run."""
    if source is None:
        try:
            tar = subprocess.run(["git", "-C", ROOT, "archive", rev, "fairseq_tnn/modules", "fairseq_tnn/ops"],
                                 check=True, capture_output=True).stdout
        except (OSError, subprocess.CalledProcessError) as err:
            raise SystemExit(f"--rev {rev}: git archive failed: {getattr(err, 'stderr', b'').decode().strip() or err} "
                             "(without the commit in this checkout's history: --from DIR, see --help)")
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            t.extractall(tmp, filter="data")
    else:  # a copy, whose operators are renamed below: the directory given stays as it is
        shutil.copytree(os.path.join(source, "fairseq_tnn"), os.path.join(tmp, "fairseq_tnn"), dirs_exist_ok=True)
    source = tmp
    name = "fairseq_tnn_at_" + "".join(c if c.isalnum() else "_" for c in rev)
    _own_operators(source, name)
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(source, "fairseq_tnn")]
    sys.modules[name] = package
    return importlib.import_module(name + ".modules")


def build(version: str, modules, kind: str, causal: bool, d1: int):
    """The TNO of ``kind``, as this checkout builds it ("current") or as the commit's ``modules`` do: a commit with
    the ``tno`` package (since the TNO types registered themselves) through its ``build_tno`` and today's setting
    names, an older one (23edccf) through its classes and their own names."""
    settings = dict(SETTINGS[kind])
    named = {CURRENT_NAMES[kind].get(k, k): v for k, v in settings.items()}
    if version == "current":
        from fairseq_tnn.modules.tno import build_tno
        return build_tno(kind, d1, causal, **named)
    package = getattr(modules, "tno", None)  # 23edccf's was a module, tno.py, whose build_tno took the old names
    if package is not None and hasattr(package, "__path__") and hasattr(package, "build_tno"):
        return package.build_tno(kind, d1, causal, **named)
    cls = {"tnn": modules.TnnTno, "fd": modules.FdTno, "ski": modules.SkiTno}[kind]
    return cls(d1, causal, **settings)


def measure(tnos: Dict[str, torch.nn.Module], d1: int, batch: int, n: int, device: str, dtype, rounds: int,
            compiled: bool = False) -> Dict:
    from benchmarks.gpu_profile import _timed
    from benchmarks.opcount import count
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(d1, batch, n, generator=g).to(device, dtype).requires_grad_()
    grad = torch.randn(d1, batch, n, generator=g).to(device, dtype)

    if compiled:
        torch._dynamo.reset()  # each shape compiles afresh, never against the recompile limit of the ones before
    forwards = {id(tno): torch.compile(tno) if compiled else tno for tno in tnos.values()}

    def step(tno):
        tno.zero_grad(set_to_none=True)
        x.grad = None
        forwards[id(tno)](x, layout="dbn").backward(grad)

    out = {}
    for name, tno in tnos.items():
        for _ in range(2 if compiled else 1):
            step(tno)  # builds what each version caches (compiled: the graphs, and a second call that may recompile)
        if compiled:  # a dispatch mode would see the compiled code run eagerly: no count
            out[name] = {"ops": None, "ffts": None, "ms": []}
        else:
            counted = count(lambda: step(tno))[1]
            out[name] = {"ops": counted.total, "ffts": sum(v for k, v in counted.counts.items() if "fft" in k),
                         "ms": []}
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step(tno)
            torch.cuda.synchronize()
            out[name]["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    for r in range(WARMUP + rounds):
        for name in (list(tnos) if r % 2 else list(tnos)[::-1]):
            ms = _timed(lambda: step(tnos[name]), device, 1)
            if r >= WARMUP:
                out[name]["ms"] += ms
    for v in out.values():
        v["median_ms"] = statistics.median(v["ms"])
    return out


def markdown(result) -> str:
    meta = result["meta"]
    out = [f"# One TNO's forward and backward: commit {meta['rev']} against this checkout ({meta['head']})", "",
           f"{meta['machine']}; torch {meta['torch']}; {meta['dtype']}; "
           f"{'compiled (torch.compile); ' if meta.get('compiled') else ''}batches divided by {meta['batch_scale']}; "
           f"median of {meta['rounds']} interleaved rounds; `{meta['command']}`.", "",
           f"| TNO | shape | {meta['rev']} ms | current ms | current / {meta['rev']} | ops: {meta['rev']} / current | "
           "FFTs: then / now | peak MiB: then / now |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        old, new = r["commit"], r["current"]
        peak = f"{old['peak_mib']:.0f} / {new['peak_mib']:.0f}" if "peak_mib" in old else "-"
        ops = f"{old['ops']} / {new['ops']}" if old["ops"] is not None else "-"
        ffts = f"{old['ffts']} / {new['ffts']}" if old["ffts"] is not None else "-"
        out.append(f"| {r['label']}, {'causal' if r['causal'] else 'bidirectional'} | {r['batch']} x {r['n']}, "
                   f"d1 {r['d1']} | {old['median_ms']:.2f} | {new['median_ms']:.2f} | "
                   f"{new['median_ms'] / old['median_ms']:.2f} | {ops} | {ffts} | {peak} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", default="23edccf", help="the earlier commit (default 23edccf)")
    p.add_argument("--from", dest="source", metavar="DIR",
                   help="read the commit's fairseq_tnn/modules and fairseq_tnn/ops from DIR instead of git (see above)")
    add_device_options(p, rounds=10)
    p.add_argument("--only", nargs="+", choices=sorted(SETTINGS), help="these TNO types only (default: all)")
    p.add_argument("--compiled", action="store_true",
                   help="both versions through torch.compile (inductor), as --tnn-compile runs the layers")
    add_out_options(p, "results/tno-versions")
    a = p.parse_args(argv)
    dtype_name, dtype = checked_dtype(p, a)
    if a.source is not None and not os.path.isfile(os.path.join(a.source, "fairseq_tnn", "modules", "__init__.py")):
        p.error(f"--from {a.source}: no fairseq_tnn/modules/__init__.py there (make it with git archive, see --help)")
    refuse_overwrite(p, a, "tno_versions.json")
    os.makedirs(a.out, exist_ok=True)
    from benchmarks.measure import _machine
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    meta = {"rev": a.rev, "head": head.strip() or "unknown", "device": a.device, "dtype": dtype_name,
            "rounds": a.rounds, "batch_scale": a.batch_scale, "compiled": a.compiled, "torch": torch.__version__,
            "machine": torch.cuda.get_device_name(0) if a.device == "cuda" else _machine(),
            "command": "python benchmarks/tno_versions.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    rows: List[Dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        then = load_commit(a.rev, tmp, a.source)
        for label, kind, causal, d1, batch, n in SHAPES:
            if a.only and kind not in a.only:
                continue
            batch = max(1, batch // a.batch_scale)
            tnos = {}
            for version in ("commit", "current"):
                torch.manual_seed(0)
                tnos[version] = build(version, then, kind, causal, d1).to(a.device, dtype)
            row = {"label": label, "kind": kind, "causal": causal, "d1": d1, "batch": batch, "n": n,
                   **measure(tnos, d1, batch, n, a.device, dtype, a.rounds, a.compiled)}
            rows.append(row)
            print(f"{label:<16} {'causal' if causal else 'bidir.':<7} {batch:>2} x {n:<5} commit "
                  f"{row['commit']['median_ms']:8.2f} ms ({row['commit']['ops'] or '-'} ops), current "
                  f"{row['current']['median_ms']:8.2f} ms ({row['current']['ops'] or '-'} ops)", flush=True)
            del tnos
            if a.device == "cuda":
                torch.cuda.empty_cache()
            result = {"meta": meta, "rows": rows}
            write_results(a.out, "tno_versions", result, markdown(result))
    print(markdown({"meta": meta, "rows": rows}))


if __name__ == "__main__":
    main()
