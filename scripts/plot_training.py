#!/usr/bin/env python
"""Validation perplexity against updates and against wall-clock time, for several training runs.

    python scripts/plot_training.py checkpoints/tnn_lm_wt103_rpe3/train.log checkpoints/fd_tnn_lm_wt103/train.log \
        --labels TNN FD-TNN --out results/training/causal.png

Reads fairseq-train logs in either format: --log-format json (what scripts/train.sh writes to
<save dir>/train.log, with or without fairseq's "date | INFO | valid |" prefix) or --log-format simple
("valid on 'valid' subset | loss ... | ppl ... | num_updates ..."). The wall-clock time of a validation
is the "wall" of the last training log line before it (seconds since the run started, carried across
resumes), so it lags by at most --log-interval updates. A resumed run's repeated validations keep the last.

Writes (never overwriting without --force):
  <out>               validation perplexity vs updates (the paper's appendix figures)
  <out stem>-wall.png validation perplexity vs wall-clock time (hours, or minutes for runs under 2 h)
  <out stem>.csv      run, log, num_updates, wall_s, loss, ppl (one row per validation)
  <out stem>.json     the same points, per run, with the median update time (update_ms of the train_inner
                      lines, which the plugin's tasks log, one per update number) where the log has it
"""
import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path

SIMPLE_VALID = re.compile(r"valid on '([^']+)' subset \| (.*)$")
SIMPLE_WALL = re.compile(r"(?:^|[ ,])wall=([0-9.]+)|\| wall ([0-9.]+)")


def _num(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _pairs_bar(text):
    """'loss 9.8 | ppl 951 | num_updates 12' -> dict"""
    out = {}
    for part in text.split(" | "):
        key, _, value = part.strip().partition(" ")
        if key and value:
            out[key] = value.strip()
    return out


def json_record(line: str):
    """The json object of a --log-format json line (with or without fairseq's "date | INFO | x |" prefix), or None."""
    brace = line.find("{")
    if brace < 0:
        return None
    try:
        record = json.loads(line[brace:])
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def parse_log(path: Path, subset: str = "valid"):
    """Return [{num_updates, wall_s, loss, ppl}] for every validation of `subset` in a fairseq log."""
    points = {}
    last_wall = None
    for line in path.read_text(errors="replace").splitlines():
        record = json_record(line)
        if record is not None:
            if f"{subset}_num_updates" in record:
                upd = _num(record.get(f"{subset}_num_updates"))
                if upd is not None:
                    points[int(upd)] = {"num_updates": int(upd), "wall_s": last_wall,
                                        "loss": _num(record.get(f"{subset}_loss")), "ppl": _num(record.get(f"{subset}_ppl"))}
            else:  # train_inner ("wall") or end of epoch ("train_wall" is the training-only time there)
                wall = record.get("wall") if "num_updates" in record else None
                if wall is None and "train_num_updates" in record:
                    wall = record.get("train_wall") if "train_train_wall" in record else None
                if _num(wall) is not None:
                    last_wall = _num(wall)
            continue
        m = SIMPLE_VALID.search(line)
        if m:
            if m.group(1) != subset:
                continue
            fields = _pairs_bar(m.group(2))
            upd = _num(fields.get("num_updates"))
            if upd is not None:
                points[int(upd)] = {"num_updates": int(upd), "wall_s": last_wall,
                                    "loss": _num(fields.get("loss")), "ppl": _num(fields.get("ppl"))}
            continue
        # simple format, training lines: "epoch 001:  10 / 300 loss=..., num_updates=10, wall=23" (train_inner)
        # or "epoch 001 | loss ... | num_updates 12 | ... | wall 28" (end of epoch)
        m = SIMPLE_WALL.search(line) if "num_updates" in line else None
        if m:
            last_wall = float(m.group(1) or m.group(2))
    return [points[k] for k in sorted(points)]


def step_times(path: Path):
    """The per-update wall times (update_ms, logged by the plugin's tasks) of the train_inner lines of a json log,
    one per update number: a line repeated in the log (a resumed run redoing updates, or a log file written by
    several handlers) counts once, the last one kept."""
    times = {}
    for line in path.read_text(errors="replace").splitlines():
        r = json_record(line)
        if r is not None and _num(r.get("num_updates")) is not None and _num(r.get("update_ms")) is not None:
            times[int(_num(r["num_updates"]))] = _num(r["update_ms"])
    return [times[k] for k in sorted(times)]


def default_labels(paths):
    labels = []
    for p in paths:
        label = p.parent.name if p.stem in ("train", "log", "stdout") and p.parent.name else p.stem
        base, n = label, 2
        while label in labels:
            label, n = f"{base}-{n}", n + 1
        labels.append(label)
    return labels


def plot(runs, xkey, xlabel, path, args, scale=1.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(args.width, args.height), dpi=args.dpi)
    for label, points in runs.items():
        pts = [p for p in points if p[xkey] is not None and p["ppl"] is not None]
        ax.plot([p[xkey] / scale for p in pts], [p["ppl"] for p in pts], marker="." if len(pts) < 50 else None,
                label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{args.subset} perplexity")
    if args.log_y:
        ax.set_yscale("log")
    if args.ymax:
        ax.set_ylim(top=args.ymax)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=args.dpi)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path, help="fairseq-train logs (json or simple format)")
    p.add_argument("--out", type=Path, required=True, help="PNG of perplexity vs updates; the other outputs go beside it")
    p.add_argument("--labels", nargs="+", help="one per log (default: the log's directory name for train.log)")
    p.add_argument("--subset", default="valid", help="validation subset to plot (default valid)")
    p.add_argument("--log-y", action="store_true", help="logarithmic perplexity axis")
    p.add_argument("--ymax", type=float, default=None, help="upper limit of the perplexity axis")
    p.add_argument("--width", type=float, default=6.4, help="figure width in inches")
    p.add_argument("--height", type=float, default=4.0, help="figure height in inches")
    p.add_argument("--dpi", type=int, default=100)
    p.add_argument("--force", action="store_true", help="overwrite existing outputs")
    args = p.parse_args(argv)

    labels = args.labels or default_labels(args.logs)
    if len(labels) != len(args.logs) or len(set(labels)) != len(labels):
        p.error("--labels needs one distinct label per log")
    if args.out.suffix.lower() != ".png":
        p.error("--out must end in .png")
    stem = args.out.with_suffix("")
    outputs = {"updates": args.out, "wall": Path(f"{stem}-wall.png"), "csv": Path(f"{stem}.csv"),
               "json": Path(f"{stem}.json")}
    existing = [str(o) for o in outputs.values() if o.exists()]
    if existing and not args.force:
        p.error(f"{existing[0]} already exists; refusing to overwrite (--force to rewrite)")

    runs, step_ms = {}, {}
    for label, log in zip(labels, args.logs):
        if not log.is_file():
            p.error(f"no such log: {log}")
        points = parse_log(log, args.subset)
        if not points:
            p.error(f"no '{args.subset}' validation lines in {log} "
                    "(fairseq-train --log-format json or simple)")
        runs[label] = points
        times = step_times(log)
        step_ms[label] = statistics.median(times) if times else None
        step = "" if step_ms[label] is None else f"; median update time {step_ms[label]:.1f} ms"
        first, last = points[0], points[-1]
        print(f"{label}: {len(points)} validations, ppl {first['ppl']} at update {first['num_updates']}, "
              f"{last['ppl']} at update {last['num_updates']}{step}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, "num_updates", "updates", outputs["updates"], args)
    longest = max((pt["wall_s"] or 0) for points in runs.values() for pt in points)
    unit, scale = ("hours", 3600.0) if longest >= 7200 else ("minutes", 60.0)
    plot(runs, "wall_s", f"wall-clock time ({unit})", outputs["wall"], args, scale=scale)
    with open(outputs["csv"], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "log", "num_updates", "wall_s", "loss", "ppl"])
        for (label, points), log in zip(runs.items(), args.logs):
            for pt in points:
                writer.writerow([label, str(log), pt["num_updates"], pt["wall_s"], pt["loss"], pt["ppl"]])
    outputs["json"].write_text(json.dumps(
        {"subset": args.subset, "runs": [{"run": label, "log": str(log), "median_update_ms": step_ms[label],
                                          "points": points}
                                         for (label, points), log in zip(runs.items(), args.logs)]}, indent=2) + "\n")
    print("plot_training.py: wrote " + ", ".join(str(o) for o in outputs.values()), file=sys.stderr)


if __name__ == "__main__":
    main()
