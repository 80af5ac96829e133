"""A model's layers' TNO spectra computed together (``fairseq_tnn.modules.layers.layer_spectra``: the RPEs of all
layers as one batched MLP) against each layer computing its own, side by side in one process: the operations a
training forward and backward dispatch (``benchmarks/opcount.py``'s count; on a GPU each costs 10-25 microseconds
of host time, eagerly) and the CPU time of one, for the Wikitext-103 presets whose TNOs have an RPE.

    .venv/bin/python benchmarks/stacked_spectra.py [--width 64] [--rounds 9] [--threads 1]

Each preset at its published depth, at ``--width`` (the counts do not depend on it) and batch 1 x 512, eager,
fp32, dropout 0. Each round times one forward and backward of each path, the order alternating; the median
process CPU time of the rounds is printed, in ms.
"""
import argparse
import os
import statistics
import sys
import time
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.opcount import count  # noqa: E402

ARCHS = ["tnn_lm_wt103", "tnn_lm_wt103_rpe3", "fd_tnn_lm_wt103", "tnn_mlm_wt103", "fd_tnn_mlm_wt103"]


def per_layer():
    """A context in which the models' stacks let each layer compute its own spectrum."""
    def each_its_own(layers, *args, **kwargs):
        return [None] * len(layers)
    return mock.patch.multiple("fairseq_tnn.models.tnn_lm", layer_spectra=each_its_own), \
        mock.patch.multiple("fairseq_tnn.models.tnn_mlm", layer_spectra=each_its_own)


def step(model, tokens):
    model.zero_grad(set_to_none=True)
    model(tokens)[0].float().pow(2).mean().backward()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=64, help="embedding width (default 64; the counts do not depend on it)")
    p.add_argument("--rounds", type=int, default=9, help="timed rounds (default 9)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--archs", nargs="+", default=ARCHS, help=f"presets (default: {' '.join(ARCHS)})")
    a = p.parse_args(argv)
    for name, value, least in (("--width", a.width, 1), ("--rounds", a.rounds, 1), ("--threads", a.threads, 1)):
        if value < least:
            p.error(f"{name}={value} is invalid: must be an integer >= {least}")
    from fairseq_tnn import register
    from fairseq_tnn.models.build import build_arch
    register()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s); batch 1 x 512, width {a.width}, fp32, forward and "
          f"backward; CPU ms: median of {a.rounds} rounds")
    print("| preset | ops, each layer its own | ops, together | CPU ms, each its own | CPU ms, together |")
    print("|---|---:|---:|---:|---:|")
    for arch in a.archs:
        causal = "_mlm_" not in arch
        torch.manual_seed(0)
        model = build_arch(arch, 1000, dropout=0.0,
                           **{"decoder_embed_dim" if causal else "encoder_embed_dim": a.width, "glu_dim": a.width})
        tokens = torch.randint(4, 1000, (1, 512))
        ops, times = {}, {"own": [], "together": []}
        for r in range(a.rounds + 1):
            for path in (["own", "together"] if r % 2 else ["together", "own"]):
                patches = per_layer() if path == "own" else ()
                for patch in patches:
                    patch.start()
                try:
                    if r == 0:
                        ops[path] = count(lambda: step(model, tokens))[1].total
                        continue
                    t = time.process_time()
                    step(model, tokens)
                    times[path].append((time.process_time() - t) * 1e3)
                finally:
                    for patch in patches:
                        patch.stop()
        own, together = (statistics.median(times[k]) for k in ("own", "together"))
        print(f"| {arch} | {ops['own']:,} | {ops['together']:,} | {own:.1f} | {together:.1f} |", flush=True)


if __name__ == "__main__":
    main()
