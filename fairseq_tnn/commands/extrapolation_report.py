"""Collect the fairseq-eval-lm logs of a length-extrapolation sweep into JSON, Markdown and a plot.

The report of the evaluate command (fairseq_tnn/commands/evaluate.py, which documents the whole procedure and
calls run() in its process; its dry run prints the same report as
``python -m fairseq_tnn.commands.extrapolation_report ...``). Reads
OUT/raw/<label>/<subset>.L<length>.cw<context window>.log and writes, in OUT:

  extrapolation.json  {"results": [{model, checkpoint, subset, length, context_window, loss, ppl,
                       evaluated_tokens, expected_tokens}, ...], "table": [{model, valid_ppl, test_ppl,
                       params, params_m}, ...], ...}
  extrapolation.md    perplexity, one row per model, one column per evaluation length
  extrapolation.png   perplexity vs evaluation length, one line per model
  table.md            rows = models; PPL (val), PPL (test), Params (m), as in the paper's Table 1

Every evaluation must have scored every token of its split (expected_tokens, counted from the
binarised data); a missing log or a short count is an error and nothing is written. Existing outputs
are never overwritten without --force.
"""
import argparse
import json
import re
import sys
from functools import lru_cache
from pathlib import Path

from fairseq_tnn.commands.common import CommandError, run_main, say

EVALUATED = re.compile(r"Evaluated ([0-9,]+) tokens")
LOSS = re.compile(r"Loss \(base 2\): ([0-9.eE+-]+|nan|inf), Perplexity: ([0-9.eE+-]+|nan|inf)")
PARAMS = re.compile(r"num\. model params: ([0-9,]+)")
OUTPUTS = ("extrapolation.json", "extrapolation.md", "extrapolation.png", "table.md")


def log_path(out_dir: Path, label: str, subset: str, length: int, context_window: int) -> Path:
    """Where the evaluate command writes one evaluation's log."""
    return out_dir / "raw" / label / f"{subset}.L{length}.cw{context_window}.log"


def parse_eval_log(path: Path):
    """loss (base 2), ppl, evaluated tokens and parameter count from a fairseq-eval-lm log; None if incomplete."""
    if not path.is_file():
        return None
    text = path.read_text(errors="replace")
    loss, evaluated, params = LOSS.search(text), EVALUATED.search(text), PARAMS.search(text)
    if not (loss and evaluated):
        return None
    return {"loss": float(loss.group(1)), "ppl": float(loss.group(2)),
            "evaluated_tokens": int(evaluated.group(1).replace(",", "")),
            "params": int(params.group(1).replace(",", "")) if params else None}


@lru_cache(maxsize=None)
def split_tokens(data: str, subset: str) -> int:
    """Tokens (end-of-sentence symbols included) in a binarised split: what eval-lm must score."""
    from fairseq.data import data_utils

    dataset = data_utils.load_indexed_dataset(str(Path(data) / subset), None)
    if dataset is None:
        raise CommandError(f"no split '{subset}' in {data}", 1)
    return int(dataset.sizes.sum())


def parse_models(specs):
    models = {}
    for spec in specs:
        label, sep, checkpoint = spec.partition("=")
        if not sep or not label:
            raise CommandError(f"--models takes label=checkpoint, got {spec!r}")
        if label in models:
            raise CommandError(f"label {label!r} given twice")
        models[label] = checkpoint
    return models


def collect(args, models):
    """Parse every expected log; return results, table rows, params and a list of problems."""
    problems, results, params = [], [], {}

    def evaluation(label, subset, length, cw):
        path = log_path(args.out_dir, label, subset, length, cw)
        parsed = parse_eval_log(path)
        if parsed is None:
            problems.append(f"{label}: no complete fairseq-eval-lm log for {subset} at L={length} ({path})")
            return None
        expected = split_tokens(str(args.data), subset)
        if parsed["evaluated_tokens"] != expected:
            problems.append(f"{label}: {subset} at L={length} scored {parsed['evaluated_tokens']} of {expected} "
                            f"tokens ({path})")
        if parsed["params"] is not None:
            params[label] = parsed["params"]
        return {"model": label, "checkpoint": models[label], "subset": subset, "length": length,
                "context_window": cw, "loss": parsed["loss"], "ppl": parsed["ppl"],
                "evaluated_tokens": parsed["evaluated_tokens"], "expected_tokens": expected, "log": str(path)}

    for label in models:
        for length in args.lengths:
            row = evaluation(label, args.subset, length, args.context_window)
            if row:
                results.append(row)
    table = []
    if args.table_tokens:
        for label in models:
            row = {"model": label}
            for split in ("valid", "test"):
                r = evaluation(label, split, args.table_tokens, args.table_context_window)
                row[f"{split}_ppl"] = r["ppl"] if r else None
            row["params"] = params.get(label)
            row["params_m"] = round(params[label] / 1e6, 2) if label in params else None
            table.append(row)
    return results, table, params, problems


def fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def extrapolation_markdown(args, models, results):
    by = {(r["model"], r["length"]): r for r in results}
    expected = split_tokens(str(args.data), args.subset)
    lines = [f"Perplexity on the {args.subset} split ({expected:,} tokens, every token scored) vs evaluation "
             f"length (tokens per block, context window {args.context_window}); trained at {args.train_length}.", "",
             "| model | " + " | ".join(str(L) for L in args.lengths) + " |",
             "|---|" + "---:|" * len(args.lengths)]
    for label in models:
        lines.append(f"| {label} | " + " | ".join(fmt(by[(label, L)]["ppl"]) for L in args.lengths) + " |")
    return "\n".join(lines) + "\n"


def table_markdown(args, table):
    lines = [f"Causal LM on {Path(args.data).name} (laid out as the paper's Table 1): fairseq-eval-lm at "
             f"{args.table_tokens} tokens per block, context window {args.table_context_window}.", "",
             "| Architecture | PPL (val) | PPL (test) | Params (m) |", "|---|---:|---:|---:|"]
    for row in table:
        lines.append(f"| {row['model']} | {fmt(row['valid_ppl'])} | {fmt(row['test_ppl'])} | {fmt(row['params_m'])} |")
    return "\n".join(lines) + "\n"


def plot(args, models, results, path: Path):
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # importing fairseq turned the root logger to DEBUG
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(args.width, args.height), dpi=args.dpi)
    for label in models:
        rows = sorted((r for r in results if r["model"] == label), key=lambda r: r["length"])
        ax.plot([r["length"] for r in rows], [r["ppl"] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(args.lengths)
    ax.set_xticklabels([str(L) for L in args.lengths])
    ax.minorticks_off()
    if args.train_length:
        ax.axvline(args.train_length, color="grey", linestyle=":", linewidth=1, label=f"training length ({args.train_length})")
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel(f"{args.subset} perplexity")
    ax.set_title("Length extrapolation")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=args.dpi)
    plt.close(fig)


def existing_outputs(out_dir: Path):
    """The report's files already in out_dir (never overwritten without --force)."""
    return [out_dir / f for f in OUTPUTS if (out_dir / f).exists()]


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, required=True, help="results directory (holds raw/)")
    p.add_argument("--data", type=Path, required=True, help="binarised data directory (to count each split's tokens)")
    p.add_argument("--models", nargs="+", required=True, metavar="LABEL=CHECKPOINT")
    p.add_argument("--lengths", type=int, nargs="+", required=True)
    p.add_argument("--subset", default="test")
    p.add_argument("--context-window", type=int, default=0)
    p.add_argument("--table-tokens", type=int, default=0, help="length of the valid/test table's evaluation (0: no table)")
    p.add_argument("--table-context-window", type=int, default=0)
    p.add_argument("--train-length", type=int, default=0, help="training length, marked on the plot (0: none)")
    p.add_argument("--width", type=float, default=6.4, help="figure width in inches")
    p.add_argument("--height", type=float, default=4.0, help="figure height in inches")
    p.add_argument("--dpi", type=int, default=100)
    p.add_argument("--force", action="store_true", help="overwrite existing outputs")
    return p


def run(argv, prog: str = "extrapolation_report") -> None:
    """Write the report of these arguments (main()'s); a CommandError if outputs exist without --force (2) or
    an evaluation is missing or incomplete (1, nothing written)."""
    args = parser(prog).parse_args(argv)
    models = parse_models(args.models)
    existing = existing_outputs(args.out_dir)
    if existing and not args.force:
        raise CommandError(f"{existing[0]} already exists; refusing to overwrite (--force to rewrite)")
    results, table, params, problems = collect(args, models)
    if problems:
        raise CommandError("incomplete evaluations, nothing written:\n  " + "\n  ".join(problems), 1)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {"data": str(args.data), "subset": args.subset, "context_window": args.context_window,
              "lengths": args.lengths, "train_length": args.train_length, "models": models, "params": params,
              "results": results, "table_tokens": args.table_tokens or None,
              "table_context_window": args.table_context_window, "table": table}
    (args.out_dir / "extrapolation.json").write_text(json.dumps(report, indent=2) + "\n")
    md = extrapolation_markdown(args, models, results)
    (args.out_dir / "extrapolation.md").write_text(md)
    plot(args, models, results, args.out_dir / "extrapolation.png")
    print(md, flush=True)
    if not table and (args.out_dir / "table.md").exists():
        (args.out_dir / "table.md").unlink()  # --force without a table: do not leave a stale one
    if table:
        tmd = table_markdown(args, table)
        (args.out_dir / "table.md").write_text(tmd)
        print(tmd, flush=True)
    say(prog, f"wrote {', '.join(f.name for f in existing_outputs(args.out_dir))} in {args.out_dir}")


def main(argv=None, prog: str = "extrapolation_report") -> int:
    return run_main(prog, lambda: run(sys.argv[1:] if argv is None else argv, prog) or 0)


if __name__ == "__main__":
    sys.exit(main())
