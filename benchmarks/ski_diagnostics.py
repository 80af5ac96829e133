"""Why SKI-TNN's low-rank part drowned its band, measured: the scales the SKI-quality issue asks about.

    python benchmarks/ski_diagnostics.py [--n 512] [--dim 384] [--out results/ski-diagnostics] [--force]

For each ``--ski-lowrank`` mode (``sum``: the knots are f itself, the scale of checkpoints before the
option; ``mean``: f = knots / h, the plugin's default) of a SKI-TNO with the paper's settings
(r = 32, m = 17, lambda = 0.99), the same knots drawn N(0, 1/r) in both (the initialisation of
``sum``; ``mean`` starts them at zero), on unit-variance input (``--dim``
channels, batch 4, length ``--n``):

* **at initialisation**: the rms of the band's output and of the low-rank part's, and how smooth each
  is along the sequence (the correlation of neighbouring positions: 1 is a signal that carries no
  position-to-position information);
* **the gradients**: the rms of dL/dtaps and dL/dknots for a unit-variance upstream gradient;
* **what the learning rate does to each part**: Adam's first step moves every parameter by lr (its
  update is lr * m / sqrt(v) = lr * sign(g) at step 1), so the change of each part's output per unit
  of lr is the part applied with the parameters sign(g): the output change of one step of lr = 1e-3
  (the recipe's peak) is given beside the output's own rms;
* **the time warp**: which of the 2r knots the inducing points' lags reach at each length
  (x = sign(t) lambda^|t| at the lags k h, h = (n - 1) / (r - 1)): a knot no lag reaches never gets a
  gradient.

``--time`` adds the cost of each mode: one SKI-TNO layer's forward + backward at the layer benchmark's shape
(batch 4, d1 = 1536, n = 2048, fp32), the modes timed in interleaved rounds in this process, each mode's
median and its ratio to ``sum`` (the computation of the code before the option: f = knots, no scaling).

**Whole models at initialisation** (``--archs``, default the Wikitext-103 presets, seeds ``--seeds``): a fresh
model of each arch (fairseq's GPT-2 dictionary size, 50,264 symbols), in eval mode, and the rms of its first
layer's TNO output and GTU output on unit-variance input of the first ``--n`` positions (the TNO's input has the
GTU width d1 = 3 d), and the std of its logits on random tokens: where a masked model starts (the authors'
RoBERTa initialisation, ``fairseq_tnn.models.tnn_mlm.init_like_roberta``) against a causal one (PyTorch's
defaults, as the authors' causal models).

``checkpoint_scales`` (used by benchmarks/quality.py) measures the band's and the low-rank part's
output rms layer by layer in trained checkpoints, on a validation batch.
Writes ``ski-diagnostics.json`` and ``ski-diagnostics.md`` into ``--out``.
"""
import argparse
import glob
import os
import re
import statistics
import sys
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.measure import add_out_options, refuse_overwrite, write_results  # noqa: E402
from fairseq_tnn.modules.tno import build_tno  # noqa: E402
from fairseq_tnn.ops.ski import ski_tno, warped_lags  # noqa: E402

PAPER = dict(ski_rank=32, ski_taps=17, ski_warp_decay=0.99)
WT103_ARCHS = ["tnn_mlm_wt103", "fd_tnn_mlm_wt103", "ski_tnn_mlm_wt103", "tnn_lm_wt103", "fd_tnn_lm_wt103"]
GPT2_VOCAB = 50264
LR = 1e-3


def rms(t: torch.Tensor) -> float:
    return t.double().pow(2).mean().sqrt().item()


def neighbour_correlation(y: torch.Tensor) -> float:
    """Correlation of y at neighbouring positions along the last dim (channel-major y (d, b, n))."""
    a, b = y[..., 1:].double(), y[..., :-1].double()
    return ((a * b).sum() / (a.norm() * b.norm())).item()


def parts(tno, x: torch.Tensor):
    """The band's and the low-rank part's outputs of a SKI-TNO, channel-major x (d, b, n)."""
    n = x.shape[-1]
    knots = tno.lowrank_knots(n)
    band = ski_tno(x, tno.conv_weight, None, tno.warp_decay, layout="dbn")
    low = ski_tno(x, torch.zeros_like(tno.conv_weight), knots, tno.warp_decay, layout="dbn") if knots is not None else None
    return band, low


def init_and_step(mode: str, n: int, dim: int, seed: int = 0) -> Dict:
    torch.manual_seed(seed)
    tno = build_tno("ski", dim, False, **PAPER, ski_lowrank=mode)
    with torch.no_grad():  # the same N(0, 1/r) knots in every mode ('mean' starts at zero by default)
        tno.knots.normal_(0.0, PAPER["ski_rank"] ** -0.5)
    x = torch.randn(dim, 4, n)
    band, low = parts(tno, x)
    g = torch.randn(dim, 4, n)
    ((band + low) * g).sum().backward()
    with torch.no_grad():
        # one Adam step of size lr at step 1: every parameter moves by lr * sign(its gradient)
        step_band = ski_tno(x, LR * tno.conv_weight.grad.sign(), None, tno.warp_decay, layout="dbn")
        step_knots = LR * tno.knots.grad.sign() * tno.lowrank_scale(n)
        step_low = ski_tno(x, torch.zeros_like(tno.conv_weight), step_knots, tno.warp_decay, layout="dbn")
    return {"mode": mode, "n": n, "dim": dim, "band_rms": rms(band), "lowrank_rms": rms(low),
            "band_neighbour_corr": neighbour_correlation(band), "lowrank_neighbour_corr": neighbour_correlation(low),
            "grad_taps_rms": rms(tno.conv_weight.grad), "grad_knots_rms": rms(tno.knots.grad),
            "step_band_rms": rms(step_band), "step_lowrank_rms": rms(step_low)}


def model_init_scales(arch: str, n: int, seed: int, vocab: int = GPT2_VOCAB) -> Dict:
    """A fresh ``arch`` model (seed ``seed``), eval mode: the rms of its first layer's TNO and GTU outputs on
    unit-variance input of length n, and the std of its logits on random tokens."""
    from fairseq_tnn.models.build import build_arch
    torch.manual_seed(seed)
    model = build_arch(arch, vocab).eval()
    stack = model.encoder if hasattr(model, "encoder") else model.decoder
    layer = stack.layers[0]
    dim = stack.embed_tokens.weight.shape[1]
    with torch.no_grad():
        tno_out = layer.gtu.tno(torch.randn(2, n, layer.gtu.tno.dim))
        gtu_out = layer.gtu(torch.randn(2, n, dim))
        logits = model(torch.randint(4, vocab, (2, n)))[0]
    return {"arch": arch, "seed": seed, "n": n, "tno_rms": rms(tno_out), "gtu_rms": rms(gtu_out),
            "logits_std": logits.double().std().item()}


def warp_coverage(n: int, r: int = 32, lam: float = 0.99) -> Dict:
    """The knots (0 .. 2r, at x = (j - r) / r) that the lags of A reach at length n."""
    r_eff = min(r, n)
    x = warped_lags(n, r_eff, lam, None)
    u = (x.clamp(-1, 1) + 1) * r
    lo = u.floor().clamp(0, 2 * r - 1).long()
    reached = sorted({int(j) for j in torch.cat([lo, lo + 1]).tolist() if j != r})  # the knot at 0 is fixed
    positive = x[r_eff:] if r_eff > 1 else x[:0]
    return {"n": n, "h": (n - 1) / (r_eff - 1) if r_eff > 1 else 0.0, "reached": len(reached), "of": 2 * r,
            "largest_x": positive.max().item() if len(positive) else 0.0,
            "smallest_x": positive.min().item() if len(positive) else 0.0,
            "lam_pow_n_minus_1": lam ** (n - 1)}


def checkpoint_scales(save_dir: str, data_bin: str, section: str, tokens: int, device: str = "cpu") -> List[Dict]:
    """For each ``checkpoint_*_<update>.pt`` in save_dir: per layer, the rms of the SKI-TNO's band and low-rank
    outputs on the TNO's real input (the GTU's v) for the first validation batch (fairseq's own loading)."""
    from fairseq import checkpoint_utils, utils
    import fairseq_tnn
    from fairseq_tnn.modules.tno.ski import SkiTno
    fairseq_tnn.register()  # the plugin's tasks and models, as --user-dir makes them known to fairseq
    out = []
    paths = glob.glob(os.path.join(save_dir, "checkpoint_*_*.pt"))
    for path in sorted(paths, key=lambda p: int(re.findall(r"_(\d+)\.pt$", p)[0])):
        update = int(re.findall(r"_(\d+)\.pt$", path)[0])
        models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
            [path], arg_overrides={"data": data_bin}, suffix="")
        model = models[0].to(device).eval()
        task.load_dataset("valid")
        itr = task.get_batch_iterator(task.dataset("valid"), max_sentences=4, seed=1).next_epoch_itr(shuffle=False)
        sample = utils.move_to_cuda(next(itr)) if device == "cuda" else next(itr)
        tnos = [m for m in model.modules() if isinstance(m, SkiTno)]
        seen = {}

        def hook(module, inputs):
            seen[module] = inputs[0].detach()

        handles = [t.register_forward_pre_hook(hook) for t in tnos]
        with torch.no_grad():
            model(**sample["net_input"])
            band_rms, low_rms = [], []
            for t in tnos:
                band, low = parts(t, seen[t])
                band_rms.append(rms(band))
                low_rms.append(rms(low) if low is not None else 0.0)
        for h in handles:
            h.remove()
        out.append({"update": update, "band_rms": band_rms, "lowrank_rms": low_rms})
    return out


def time_modes(rounds: int, n: int = 2048, dim: int = 1536, batch: int = 4) -> Dict:
    """Median forward + backward time (ms) of a SKI-TNO layer per mode, interleaved rounds (order reversed
    every round), and each mode's median per-round ratio to 'sum'."""
    torch.manual_seed(0)
    modes = ["sum", "mean", "off"]
    tnos = {m: build_tno("ski", dim, False, **PAPER, ski_lowrank=m) for m in modes}
    x = torch.randn(dim, batch, n, requires_grad=True)
    g = torch.randn(dim, batch, n)

    def step(tno):
        start = time.perf_counter()
        tno(x, layout="dbn").backward(g)
        return (time.perf_counter() - start) * 1000

    for m in modes:  # warm-up
        step(tnos[m])
    times = {m: [] for m in modes}
    for i in range(rounds):
        for m in (modes if i % 2 == 0 else modes[::-1]):
            times[m].append(step(tnos[m]))
    return {"shape": f"batch {batch}, d1 {dim}, n {n}, fp32, {torch.get_num_threads()} threads", "rounds": rounds,
            "ms": {m: statistics.median(t) for m, t in times.items()},
            "ratio_to_sum": {m: statistics.median(a / b for a, b in zip(times[m], times["sum"])) for m in modes}}


def markdown(result: Dict) -> str:
    lines = [f"SKI-TNO with the paper's r = 32, m = 17, lambda = 0.99, knots N(0, 1/r) in both modes, unit-variance "
             f"input, {result['dim']} channels, batch 4 (benchmarks/ski_diagnostics.py).", "",
             "| --ski-lowrank | n | band rms | low-rank rms | low rank / band | neighbour corr. band | low rank | "
             "dL/dtaps rms | dL/dknots rms | one Adam step (lr 1e-3): band | low rank |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result["scales"]:
        lines.append(f"| {s['mode']} | {s['n']} | {s['band_rms']:.3f} | {s['lowrank_rms']:.3f} | "
                     f"{s['lowrank_rms'] / s['band_rms']:.2f} | {s['band_neighbour_corr']:.3f} | "
                     f"{s['lowrank_neighbour_corr']:.3f} | {s['grad_taps_rms']:.3g} | {s['grad_knots_rms']:.3g} | "
                     f"{s['step_band_rms']:.2e} | {s['step_lowrank_rms']:.2e} |")
    lines += ["", "Knots reached by the time warp (lags k h of the inducing points, x = lambda^(k h)):", "",
              "| n | h | knots reached (of 2r) | largest x | smallest x | lambda^(n-1) |", "|---:|---:|---:|---:|---:|---:|"]
    for w in result["warp"]:
        lines.append(f"| {w['n']} | {w['h']:.1f} | {w['reached']} of {w['of']} | {w['largest_x']:.3f} | "
                     f"{w['smallest_x']:.2e} | {w['lam_pow_n_minus_1']:.2e} |")
    if result.get("models"):
        lines += ["", f"Whole models at initialisation (fresh, eval mode, first layer, unit-variance input of "
                      f"{result['models'][0]['n']} positions; mean over seeds {result['seeds']}):", "",
                  "| arch | TNO output rms | GTU output rms | logits std |", "|---|---:|---:|---:|"]
        for arch in dict.fromkeys(m["arch"] for m in result["models"]):
            rows = [m for m in result["models"] if m["arch"] == arch]
            cells = [statistics.mean(m[k] for m in rows) for k in ("tno_rms", "gtu_rms", "logits_std")]
            lines.append(f"| {arch} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    if "time" in result:
        t = result["time"]
        lines += ["", f"SKI-TNO layer forward + backward ({t['shape']}; median of {t['rounds']} interleaved rounds):", "",
                  "| --ski-lowrank | ms | / sum |", "|---|---:|---:|"]
        for m, ms in t["ms"].items():
            lines.append(f"| {m} | {ms:.1f} | {t['ratio_to_sum'][m]:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[512, 2048], help="sequence lengths")
    p.add_argument("--dim", type=int, default=384, help="channels (the GTU width d1)")
    p.add_argument("--time", type=int, default=0, metavar="ROUNDS",
                   help="also time a SKI-TNO layer in each mode, this many interleaved rounds (0: don't)")
    p.add_argument("--archs", nargs="*", default=WT103_ARCHS,
                   help="whole models to measure at initialisation (default: the Wikitext-103 presets; none: skip)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds of the --archs models")
    add_out_options(p, os.path.join("results", "ski-diagnostics"))
    args = p.parse_args(argv)
    from fairseq_tnn.models.build import build_arch  # noqa: F401  (registers the archs)
    from fairseq.models import ARCH_MODEL_REGISTRY
    for arch in args.archs:
        if arch not in ARCH_MODEL_REGISTRY or not arch.startswith(("tnn_", "fd_tnn_", "ski_tnn_")):
            p.error(f"--archs: {arch!r} is not an architecture of this plugin")
    for n in args.n:
        if n < 2:
            p.error(f"--n={n} is invalid: must be >= 2")
    if args.dim < 1:
        p.error(f"--dim={args.dim} is invalid: must be >= 1")
    if args.time < 0:
        p.error(f"--time={args.time} is invalid: must be >= 0")
    refuse_overwrite(p, args, "ski-diagnostics.json")
    os.makedirs(args.out, exist_ok=True)
    result = {"dim": args.dim, "seeds": args.seeds,
              "models": [model_init_scales(a, args.n[0], seed) for a in args.archs for seed in args.seeds],
              "scales": [init_and_step(mode, n, args.dim) for n in args.n for mode in ("sum", "mean")],
              "warp": [warp_coverage(n) for n in sorted(set(args.n) | {512, 2048, 14336})]}
    if args.time:
        result["time"] = time_modes(args.time)
    md = markdown(result)
    write_results(args.out, "ski-diagnostics", result, md)
    print(md)


if __name__ == "__main__":
    main()
