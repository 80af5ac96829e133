"""The host's cost of a stack's parameters: one training step (forward and backward) of a wt103 preset's layer stack
at a tiny shape, where the arithmetic is small and what remains is per-operation and per-tensor work, for one or
more source trees side by side, each in its own process, the trees alternated round by round.

    python benchmarks/stack_step.py                                     # this checkout, eager and compiled
    mkdir -p /tmp/old && git archive bd203d5 fairseq_tnn | tar -x -C /tmp/old
    python benchmarks/stack_step.py --trees /tmp/old . --rounds 3      # before and after, alternated

A tree is a folder holding a ``fairseq_tnn`` package (``.``: this checkout), imported by PYTHONPATH. The step is the
stack's ``run_layers`` eagerly, or ``torch.compile(_stack_forward)`` as ``--tnn-cuda-graphs`` compiles the stack
(inductor; on the CPU without CUDA graphs), on a random input of 1 x ``--tokens`` x ``--width``, its sum's backward,
the gradients set to None before each step as fairseq's optimizers leave them. It prints, per tree, mode and round,
the parameter tensors of the stack and the median and least of ``--steps`` steps after a warm-up (ms), and then the
median over the rounds. One thread; the machine's load moves every figure, so compare within one run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one(arch: str, mode: str, width: int, tokens: int, steps: int) -> dict:
    """The measurement in this process, with whatever ``fairseq_tnn`` PYTHONPATH gives."""
    import torch
    torch.set_num_threads(1)
    from fairseq_tnn.models.build import build_arch
    from fairseq_tnn.models.compile import STACK_REGIONS, _stack_forward, run_layers
    torch.manual_seed(0)
    causal = "_lm" in arch
    dims = {"decoder_embed_dim" if causal else "encoder_embed_dim": width, "glu_dim": width, "dropout": 0.0}
    model = build_arch(arch, 100, **dims)
    layers = (model.decoder if causal else model.encoder).layers
    params = list(layers.parameters())
    x0 = torch.randn(1, tokens, width)
    compiled = torch.compile(_stack_forward) if mode == "compiled" else None

    def step():
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_()
        y = compiled(layers, x, None, None, STACK_REGIONS) if compiled else run_layers(layers, x)
        y.sum().backward()

    for _ in range(6):  # the first compiles
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return {"tensors": len(params), "median_ms": statistics.median(times), "least_ms": min(times)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="+", default=["."], help="folders holding a fairseq_tnn package (default: .)")
    p.add_argument("--arch", default="tnn_lm_wt103", help="a wt103 preset (default tnn_lm_wt103)")
    p.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: measure in this process
    a = p.parse_args(argv)
    for name in ("width", "tokens", "steps", "rounds"):
        if getattr(a, name) < 1:
            p.error(f"--{name}={getattr(a, name)} is invalid: must be an integer >= 1")
    if a.one:
        print(json.dumps(one(a.arch, a.modes[0], a.width, a.tokens, a.steps)))
        return 0
    trees = [os.path.abspath(t) for t in a.trees]
    for tree in trees:
        if not os.path.isfile(os.path.join(tree, "fairseq_tnn", "__init__.py")):
            p.error(f"--trees: {tree} holds no fairseq_tnn package")
    results = {}
    for r in range(1, a.rounds + 1):
        for tree in trees:
            for mode in a.modes:
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]),
                           OMP_NUM_THREADS="1")
                out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "stack_step.py"), "--one",
                                      "--arch", a.arch, "--modes", mode, "--width", str(a.width), "--tokens",
                                      str(a.tokens), "--steps", str(a.steps)], env=env, capture_output=True, text=True,
                                     cwd=tree)
                if out.returncode != 0:
                    print(out.stdout[-2000:], out.stderr[-3000:], file=sys.stderr)
                    return out.returncode
                res = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault((tree, mode), []).append(res)
                print(f"round {r} {tree} {mode}: {res['tensors']} tensors, median {res['median_ms']:.2f} ms, "
                      f"least {res['least_ms']:.2f} ms", flush=True)
    print(f"\n| tree | mode | tensors | median over {a.rounds} round(s), ms | least, ms |\n|---|---|---:|---:|---:|")
    for (tree, mode), rs in results.items():
        print(f"| {tree} | {mode} | {rs[0]['tensors']} | {statistics.median(x['median_ms'] for x in rs):.2f} | "
              f"{min(x['least_ms'] for x in rs):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
