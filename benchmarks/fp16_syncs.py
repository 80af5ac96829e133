"""Host time per update of ``--fp16``'s two master-weight syncs: fairseq's per-parameter loops against the
plugin's multi-tensor copies (fairseq_tnn/patches/fp16_syncs.py), side by side in one run.

    .venv/bin/python benchmarks/fp16_syncs.py [--arch tnn_lm_wt103] [--device meta|cpu] [--rounds 100]

The model's fp16 parameters, with gradients, and two FP16Optimizer sync states holding flat fp32 master
weights laid out as fairseq's ``build_fp32_params`` lays them out for ``--fp16``; each round times fairseq's two syncs on one and the
plugin's on the other, in alternating order; the medians over the rounds after 5 warm-up rounds are printed.
``--device meta`` (the default) computes nothing, so its times are the host's alone: what a GPU, whose
copies are asynchronous kernel launches, waits for. ``--device cpu`` includes the copies themselves.
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

WARMUP = 5
SYNCS = ("_sync_fp16_grads_to_fp32", "_sync_fp32_params_to_fp16")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="tnn_lm_wt103", help="a tnn_lm / tnn_mlm architecture (default tnn_lm_wt103)")
    p.add_argument("--device", default="meta", choices=["meta", "cpu"])
    p.add_argument("--rounds", type=int, default=100, help="timed rounds (default 100)")
    p.add_argument("--vocab", type=int, default=50264, help="dictionary size (default Wikitext-103's 50264)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds={a.rounds} is invalid: must be an integer >= 1")
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    from fairseq_tnn import register
    from fairseq_tnn.models.build import build_arch
    from fairseq_tnn.patches.base import resolve
    register()  # the plugin as fairseq loads it: the patches installed
    syncs = {"fairseq": [resolve(f"fairseq.optim.fp16_optimizer:_FP16OptimizerMixin.{s}") for s in SYNCS],
             "plugin": [getattr(FP16Optimizer, s) for s in SYNCS]}
    with torch.device(a.device):
        params = list(build_arch(a.arch, a.vocab).half().parameters())
    for param in params:
        param.grad = torch.zeros_like(param)
    states = {}
    for name in syncs:  # FP16Optimizer's sync state (its build_fp32_params would ask CUDA for the device)
        state = states[name] = object.__new__(FP16Optimizer)
        state.fp16_params = params
        with torch.device(a.device):
            flat = torch.cat([q.detach().reshape(-1).float() for q in params])
        state.fp32_params = {params[0].device.index: torch.nn.Parameter(flat)}
        state.fp32_params[params[0].device.index].grad = torch.zeros_like(flat)
    times = {name: ([], []) for name in syncs}
    for r in range(WARMUP + a.rounds):
        for name in (list(syncs) if r % 2 else list(syncs)[::-1]):
            state, (grads, weights) = states[name], syncs[name]
            state._needs_sync = True
            t0 = time.perf_counter()
            grads(state)
            t1 = time.perf_counter()
            weights(state)
            t2 = time.perf_counter()
            if r >= WARMUP:
                times[name][0].append(t1 - t0)
                times[name][1].append(t2 - t1)
    print(f"{a.arch}, {len(params)} parameters, device {a.device}, torch {torch.__version__}, "
          f"median of {a.rounds} rounds (ms per update)")
    print("| syncs | gradients -> fp32 | fp32 -> weights | both |\n|---|---:|---:|---:|")
    for name, (g, w) in times.items():
        g, w = statistics.median(g) * 1e3, statistics.median(w) * 1e3
        print(f"| {name} | {g:.3f} | {w:.3f} | {g + w:.3f} |")


if __name__ == "__main__":
    main()
