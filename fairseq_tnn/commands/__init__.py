"""The project's commands, one entry point: ``python -m fairseq_tnn <command> [arguments]`` (or the console
script ``fairseq-tnn``). Each command owns its recipe, defaults, knob checks and the command lines it builds;
the shell scripts under scripts/ keep their names, usage, environment knobs and exit codes and only hand over
to it (``exec python -m fairseq_tnn <command> "$@"``).

A command is a module of this package with ``main(argv, prog) -> int``: argv its arguments, prog the name its
messages start with (the calling script's, e.g. ``train.sh``). Knobs are environment variables, read and
checked by the command (common.Knobs) before any work. Bad input: one line ``<prog>: error: ...`` on stderr,
exit status 2. This package imports neither torch nor fairseq at import time: a command imports them only
where it needs them, so dry runs and refusals start in a fraction of a second.
"""
import importlib
import sys
from typing import List, Optional

# command -> (module under fairseq_tnn.commands, one-line summary)
COMMANDS = {
    "train": ("train", "train a preset with the paper's recipe: one process, this machine's, or several machines'"),
    "slurm-train": ("slurm_train", "train a preset inside a SLURM job, under srun (scripts/slurm/train.sbatch)"),
    "evaluate": ("evaluate", "perplexity against evaluation length, and the valid/test table (eval_extrapolation.sh)"),
    "demo": ("demo", "TNN and FD-TNN trained side by side on data/sample on CPU, evaluated and reported (demo.sh)"),
    "slurm-evaluate": ("slurm_evaluate", "one task of the evaluation's SLURM array (extrapolation.sbatch)"),
    "preprocess": ("preprocess", "binarise a corpus encoded into pieces (fairseq-preprocess)"),
    "prepare-corpus": ("prepare_corpus", "your own text to fairseq data: check, split, tokenizer, encode, binarise"),
    "prepare-wikitext-103": ("prepare_wikitext", "download, GPT-2 BPE-encode and binarise Wikitext-103"),
    "make-sample-data": ("make_sample_data", "build data/sample from the King James Bible (Debian's packages)"),
    "gpu-check": ("gpu_check", "everything a CUDA GPU can check, in one run and one report (gpu_check.sh)"),
    "export": ("export", "a checkpoint as a folder that loads with torch alone (fairseq_tnn.pretrained)"),
}


def usage() -> str:
    width = max((len(name) for name in COMMANDS), default=0)
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "usage: python -m fairseq_tnn <command> [arguments]\ncommands:\n" + "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = None
    if argv[:1] == ["--prog"] and len(argv) >= 2:  # the shell scripts name themselves in messages
        prog, argv = argv[1], argv[2:]
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"{prog or 'fairseq-tnn'}: error: unknown command '{name}'; choose one of: {' '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__name__}.{COMMANDS[name][0]}")
    return module.main(rest, prog or f"fairseq-tnn {name}")
