"""An update's gradient clipping and Adam step: fairseq's per-parameter code against the plugin's multi-tensor
kernels (fairseq_tnn/patches/multi_tensor_optim.py), side by side in one run, for one model's parameters.

    .venv/bin/python benchmarks/optimizer_step.py [--arch tnn_lm_wt103] [--rounds 20] [--width 16 --vocab 64]

Two layouts of the weights the optimizer sees: ``flat``, the one fp32 master tensor of ``--fp16`` (fairseq's
default flattening), and ``per-parameter``, the model's own fp32 parameters (fp32 training, ``--bf16-autocast``,
``--fp16-no-flatten-grads``). For each, fairseq's ``clip_grad_norm_`` (max norm 1) and ``Adam.step`` (the paper's
betas, eps and a weight decay) and the plugin's: the operations they dispatch (on a GPU each is a kernel launch
the host issues, 10-25 microseconds whatever its size), and the median CPU time per update over the rounds after
3 warm-up rounds, the two alternating (memory-bound passes over the weights, as on a GPU). With ``--width`` (and a
small ``--vocab``) the weights are few and the times nearly all the host's: what a GPU waits for while the host
launches the step.
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

WARMUP = 3
LAYOUTS = ("flat", "per-parameter")


def _params(arch: str, vocab: int, layout: str, width=None):
    """fp32 parameters with gradients: the model's (at ``width``, its GLU and RPE as narrow, where given), or one
    flat tensor of their total size."""
    from fairseq_tnn.models.build import build_arch
    side = "encoder" if "mlm" in arch else "decoder"
    narrow = {} if width is None else {f"{side}_embed_dim": width, "glu_dim": width,
                                       **({} if "ski" in arch else {"rpe_dim": width})}
    params = [torch.nn.Parameter(p.detach().float()) for p in build_arch(arch, vocab, **narrow).parameters()]
    if layout == "flat":
        params = [torch.nn.Parameter(torch.zeros(sum(p.numel() for p in params)))]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    return params


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="tnn_lm_wt103", help="a tnn_lm / tnn_mlm architecture (default tnn_lm_wt103)")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (default 20)")
    p.add_argument("--vocab", type=int, default=50264, help="dictionary size (default Wikitext-103's 50264)")
    p.add_argument("--width", type=int, help="the model at this width (its GLU and RPE as narrow), so that the "
                   "times are the host's (default: the architecture's own)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds={a.rounds} is invalid: must be an integer >= 1")
    if a.width is not None and a.width < 1:
        p.error(f"--width={a.width} is invalid: must be an integer >= 1")
    import fairseq.utils
    from fairseq.optim.adam import Adam

    from benchmarks.opcount import count
    from fairseq_tnn import register
    from fairseq_tnn.patches.base import resolve
    register()  # the plugin as fairseq loads it: the patches installed
    code = {"fairseq": (resolve("fairseq.utils:clip_grad_norm_"), resolve("fairseq.optim.adam:Adam.step")),
            "plugin": (fairseq.utils.clip_grad_norm_, Adam.step)}
    rows = {}
    for layout in LAYOUTS:
        setups = {}
        for name, (clip, step) in code.items():
            params = _params(a.arch, a.vocab, layout, a.width)
            opt = Adam(params, lr=5e-4, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)

            def update(params=params, opt=opt, clip=clip, step=step):
                clip(params, 1.0)
                step(opt)
            update()  # builds the optimizer state
            setups[name] = (update, len(params), count(update)[1].total)
        times = {name: [] for name in setups}
        for r in range(WARMUP + a.rounds):
            for name in (list(setups) if r % 2 else list(setups)[::-1]):
                t = time.perf_counter()
                setups[name][0]()
                if r >= WARMUP:
                    times[name].append((time.perf_counter() - t) * 1e3)
        for name, (_, n, ops) in setups.items():
            rows[name, layout] = (n, ops, statistics.median(times[name]))
    at = "" if a.width is None else f" at width {a.width}"
    print(f"{a.arch}{at}, {rows['fairseq', 'per-parameter'][0]} parameters, torch {torch.__version__}; "
          f"clip_grad_norm_ and Adam.step, median of {a.rounds} rounds")
    print("| code | weights | ops dispatched | CPU ms per update |\n|---|---|---:|---:|")
    for (name, layout), (_, ops, ms) in sorted(rows.items()):
        print(f"| {name} | {layout} | {ops:,} | {ms:.3f} |")


if __name__ == "__main__":
    main()
