"""Quality side by side: TNN (RPE 3), FD-TNN and SKI-TNN trained by fairseq-train with one recipe.

    python benchmarks/quality.py                       # the default: one seed, 6 runs, about 25 min on 2 CPU cores
    python benchmarks/quality.py --seeds 1 2 --models masked/tnn3 masked/fd masked/ski masked/ski_sum \
        masked/ski_band causal/tnn3 causal/fd         # docs/performance.md's table: 14 runs, about an hour
    python benchmarks/quality.py --seeds 1 2 3 --updates 2000 --width 512 --layers 6 --device cuda
    python benchmarks/quality.py --quick --out /tmp/q  # toy sizes, a minute (what the tests run)

Every model trains through ``fairseq-train --user-dir fairseq_tnn`` with the same recipe and the same
number of updates (Adam (0.9, 0.98), lr 1e-3, inverse-sqrt with warm-up, clip 1.0, weight decay 0.01,
dropout 0.1, at the paper's length of 512 tokens, batches of 8), the masked models with ``tnn_masked_lm``
and fairseq's ``masked_lm`` criterion (``--sample-break-mode complete``), the causal ones with
``tnn_language_modeling`` (``--sample-break-mode none``). Each run validates every ``--validate-every``
updates; a model's curve is its validation perplexity against the update. The SKI rows use the paper's
settings (r = 32, m = 17, lambda = 0.99) with the plugin's default low rank (``--ski-lowrank mean``),
the paper's scale (``sum``) and the band alone (``off``), so that what the low-rank part adds is measured.

For the SKI runs the checkpoints of each validation are kept, and ``benchmarks/ski_diagnostics.py`` reads
from each the size of the band's and the low-rank part's outputs on a validation batch, layer by layer.

The data: ``--data`` names a directory of ``{train,valid,test}.bpe`` (default the bundled sample,
data/sample), binarised into ``<out>/data-bin``; ``--data-bin`` uses an already binarised one.
A finished run is kept in ``<out>/runs/<section>-<model>-s<seed>/`` (train.log, result.json) and reused
when the benchmark runs again into the same ``--out`` (``--force`` once it has finished) with the same
command for it, so an interrupted benchmark resumes; anything else in a run's folder is trained again.
Writes ``quality.json`` (everything, each run with its seed), ``quality.md`` (the tables and the targets
of the SKI-quality issue, met or not) and ``quality.png`` (the curves) into ``--out``.
"""
import argparse
import concurrent.futures
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.measure import _machine, add_out_options, refuse_overwrite, write_results  # noqa: E402

RPE3 = ["--rpe-dim", "32", "--rpe-layers", "3"]
SKI_PAPER = ["--ski-rank", "32", "--ski-taps", "17", "--ski-warp-decay", "0.99"]
# (section, key): (arch, extra options, label). The first key of a section is its baseline.
MODELS = {
    ("masked", "tnn3"): ("tnn_mlm_tiny", RPE3, "TNN (RPE 32 x 3)"),
    ("masked", "fd"): ("fd_tnn_mlm_tiny", RPE3, "FD-TNN (RPE 32 x 3)"),
    ("masked", "ski"): ("ski_tnn_mlm_tiny", SKI_PAPER, "SKI-TNN (r 32, m 17, lambda 0.99), low rank 'mean' (default)"),
    ("masked", "ski_sum"): ("ski_tnn_mlm_tiny", SKI_PAPER + ["--ski-lowrank", "sum"],
                            "SKI-TNN, low rank 'sum' (the knots' own scale)"),
    ("masked", "ski_band"): ("ski_tnn_mlm_tiny", SKI_PAPER + ["--ski-lowrank", "off"], "SKI-TNN's band alone (m 17)"),
    ("causal", "tnn3"): ("tnn_lm_tiny", RPE3, "TNN (RPE 32 x 3)"),
    ("causal", "fd"): ("fd_tnn_lm_tiny", RPE3, "FD-TNN (RPE 32 x 3)"),
}
QUICK_MODELS = ["masked/tnn3", "masked/ski", "masked/ski_band", "causal/fd"]
# The default: every model but the 'sum' diagnosis row (--models names it), to stay near 30 min on 2 cores
DEFAULT_MODELS = [f"{s}/{k}" for s, k in MODELS if k != "ski_sum"]
# The targets, at equal updates: (section, model, than, factor): ppl(model) <= factor * ppl(than)
TARGETS = [("masked", "ski", "ski_band", 1.0, "SKI-TNN at least as good as its band alone"),
           ("masked", "ski", "tnn3", 1.05, "SKI-TNN within 5% of TNN (RPE 3)"),
           ("masked", "fd", "tnn3", 1.02, "FD-TNN within 2% of TNN (RPE 3), masked"),
           ("causal", "fd", "tnn3", 1.02, "FD-TNN within 2% of TNN (RPE 3), causal")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(ROOT, "data", "sample"),
                   help="directory of train.bpe, valid.bpe, test.bpe (default: the bundled sample)")
    p.add_argument("--data-bin", default=None, help="an already binarised directory (instead of --data)")
    p.add_argument("--models", nargs="+", default=None,
                   help=f"section/key of the models to train, of {' '.join(f'{s}/{k}' for s, k in MODELS)} "
                        f"(default: all but masked/ski_sum)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1], help="one run per model and seed (default: 1)")
    p.add_argument("--updates", type=int, default=300, help="updates per run (equal for every model)")
    p.add_argument("--validate-every", type=int, default=50, help="updates between validations")
    p.add_argument("--warmup", type=int, default=200, help="inverse-sqrt warm-up updates")
    p.add_argument("--width", type=int, default=128, help="embedding dim (GLU dim too)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens-per-sample", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", default="1e-3")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs at a time (default: one per core on CPU, each with one thread; 1 on CUDA); the cores are shared out")
    p.add_argument("--quick", action="store_true", help="toy sizes and the models " + " ".join(QUICK_MODELS))
    add_out_options(p, os.path.join("results", "quality"))
    args = p.parse_args(argv)
    if args.quick:
        args.updates, args.validate_every, args.warmup = 8, 4, 2
        args.width, args.layers, args.tokens_per_sample, args.batch_size = 16, 1, 64, 2
        args.seeds = args.seeds[:1]
        args.models = args.models or QUICK_MODELS
    models = args.models or DEFAULT_MODELS
    known = [f"{s}/{k}" for s, k in MODELS]
    for m in models:
        if m not in known:
            p.error(f"--models: {m!r} is not a model of this benchmark; choose from {' '.join(known)}")
    args.models = [tuple(m.split("/")) for m in models]
    for name in ("updates", "validate_every", "width", "layers", "tokens_per_sample", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be an integer >= 1")
    if args.warmup < 0:
        p.error(f"--warmup={args.warmup} is invalid: must be >= 0")
    if args.jobs is not None and args.jobs < 1:
        p.error(f"--jobs={args.jobs} is invalid: must be >= 1")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds={args.seeds} is invalid: give one or more distinct seeds")
    if args.data_bin is None:
        missing = [s for s in ("train", "valid") if not os.path.isfile(os.path.join(args.data, s + ".bpe"))]
        if missing:
            p.error(f"--data={args.data} is invalid: it has no {', '.join(s + '.bpe' for s in missing)}")
    elif not os.path.isfile(os.path.join(args.data_bin, "dict.txt")):
        p.error(f"--data-bin={args.data_bin} is invalid: it has no dict.txt (binarise with scripts/preprocess.sh)")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            p.error("--device=cuda is invalid here: torch sees no CUDA GPU")
    refuse_overwrite(p, args, "quality.json")
    return args


def fairseq_bin() -> str:
    """The fairseq CLIs: FAIRSEQ_BIN, else beside this Python (the README's .venv)."""
    return os.environ.get("FAIRSEQ_BIN") or os.path.dirname(sys.executable)


def binarise(args) -> str:
    if args.data_bin:
        return args.data_bin
    dest = os.path.join(args.out, "data-bin")
    env = dict(os.environ, FAIRSEQ_PREPROCESS=os.path.join(fairseq_bin(), "fairseq-preprocess"))
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "preprocess.sh"), args.data, dest], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    return dest


def train_command(args, data_bin: str, section: str, key: str, seed: int, save_dir: Optional[str]) -> List[str]:
    arch, extra, _ = MODELS[(section, key)]
    dim = ["--encoder-embed-dim" if section == "masked" else "--decoder-embed-dim", str(args.width),
           "--encoder-layers" if section == "masked" else "--decoder-layers", str(args.layers),
           "--glu-dim", str(args.width)]
    task = (["--task", "tnn_masked_lm", "--criterion", "masked_lm", "--sample-break-mode", "complete"]
            if section == "masked" else
            ["--task", "tnn_language_modeling", "--criterion", "cross_entropy", "--sample-break-mode", "none"])
    saving = (["--save-dir", save_dir, "--save-interval-updates", str(args.validate_every), "--keep-interval-updates", "-1",
               "--no-epoch-checkpoints", "--no-last-checkpoints"] if save_dir else ["--no-save"])
    return [os.path.join(fairseq_bin(), "fairseq-train"), data_bin, "--user-dir", os.path.join(ROOT, "fairseq_tnn"),
            "--arch", arch, *dim, *extra, *task,
            "--tokens-per-sample", str(args.tokens_per_sample), "--batch-size", str(args.batch_size),
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", str(args.lr),
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(args.warmup), "--clip-norm", "1.0",
            "--weight-decay", "0.01", "--dropout", "0.1", "--max-update", str(args.updates), "--seed", str(seed),
            "--validate-interval-updates", str(args.validate_every), "--validate-interval", "1000000",
            "--log-format", "simple", "--log-interval", str(args.validate_every), "--num-workers", "0",
            *(["--cpu"] if args.device == "cpu" else []), *saving]


VALID = re.compile(r"valid on 'valid' subset \| loss ([0-9.]+) \| ppl ([0-9.]+).*?num_updates (\d+)")
UPDATE_MS = re.compile(r"update_ms[= ]([0-9.]+)")


def parse_log(log: str) -> Dict:
    curve = {}
    for loss, ppl, upd in VALID.findall(log):
        curve[int(upd)] = float(ppl)  # the last validation at an update wins (fairseq may repeat the final one)
    times = [float(t) for t in UPDATE_MS.findall(log)]
    return {"curve": sorted(curve.items()), "update_ms": statistics.median(times) if times else None}


def run_one(args, data_bin, section, key, seed, threads) -> Dict:
    """Train one model with one seed (or reuse the finished run of the same command in --out: an
    interrupted benchmark resumes), then read its log, and for SKI its checkpoints."""
    name = f"{section}-{key}-s{seed}"
    run_dir = os.path.join(args.out, "runs", name)
    arch, extra, _ = MODELS[(section, key)]
    ski = arch.startswith("ski") and "off" not in extra
    save_dir = os.path.join(run_dir, "checkpoints") if ski else None
    cmd = train_command(args, data_bin, section, key, seed, save_dir)
    done = os.path.join(run_dir, "result.json")
    if os.path.exists(done):
        with open(done) as f:
            previous = json.load(f)
        if previous["command"] == " ".join(cmd) and previous["returncode"] == 0:
            previous["reused"] = True
            return previous
    if os.path.isdir(run_dir):
        shutil.rmtree(run_dir)  # an unfinished or different run: start it again
    os.makedirs(run_dir)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    start = time.time()
    with open(os.path.join(run_dir, "train.log"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    out = collect(run_dir, section, key, seed, cmd, proc.returncode, time.time() - start, data_bin, args)
    if proc.returncode == 0:
        with open(done, "w") as f:
            json.dump(out, f, indent=1)
    return out


def collect(run_dir, section, key, seed, cmd, returncode, wall, data_bin, args) -> Dict:
    """The result of one run from its train.log (and the SKI part sizes from its checkpoints)."""
    with open(os.path.join(run_dir, "train.log")) as f:
        text = f.read()
    out = {"section": section, "key": key, "label": MODELS[(section, key)][2], "seed": seed,
           "command": " ".join(cmd), "wall_s": round(wall, 1), "returncode": returncode, **parse_log(text)}
    save_dir = os.path.join(run_dir, "checkpoints")
    if returncode != 0:
        out["log_tail"] = text[-3000:]
    elif os.path.isdir(save_dir):
        from benchmarks.ski_diagnostics import checkpoint_scales
        out["ski_scales"] = checkpoint_scales(save_dir, data_bin, section, args.tokens_per_sample, args.device)
    return out


def summarise(runs: List[Dict], seeds: List[int]) -> Dict:
    """Per (section, key): the final perplexity of each seed, their mean, and the mean curve."""
    table = {}
    for r in runs:
        if r["returncode"] != 0 or not r["curve"]:
            continue
        row = table.setdefault(f"{r['section']}/{r['key']}", {"section": r["section"], "key": r["key"],
                                                              "label": r["label"], "final": {}, "curves": {}})
        row["final"][r["seed"]] = r["curve"][-1][1]
        row["curves"][r["seed"]] = r["curve"]
    for row in table.values():
        row["mean"] = statistics.mean(row["final"].values())
        row["complete"] = sorted(row["final"]) == sorted(seeds)
    return table


def targets(table: Dict) -> List[Dict]:
    out = []
    for section, model, than, factor, what in TARGETS:
        a, b = table.get(f"{section}/{model}"), table.get(f"{section}/{than}")
        if a is None or b is None:
            continue
        ratio = a["mean"] / b["mean"]
        out.append({"target": what, "ratio": round(ratio, 4), "bound": factor, "met": ratio <= factor})
    return out


def markdown(result: Dict) -> str:
    cfg, table = result["config"], result["table"]
    seeds = cfg["seeds"]
    lines = [f"Validation perplexity after {cfg['updates']} updates of {cfg['batch_size']} x {cfg['tokens_per_sample']} "
             f"tokens, width {cfg['width']} x {cfg['layers']} layers, the same recipe for every model "
             f"(benchmarks/quality.py; data: {cfg['data']}; {result['machine']}).", ""]
    for section in ("masked", "causal"):
        rows = [r for r in table.values() if r["section"] == section]
        if not rows:
            continue
        base = rows[0]
        lines += [f"**{section}**", "", "| model | " + " | ".join(f"seed {s}" for s in seeds) +
                  f" | mean | vs {base['key']} |", "|---|" + "---:|" * (len(seeds) + 2)]
        for r in rows:
            cells = [f"{r['final'][s]:.2f}" if s in r["final"] else "failed" for s in seeds]
            lines.append(f"| {r['label']} | " + " | ".join(cells) + f" | {r['mean']:.2f} | {r['mean'] / base['mean']:.3f} |")
        lines.append("")
        updates = sorted({u for r in rows for c in r["curves"].values() for u, _ in c})
        lines += ["Mean over the seeds at each validation:", "",
                  "| model | " + " | ".join(str(u) for u in updates) + " |", "|---|" + "---:|" * len(updates)]
        for r in rows:
            cells = []
            for u in updates:
                vals = [p for c in r["curves"].values() for uu, p in c if uu == u]
                cells.append(f"{statistics.mean(vals):.1f}" if len(vals) == len(r["curves"]) else "")
            lines.append(f"| {r['key']} | " + " | ".join(cells) + " |")
        lines.append("")
    if result["targets"]:
        lines += ["| target (mean over seeds, equal updates) | ratio | bound | met |", "|---|---:|---:|---|"]
        for t in result["targets"]:
            lines.append(f"| {t['target']} | {t['ratio']:.3f} | {t['bound']:.2f} | {'yes' if t['met'] else 'no'} |")
        lines.append("")
    failed = [r for r in result["runs"] if r["returncode"] != 0]
    for r in failed:
        lines += [f"FAILED: {r['section']}/{r['key']} seed {r['seed']} (exit {r['returncode']}): {r['command']}",
                  "```", r.get("log_tail", "")[-1500:], "```", ""]
    scales = [r for r in result["runs"] if r.get("ski_scales")]
    if scales:
        lines += ["SKI: rms of the band's and the low-rank part's outputs on a validation batch (mean over layers), "
                  "by update:", "", "| run | update | band | low rank | low rank / band |", "|---|---:|---:|---:|---:|"]
        for r in scales:
            for s in r["ski_scales"]:
                band = statistics.mean(s["band_rms"])
                low = statistics.mean(s["lowrank_rms"])
                lines.append(f"| {r['key']} s{r['seed']} | {s['update']} | {band:.3f} | {low:.3f} | {low / band:.2f} |")
        lines.append("")
    return "\n".join(lines)


def plot(result: Dict, out: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sections = [s for s in ("masked", "causal") if any(r["section"] == s for r in result["table"].values())]
    fig, axes = plt.subplots(1, len(sections), figsize=(6.5 * len(sections), 4.5), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, section in zip(axes[0], sections):
        rows = [r for r in result["table"].values() if r["section"] == section]
        for i, r in enumerate(rows):
            color = f"C{i}"
            for j, (seed, curve) in enumerate(sorted(r["curves"].items())):
                ax.plot([u for u, _ in curve], [p for _, p in curve], styles[j % len(styles)], color=color,
                        label=f"{r['key']} (seed {seed})")
        ax.set_yscale("log")
        ax.set_xlabel("update")
        ax.set_ylabel("validation perplexity")
        ax.set_title(f"{section}: {result['config']['width']} x {result['config']['layers']}, "
                     f"{result['config']['batch_size']} x {result['config']['tokens_per_sample']} tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "quality.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cores = os.cpu_count() or 1
    todo = [(s, k, seed) for seed in args.seeds for s, k in args.models]
    jobs = args.jobs or (1 if args.device == "cuda" else max(1, min(cores, len(todo))))
    threads = max(1, cores // jobs)
    data_bin = binarise(args)
    print(f"quality: {len(todo)} runs of {args.updates} updates, {jobs} at a time with {threads} threads each", flush=True)
    start = time.time()
    runs = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_one, args, data_bin, s, k, seed, threads) for s, k, seed in todo]
        for fut in concurrent.futures.as_completed(futures):
            r = fut.result()
            runs.append(r)
            final = f"ppl {r['curve'][-1][1]:.2f}" if r["curve"] else "no validation"
            print(f"quality: {r['section']}/{r['key']} seed {r['seed']}: {final}, exit {r['returncode']}, "
                  f"{r['wall_s']:.0f} s{' (reused)' if r.get('reused') else ''}", flush=True)
    order = {(s, k): i for i, (s, k) in enumerate(MODELS)}
    runs.sort(key=lambda r: (order[(r["section"], r["key"])], r["seed"]))
    config = {k: getattr(args, k) for k in ("updates", "validate_every", "warmup", "width", "layers", "tokens_per_sample",
                                            "batch_size", "lr", "device", "seeds")}
    config["data"] = args.data_bin or os.path.relpath(args.data, ROOT)
    table = summarise(runs, args.seeds)
    result = {"config": config, "machine": _machine(), "wall_s": round(time.time() - start, 1), "runs": runs,
              "table": table, "targets": targets(table)}
    md = markdown(result)
    write_results(args.out, "quality", result, md)
    if table:
        plot(result, args.out)
    print(md)
    failed = [r for r in runs if r["returncode"] != 0]
    if failed:
        print(f"quality: {len(failed)} run(s) failed (logs under {args.out}/runs)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
