"""``demo``: a miniature of the paper's causal experiment on the bundled sample corpus, CPU only (README command 1,
``bash scripts/demo.sh``, which sets up .venv first and hands over to this).

Binarises data/sample (the preprocess command), trains a small TNN and a small FD-TNN causal LM side by side with
the CPU smoke recipe (fairseq_tnn/recipe.py: SMOKE, the paper's recipe shortened; through the train command), then
for both: validation/test perplexity (Table 1 layout) and perplexity against evaluation length up to 16x the
training length in one plot (the evaluate command), validation perplexity against updates and wall-clock time and
the median wall time of one training update (scripts/plot_training.py), the learned kernels
(scripts/plot_kernels.py), and a short sampled continuation of a fixed prompt from each model
(fairseq-interactive with the incremental decoder).

A finished training run in WORK is reused and an interrupted one resumed; FORCE=1 deletes WORK's runs and results
and starts again from scratch. Knobs of scripts/train.sh and of the evaluate command that the demo does not set
(e.g. SEED, CONTEXT_WINDOW) pass through to them.
Outputs in WORK: checkpoints/<model>/ (train.log, checkpoints), logs/<model>.out, results/demo/
(extrapolation.{json,md,png}, table.md, training{,-wall}.png, training.{csv,json}, kernels/<model>/).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

from fairseq_tnn import recipe
from fairseq_tnn.commands.common import (ROOT, USER_DIR, CommandError, Knob, abs_path, fairseq_bin, invocation,
                                         is_pos_int, knobs_help, read_knobs, run_main)
from fairseq_tnn.commands.evaluate import LENGTHS

BOOL = ("0", "1")
PROMPT = "And God said unto Moses"
SAMPLE = ROOT / "data" / "sample"


def _presets(text: str) -> bool:
    return bool(text.split()) and all(name in recipe.CAUSAL_PRESETS for name in text.split())


def _rate(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def _smoke(name: str, help: str, **check) -> Knob:
    """A knob whose default is the smoke recipe's value of the train.sh knob name."""
    return Knob(name, recipe.SMOKE[name], help, **check)


POSITIVE = {"check": is_pos_int, "allowed": "a positive integer"}
KNOBS = [
    Knob("MODELS", "tnn_lm_tiny fd_tnn_lm_tiny", "the causal presets trained side by side", check=_presets,
         allowed=f"causal presets separated by spaces ({' '.join(recipe.CAUSAL_PRESETS)})"),
    _smoke("MAX_UPDATE", "training updates", **POSITIVE),
    _smoke("TOKENS_PER_SAMPLE", "tokens per training block (the training length)", **POSITIVE),
    Knob("BATCH_SIZE", recipe.SMOKE["SEQS_PER_UPDATE"], "sequences per update", **POSITIVE),
    _smoke("LR", "peak learning rate", check=_rate, allowed="a positive number"),
    _smoke("WARMUP_UPDATES", "warm-up updates", **POSITIVE),
    _smoke("LOG_INTERVAL", "updates between training log lines", **POSITIVE),
    Knob("LENGTHS", "128 256 512 1024 2048", "the evaluation lengths", check=LENGTHS.check, allowed=LENGTHS.allowed),
    Knob("WORK", str(ROOT / "demo-run"), "the folder of the runs and results"),
    Knob("FORCE", "0", "1 deletes WORK's runs and results first", choices=BOOL),
]
ENVIRONMENT = ("FAIRSEQ_BIN: unset, scripts/demo.sh sets up <repo>/.venv and uses it; set, the directory of the "
               "fairseq commands to use instead\nPYTHON [$FAIRSEQ_BIN/python]: the python the script hands over to")


def step(cmd: List, env: Dict[str, str], log: Path, what: str, tail: int = 30) -> None:
    """Run cmd with stdout and stderr in log; on failure the log's last lines on stderr, then an error."""
    with open(log, "w") as f:
        status = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if status != 0:
        sys.stderr.write("".join(log.read_text(errors="replace").splitlines(True)[-tail:]))
        raise CommandError(f"{what} failed (exit status {status}), see {log}", 1)


def demo(argv: List[str], prog: str) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: {invocation(prog)}   (no arguments)\n\n{__doc__.strip()}\n\n{knobs_help(KNOBS)}\n{ENVIRONMENT}")
        return 0
    if argv:
        print(f"usage: {invocation(prog)}   (no arguments; settings are environment variables: "
              "python -m fairseq_tnn demo --help)", file=sys.stderr)
        return 2
    knobs = read_knobs(KNOBS)
    models, tps, batch = knobs["MODELS"].split(), knobs["TOKENS_PER_SAMPLE"], knobs["BATCH_SIZE"]
    fairseq = fairseq_bin()
    work = abs_path(knobs["WORK"])
    data = ROOT / "data-bin" / "sample"
    results = work / "results" / "demo"
    # the scripts and commands run below: this fairseq, this python, this repository's package
    env = {**os.environ, "FAIRSEQ_BIN": str(fairseq), "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    work.mkdir(parents=True, exist_ok=True)
    log = work / "preprocess.log"
    with open(log, "w") as f:  # on failure the whole log: preprocess.sh's error is its last line or its first
        if subprocess.run([sys.executable, "-m", "fairseq_tnn", "preprocess", str(SAMPLE), str(data)], stdout=f,
                          stderr=subprocess.STDOUT, env={**env, "FORCE": "0"}).returncode != 0:
            sys.stderr.write(log.read_text(errors="replace"))
            return 1
    if knobs["FORCE"] == "1":
        for name in ("checkpoints", "results", "logs"):
            shutil.rmtree(work / name, ignore_errors=True)

    for arch in models:
        run_dir, out = work / "checkpoints" / arch, work / "logs" / f"{arch}.out"
        last = run_dir / "checkpoint_last.pt"
        if last.is_file() and out.is_file() and "done training" in out.read_text(errors="replace"):
            print(f"demo: reusing the finished run in {run_dir}", flush=True)
            continue
        resume = last.is_file()
        print(f"demo: training {arch} for {knobs['MAX_UPDATE']} updates of {batch} x {tps} tokens on CPU (log: {out})",
              flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        smoke = {**recipe.SMOKE, **{k: knobs[k] for k in ("MAX_UPDATE", "TOKENS_PER_SAMPLE", "LR", "WARMUP_UPDATES",
                                                           "LOG_INTERVAL")},
                 "SEQS_PER_UPDATE": batch, "BATCH_PER_GPU": batch}
        part = out.with_name(out.name + ".part")
        step([sys.executable, "-m", "fairseq_tnn", "train", arch, data, *recipe.SMOKE_ARGS],
             {**env, **smoke, "SAVE_ROOT": str(work / "checkpoints"), "RESUME": str(int(resume)),
              "FORCE": str(1 - int(resume))}, part, f"training {arch}")
        part.rename(out)

    print(f"demo: evaluating at {knobs['LENGTHS']} tokens (trained at {tps}), every block scored", flush=True)
    checkpoints = [f"{arch}={work / 'checkpoints' / arch / 'checkpoint_last.pt'}" for arch in models]
    step([sys.executable, "-m", "fairseq_tnn", "evaluate", *checkpoints],
         {**env, "FORCE": "1", "CPU": "1", "DATA": str(data), "LENGTHS": knobs["LENGTHS"], "TABLE_TOKENS": tps,
          "TRAIN_TOKENS": tps, "NAME": "demo", "RESULTS_ROOT": str(work / "results")}, work / "eval.log",
         "the evaluation")
    summary = work / "training-summary.txt"
    plotted = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_training.py"),
                              *(str(work / "checkpoints" / arch / "train.log") for arch in models),
                              "--out", str(results / "training.png"), "--force"],
                             capture_output=True, text=True, env=env)
    summary.write_text(plotted.stdout)
    if plotted.returncode != 0:
        sys.stderr.write(plotted.stderr)
        raise CommandError("plot_training.py failed", 1)
    for arch in models:  # what the models learned: impulse/frequency responses and Toeplitz matrices
        step([sys.executable, ROOT / "scripts" / "plot_kernels.py", work / "checkpoints" / arch / "checkpoint_last.pt",
              "--out", results / "kernels" / arch, "--force"], env, work / f"kernels-{arch}.log",
             f"drawing the kernels of {arch}", tail=20)

    symbols = len((data / "dict.txt").read_text().splitlines())
    print(f"\ndemo: {' '.join(models)}, {knobs['MAX_UPDATE']} updates of {batch} x {tps} tokens each; vocabulary "
          f"{symbols} + 4 symbols")
    print(f"demo: validation and test perplexity (context window 0, blocks of {tps}):")
    print((results / "table.md").read_text())
    print(f"demo: test perplexity against evaluation length (trained at {tps}):")
    print((results / "extrapolation.md").read_text())
    print("demo: training (validation perplexity at the first and the last validation, median wall time of one "
          "update):")
    print("".join(f"  {line}" for line in summary.read_text().splitlines(True)))
    print(f"demo: \"{PROMPT}\" continued by each model (fairseq-interactive, top-10 sampling, seed 1, decoded with "
          "data/sample/spm.model):", flush=True)
    for arch in models:
        sampled = subprocess.run(
            [str(fairseq / "fairseq-interactive"), str(data), "--user-dir", str(USER_DIR), "--task",
             "tnn_language_modeling", "--path", str(work / "checkpoints" / arch / "checkpoint_last.pt"), "--cpu",
             "--bpe", "sentencepiece", "--sentencepiece-model", str(SAMPLE / "spm.model"), "--beam", "1",
             "--sampling", "--sampling-topk", "10", "--seed", "1", "--max-len-b", "32"],
            input=PROMPT + "\n", capture_output=True, text=True, env=env)
        (work / "sample.log").write_text(sampled.stderr)
        if sampled.returncode != 0:
            sys.stderr.write(sampled.stderr)
            raise CommandError(f"sampling from {arch} failed", 1)
        text = [line.split("\t")[2] for line in sampled.stdout.splitlines() if line.startswith("D-0\t")]
        print(f"  {arch}: {text[0] if text else ''}")

    print(f"\ndemo: plots: {results / 'extrapolation.png'} {results / 'training.png'} {results / 'training-wall.png'}")
    layers = "".join(f"{results / 'kernels' / arch / 'layer0.png'} " for arch in models)
    print(f"demo: kernels: {layers}(one per layer, kernels.json beside)")
    return 0


def main(argv: List[str], prog: str) -> int:
    return run_main(prog, lambda: demo(argv, prog))
