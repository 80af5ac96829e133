"""What ``--tnn-cuda-graphs`` records as one CUDA graph (``CUDA_GRAPH_SCOPE`` in fairseq_tnn/models/compile.py): each
layer's graphs ("layers") against the whole stack's ("stack": inductor's kernels; "stack-aten": aten's, unfused), side
by side, for the Wikitext-103 presets: the compile time of a training update, its steady time, and its output and
gradients against the eager model's.

    .venv/bin/python benchmarks/graph_scopes.py [--device cpu] [--width 64] [--archs tnn_lm_wt103 ...]

Each preset at its published depth (``--width``: its width instead, on the CPU where the published one is slow), batch
1 x 512 on the CPU (8 x 512 causal, 16 x 512 masked on a GPU), dropout 0, fp32 on the CPU and fp16 weights on a GPU.
Each scope runs in a process of its own with inductor's cache in a new folder, so that its compile is cold: the first
training update (forward and backward), which compiles, less a steady one; then the median of ``--timed`` updates.
On a GPU the stack scopes record real CUDA graphs; on the CPU, which has none, torch.compile runs the same compiled
functions without them (the stack's function stands in for its graph: ``CompiledStack.trains_on_cuda`` is patched to
accept the CPU), so that the CPU measures what each scope costs to compile, and checks what it computes, but not what
the graphs save (a GPU's launches and host time). Prints a markdown table; ``--out`` also writes it with the JSON.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

ARCHS = ["tnn_lm_wt103", "fd_tnn_lm_wt103", "tnn_mlm_wt103", "ski_tnn_mlm_wt103"]
SCOPES = ["layers", "stack", "stack-aten"]


def _model(arch: str, width, device: str):
    from fairseq_tnn.models.build import build_arch
    causal = "_mlm_" not in arch
    sizes = {"decoder_embed_dim" if causal else "encoder_embed_dim": width, "glu_dim": width} if width else {}
    torch.manual_seed(0)
    model = build_arch(arch, 1000, dropout=0.0, **sizes).to(device)
    return model.half() if device == "cuda" else model


def measure(arch: str, scope: str, width, device: str, timed: int) -> dict:
    """One scope of one preset, in this process: compile and steady times of a training update, and the largest
    relative difference of its output and parameter gradients from the eager model's."""
    import copy
    from fairseq_tnn.models import compile as compiling
    eager = _model(arch, width, device)
    model = copy.deepcopy(eager)
    layers = model.decoder.layers if hasattr(model, "decoder") else model.encoder.layers
    with mock.patch.object(compiling, "CUDA_GRAPH_SCOPE", scope):
        compiling.compile_layers(layers, "strict", "layers", cuda_graphs=device == "cuda" or scope != "layers")
    if device == "cpu":  # the CPU stands in for a GPU: the stack's function runs where its graph would
        compiling.CompiledStack.trains_on_cuda = lambda self, layer, x: layer.training and torch.is_grad_enabled()
    batch = (8 if hasattr(model, "decoder") else 16) if device == "cuda" else 1
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, 1000, (batch, 512), generator=g).to(device)

    def update(m):
        m.zero_grad(set_to_none=True)
        y = m(tokens)[0]
        y.float().pow(2).mean().backward()
        return y

    def timed_update(m):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        y = update(m)
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1000.0, y

    first, y = timed_update(model)
    ms = [timed_update(model)[0] for _ in range(timed)]
    ye = update(eager)

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
    grads = [rel(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters()) if q.grad is not None]
    return {"arch": arch, "scope": scope, "compile_s": max(0.0, (first - statistics.median(ms)) / 1000.0),
            "update_ms": statistics.median(ms), "output_rel": rel(y, ye), "grad_rel": max(grads)}


def child(args) -> dict:
    """``measure`` in a new process with inductor's cache in a new folder (a cold compile)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": ROOT}
        code = ("import json, sys; sys.path.insert(0, %r); from benchmarks.graph_scopes import measure; "
                "print('RESULT ' + json.dumps(measure(*json.loads(sys.argv[1]))))" % ROOT)
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(args)], env=env, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise RuntimeError(f"{args[:2]} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        return json.loads(lines[-1][len("RESULT "):])


def markdown(rows, meta) -> str:
    out = [f"# CUDA graph scopes ({meta['device']}, torch {meta['torch']}, width {meta['width'] or 'published'})", "",
           f"`{meta['command']}`", "",
           "| preset | scope | compile s | update ms | output rel. diff | largest gradient rel. diff |",
           "|---|---|---:|---:|---:|---:|"]
    out += [f"| {r['arch']} | {r['scope']} | {r['compile_s']:.1f} | {r['update_ms']:.1f} | {r['output_rel']:.1e} | "
            f"{r['grad_rel']:.1e} |" for r in rows]
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--archs", nargs="+", choices=ARCHS, default=ARCHS, metavar="ARCH")
    p.add_argument("--scopes", nargs="+", choices=SCOPES, default=SCOPES, metavar="SCOPE")
    p.add_argument("--width", type=int, help="the models' width instead of the published one (default: published)")
    p.add_argument("--timed", type=int, default=3, help="steady updates timed per scope (default 3)")
    p.add_argument("--out", help="also write graph_scopes.md and graph_scopes.json here")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible to torch")
    if a.width is not None and a.width < 8:
        p.error(f"--width={a.width} must be >= 8")
    if a.timed < 1:
        p.error(f"--timed={a.timed} must be >= 1")
    meta = {"device": a.device, "torch": torch.__version__, "width": a.width,
            "command": "python benchmarks/graph_scopes.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    rows = []
    for arch in a.archs:
        for scope in a.scopes:
            rows.append(child([arch, scope, a.width, a.device, a.timed]))
            print(json.dumps(rows[-1]), flush=True)
    md = markdown(rows, meta)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "graph_scopes.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(os.path.join(a.out, "graph_scopes.md"), "w") as f:
            f.write(md)
    return rows


if __name__ == "__main__":
    main()
