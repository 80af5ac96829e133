"""What the benchmark measures: the sizes (full and --quick), the configurations' labels, and the groups of
configurations timed together (the first of each group is the baseline its ratios refer to)."""
from typing import Dict, List

FULL = dict(
    causal_dim=512, bi_dim=768, layers=2, vocab=2000, tokens=1024,
    causal_lengths=[512, 1024, 2048, 4096], bi_lengths=[512, 2048], rpe_length=512, rpe_depths=[1, 2, 3, 4, 5, 6],
    layer_dim=1536, layer_batch=4, layer_lengths=[512, 2048], rounds=5, warmup=1,
)
QUICK = dict(
    causal_dim=32, bi_dim=32, layers=1, vocab=64, tokens=128,
    causal_lengths=[32, 64], bi_lengths=[32, 64], rpe_length=32, rpe_depths=[1, 2, 3, 4, 5, 6],
    layer_dim=48, layer_batch=2, layer_lengths=[64], rounds=2, warmup=1,
)

LABELS = {
    "tnn6": "TNN (RPE 6)", "tnn3": "TNN (RPE 3)", "fd3": "FD-TNN (RPE 3)", "ski": "SKI-TNN (r 32, m 17)",
    "transformer": "transformer_lm", "bound_fixed": "bound: TNN with a fixed spectrum",
    "bound_identity": "bound: no token mixing",
    "tnn": "TNN TNO (RPE 6)", "fd": "FD-TNO (RPE 3)", "ski_op": "SKI-TNO (r 32, m 17)",
    "ski_causal_local": "causal SKI, local sums (ours)", "ski_causal_cumsum": "causal SKI, appendix cumsum",
    "floor": "floor: FFT conv, channel-major, custom backward",
    "floor_autograd": "floor: FFT conv, channel-major, torch autograd",
    "floor_dim2": "floor: FFT conv along dim -2, torch autograd",
    "floor_trainable": "floor + a trainable spectrum (kernel gradient)",
}


def plan(sections: List[str], s: Dict) -> List[Dict]:
    """Groups of configurations; the first of each group is the baseline its ratios refer to."""
    groups = []
    rpe_of = {"tnn6": 6, "tnn3": 3, "fd3": 3, "bound_fixed": 6, "bound_identity": 6}

    def cfg(section, direction, key, n, batch, dim, label=None, **kw):
        if key in rpe_of and "rpe_layers" not in kw:
            kw["rpe_layers"] = rpe_of[key]
        return dict(section=section, direction=direction, key=key, label=label or LABELS[key], n=n, batch=batch,
                    dim=dim, **kw)

    def group(section, direction, n, batch, configs):
        groups.append(dict(section=section, direction=direction, n=n, batch=batch, configs=configs))

    def batch_for(n):
        return max(1, s["tokens"] // n)

    if "causal" in sections:
        for n in s["causal_lengths"]:
            keys = ["tnn6", "tnn3", "fd3", "transformer", "bound_fixed", "bound_identity"]
            group("causal", "causal", n, batch_for(n),
                  [cfg("causal", "causal", k, n, batch_for(n), s["causal_dim"]) for k in keys])
    if "bidirectional" in sections:
        for n in s["bi_lengths"]:
            keys = ["tnn6", "fd3", "ski", "bound_fixed", "bound_identity"]
            group("bidirectional", "bidirectional", n, batch_for(n),
                  [cfg("bidirectional", "bidirectional", k, n, batch_for(n), s["bi_dim"]) for k in keys])
    if "rpe" in sections:
        n = s["rpe_length"]
        group("rpe", "causal", n, batch_for(n), [
            cfg("rpe", "causal", key, n, batch_for(n), s["causal_dim"], label=f"{name} (RPE {depth})", rpe_layers=depth)
            for key, name in (("tnn_rpe", "TNN"), ("fd_rpe", "FD-TNN")) for depth in s["rpe_depths"]])
    if "layer" in sections:
        for direction in ("causal", "bidirectional"):
            for n in s["layer_lengths"]:
                keys = ["tnn", "fd"] + (["ski_op"] if direction == "bidirectional" else
                                        ["ski_causal_local", "ski_causal_cumsum"])
                keys += ["floor", "floor_trainable", "floor_autograd", "floor_dim2"]
                group("layer", direction, n, s["layer_batch"],
                      [cfg("layer", direction, k, n, s["layer_batch"], s["layer_dim"]) for k in keys])
    return groups
