"""What the benchmark reports: its targets, met or missed, the Markdown tables with the published figures
beside ours (benchmarks/published.py), and the plots."""
import os
from typing import Dict, List

from benchmarks.plan import LABELS
from benchmarks.published import AUTHORS_MIB_2048_BI, AUTHORS_MS, PAPER, SKI_PAPER_A100

def _find(groups, section, direction, n, key):
    for grp in groups:
        if grp["section"] == section and grp["direction"] == direction and grp["n"] == n:
            for c in grp["configs"]:
                if c["key"] == key:
                    return c
    return None


def _speedup(fast, slow):
    """slow / fast: the median of the per-round ratios when slow is the group's baseline, else of the medians."""
    if fast is None or slow is None:
        return None
    if fast is not slow and slow.get("is_baseline"):
        return fast["paired_speedup"]["median"]
    return slow["wall_ms"]["median"] / fast["wall_ms"]["median"]


def _mem_ratio(a, b):
    if a is None or b is None or "memory" not in a or "memory" not in b:
        return None
    return a["memory"]["tensor_peak_mib"] / b["memory"]["tensor_peak_mib"]


def targets(groups) -> List[Dict]:
    """The speed and memory targets set for this implementation (against TNN, against each operator's FFT
    floor, against the authors' operators), each with the measured value and whether it is met (None: not
    measured). Each is evaluated only when the groups hold its lengths (n = 512 and 2048)."""
    out = []

    def add(name, value, ok, detail=""):
        out.append(dict(target=name, value=value, met=None if value is None else bool(ok), detail=detail))

    def model(direction, n, key):
        return _find(groups, direction, direction, n, key)

    if model("causal", 512, "fd3") is not None:
        fd, fixed = model("causal", 512, "fd3"), model("causal", 512, "bound_fixed")
        for base, want in (("tnn6", 1.2), ("tnn3", 1.1)):
            v = _speedup(fd, model("causal", 512, base))
            add(f"FD-TNN causal >= {want}x faster than {LABELS[base]}, whole step, n = 512", v, v is not None and v >= want,
                f"upper bound for any operator that FFT-convolves the activations ({LABELS[base]} / "
                f"fixed-spectrum model): x{_fmt(_speedup(fixed, model('causal', 512, base)), '.3f')}")
    if model("bidirectional", 512, "fd3") is not None:
        fd, tnn6 = model("bidirectional", 512, "fd3"), model("bidirectional", 512, "tnn6")
        v = _speedup(fd, tnn6)
        add("FD-TNN bidirectional >= 1.5x faster than TNN (RPE 6), whole step, n = 512", v, v is not None and v >= 1.5,
            f"upper bound for FFT-convolving operators: x{_fmt(_speedup(model('bidirectional', 512, 'bound_fixed'), tnn6), '.3f')}")
    if model("bidirectional", 2048, "ski") is not None:
        ski, tnn6, ident = (model("bidirectional", 2048, k) for k in ("ski", "tnn6", "bound_identity"))
        v = _speedup(ski, tnn6)
        add("SKI-TNN >= 1.4x faster than TNN (RPE 6), whole step, n = 2048", v, v is not None and v >= 1.4,
            f"upper bound for any token mixer (TNN / model without token mixing): x{_fmt(_speedup(ident, tnn6), '.3f')}")
        m = _mem_ratio(ski, tnn6)
        add("SKI-TNN peak tensor memory <= 0.7x TNN's, whole step, n = 2048", m, m is not None and m <= 0.7,
            f"model without token mixing: {_fmt(_mem_ratio(ident, tnn6), '.3f')}x")
    for direction in ("causal", "bidirectional"):
        fd, floor = _find(groups, "layer", direction, 2048, "fd"), _find(groups, "layer", direction, 2048, "floor")
        if fd is not None and floor is not None:
            v = fd["wall_ms"]["median"] / floor["wall_ms"]["median"]
            add(f"FD-TNO {direction} within 1.25x of its FFT floor, n = 2048 (time / floor)", v, v <= 1.25)
    ski, floor = _find(groups, "layer", "bidirectional", 2048, "ski_op"), _find(groups, "layer", "bidirectional", 2048, "floor")
    if ski is not None and floor is not None:
        v = ski["wall_ms"]["median"] / floor["wall_ms"]["median"]
        add("SKI-TNO below its FFT floor, n = 2048 (time / floor)", v, v < 1.0)
    for direction in ("causal", "bidirectional"):
        fa = _find(groups, "layer", direction, 2048, "floor_autograd")
        for key, akey in (("tnn", "tnn"), ("fd", "fd"), ("ski_op", "ski")):
            ours = _find(groups, "layer", direction, 2048, key)
            authors = AUTHORS_MS.get((direction, 2048), {}).get(akey)
            if ours is None or authors is None or fa is None:
                continue
            raw = authors / ours["wall_ms"]["median"]
            # both relative to the same floor (channel-major FFT conv, torch autograd), measured in both runs
            cal = (authors / AUTHORS_MS[(direction, 2048)]["floor_autograd"]) / (ours["wall_ms"]["median"] / fa["wall_ms"]["median"])
            add(f"{LABELS[key]} {direction} >= 2x faster than the authors', n = 2048 (their time / ours, calibrated)",
                cal, cal >= 2.0, f"raw: authors' {authors} ms (docs/references.md) / ours {ours['wall_ms']['median']:.0f} ms here = x{raw:.2f}")
    if ski is not None and "memory" in ski:
        v = ski["memory"]["step_peak_mib"]
        fa = _find(groups, "layer", "bidirectional", 2048, "floor_autograd")
        check = "" if fa is None or "memory" not in fa else (
            f"measured like the authors' figures (tensor bytes above the input and output gradient): our autograd "
            f"floor {fa['memory']['step_peak_mib']:.0f} MiB vs theirs {AUTHORS_MIB_2048_BI['floor_autograd']} MiB")
        authors = AUTHORS_MIB_2048_BI["ski"]
        add(f"SKI-TNO peak tensor memory <= the authors' {authors} MiB, n = 2048 bidirectional (MiB)", v, v <= authors,
            check)
    return out


def _fmt(v, spec=".2f", suffix=""):
    return "-" if v is None else f"{v:{spec}}{suffix}"


def markdown(result: Dict) -> str:
    meta, groups = result["meta"], result["groups"]
    lines = ["# fairseq-tnn CPU benchmark", "",
             f"`{meta['command']}`", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}, {meta['threads']} threads; "
             f"glibc malloc: {meta['malloc']}. Median of {meta['sizes']['rounds']} interleaved rounds after "
             f"{meta['sizes']['warmup']} warm-up rounds; [q1-q3] quartiles. Speed-up = baseline time / time "
             "(median of the per-round ratios; > 1 is faster). Memory, in a fresh process per configuration "
             "(see benchmarks/run.py): step peak = the highest live tensor bytes during one step above the "
             "resting state (for a layer: above its input, output gradient and parameters, as the authors' "
             "operators were measured); total peak = step peak + resting tensors (parameters, "
             "optimizer state, inputs); memory vs baseline compares total peaks (step peaks for layers); "
             "RSS = the process's peak resident set growth (also MKL/oneDNN workspaces, heap "
             "fragmentation). "
             "The papers' figures are from an A100 (the SKI paper) and, for single operators, the authors' "
             "code on this kind of 2-core machine (docs/references.md#the-authors-operators-on-cpu).", ""]
    sizes = meta["sizes"]
    for section, title in (("causal", "Causal LM, whole training step"), ("bidirectional", "Masked LM, whole training step"),
                           ("rpe", "RPE depth sweep, causal, whole training step"), ("layer", "One TNO layer alone, forward + backward")):
        sg = [g for g in groups if g["section"] == section]
        if not sg:
            continue
        lines += [f"## {title}", ""]
        if section in ("causal", "bidirectional", "rpe"):
            dim = sizes["causal_dim"] if section != "bidirectional" else sizes["bi_dim"]
            lines += [f"{sizes['layers']} layers x {dim}, expand 3 (d1 = {3 * dim}), RPE width 64, vocabulary "
                      f"{sizes['vocab']}, batch = max(1, {sizes['tokens']} // n) sequences of n tokens, dropout 0.1, "
                      "Adam, clip 1.0.", ""]
        else:
            lines += [f"Activations (b = {sizes['layer_batch']}, n, d1 = {sizes['layer_dim']}), channel-major for "
                      "ours; gradients for the input and the operator's parameters. Authors' times: docs/references.md"
                      "#the-authors-operators-on-cpu (their machine state; compare through the floors measured in "
                      "both runs).", ""]
        ratio_head = "time / floor" if section == "layer" else "speed-up vs baseline [q1-q3]"
        lines += [f"| n | batch | configuration | ms [q1-q3] | user / sys ms | {ratio_head} | papers | "
                  "step peak MiB | total peak MiB | memory vs baseline | RSS MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for g in sg:
            base = g["configs"][0]
            floor = next((c for c in g["configs"] if c["key"] == "floor"), None)
            for c in g["configs"]:
                w, p = c["wall_ms"], c["paired_speedup"]
                mem, bm = c.get("memory", {}), base.get("memory", {})
                field = "step_peak_mib" if section == "layer" else "tensor_peak_mib"
                mr = mem[field] / bm[field] if mem and bm else None
                paper = PAPER.get((section, c["key"], g["n"], base["key"])) or PAPER.get((section, c["key"], None, base["key"])) or ""
                if section == "layer":
                    akey = {"ski_op": "ski"}.get(c["key"], c["key"])
                    a = AUTHORS_MS.get((g["direction"], g["n"]), {}).get(akey)
                    if a is not None:
                        paper = f"authors: {a} ms"
                        if g["n"] == 2048 and g["direction"] == "bidirectional":
                            paper += f", {AUTHORS_MIB_2048_BI[akey]} MiB"
                    ratio = f"{w['median'] / floor['wall_ms']['median']:.3f}"
                else:
                    ratio = "baseline" if c is base else f"{p['median']:.3f} [{p['q1']:.3f}-{p['q3']:.3f}]"
                name = c["label"] + (f" ({g['direction']})" if section == "layer" and c is base else "")
                lines.append(
                    f"| {g['n']} | {g['batch']} | {name} | {w['median']:.1f} [{w['q1']:.1f}-{w['q3']:.1f}] | "
                    f"{c['user_ms']['median']:.0f} / {c['sys_ms']['median']:.0f} | {ratio} | {paper} | "
                    f"{_fmt(mem.get('step_peak_mib'), '.0f')} | {_fmt(mem.get('tensor_peak_mib'), '.0f')} | "
                    f"{_fmt(mr, '.3f')} | {_fmt(mem.get('rss_peak_mib'), '.0f')} |")
        lines.append("")
    tg = result.get("targets", [])
    if tg:
        lines += ["## Targets", "", "| target | measured | met | note |", "|---|---|---|---|"]
        for t in tg:
            met = "-" if t["met"] is None else ("yes" if t["met"] else "**no**")
            lines.append(f"| {t['target']} | {_fmt(t['value'], '.3f')} | {met} | {t['detail']} |")
        lines.append("")
    if result.get("plots"):
        lines += ["## Plots", ""] + [f"- `{p}`" for p in result["plots"]] + [""]
    return "\n".join(lines)


def plots(result: Dict, out: str) -> List[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    made = []
    groups = result["groups"]

    def save(fig, name):
        path = os.path.join(out, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)

    for section in ("causal", "bidirectional"):
        sg = [g for g in groups if g["section"] == section]
        if not sg:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        keys = [c["key"] for c in sg[0]["configs"]]
        for key in keys:
            xs = [g["n"] for g in sg]
            cs = [next(c for c in g["configs"] if c["key"] == key) for g in sg]
            lab = cs[0]["label"]
            axes[0].plot(xs, [c["wall_ms"]["median"] / g["batch"] for c, g in zip(cs, sg)], "o-", label=lab)
            axes[1].plot(xs, [c["paired_speedup"]["median"] for c in cs], "o-", label=lab)
            if all("memory" in c and "memory" in g["configs"][0] for c, g in zip(cs, sg)):
                axes[2].plot(xs, [c["memory"]["tensor_peak_mib"] / g["configs"][0]["memory"]["tensor_peak_mib"]
                                  for c, g in zip(cs, sg)], "o-", label=lab)
        axes[0].set(xscale="log", yscale="log", xlabel="n", ylabel="ms per sequence", title=f"{section}: step time")
        axes[1].set(xscale="log", xlabel="n", ylabel=f"speed-up vs {sg[0]['configs'][0]['label']}", title="speed-up")
        axes[2].set(xscale="log", xlabel="n", ylabel="peak tensor memory / baseline", title="memory")
        paper = SKI_PAPER_A100
        if section == "bidirectional":
            axes[1].axhspan(*paper["fd_bidirectional_speedup_range"], color="gray", alpha=0.15, label="paper FD (A100)")
            for field, ax in (("ski_speedup", axes[1]), ("ski_memory", axes[2])):
                ax.plot(list(paper[field]), list(paper[field].values()), "k*", label="paper SKI (A100)")
        else:
            fd = paper["fd_causal_speedup_vs_tnn6"]
            axes[1].plot(list(fd), list(fd.values()), "k*", label="paper FD vs TNN6 (A100)")
        lengths = sorted({g["n"] for g in sg})
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.set_xticks(lengths)
            ax.set_xticklabels([str(x) for x in lengths])
            ax.minorticks_off()
        axes[1].legend(fontsize=7)
        save(fig, f"{section}.png")
    sg = [g for g in groups if g["section"] == "rpe"]
    if sg:
        fig, ax = plt.subplots(figsize=(6, 4))
        for kind, lab in (("tnn_rpe", "TNN"), ("fd_rpe", "FD-TNN")):
            cs = [c for c in sg[0]["configs"] if c["key"] == kind]
            ax.plot([c["rpe_layers"] for c in cs], [c["wall_ms"]["median"] for c in cs], "o-", label=lab)
        ax.set(xlabel="RPE layers", ylabel="step ms", title=f"RPE depth, causal, n = {sg[0]['n']}")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "rpe.png")
    sg = [g for g in groups if g["section"] == "layer"]
    if sg:
        fig, ax = plt.subplots(figsize=(11, 4.5))
        labels, vals, authors = [], [], []
        for g in sg:
            floor = next(c for c in g["configs"] if c["key"] == "floor")
            fa = next(c for c in g["configs"] if c["key"] == "floor_autograd")
            for c in g["configs"]:
                if c["key"].startswith("floor"):
                    continue
                short = {"ski_op": "SKI", "tnn": "TNN", "fd": "FD", "ski_causal_local": "causal SKI\nlocal",
                         "ski_causal_cumsum": "causal SKI\ncumsum"}.get(c["key"], c["key"])
                labels.append(f"{short}\n{'causal' if g['direction'] == 'causal' else 'bidir'} {g['n']}")
                vals.append(c["wall_ms"]["median"] / floor["wall_ms"]["median"])
                a = AUTHORS_MS.get((g["direction"], g["n"]), {}).get({"ski_op": "ski"}.get(c["key"], c["key"]))
                # the authors' operator on the same scale: its time / their autograd floor, times ours / our floor
                authors.append(None if a is None else a / AUTHORS_MS[(g["direction"], g["n"])]["floor_autograd"]
                               * fa["wall_ms"]["median"] / floor["wall_ms"]["median"])
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], vals, width=0.4, label="ours")
        ax.bar([x + 0.2 for x in xs], [a or 0 for a in authors], width=0.4, label="authors' (calibrated)")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set(ylabel="time / FFT floor (channel-major, custom backward)", yscale="log", title="TNO layer vs its floor")
        ax.legend()
        ax.grid(alpha=0.3, axis="y")
        save(fig, "layer.png")
    return made
