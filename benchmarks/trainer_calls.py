"""Host time of the model calls fairseq's Trainer makes at every update besides forward and backward: two
``model.train()`` and one ``model.set_num_updates``, the plugin's (fairseq_tnn/models/trainer_calls.py) against
nn.Module's and fairseq's, side by side in one run, for the Wikitext-103 models at their published size.

    .venv/bin/python benchmarks/trainer_calls.py [--rounds 200]

The same model, built twice: one with the plugin's calls, one whose instance (and encoder) calls nn.Module's
``train`` and fairseq's ``set_num_updates`` instead. Each round times one update's three calls on each, in
alternating order; the medians after 20 warm-up rounds are printed, in milliseconds of host time per update (on a
GPU, time in which a GPU that has finished the previous update's kernels waits for the next). Then the Trainer's seed
of every update (``Trainer._set_seed``), fairseq's against the plugin's ``direct-seed`` patch
(fairseq_tnn/patches/seed.py), called ``SEED_DEPTH`` frames below the benchmark's own, about where fairseq-train's
update calls it (torch's seed formats the Python stack for each backend not initialised, so its cost grows with the
depth): a row ``| the Trainer's seed | - | fairseq's | plugin's |``. Then a small model's whole update (``tnn_lm_wt103`` at
width 16, where host time is nearly all of it) through fairseq's ``Trainer.train_step``, which reads its OmegaConf config
some 40 times, and through the plugin's ``config-snapshot`` patch (fairseq_tnn/patches/config_snapshot.py): a row
``| a small model's update, its config read | - | fairseq's | plugin's |``. Last, the same update with fairseq's logging
of it and with the plugin's ``update-stats-without-reads`` patch (fairseq_tnn/patches/update_stats.py), whose metrics
are read only when looked into: a row ``| a small model's update, its stats logged | - | fairseq's | plugin's |``.
"""
import argparse
import os
import statistics
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch import nn  # noqa: E402

ARCHS = ["tnn_lm_wt103", "fd_tnn_lm_wt103", "tnn_mlm_wt103", "ski_tnn_mlm_wt103"]
WARMUP = 20
SEED_DEPTH = 12


def fairseqs_calls(model):
    """``model`` with nn.Module's ``train`` and fairseq's ``set_num_updates`` on its instance (and its encoder's),
    where the plugin's class defines its own."""
    from fairseq.models import BaseFairseqModel, FairseqEncoder

    from fairseq_tnn.models.trainer_calls import modules_of
    for m in modules_of(model):
        m.train = types.MethodType(nn.Module.train, m)
        if isinstance(m, FairseqEncoder):
            m.set_num_updates = types.MethodType(FairseqEncoder.set_num_updates, m)
    model.set_num_updates = types.MethodType(BaseFairseqModel.set_num_updates, model)
    return model


def update_calls(model, num_updates: int) -> None:
    """What fairseq's ``Trainer.train_step`` and ``FairseqTask.train_step`` call on the model in one update."""
    model.train()
    model.train()
    model.set_num_updates(num_updates)


def interleaved_medians(calls: dict, rounds: int) -> dict:
    """{name: median ms of ``calls[name](r)``} over ``rounds`` rounds after ``WARMUP``, the calls of a round in
    alternating order."""
    times = {name: [] for name in calls}
    for r in range(WARMUP + rounds):
        for name in (list(calls) if r % 2 else list(calls)[::-1]):
            t = time.perf_counter()
            calls[name](r)
            if r >= WARMUP:
                times[name].append((time.perf_counter() - t) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _nested(depth: int, fn):
    return fn() if depth == 0 else _nested(depth - 1, fn)


def seed_times(rounds: int) -> dict:
    """Median ms of fairseq's ``Trainer._set_seed`` and of the plugin's, interleaved, ``SEED_DEPTH`` frames down."""
    from fairseq.trainer import Trainer

    from fairseq_tnn.patches import base
    trainer = types.SimpleNamespace(cfg=types.SimpleNamespace(common=types.SimpleNamespace(seed=1)),
                                    get_num_updates=lambda: 0)
    seeds = {"fairseq": base.resolve("fairseq.trainer:Trainer._set_seed"), "plugin": Trainer._set_seed}
    return interleaved_medians({name: (lambda r, f=f: _nested(SEED_DEPTH, lambda: f(trainer)))
                                for name, f in seeds.items()}, rounds)


def _small_update():
    """A Trainer of ``tnn_lm_wt103`` at width 16 on the CPU (fp32) and its batch, 2 x 16 tokens: an update where host
    time is nearly all of it."""
    import tempfile

    from benchmarks import trainer as tr
    with tempfile.TemporaryDirectory() as tmp:
        trainer = tr.build_trainer("causal", "tnn_lm_wt103", None, 16, "cpu", "fp32", False, tr._dictionary_dir(tmp, 64),
                                   True, width=16)
    return trainer, tr.synthetic_sample("causal", 16, 2, 64)


def config_times(rounds: int) -> dict:
    """Median ms of a small model's whole update (``Trainer.train_step``, fp32 on the CPU: ``tnn_lm_wt103`` at width 16,
    2 x 16 tokens, where host time is nearly all of it) with fairseq's ``train_step``, which reads the Trainer's OmegaConf
    config, and with the plugin's ``config-snapshot`` patch, which reads a snapshot of it; interleaved, on one
    Trainer."""
    from fairseq.trainer import Trainer

    from fairseq_tnn.patches import base
    trainer, sample = _small_update()
    steps = {"fairseq": base.resolve("fairseq.trainer:Trainer.train_step"), "plugin": Trainer.train_step}
    steps["plugin"](trainer, [sample])  # builds the optimizer, after which the snapshot is taken
    return interleaved_medians({name: (lambda r, f=f: f(trainer, [sample])) for name, f in steps.items()}, rounds)


def stats_times(rounds: int) -> dict:
    """Median ms of a small model's whole update (as :func:`config_times`) with fairseq's ``_reduce_and_log_stats``,
    which reads the gradient norm's ``isfinite`` and the returned metrics' values, and with the plugin's
    ``update-stats-without-reads`` patch, which returns them unread; interleaved, on one Trainer."""
    from fairseq.trainer import Trainer

    from fairseq_tnn.patches import base
    trainer, sample = _small_update()
    plugins = Trainer._reduce_and_log_stats
    logging = {"fairseq": base.resolve("fairseq.trainer:Trainer._reduce_and_log_stats"), "plugin": plugins}

    def update(f):
        Trainer._reduce_and_log_stats = f
        trainer.train_step([sample])

    try:
        update(plugins)  # builds the optimizer
        return interleaved_medians({name: (lambda r, f=f: update(f)) for name, f in logging.items()}, rounds)
    finally:
        Trainer._reduce_and_log_stats = plugins


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=200, help="timed rounds (default 200)")
    p.add_argument("--archs", nargs="+", default=ARCHS, help=f"architectures (default: {' '.join(ARCHS)})")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds={a.rounds} is invalid: must be an integer >= 1")
    from fairseq_tnn import register
    from fairseq_tnn.models.build import build_arch
    register()
    print(f"torch {torch.__version__}; two train() and one set_num_updates per update, median of {a.rounds} rounds "
          "(ms of host time per update)")
    print("| model | modules | fairseq's | plugin's |\n|---|---:|---:|---:|")
    for arch in a.archs:
        models = {"fairseq": fairseqs_calls(build_arch(arch, 1000)), "plugin": build_arch(arch, 1000)}
        ms = interleaved_medians({name: (lambda r, m=m: update_calls(m, r)) for name, m in models.items()}, a.rounds)
        n = len(list(models["plugin"].modules()))
        print(f"| {arch} | {n} | {ms['fairseq']:.3f} | {ms['plugin']:.3f} |")
    ms = seed_times(a.rounds)
    print(f"| the Trainer's seed | - | {ms['fairseq']:.3f} | {ms['plugin']:.3f} |")
    ms = config_times(a.rounds)
    print(f"| a small model's update, its config read | - | {ms['fairseq']:.3f} | {ms['plugin']:.3f} |")
    ms = stats_times(a.rounds)
    print(f"| a small model's update, its stats logged | - | {ms['fairseq']:.3f} | {ms['plugin']:.3f} |")


if __name__ == "__main__":
    main()
