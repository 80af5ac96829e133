"""The host's cost of a stack's parameters, and the time to compile its graphs: one training step (forward and
backward) of a wt103 preset's layer stack at a tiny shape, where the arithmetic is small and what remains is
per-operation and per-tensor work, for one or more source trees side by side, each in its own process, the trees
alternated round by round.

    python benchmarks/stack_step.py                                     # this checkout, eager and compiled
    mkdir -p /tmp/old && git archive bd203d5 fairseq_tnn | tar -x -C /tmp/old
    python benchmarks/stack_step.py --trees /tmp/old . --rounds 3      # before and after, alternated
    python benchmarks/stack_step.py --modes compiled one-graph --arch fd_tnn_lm_wt103   # the regions' compile time
    python benchmarks/stack_step.py --modes compiled --layers 1 --steps 5 --phases     # where a compile's time goes
    python benchmarks/stack_step.py --arch fd_tnn_mlm_wt103 --modes compiled dynamic --pad 3 --lengths 48 40 --steps 10
                                                                        # new lengths: static shapes, dynamo's default

A tree is a folder holding a ``fairseq_tnn`` package (``.``: this checkout), imported by PYTHONPATH (put first on the
PYTHONPATH the children inherit, so another torch can follow it there). The step is the stack's ``run_layers``
eagerly, or ``torch.compile(_stack_forward)`` as ``--tnn-cuda-graphs`` compiles the stack (inductor; on the CPU without
CUDA graphs): ``compiled`` with each layer a region where the torch has them (``STACK_REGIONS``) and the graphs' static
shapes where the tree has them (``GRAPH_SHAPES``), ``one-graph`` with every layer's operations in the stack's graph,
``dynamic`` as ``compiled`` with dynamo's default shapes (a frame's second shape compiled with symbolic sizes). The
input and the output's gradient are random, 1 x ``--tokens`` x ``--width`` (a masked preset's last ``--pad`` positions
padded), the parameters' gradients set to None before each step as fairseq's optimizers leave them. ``--lengths``:
after the timed steps, one step at each further length in turn, as a masked model's length buckets come, its seconds
(the compile of that length's graph) or the error that stopped it. It prints,
per tree, mode and round, the parameter tensors of the stack, the first step's seconds (compiled: the compile, with
inductor's caches off, ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``), the largest relative difference of the output and
of any gradient from the eager stack's, and the median and least of ``--steps`` steps after a warm-up (ms); then the
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


# The phases of a compile that ``--phases`` prints, from the phases torch's ``compile_times`` names, which nest (the
# backend's call holds AOT autograd's, which holds inductor's), so that these do not: dynamo's own work (its compile
# less the backend's call), AOT autograd's tracing and partitioning of the joint graph, and inductor's compile of the
# forward and backward graphs (the backward's at the first backward), of which its code generation (on the CPU with
# the C++ compiler's runs; a GPU's Triton kernels compile in workers, waited for apart). dynamo and AOT autograd are
# the host's work whatever the device.
AOT_PHASES = ("aot_collect_metadata", "aot_trace_joint_graph", "_recursive_joint_graph_passes",
              "min_cut_rematerialization_partition")
INDUCTOR_PHASES = ("compile_fx.<locals>.fw_compiler_base", "compile_fx.<locals>.bw_compiler")


def compile_phases() -> dict:
    """Seconds this process has spent so far in dynamo, AOT autograd and inductor, and in inductor's code generation
    (``AOT_PHASES``, ``INDUCTOR_PHASES``)."""
    from torch._dynamo.utils import compile_times
    names, values = compile_times(repr="csv", aggregate=True)
    spent = {n: float(v) for n, v in zip(names, values) if v not in ("", None)}
    return {"dynamo": spent.get("_compile.compile_inner", 0.0) - spent.get("OutputGraph.call_user_compiler", 0.0),
            "aot": sum(spent.get(n, 0.0) for n in AOT_PHASES),
            "inductor": sum(spent.get(n, 0.0) for n in INDUCTOR_PHASES),
            "codegen": spent.get("GraphLowering.codegen", 0.0)}


def one(arch: str, mode: str, width: int, tokens: int, steps: int, layers_n: int = 0, pad: int = 0,
        lengths=()) -> dict:
    """The measurement in this process, with whatever ``fairseq_tnn`` PYTHONPATH gives."""
    import contextlib
    import copy
    import torch
    torch.set_num_threads(1)
    from fairseq_tnn.models.build import build_arch
    from fairseq_tnn.models import compile as compiling
    torch.manual_seed(0)
    causal = "_lm" in arch
    side = "decoder" if causal else "encoder"
    dims = {f"{side}_embed_dim": width, "glu_dim": width, "dropout": 0.0}
    if layers_n:
        dims[f"{side}_layers"] = layers_n
    model = build_arch(arch, 100, **dims)
    layers = getattr(model, side).layers
    eager = copy.deepcopy(layers)
    params = list(layers.parameters())
    def inputs(n):
        pad_mask = None
        if pad:
            pad_mask = torch.zeros(1, n, dtype=torch.bool)
            pad_mask[:, n - pad:] = True
        return torch.randn(1, n, width), torch.randn(1, n, width), pad_mask

    x0, g0, pad_mask = inputs(tokens)
    regions = mode in ("compiled", "dynamic") and getattr(compiling, "STACK_REGIONS", False)
    shapes = getattr(compiling, "GRAPH_SHAPES", {}) if mode != "dynamic" else {}
    compiled = torch.compile(compiling._stack_forward, **shapes) if mode != "eager" else None
    settings = getattr(compiling, "_graph_settings", contextlib.nullcontext)

    def step(stack=layers):
        for p in stack.parameters():
            p.grad = None
        x = x0.clone().requires_grad_()
        if compiled and stack is layers:
            with settings():  # inductor's settings of the stack's graphs, where the tree has them
                y = compiled(stack, x, pad_mask, None, regions)
        else:
            y = compiling.run_layers(stack, x, pad_mask)
        # a random gradient (a post-norm stack's sum of squares is a constant), a copy: the compiled backward of
        # torch 2.11's and 2.13's regions overwrote the gradient it is handed, before the stack's graphs' settings
        # (docs/performance.md)
        y.backward(g0.clone())
        return y

    start = time.perf_counter()
    y = step()
    first = time.perf_counter() - start
    phases = compile_phases() if compiled else {}
    y_ref = step(eager)
    rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
    diffs = {"output": rel(y.detach(), y_ref.detach()),
             "gradient": max(rel(p.grad, q.grad) for p, q in zip(params, eager.parameters()) if q.grad is not None)}
    for _ in range(5):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    later = []
    for n in lengths:
        x0, g0, pad_mask = inputs(n)
        start = time.perf_counter()
        try:
            step()
            later.append({"tokens": n, "first_s": time.perf_counter() - start})
        except Exception as err:  # dynamo's failure to compile a length is the finding, reported
            later.append({"tokens": n, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"})
    return {"tensors": len(params), "layers": len(layers), "first_s": first, "regions": bool(regions),
            "torch": torch.__version__, "phases": phases, **{f"{k}_rel_diff": v for k, v in diffs.items()},
            "median_ms": statistics.median(times), "least_ms": min(times), "later": later}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="+", default=["."], help="folders holding a fairseq_tnn package (default: .)")
    p.add_argument("--arch", default="tnn_lm_wt103", help="a wt103 preset (default tnn_lm_wt103)")
    p.add_argument("--modes", nargs="+", choices=["eager", "compiled", "one-graph", "dynamic"],
                   default=["eager", "compiled"],
                   help="eager; compiled: the stack's graph with each layer a region where the torch has them; "
                        "one-graph: every layer's operations in the stack's graph; dynamic: as compiled, with "
                        "dynamo's default shapes (default: eager compiled)")
    p.add_argument("--layers", type=int, default=0, help="layers of the stack (default 0: the preset's)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--pad", type=int, default=0, help="a masked preset's last PAD positions padded (default 0)")
    p.add_argument("--lengths", type=int, nargs="*", default=[],
                   help="after the timed steps, one step at each of these lengths in turn (default: none)")
    p.add_argument("--phases", action="store_true",
                   help="print where the compile's seconds went too: dynamo, AOT autograd, inductor, and inductor's "
                        "code generation within it (compile_phases)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: measure in this process
    a = p.parse_args(argv)
    for name in ("width", "tokens", "steps", "rounds"):
        if getattr(a, name) < 1:
            p.error(f"--{name}={getattr(a, name)} is invalid: must be an integer >= 1")
    if a.layers < 0:
        p.error(f"--layers={a.layers} is invalid: must be an integer >= 1, or 0 for the preset's")
    if any(n < 1 for n in a.lengths):
        p.error(f"--lengths={a.lengths} is invalid: each must be an integer >= 1")
    for n in [a.tokens] + a.lengths:
        if not 0 <= a.pad < n:
            p.error(f"--pad={a.pad} is invalid: must be an integer >= 0 and below each length (--tokens, --lengths: "
                    f"{n})")
    if a.pad and "_lm" in a.arch:
        p.error(f"--pad={a.pad} is invalid with --arch {a.arch}: a causal stack takes no padding (a masked preset "
                f"does, or --pad 0)")
    if a.one:
        print(json.dumps(one(a.arch, a.modes[0], a.width, a.tokens, a.steps, a.layers, a.pad, a.lengths)))
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
                           OMP_NUM_THREADS="1", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
                out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "stack_step.py"), "--one",
                                      "--arch", a.arch, "--modes", mode, "--width", str(a.width), "--tokens",
                                      str(a.tokens), "--steps", str(a.steps), "--layers", str(a.layers), "--pad",
                                      str(a.pad), "--lengths", *map(str, a.lengths)],
                                     env=env, capture_output=True, text=True, cwd=tree)
                if out.returncode != 0:
                    print(out.stdout[-2000:], out.stderr[-3000:], file=sys.stderr)
                    return out.returncode
                res = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault((tree, mode), []).append(res)
                print(f"round {r} {tree} {mode}: {res['tensors']} tensors, {res['layers']} layers, first step "
                      f"{res['first_s']:.1f} s, rel. diff output {res['output_rel_diff']:.1e} gradient "
                      f"{res['gradient_rel_diff']:.1e}, median {res['median_ms']:.2f} ms, least {res['least_ms']:.2f} ms "
                      f"(torch {res['torch']}{', regions' if res['regions'] else ''})", flush=True)
                if a.phases and res.get("phases"):
                    print(f"round {r} {tree} {mode}: compile phases, s: " + ", ".join(
                        f"{k} {v:.1f}" for k, v in res["phases"].items()), flush=True)
                for later in res.get("later", []):
                    print(f"round {r} {tree} {mode}: then length {later['tokens']}: " + (
                        f"first step {later['first_s']:.1f} s" if "first_s" in later else f"failed: {later['error']}"),
                        flush=True)
    print(f"\n| tree | mode | tensors | first step (compile), s: median | largest rel. diff from eager | "
          f"step: median over {a.rounds} round(s), ms | least, ms |\n|---|---|---:|---:|---:|---:|---:|")
    for (tree, mode), rs in results.items():
        diff = max(max(x["output_rel_diff"], x["gradient_rel_diff"]) for x in rs)
        print(f"| {tree} | {mode} | {rs[0]['tensors']} | {statistics.median(x['first_s'] for x in rs):.1f} | "
              f"{diff:.1e} | {statistics.median(x['median_ms'] for x in rs):.2f} | {min(x['least_ms'] for x in rs):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
