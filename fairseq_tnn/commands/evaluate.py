"""``evaluate``: length extrapolation (the paper's perplexity-vs-length figure) and the validation/test table (its
Table 1) of causal checkpoints; ``slurm-evaluate``: the same as a SLURM array, one task per length.

    python -m fairseq_tnn evaluate [label=]<checkpoint.pt>...         (bash scripts/eval_extrapolation.sh)
    python -m fairseq_tnn slurm-evaluate [label=]<checkpoint.pt>...   (sbatch scripts/slurm/extrapolation.sbatch)

A label defaults to the checkpoint's directory name (checkpoints/<run>/checkpoint_best.pt -> <run>). For every
checkpoint and every L in LENGTHS, evaluate runs

    fairseq-eval-lm DATA --task tnn_language_modeling --path CKPT --gen-subset SUBSET --sample-break-mode none
      --context-window CONTEXT_WINDOW --batch-size 1 --tokens-per-sample L --max-tokens L

(TNNs have no positional limit, and tnn_language_modeling makes a block the model cannot take an error, so every
block is scored), and for the table the same at TABLE_TOKENS on the valid and the test split. The training length
is read from the checkpoints (tokens_per_sample in their saved config) and is the default of TRAIN_TOKENS (marked
on the plot) and TABLE_TOKENS; checkpoints trained at different lengths are an error unless both are set.
Outputs in RESULTS_ROOT/NAME:
  raw/<label>/<subset>.L<L>.cw<context window>.log   one fairseq-eval-lm log per evaluation
  extrapolation.json, extrapolation.md, extrapolation.png, table.md   the report (extrapolation_report.py),
    which fails if any evaluation scored fewer tokens than the split has
Existing report files are never overwritten without FORCE=1 (refused before any work); an evaluation whose log
is complete is reused. DRY_RUN=1 prints the commands instead, whatever is on disk (missing data or checkpoints
and results a real run would refuse are reported, not fatal).

slurm-evaluate runs inside an array task (scripts/slurm/extrapolation.sbatch): task i evaluates every checkpoint
at the i-th length of LENGTHS, task 0 also the table (``srun ... env LENGTHS=<L> TABLE=<0|TABLE> REPORT=0
python -m fairseq_tnn evaluate ...``), each writing only RESULTS_ROOT/NAME/raw/; with REPORT_ONLY=1 (the job
that depends on the array) it writes the report. DRY_RUN=1 prints that command.
"""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from fairseq_tnn.commands import extrapolation_report as report
from fairseq_tnn.commands.common import (ROOT, USER_DIR, CommandError, Knob, abs_path, fairseq_bin, invocation,
                                         is_pos_int, knobs_help, quote_cmd, read_knobs, refuse_unless_dry, run_main, say)

BOOL = ("0", "1")


def _lengths(text: str) -> bool:
    return bool(text.split()) and all(is_pos_int(w) for w in text.split())


def _count(text: str) -> bool:
    return re.fullmatch(r"0|[1-9][0-9]*", text) is not None


def _length_or_empty(text: str) -> bool:
    return text == "" or is_pos_int(text)


def _name(text: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9._-]+", text) is not None


def _shell_words(text: str) -> bool:
    try:
        shlex.split(text)
    except ValueError:
        return False
    return True


LENGTHS = Knob("LENGTHS", "512 1024 2048 4096 8192 14336", "the sweep's evaluation lengths (tokens per block)",
               check=_lengths, allowed="positive integers separated by spaces")
KNOBS = [
    Knob("DATA", str(ROOT / "data-bin" / "wikitext-103"), "binarised data the checkpoints were trained on"),
    LENGTHS,
    Knob("SUBSET", "test", "the sweep's split", check=_name, allowed="a split's name (letters, digits, '.', '_', '-')"),
    Knob("CONTEXT_WINDOW", "0", "the sweep's --context-window", check=_count, allowed="a non-negative integer"),
    Knob("TABLE", "1", "1: also the valid/test table at TABLE_TOKENS (the paper's Table 1); 0: no table",
         choices=BOOL),
    Knob("TABLE_TOKENS", "", "the table's tokens per block (empty: the training length)", check=_length_or_empty,
         allowed="a positive integer"),
    Knob("TABLE_CONTEXT_WINDOW", "0", "the table's --context-window", check=_count, allowed="a non-negative integer"),
    Knob("TRAIN_TOKENS", "", "the training length, marked on the plot (empty: read from the checkpoints)",
         check=_length_or_empty, allowed="a positive integer"),
    Knob("NAME", "extrapolation", "the results folder, RESULTS_ROOT/NAME", check=_name,
         allowed="letters, digits, '.', '_' or '-'"),
    Knob("RESULTS_ROOT", str(ROOT / "results"), "where the NAME folder is made"),
    Knob("CPU", "0", "1 evaluates on the CPU (--cpu)", choices=BOOL),
    Knob("NUM_WORKERS", "1", "data loader workers (--num-workers)", check=_count, allowed="a non-negative integer"),
    Knob("EXTRA_ARGS", "", "more fairseq-eval-lm options, split as a shell splits words", check=_shell_words,
         allowed="words a shell can split (balanced quotes)"),
    Knob("REPORT", "1", "0 only runs the evaluations (the array's tasks)", choices=BOOL),
    Knob("REPORT_ONLY", "0", "1 only writes the report, from the logs in RESULTS_ROOT/NAME/raw", choices=BOOL),
    Knob("FORCE", "0", "1 redoes the requested evaluations and rewrites the report", choices=BOOL),
    Knob("DRY_RUN", "0", "1 prints the commands instead of running them", choices=BOOL),
]
ENVIRONMENT = ("FAIRSEQ_BIN [<repo>/.venv/bin]: the directory of fairseq-eval-lm; PYTHON [$FAIRSEQ_BIN/python]: "
               "the python the scripts hand over to")
ARGUMENTS = "[label=]<checkpoint.pt>..."


def usage_or_help(argv: List[str], prog: str, doc: str, knobs: Sequence[Knob], extra: str = "") -> Optional[int]:
    """None to go on with argv as the checkpoints; 0 after --help (printed: usage, doc, knobs, extra); 2 after
    the usage line on stderr, for no checkpoint or an option first."""
    usage = f"usage: {invocation(prog)} {ARGUMENTS}"
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\n{doc.strip()}\n\n{knobs_help(knobs)}\n{extra}".rstrip())
        return 0
    if not argv or argv[0].startswith("-"):
        print(usage, file=sys.stderr)
        return 2
    return None


def parse_models(argv: List[str], dry: bool) -> List[Tuple[str, Path]]:
    """[(label, absolute checkpoint path)] of label=path (or path) arguments."""
    models: List[Tuple[str, Path]] = []
    for arg in argv:
        label, sep, path = arg.partition("=")
        if not sep:
            path, label = arg, Path(os.path.abspath(arg)).parent.name
        if not re.fullmatch(r"[A-Za-z0-9._+-]+", label):
            raise CommandError(f"model label '{label}' must be letters, digits, '.', '_', '+' or '-' (use label=path)")
        if label in (seen for seen, _ in models):
            raise CommandError(f"two checkpoints are labelled '{label}'; name them with label=path")
        if not Path(path).is_file() and not dry:
            raise CommandError(f"checkpoint not found: {path}")
        models.append((label, abs_path(path)))
    return models


def trained_lengths(checkpoints: Sequence[Path]) -> Dict[Path, object]:
    """{checkpoint: the task's tokens_per_sample in its saved config ('?' if it has none)}."""
    import fairseq_tnn

    fairseq_tnn.register()  # the models; old-style checkpoints load with weights_only on
    from fairseq import checkpoint_utils

    found = {}
    for path in checkpoints:
        state = checkpoint_utils.load_checkpoint_to_cpu(str(path))
        task = (state.get("cfg") or {}).get("task") or {}
        found[path] = task.get("tokens_per_sample", "?")
    return found


def training_length(prog: str, models: List[Tuple[str, Path]], dry: bool) -> int:
    """The one length the checkpoints were trained at; an error listing them if they differ."""
    if not all(path.is_file() for _, path in models):  # only a dry run gets here with a missing checkpoint
        say(prog, "DRY_RUN: a checkpoint is missing, so its training length is unknown; assuming 512")
        return 512
    try:
        found = trained_lengths([path for _, path in models])
    except Exception as e:  # noqa: BLE001  (any failure to load: the way out is setting the lengths)
        raise CommandError(f"could not read the training length from the checkpoints ({type(e).__name__}: {e}); "
                           "set TRAIN_TOKENS and TABLE_TOKENS", 1)
    distinct = {str(n) for n in found.values()}
    if len(distinct) != 1 or not is_pos_int(next(iter(distinct))):
        listing = "\n".join(f"  tokens_per_sample {n}\t{path}" for path, n in found.items())
        raise CommandError("the checkpoints were trained at different lengths (or one has none in its config):\n"
                           f"{listing}\nset TRAIN_TOKENS (marked on the plot) and TABLE_TOKENS (the valid/test "
                           "table's length) explicitly")
    return int(distinct.pop())


class Sweep:
    """The evaluations of one run: each command, its log, and whether to run it."""

    def __init__(self, prog: str, knobs: Dict[str, str], data: Path, out: Path):
        self.prog, self.knobs, self.data, self.out = prog, knobs, data, out
        self.dry, self.force = knobs["DRY_RUN"] == "1", knobs["FORCE"] == "1"
        self.eval_lm = fairseq_bin() / "fairseq-eval-lm"
        self.done = set()  # logs of this run (the table's test evaluation may be one of the sweep's)

    def command(self, checkpoint: Path, subset: str, length: int, context_window: str) -> List[str]:
        cmd = [str(self.eval_lm), str(self.data), "--user-dir", str(USER_DIR), "--task", "tnn_language_modeling",
               "--path", str(checkpoint), "--gen-subset", subset, "--sample-break-mode", "none",
               "--context-window", context_window, "--batch-size", "1", "--tokens-per-sample", str(length),
               "--max-tokens", str(length), "--num-workers", self.knobs["NUM_WORKERS"]]
        if self.knobs["CPU"] == "1":
            cmd.append("--cpu")
        return cmd + shlex.split(self.knobs["EXTRA_ARGS"])

    def evaluate(self, label: str, checkpoint: Path, subset: str, length: int, context_window: str) -> None:
        log = report.log_path(self.out, label, subset, length, int(context_window))
        if log in self.done:
            return
        self.done.add(log)
        cmd = self.command(checkpoint, subset, length, context_window)
        if self.dry:
            print(f"{quote_cmd(cmd)}\n  > {log}", flush=True)
            return
        if not self.force and log.is_file() and "Perplexity:" in log.read_text(errors="replace"):
            say(self.prog, f"{label} {subset} L={length}: reusing {log}")
            return
        log.parent.mkdir(parents=True, exist_ok=True)
        say(self.prog, f"{label} {subset} L={length} context-window {context_window}")
        part = log.with_name(log.name + ".part")
        with open(part, "w") as f:
            status = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        if status != 0:
            sys.stderr.write("".join(part.read_text(errors="replace").splitlines(True)[-30:]))
            raise CommandError(f"fairseq-eval-lm failed for {label} ({subset}, L={length}); full log: {part}", 1)
        part.rename(log)
        for line in log.read_text(errors="replace").splitlines():
            if "Evaluated" in line or "Perplexity" in line:
                print(re.sub(r"^.*eval_lm[:|] *", "", line), file=sys.stderr, flush=True)


def evaluate(argv: List[str], prog: str) -> int:
    stop = usage_or_help(argv, prog, __doc__, KNOBS, ENVIRONMENT)
    if stop is not None:
        return stop
    knobs = read_knobs(KNOBS)
    dry = knobs["DRY_RUN"] == "1"
    fairseq_bin()  # refuses the retired FAIRSEQ_PREPROCESS before any work
    lengths = [int(L) for L in knobs["LENGTHS"].split()]
    out = abs_path(Path(knobs["RESULTS_ROOT"]) / knobs["NAME"])
    data = knobs["DATA"]
    if not (Path(data) / "dict.txt").is_file():
        refuse_unless_dry(prog, dry, f"no binarised data in '{data}' (set DATA=<data-bin>)")
    data = abs_path(data)
    models = parse_models(argv, dry)

    write_report = knobs["REPORT"] == "1" or knobs["REPORT_ONLY"] == "1"
    existing = report.existing_outputs(out) if write_report else []
    if existing and knobs["FORCE"] != "1":
        refuse_unless_dry(prog, dry, f"{existing[0]} already exists; refusing to overwrite the results in {out} "
                                     "(FORCE=1 redoes them, or choose another NAME)")

    train_tokens, table_tokens = knobs["TRAIN_TOKENS"], knobs["TABLE_TOKENS"]
    if not (train_tokens and table_tokens):
        trained = training_length(prog, models, dry)
        train_tokens, table_tokens = train_tokens or str(trained), table_tokens or str(trained)
        say(prog, f"trained at {trained} tokens (the checkpoints' tokens_per_sample): TRAIN_TOKENS={train_tokens} "
                  f"TABLE_TOKENS={table_tokens}")
    table = knobs["TABLE"] == "1"

    if knobs["REPORT_ONLY"] != "1":
        sweep = Sweep(prog, knobs, data, out)
        for label, checkpoint in models:
            for length in lengths:
                sweep.evaluate(label, checkpoint, knobs["SUBSET"], length, knobs["CONTEXT_WINDOW"])
            if table:
                for split in ("valid", "test"):
                    sweep.evaluate(label, checkpoint, split, int(table_tokens), knobs["TABLE_CONTEXT_WINDOW"])

    if write_report:
        args = ["--out-dir", str(out), "--data", str(data), "--subset", knobs["SUBSET"],
                "--context-window", knobs["CONTEXT_WINDOW"], "--lengths", *map(str, lengths),
                "--train-length", train_tokens, "--models", *(f"{label}={path}" for label, path in models)]
        if table:
            args += ["--table-tokens", table_tokens, "--table-context-window", knobs["TABLE_CONTEXT_WINDOW"]]
        if knobs["FORCE"] == "1":
            args.append("--force")
        if dry:
            print(quote_cmd([sys.executable, "-m", report.__name__, *args]), flush=True)
            return 0
        report.run(args, prog)
    return 0


def slurm_evaluate(argv: List[str], prog: str) -> int:
    stop = usage_or_help(argv, prog, __doc__, KNOBS, f"{ENVIRONMENT}\nSLURM_ARRAY_TASK_ID: the array task (SLURM "
                         "sets it; set it by hand for a dry run outside SLURM)")
    if stop is not None:
        return stop
    knobs = read_knobs(KNOBS)  # every knob of the evaluation checked before the job starts it
    lengths = knobs["LENGTHS"].split()
    evaluate_cmd = [sys.executable, "-m", "fairseq_tnn", "--prog", prog, "evaluate", *argv]
    if knobs["REPORT_ONLY"] == "1":
        cmd = ["env", f"LENGTHS={' '.join(lengths)}", "REPORT_ONLY=1", *evaluate_cmd]
    else:
        task = os.environ.get("SLURM_ARRAY_TASK_ID", "")
        if not re.fullmatch(r"[0-9]+", task):
            raise CommandError("not an array task (SLURM_ARRAY_TASK_ID unset); submit with sbatch, or REPORT_ONLY=1 "
                               "for the report")
        if int(task) >= len(lengths):
            raise CommandError(f"array task {task} but only {len(lengths)} LENGTHS ({' '.join(lengths)}); use "
                               f"--array=0-{len(lengths) - 1}")
        table = knobs["TABLE"] if int(task) == 0 else "0"
        cmd = ["srun", "--ntasks=1", "--kill-on-bad-exit=1", "env", f"LENGTHS={lengths[int(task)]}", f"TABLE={table}",
               "REPORT=0", *evaluate_cmd]
    if knobs["DRY_RUN"] == "1":
        print(quote_cmd(cmd), flush=True)
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)


def main(argv: List[str], prog: str) -> int:
    return run_main(prog, lambda: evaluate(argv, prog))
