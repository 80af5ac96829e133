#!/usr/bin/env python
"""Pictures of what a TNN learned: the Toeplitz kernels of every TNO layer of a checkpoint.

    python scripts/plot_kernels.py checkpoints/fd_tnn_lm_wt103/checkpoint_best.pt --out results/kernels/fd
    python scripts/plot_kernels.py CKPT --layers 0 5 --channels 0 1 2 3 --length 512 --out DIR
    python scripts/plot_kernels.py --init-study --out results/kernels/init

The kernels are computed by the model's own TNO modules (fairseq_tnn/modules/tno/), never re-derived:
  tnn  TnnTno.kernel(n): the RPE MLP of the lag times lambda^|t|, the coefficients its forward applies
  fd   FdTno.kernel(n): the inverse FFT of its spectrum (RPE MLP of the frequency; Hilbert transform when causal)
  ski  SkiTno's two parts from fairseq_tnn/ops/ski.py: the band (its conv_weight taps) and the low-rank
       W A W^T (ski_lowrank_dense of the f its knots give at the length, SkiTno.lowrank_knots); the operator is their sum. SKI's low-rank part is only
       approximately Toeplitz, so its "impulse response" is the column of the middle position.
For every layer (PNG layer<L>.png) and every channel in --channels: the impulse response against the lag (both
directions for a bidirectional model), the magnitude and the phase of the frequency response on [0, pi], and the
Toeplitz matrix of the first channel as a heat map at the length (default: the training length in the
checkpoint's config). SKI layers also get layer<L>-ski-parts.png (band, low-rank and sum, each as impulse response
and heat map). All numbers go to kernels.json.

--init-study reproduces the SKI-TNN paper's appendix figures on smoothness and decay (Moreno et al., 2023,
"SKI to go Faster: Accelerating Toeplitz Neural Networks via Asymmetric Kernels", appendix "visualizations of
smoothness and decay"): randomly initialised FD RPE MLPs (fairseq_tnn's FdTno, causal unless --bidirectional)
with ReLU, SiLU and GeLU activations; for each, frequency responses and impulse responses (init-<act>.png), and
the decay of the impulse responses' magnitude on a log scale (init-decay.png), numbers in init-study.json. The
MLP is sampled on [0, pi] and extended to the circle by symmetry (even real part; odd imaginary part forced to 0
at 0 and pi), so the extended response has kinks at 0 and pi whatever the activation: expect a power-law tail
(about 1/t^2 causal, slower bidirectional) under the fast initial decay, not the super-exponential decay the
paper's theorems give for an MLP that is smooth on the whole circle.

Bad input (not a checkpoint, not a TNN model, a layer or channel out of range, an existing --out) stops with a
message before anything is written; --force replaces an existing --out directory's files.
"""
import argparse
import json
import math
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INIT_ACTIVATIONS = ("relu", "silu", "gelu")


def fail(msg):
    """Bad input (a missing or unreadable checkpoint, a value out of range, an --out to keep): the error, exit 2."""
    print(f"plot_kernels.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


# ---------------------------------------------------------------- loading

def load_model(path: Path):
    """(model, cfg) of a fairseq-tnn checkpoint, built from its saved config with fairseq's checkpoint loader."""
    sys.path.insert(0, str(ROOT))
    import torch  # noqa: F401

    import fairseq_tnn
    fairseq_tnn.register()  # tnn_lm / tnn_mlm
    from fairseq import checkpoint_utils
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY

    from fairseq_tnn.models.build import VocabTask, dictionary_of_size
    from fairseq_tnn.models.tnn_lm import TnnLanguageModel
    from fairseq_tnn.models.tnn_mlm import TnnMaskedLMModel

    if not path.is_file():
        fail(f"checkpoint not found: {path}")
    try:
        state = checkpoint_utils.load_checkpoint_to_cpu(str(path))
    except Exception as e:  # a file torch cannot read as a checkpoint
        fail(f"{path} is not a fairseq checkpoint ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})")
    cfg = state.get("cfg") if isinstance(state, dict) else None
    if cfg is None or cfg.get("model") is None or "model" not in state:
        fail(f"{path} is not a fairseq checkpoint (no model config or weights in it)")
    name = cfg.model.get("_name") or cfg.model.get("arch")
    model_cls = ARCH_MODEL_REGISTRY.get(name) or MODEL_REGISTRY.get(name)
    if model_cls not in (TnnLanguageModel, TnnMaskedLMModel):
        fail(f"{path} holds a {name!r} model, not a TNN: plot_kernels.py draws the Toeplitz kernels of fairseq-tnn "
             "models (tnn_lm, tnn_mlm; architectures tnn_lm_*, fd_tnn_lm_*, tnn_mlm_*, fd_tnn_mlm_*, ski_tnn_mlm_*)")
    embed = [v for k, v in state["model"].items() if k.endswith("embed_tokens.weight")]
    if not embed:
        fail(f"{path}: no token embedding in the weights; is it a complete fairseq-tnn checkpoint?")
    model = model_cls.build_model(cfg.model, VocabTask(dictionary_of_size(embed[0].shape[0])))
    model.load_state_dict(state["model"], strict=True)
    model.eval()
    return model, cfg


def tno_layers(model):
    from fairseq_tnn.modules.layers import TnnLayer
    return [m.gtu.tno for m in model.modules() if isinstance(m, TnnLayer)]


def tno_kind(tno):
    if tno.name not in ("tnn", "fd", "ski"):
        raise TypeError(f"no pictures for TNO type {tno.name!r} ({type(tno).__name__})")
    return tno.name


def tno_channels(tno):
    kind = tno_kind(tno)
    if kind == "ski":
        return tno.conv_weight.shape[0]
    out = tno.rpe.out.out_features
    return out if (kind == "tnn" or tno.causal) else out // 2


# ---------------------------------------------------------------- kernels through the model's modules

def _toeplitz(pos, neg):
    """(c, n, n) matrices T[i, j] = k(i - j) from pos (c, n) (lags 0..n-1) and neg (c, n-1) (lags -1..-(n-1))."""
    from fairseq_tnn.ops.toeplitz import toeplitz_dense
    return toeplitz_dense(pos.t(), neg.t())


def layer_kernels(tno, n: int, channels):
    """What one TNO layer does at length n, for the given channels (float64 numpy arrays):
    lags (2n-1,), impulse (c, 2n-1) (T[i, j] as a function of i - j; for SKI the column of the middle position),
    omega (f,), spectrum (c, f) complex, matrix (c, n, n) and, for SKI, the parts band/lowrank (c, n, n)."""
    import torch

    ch = torch.as_tensor(list(channels), dtype=torch.long)
    kind = tno_kind(tno)
    out = {"kind": kind, "causal": bool(getattr(tno, "causal", False))}
    with torch.no_grad():
        if kind in ("tnn", "fd"):
            pos, neg = tno.kernel(n)  # (d, n), (d, n-1) or None when causal: the operator the layer applies
            pos = pos[ch].double()
            neg = neg[ch].double() if neg is not None else pos.new_zeros(len(ch), n - 1)
            matrix = _toeplitz(pos, neg)
            impulse = torch.cat([neg.flip(-1), pos], dim=-1)  # lags -(n-1) .. n-1
        else:
            from fairseq_tnn.ops.ski import band_dense, ski_lowrank_dense
            band = band_dense(n, tno.conv_weight[ch].double())
            knots = tno.lowrank_knots(n)  # f at length n (--ski-lowrank); None: the band alone
            lowrank = (ski_lowrank_dense(n, knots[:, ch].double(), tno.warp_decay) if knots is not None
                       else torch.zeros_like(band))
            matrix = band + lowrank
            mid = (n - 1) // 2
            impulse = torch.full((len(ch), 2 * n - 1), float("nan"), dtype=torch.float64)
            parts = {}
            for name, m in (("band", band), ("lowrank", lowrank), ("sum", matrix)):
                col = torch.full((len(ch), 2 * n - 1), float("nan"), dtype=torch.float64)
                col[:, n - 1 - mid: 2 * n - 1 - mid] = m[:, :, mid]  # lag i - mid for i = 0 .. n-1
                parts[name] = col
            impulse = parts["sum"]
            out["parts"] = {"band": band.numpy(), "lowrank": lowrank.numpy()}
            out["part_impulse"] = {k: v.numpy() for k, v in parts.items()}
        lags = torch.arange(-(n - 1), n)
        # frequency response: the DTFT of the impulse response (lags with a value) on [0, pi]
        size = 1 << max(1, math.ceil(math.log2(2 * n)))
        k = torch.nan_to_num(impulse)
        circ = torch.zeros(len(ch), size, dtype=torch.float64)
        circ[:, :n] = k[:, n - 1:]
        if n > 1:
            circ[:, size - (n - 1):] = k[:, : n - 1]
        spectrum = torch.fft.rfft(circ)
        omega = torch.arange(size // 2 + 1, dtype=torch.float64) * (2 * math.pi / size)
    out.update(lags=lags.numpy(), impulse=impulse.numpy(), omega=omega.numpy(), spectrum=spectrum.numpy(),
               matrix=matrix.numpy())
    return out


# ---------------------------------------------------------------- drawing

def _plt():
    import logging

    # before matplotlib is imported (it logs while importing): fairseq's logging setup would show its debug lines
    logging.getLogger("matplotlib").setLevel(logging.WARNING)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _response_axes(axes, k, channels, title, bidirectional):
    import numpy as np

    ax_t, ax_m, ax_p = axes
    keep = ~np.isnan(k["impulse"][0])
    lags = k["lags"][keep]
    for c, ch in enumerate(channels):
        ax_t.plot(lags, k["impulse"][c][keep], lw=1, label=f"ch {ch}")
        ax_m.plot(k["omega"], np.abs(k["spectrum"][c]), lw=1)
        ax_p.plot(k["omega"], np.angle(k["spectrum"][c]), lw=1)
    ax_t.set_title(f"{title}: impulse response" + (" (both directions)" if bidirectional else ""), fontsize=9)
    ax_t.set_xlabel("lag i - j")
    ax_t.axvline(0, color="grey", lw=0.5)
    ax_t.legend(fontsize=7)
    ax_m.set_title("|frequency response|", fontsize=9)
    ax_m.set_yscale("log")
    ax_p.set_title("phase (rad)", fontsize=9)
    for ax in (ax_m, ax_p):
        ax.set_xlabel("omega")
        ax.set_xlim(0, math.pi)


def _heatmap(fig, ax, m, title):
    import numpy as np

    lim = float(np.abs(m).max()) or 1.0
    im = ax.imshow(m, cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("j")
    ax.set_ylabel("i")
    fig.colorbar(im, ax=ax, fraction=0.046)


def draw_layer(k, layer, channels, n, path):
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4), dpi=80)
    bidirectional = not k["causal"]
    _response_axes(axes[:3], k, channels, f"layer {layer} ({k['kind']})", bidirectional)
    _heatmap(fig, axes[3], k["matrix"][0], f"Toeplitz matrix, channel {channels[0]}, n={n}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def draw_ski_parts(k, layer, channels, n, path):
    import numpy as np

    plt = _plt()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), dpi=80)
    mats = {"band": k["parts"]["band"][0], "lowrank": k["parts"]["lowrank"][0], "sum": k["matrix"][0]}
    for col, name in enumerate(("band", "lowrank", "sum")):
        imp = k["part_impulse"][name]
        keep = ~np.isnan(imp[0])
        for c, ch in enumerate(channels):
            axes[0, col].plot(k["lags"][keep], imp[c][keep], lw=1, label=f"ch {ch}")
        axes[0, col].set_title(f"layer {layer} SKI {name}: column of position {(n - 1) // 2}", fontsize=9)
        axes[0, col].set_xlabel("lag i - j")
        axes[0, col].legend(fontsize=7)
        _heatmap(fig, axes[1, col], mats[name], f"{name}, channel {channels[0]}, n={n}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _json_layer(k, layer, channels):
    import numpy as np

    def arr(a):
        return [None if (isinstance(x, float) and math.isnan(x)) else x for x in np.asarray(a, dtype=float).tolist()]

    keep = ~np.isnan(k["impulse"][0])
    out = {"layer": layer, "kind": k["kind"], "causal": k["causal"], "channels": list(channels),
           "lags": [int(x) for x in k["lags"][keep]], "omega": arr(k["omega"]),
           "impulse": [arr(row[keep]) for row in k["impulse"]],
           "magnitude": [arr(np.abs(s)) for s in k["spectrum"]], "phase": [arr(np.angle(s)) for s in k["spectrum"]],
           "matrix_channel": channels[0], "matrix_first_column": arr(k["matrix"][0][:, 0]),
           "matrix_first_row": arr(k["matrix"][0][0, :])}
    if "parts" in k:
        out["ski_parts"] = {name: [arr(row[keep]) for row in k["part_impulse"][name]] for name in ("band", "lowrank", "sum")}
    return out


# ---------------------------------------------------------------- the two modes

def prepare_out(out: Path, force: bool):
    if out.exists():
        if not out.is_dir():
            fail(f"--out {out} exists and is not a directory")
        if not force:
            fail(f"--out {out} already exists; refusing to overwrite it (--force replaces its files, or choose "
                 "another directory)")
        shutil.rmtree(out)
    out.mkdir(parents=True)


def plot_checkpoint(args):
    model, cfg = load_model(args.checkpoint)
    tnos = tno_layers(model)
    layers = args.layers if args.layers is not None else list(range(len(tnos)))
    bad = [x for x in layers if not 0 <= x < len(tnos)]
    if bad:
        fail(f"--layers {bad[0]} is out of range: the model has {len(tnos)} TNO layers (0..{len(tnos) - 1})")
    if len(set(layers)) != len(layers):
        fail("--layers lists a layer twice")
    n = args.length or int(cfg.task.get("tokens_per_sample") or 0)
    if n < 2:
        fail("the checkpoint's config has no tokens_per_sample; give the length with --length N (N >= 2)")
    for layer in layers:
        d = tno_channels(tnos[layer])
        bad = [c for c in args.channels if not 0 <= c < d]
        if bad:
            fail(f"--channels {bad[0]} is out of range: layer {layer}'s TNO has {d} channels (0..{d - 1})")
    prepare_out(args.out, args.force)
    report = {"checkpoint": str(args.checkpoint), "arch": cfg.model.get("arch") or cfg.model.get("_name"),
              "length": n, "layers": []}
    for layer in layers:
        k = layer_kernels(tnos[layer], n, args.channels)
        draw_layer(k, layer, args.channels, n, args.out / f"layer{layer}.png")
        if k["kind"] == "ski":
            draw_ski_parts(k, layer, args.channels, n, args.out / f"layer{layer}-ski-parts.png")
        report["layers"].append(_json_layer(k, layer, args.channels))
        print(f"layer {layer}: {k['kind']} TNO, {'causal' if k['causal'] else 'bidirectional'}, channels "
              f"{args.channels}, n={n}")
    (args.out / "kernels.json").write_text(json.dumps(report) + "\n")
    print(f"plot_kernels.py: wrote {len(layers)} layer figure(s) and kernels.json to {args.out}", file=sys.stderr)


def decay_lag(mag, threshold=1e-3):
    """The first lag t >= 0 after which |k[t]| / max |k| stays below threshold (len(mag) if never)."""
    import numpy as np

    rel = mag / max(float(mag.max()), 1e-300)
    above = np.nonzero(rel >= threshold)[0]
    return int(above[-1]) + 1 if len(above) else 0


def init_study(args):
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT))
    from fairseq_tnn.modules.tno import FdTno

    n = args.length or 512
    channels = list(args.channels)
    prepare_out(args.out, args.force)
    defaults = FdTno.Settings()
    plt = _plt()
    fig_d, ax_d = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    causal = not args.bidirectional
    report = {"length": n, "causal": causal, "seed": args.seed, "rpe_dim": defaults.rpe_dim,
              "rpe_layers": defaults.rpe_layers, "channels": channels, "activations": {}}
    for act in INIT_ACTIVATIONS:
        torch.manual_seed(args.seed)
        tno = FdTno(max(channels) + 1, causal, rpe_activation=act)
        k = layer_kernels(tno, n, channels)
        pos = np.abs(k["impulse"][:, n - 1:])  # lags 0 .. n-1
        neg = np.abs(k["impulse"][:, : n - 1][:, ::-1])  # lags -1 .. -(n-1)
        envelope = np.maximum(pos[:, 1:], neg) if not causal else pos[:, 1:]
        envelope = np.concatenate([pos[:, :1], envelope], axis=1).max(axis=0)  # max over channels, both directions
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=80)
        for c, ch in enumerate(channels):
            axes[0].plot(k["omega"], k["spectrum"][c].real, lw=1, label=f"ch {ch}")
            axes[1].plot(np.arange(n), k["impulse"][c][n - 1:], lw=1)
        axes[0].set_title(f"FD RPE MLP ({act}), random init: frequency response (real part)", fontsize=9)
        axes[0].set_xlabel("omega")
        axes[0].legend(fontsize=7)
        axes[1].set_title("impulse response, lags >= 0", fontsize=9)
        axes[1].set_xlabel("lag")
        fig.tight_layout()
        fig.savefig(args.out / f"init-{act}.png")
        plt.close(fig)
        ax_d.semilogy(np.arange(n), np.maximum(envelope, 1e-16), lw=1, label=act)
        report["activations"][act] = {
            "omega": k["omega"].tolist(), "spectrum_real": k["spectrum"].real.tolist(),
            "spectrum_imag": k["spectrum"].imag.tolist(), "impulse_lags": k["lags"].tolist(),
            "impulse": k["impulse"].tolist(), "decay_envelope": envelope.tolist(),
            "decay_lag_1e-3": decay_lag(envelope)}
        print(f"{act}: |k[t]| stays below 1e-3 of its maximum from lag {decay_lag(envelope)} on (n={n})")
    ax_d.set_title("decay of the impulse responses (max |k[t]| over channels)", fontsize=9)
    ax_d.set_xlabel("lag |t|")
    ax_d.set_ylabel("|k[t]|")
    ax_d.legend()
    fig_d.tight_layout()
    fig_d.savefig(args.out / "init-decay.png")
    plt.close(fig_d)
    (args.out / "init-study.json").write_text(json.dumps(report) + "\n")
    print(f"plot_kernels.py: wrote init-{{relu,silu,gelu}}.png, init-decay.png and init-study.json to {args.out}",
          file=sys.stderr)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("checkpoint", nargs="?", type=Path, help="a fairseq-tnn checkpoint (not with --init-study)")
    p.add_argument("--out", type=Path, required=True, help="output directory (must not exist, unless --force)")
    p.add_argument("--layers", type=int, nargs="+", help="TNO layers to draw, from 0 (default: all)")
    p.add_argument("--channels", type=int, nargs="+", default=[0, 1, 2, 3],
                   help="channels of each TNO to draw (default 0 1 2 3); the heat map shows the first")
    p.add_argument("--length", type=int, help="sequence length n (default: the checkpoint's tokens_per_sample; "
                                               "512 for --init-study)")
    p.add_argument("--init-study", action="store_true",
                   help="randomly initialised FD RPE MLPs with relu, silu and gelu instead of a checkpoint")
    p.add_argument("--bidirectional", action="store_true",
                   help="--init-study: bidirectional FD-TNOs (default causal, as the paper's FD-TNN language models)")
    p.add_argument("--seed", type=int, default=1, help="--init-study: random seed (default 1)")
    p.add_argument("--force", action="store_true", help="replace an existing --out directory")
    args = p.parse_args(argv)
    if args.init_study == (args.checkpoint is not None):
        p.error("give either a checkpoint or --init-study")
    if not args.init_study and (args.bidirectional or args.seed != 1):
        p.error("--bidirectional and --seed apply to --init-study only")
    if args.init_study and args.layers is not None:
        p.error("--layers applies to a checkpoint only")
    if args.length is not None and args.length < 2:
        p.error(f"--length {args.length}: must be >= 2")
    if any(c < 0 for c in args.channels) or len(set(args.channels)) != len(args.channels):
        p.error(f"--channels {' '.join(map(str, args.channels))}: must be distinct integers >= 0")
    if args.init_study:
        init_study(args)
    else:
        plot_checkpoint(args)


if __name__ == "__main__":
    main()
