"""What the commands share (the Python side of what scripts/lib.sh was): messages and exit codes, environment
knobs with their defaults and checks, command lines printed so that they paste into a shell, the repository's
paths, the fairseq commands' directory, and the number of GPUs. Standard library only."""
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Sequence

# the repository (fairseq_tnn/commands/common.py), as the scripts name it: symbolic links kept, as bash's pwd
# keeps them (a checkout whose fairseq_tnn/ is a link trains with --user-dir <checkout>/fairseq_tnn)
ROOT = Path(os.path.abspath(__file__)).parents[2]
USER_DIR = ROOT / "fairseq_tnn"  # what --user-dir names


class CommandError(Exception):
    """Stops a command: ``<prog>: error: <message>`` on stderr and exit status ``code`` (2: bad input, given
    before any work; 1: a step that failed)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def say(prog: str, message: str) -> None:
    print(f"{prog}: {message}", file=sys.stderr, flush=True)


def run_main(prog: str, body: Callable[[], int]) -> int:
    """body(), with a CommandError turned into its one-line message and exit status."""
    try:
        return body()
    except CommandError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return e.code


def quote_cmd(cmd: Sequence) -> str:
    """A command line that pastes into a shell (and splits back with shlex)."""
    return " ".join(shlex.quote(str(a)) for a in cmd)


def is_count(text) -> bool:
    """0, 1, 2, ... (digits only)."""
    return str(text).isascii() and str(text).isdigit()


def cpus() -> int:
    """The CPUs this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def is_pos_int(text) -> bool:
    return re.fullmatch(r"[1-9][0-9]*", str(text)) is not None


def abs_path(path) -> Path:
    """path made absolute against the current directory (not resolving links, as the scripts did)."""
    p = Path(path)
    return p if p.is_absolute() else Path(os.getcwd()) / p


def refuse_unless_dry(prog: str, dry: bool, message: str) -> None:
    """message as an error (exit 2), or in a dry run said with "a real run stops here": a dry run prints its
    commands whatever is on disk."""
    if not dry:
        raise CommandError(message)
    say(prog, f"DRY_RUN: {message} (a real run stops here)")


@dataclass(frozen=True)
class Knob:
    """An environment knob: its name, default (a string, or a function of the knobs read before it), the
    values allowed (a tuple of strings, or a predicate with a description), and a line of help."""
    name: str
    default: object
    help: str
    choices: Optional[Sequence[str]] = None
    check: Optional[Callable[[str], bool]] = None
    allowed: str = ""  # what check accepts, in words ("a positive integer")


def read_knobs(knobs: Sequence[Knob], env: Optional[Mapping[str, str]] = None,
               known: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """{name: value} of knobs from env (default os.environ), an empty value meaning the default; a value not
    allowed is a CommandError naming the knob, its value and what is allowed. known: values the defaults may
    use besides the knobs read before (e.g. the preset), returned with the knobs."""
    env = os.environ if env is None else env
    values: Dict[str, str] = dict(known or {})
    for knob in knobs:
        value = env.get(knob.name) or ""
        if not value:
            value = knob.default(values) if callable(knob.default) else knob.default
        value = str(value)
        if knob.choices is not None and value not in knob.choices:
            raise CommandError(f"{knob.name} must be {' or '.join(knob.choices)}, not '{value}'")
        if knob.check is not None and not knob.check(value):
            raise CommandError(f"{knob.name} must be {knob.allowed}, not '{value}'")
        values[knob.name] = value
    return values


def fairseq_bin(env: Optional[Mapping[str, str]] = None) -> Path:
    """The directory of the fairseq commands: FAIRSEQ_BIN, else <repo>/.venv/bin, else this interpreter's."""
    env = os.environ if env is None else env
    if env.get("FAIRSEQ_PREPROCESS") is not None:
        raise CommandError(f"FAIRSEQ_PREPROCESS is set ('{env['FAIRSEQ_PREPROCESS']}') but no longer read: set "
                           "FAIRSEQ_BIN to the directory of the fairseq commands instead (fairseq-preprocess is "
                           f"$FAIRSEQ_BIN/fairseq-preprocess; default {ROOT}/.venv/bin)")
    if env.get("FAIRSEQ_BIN"):
        return Path(env["FAIRSEQ_BIN"])
    venv = ROOT / ".venv" / "bin"
    return venv if venv.is_dir() else Path(sys.executable).parent


def count_gpus(env: Optional[Mapping[str, str]] = None) -> int:
    """The GPUs this process may use: those CUDA_VISIBLE_DEVICES lists if it is set (as SLURM sets it for a
    job's GPUs), else nvidia-smi's, else 0. (No torch import: a dry run stays fast.)"""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        return len([d for d in re.split(r"[,\s]+", env["CUDA_VISIBLE_DEVICES"]) if d])
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if line.startswith("GPU"))


def knobs_help(knobs: Sequence[Knob]) -> str:
    """The knobs as every --help lists them, under one heading: NAME [default]  help (allowed: ...). A default
    that is a function of other values has no brackets: its help says it."""
    lines = ["knobs are environment variables (defaults in brackets; an empty value is the default):"]
    for knob in knobs:
        allowed = " | ".join(knob.choices) if knob.choices else knob.allowed
        name = knob.name if callable(knob.default) else f"{knob.name} [{knob.default}] "
        lines.append(f"  {name} {knob.help}{f' (allowed: {allowed})' if allowed else ''}")
    return "\n".join(lines)


# How a user runs a script that hands over, by its suffix: the program and the script's folder
LAUNCHERS = {".sh": ("bash", "scripts"), ".sbatch": ("sbatch", "scripts/slurm")}


def invocation(prog: str) -> str:
    """How a user runs the command that prog names: the script's command line ("train.sh": "bash
    scripts/train.sh"), or "python -m fairseq_tnn <command>" for "fairseq-tnn <command>"."""
    for suffix, (program, folder) in LAUNCHERS.items():
        if prog.endswith(suffix):
            return f"{program} {folder}/{prog}"
    return prog.replace("fairseq-tnn ", "python -m fairseq_tnn ", 1)
