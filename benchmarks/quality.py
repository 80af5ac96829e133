"""Quality side by side: TNN (RPE 3), FD-TNN and SKI-TNN trained by fairseq-train with one recipe.

    python benchmarks/quality.py                       # the default: one seed, 6 runs, about 25 min on 2 CPU cores
    python benchmarks/quality.py --seeds 1 2 --models masked/tnn3 masked/fd masked/ski masked/ski_sum \
        masked/ski_band causal/tnn3 causal/fd         # docs/performance.md's table: 14 runs, about an hour
    python benchmarks/quality.py --seeds 1 2 3 --updates 2000 --width 512 --layers 6 --device cuda
    python benchmarks/quality.py --quick --out /tmp/q  # toy sizes, a minute (what the tests run)

Every model trains through ``fairseq-train --user-dir fairseq_tnn`` with the same recipe (fairseq_tnn/recipe.py's
QUALITY) and the same
number of updates (Adam (0.9, 0.98), lr 1e-3, inverse-sqrt with warm-up, clip 1.0, weight decay 0.01,
dropout 0.1, at the paper's length of 512 tokens, batches of 8), the masked models with ``tnn_masked_lm``
and fairseq's ``masked_lm`` criterion (``--sample-break-mode complete``), the causal ones with
``tnn_language_modeling`` (``--sample-break-mode none``). Each run validates every ``--validate-every``
updates; a model's curve is its validation perplexity against the update. The SKI rows use the paper's
settings (r = 32, m = 17, lambda = 0.99) with the plugin's default low rank (``--ski-lowrank mean``),
the paper's scale (``sum``) and the band alone (``off``), so that what the low-rank part adds is measured.

For the SKI runs the checkpoints of each validation are kept, and ``benchmarks/ski_diagnostics.py`` reads
from each the size of the band's and the low-rank part's outputs on a validation batch, layer by layer.

Quality against length (masked models): each masked run's final checkpoint is scored by ``fairseq-validate``
on the validation split at every ``--length-factors`` multiple of its training length (default 1 2 4 8), in
blocks of exactly that many tokens (``--sample-break-mode none``) and with fairseq's masking seeded by 1, so
every model and seed is scored on the same masked positions at a length.

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
from fairseq_tnn import recipe  # noqa: E402

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
    # TNN trained in bf16 two ways, fairseq's --bf16 and the plugin's --bf16-autocast, beside fp32's tnn3
    ("causal", "tnn3_bf16"): ("tnn_lm_tiny", RPE3 + ["--bf16"], "TNN (RPE 32 x 3), --bf16 (bf16 weights, fp32 master)"),
    ("causal", "tnn3_bf16_autocast"): ("tnn_lm_tiny", RPE3 + ["--bf16-autocast"],
                                       "TNN (RPE 32 x 3), --bf16-autocast (fp32 weights, bf16 autocast)"),
}
QUICK_MODELS = ["masked/tnn3", "masked/ski", "masked/ski_band", "causal/fd"]
# The default: every model but the 'sum' diagnosis row and the bf16 ones (--models names them), to stay near 30 min
# on 2 cores
DEFAULT_MODELS = [f"{s}/{k}" for s, k in MODELS if k != "ski_sum" and "bf16" not in k]
# The targets, at equal updates: (section, model, than, factor): ppl(model) <= factor * ppl(than)
TARGETS = [("masked", "ski", "ski_band", 1.0, "SKI-TNN at least as good as its band alone"),
           ("masked", "ski", "tnn3", 1.05, "SKI-TNN within 5% of TNN (RPE 3)"),
           ("masked", "fd", "tnn3", 1.02, "FD-TNN within 2% of TNN (RPE 3), masked"),
           ("causal", "fd", "tnn3", 1.02, "FD-TNN within 2% of TNN (RPE 3), causal"),
           ("causal", "tnn3_bf16", "tnn3_bf16_autocast", 1.02, "TNN's --bf16 within 2% of its --bf16-autocast"),
           ("causal", "tnn3_bf16", "tnn3", 1.02, "TNN's --bf16 within 2% of its fp32")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(ROOT, "data", "sample"),
                   help="directory of train.bpe, valid.bpe, test.bpe (default: the bundled sample)")
    p.add_argument("--data-bin", default=None, help="an already binarised directory (instead of --data)")
    p.add_argument("--models", nargs="+", default=None,
                   help=f"section/key of the models to train, of {' '.join(f'{s}/{k}' for s, k in MODELS)} "
                        f"(default: all but masked/ski_sum)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1], help="one run per model and seed (default: 1)")
    p.add_argument("--updates", type=int, default=int(recipe.QUALITY["max_update"]),
                   help="updates per run (equal for every model)")
    p.add_argument("--validate-every", type=int, default=int(recipe.QUALITY["validate_interval_updates"]),
                   help="updates between validations")
    p.add_argument("--warmup", type=int, default=int(recipe.QUALITY["warmup_updates"]),
                   help="inverse-sqrt warm-up updates")
    p.add_argument("--width", type=int, default=128, help="embedding dim (GLU dim too)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens-per-sample", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", default=recipe.QUALITY["lr"])
    p.add_argument("--length-factors", nargs="*", type=int, default=[1, 2, 4, 8],
                   help="score the masked models by fairseq-validate at these multiples of --tokens-per-sample "
                        "(default 1 2 4 8; none given: no scoring against length)")
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
        args.length_factors = args.length_factors[:2]
    models = args.models or DEFAULT_MODELS
    known = [f"{s}/{k}" for s, k in MODELS]
    for m in models:
        if m not in known:
            p.error(f"--models: {m!r} is not a model of this benchmark; choose from {' '.join(known)}")
    args.models = [tuple(m.split("/")) for m in models]
    for name in ("updates", "validate_every", "width", "layers", "tokens_per_sample", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be an integer >= 1")
    if any(f < 1 for f in args.length_factors) or len(set(args.length_factors)) != len(args.length_factors):
        p.error(f"--length-factors={args.length_factors} is invalid: give distinct integers >= 1")
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
        p.error(f"--data-bin={args.data_bin} is invalid: it has no dict.txt (binarise with scripts/prepare-corpus.sh or scripts/preprocess.sh)")
    if "FAIRSEQ_PREPROCESS" in os.environ:
        p.error("FAIRSEQ_PREPROCESS is set but no longer read: set FAIRSEQ_BIN to the directory of the fairseq "
                "commands instead")
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
    env = dict(os.environ, FAIRSEQ_BIN=fairseq_bin())
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "preprocess.sh"), args.data, dest], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    return dest


def train_command(args, data_bin: str, section: str, key: str, seed: int, save_dir: Optional[str]) -> List[str]:
    arch, extra, _ = MODELS[(section, key)]
    dim = ["--encoder-embed-dim" if section == "masked" else "--decoder-embed-dim", str(args.width),
           "--encoder-layers" if section == "masked" else "--decoder-layers", str(args.layers),
           "--glu-dim", str(args.width)]
    # masked runs keep their final checkpoint (checkpoint_last.pt, scored against length), SKI ones also one per
    # validation (their part sizes)
    saving = ["--no-save"]
    if save_dir:
        saving = ["--save-dir", save_dir, "--no-epoch-checkpoints"]
        if MODELS[(section, key)][0].startswith("ski") and "off" not in MODELS[(section, key)][1]:
            saving += ["--save-interval-updates", str(args.validate_every), "--keep-interval-updates", "-1"]
    knobs = {"lr": str(args.lr), "warmup_updates": str(args.warmup), "max_update": str(args.updates),
             "seed": str(seed), "validate_interval_updates": str(args.validate_every),
             "log_interval": str(args.validate_every), "cpu": args.device == "cpu"}
    return [os.path.join(fairseq_bin(), "fairseq-train"), data_bin,
            *recipe.fairseq_options({"user_dir": recipe.USER_DIR, "arch": arch}), *dim, *extra,
            *recipe.fairseq_options({**recipe.TASK[section], "tokens_per_sample": str(args.tokens_per_sample),
                                     "batch_size": str(args.batch_size), **recipe.QUALITY}, knobs),
            *saving]


VALID = re.compile(r"valid on 'valid' subset \| loss ([0-9.]+) \| ppl ([0-9.]+).*?num_updates (\d+)")
VALIDATE = re.compile(r"valid on 'valid' subset \| loss ([0-9.]+) \| ppl ([0-9.]+)")
UPDATE_MS = re.compile(r"update_ms[= ]([0-9.]+)")


def parse_log(log: str) -> Dict:
    curve = {}
    for loss, ppl, upd in VALID.findall(log):
        curve[int(upd)] = float(ppl)  # the last validation at an update wins (fairseq may repeat the final one)
    times = [float(t) for t in UPDATE_MS.findall(log)]
    return {"curve": sorted(curve.items()), "update_ms": statistics.median(times) if times else None}


def thread_env(threads: int) -> Dict[str, str]:
    """The environment of a run's commands: this one, with ``threads`` threads for torch."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))


def run_one(args, data_bin, section, key, seed, threads) -> Dict:
    """Train one model with one seed (or reuse the finished run of the same command in --out: an
    interrupted benchmark resumes), then read its log, and for SKI its checkpoints."""
    name = f"{section}-{key}-s{seed}"
    run_dir = os.path.join(args.out, "runs", name)
    save_dir = os.path.join(run_dir, "checkpoints") if section == "masked" else None
    cmd = train_command(args, data_bin, section, key, seed, save_dir)
    done = os.path.join(run_dir, "result.json")
    if os.path.exists(done):
        with open(done) as f:
            previous = json.load(f)
        if previous["command"] == " ".join(cmd) and previous["returncode"] == 0:
            previous["reused"] = True
            return score_lengths(args, data_bin, run_dir, previous, threads)
    if os.path.isdir(run_dir):
        shutil.rmtree(run_dir)  # an unfinished or different run: start it again
    os.makedirs(run_dir)
    env = thread_env(threads)
    start = time.time()
    with open(os.path.join(run_dir, "train.log"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    out = collect(run_dir, section, key, seed, cmd, proc.returncode, time.time() - start, data_bin, args)
    if proc.returncode == 0:
        with open(done, "w") as f:
            json.dump(out, f, indent=1)
        out = score_lengths(args, data_bin, run_dir, out, threads)
    return out


def validate_command(args, data_bin: str, checkpoint: str, length: int) -> List[str]:
    """fairseq-validate of a masked checkpoint in blocks of ``length`` tokens, masks seeded by 1 (the same
    masked positions for every model and training seed at a length), every block scored (fairseq's batching
    drops a last batch whose size is not a multiple of --required-batch-size-multiple, 8 by default)."""
    overrides = {"data": data_bin, "tokens_per_sample": length, "sample_break_mode": "none", "seed": 1}
    return [os.path.join(fairseq_bin(), "fairseq-validate"), data_bin, "--user-dir", os.path.join(ROOT, "fairseq_tnn"),
            "--task", "tnn_masked_lm", "--path", checkpoint, "--valid-subset", "valid", "--model-overrides",
            repr(overrides), "--batch-size", str(args.batch_size), "--required-batch-size-multiple", "1", "--seed", "1",
            "--num-workers", "0",
            *(["--cpu"] if args.device == "cpu" else [])]


def score_lengths(args, data_bin: str, run_dir: str, out: Dict, threads: int) -> Dict:
    """A finished masked run's validation perplexity at each --length-factors multiple of the training length
    (``out["lengths"]``: {length: ppl}), scored by fairseq-validate and kept in result.json (a length already
    scored by the same command is not scored again)."""
    if out["section"] != "masked" or not args.length_factors:
        return out
    checkpoint = os.path.join(run_dir, "checkpoints", "checkpoint_last.pt")
    env = thread_env(threads)
    scored = out.setdefault("lengths", {})
    commands = out.setdefault("length_commands", {})
    for factor in args.length_factors:
        length = factor * args.tokens_per_sample
        cmd = validate_command(args, data_bin, checkpoint, length)
        if str(length) in scored and commands.get(str(length)) == " ".join(cmd):
            continue
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        found = VALIDATE.findall(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not found:
            out["returncode"] = proc.returncode or 1
            out["log_tail"] = f"{' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-3000:]}"
            return out
        scored[str(length)] = float(found[-1][1])
        commands[str(length)] = " ".join(cmd)
    with open(os.path.join(run_dir, "result.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def collect(run_dir, section, key, seed, cmd, returncode, wall, data_bin, args) -> Dict:
    """The result of one run from its train.log (and the SKI part sizes from its checkpoints)."""
    with open(os.path.join(run_dir, "train.log")) as f:
        text = f.read()
    out = {"section": section, "key": key, "label": MODELS[(section, key)][2], "seed": seed,
           "command": " ".join(cmd), "wall_s": round(wall, 1), "returncode": returncode, **parse_log(text)}
    save_dir = os.path.join(run_dir, "checkpoints")
    arch, extra, _ = MODELS[(section, key)]
    if returncode != 0:
        out["log_tail"] = text[-3000:]
    elif arch.startswith("ski") and "off" not in extra:
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
        for length, ppl in r.get("lengths", {}).items():
            row.setdefault("lengths", {}).setdefault(length, {})[r["seed"]] = ppl
    for row in table.values():
        row["mean"] = statistics.mean(row["final"].values())
        row["complete"] = sorted(row["final"]) == sorted(seeds)
        if "lengths" in row:  # json keys: the lengths as strings, in increasing order
            row["lengths"] = {str(n): row["lengths"][str(n)] for n in sorted(map(int, row["lengths"]))}
            row["length_mean"] = {n: statistics.mean(v.values()) for n, v in row["lengths"].items()}
    return table


def targets(table: Dict) -> List[Dict]:
    out = []
    for section, model, than, factor, what in TARGETS:
        a, b = table.get(f"{section}/{model}"), table.get(f"{section}/{than}")
        if a is None or b is None:
            continue
        ratio = a["mean"] / b["mean"]
        out.append({"target": what, "ratio": round(ratio, 4), "bound": factor, "met": ratio <= factor})
        if (model, than) == ("ski", "ski_band") and a.get("length_mean") and b.get("length_mean"):
            longest = max(set(a["length_mean"]) & set(b["length_mean"]), key=int)
            ratio = a["length_mean"][longest] / b["length_mean"][longest]
            out.append({"target": f"{what}, at {longest} tokens", "ratio": round(ratio, 4), "bound": factor,
                        "met": ratio <= factor})
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
        lines += length_table(cfg, rows)
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


def length_table(cfg: Dict, rows: List[Dict]) -> List[str]:
    """Markdown: validation perplexity against the scoring length, each seed and their mean, and the mean's
    ratio to the section's first model."""
    rows = [r for r in rows if r.get("length_mean")]
    if not rows:
        return []
    lengths = sorted({int(n) for r in rows for n in r["length_mean"]})
    base = rows[0]
    lines = [f"Against length: validation perplexity by fairseq-validate in blocks of n tokens (trained at "
             f"{cfg['tokens_per_sample']}; the same masked positions for every model at a length), each seed / their mean "
             f"(vs {base['key']}):", "", "| model | " + " | ".join(f"n = {n}" for n in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    for r in rows:
        cells = []
        for n in map(str, lengths):
            if n not in r["length_mean"]:
                cells.append("")
                continue
            seeds = " / ".join(f"{r['lengths'][n][s]:.1f}" for s in sorted(r["lengths"][n]))
            mean = r["length_mean"][n]
            vs = f" ({mean / base['length_mean'][n]:.3f})" if n in base.get("length_mean", {}) else ""
            cells.append(f"{seeds} / **{mean:.1f}**{vs}")
        lines.append(f"| {r['key']} | " + " | ".join(cells) + " |")
    return lines + [""]


def plot(result: Dict, out: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sections = [s for s in ("masked", "causal") if any(r["section"] == s for r in result["table"].values())]
    by_length = [r for r in result["table"].values() if r.get("length_mean")]
    panels = len(sections) + (1 if by_length else 0)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
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
    if by_length:
        ax = axes[0][-1]
        for i, r in enumerate(by_length):
            lengths = [int(n) for n in r["length_mean"]]
            ax.plot(lengths, list(r["length_mean"].values()), "o-", color=f"C{i}", label=f"{r['key']} (mean)")
            for j, seed in enumerate(sorted({s for v in r["lengths"].values() for s in v})):
                ax.plot(lengths, [r["lengths"][str(n)].get(seed, float("nan")) for n in lengths], styles[(j + 1) % 4],
                        color=f"C{i}", alpha=0.4, linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per block (fairseq-validate)")
        ax.set_ylabel("validation perplexity")
        ax.set_title(f"masked, against length (trained at {result['config']['tokens_per_sample']})")
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
                                            "batch_size", "lr", "device", "seeds", "length_factors")}
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
