"""What the data commands (preprocess, prepare-corpus, prepare-wikitext-103, make-sample-data) share: their
argument parser with the knobs in its help, the knobs they have in common, a stop by a signal turned into an
exception (so that temporary files are removed), and fairseq-preprocess. Standard library only."""
import argparse
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, List, Mapping, Optional, Sequence

from fairseq_tnn.commands.common import Knob, cpus, invocation, is_count, knobs_help, run_main, say

SPLITS = ("train", "valid", "test")
# What fairseq-preprocess --only-source writes
BIN_FILES = ("dict.txt", "preprocess.log", *(f"{s}.{e}" for s in SPLITS for e in ("bin", "idx")))


WORKERS = Knob("WORKERS", "0", "encoding threads (GPT-2: processes) and fairseq-preprocess workers; 0: the CPUs "
               "this process may use", check=is_count, allowed="a positive integer (0: the CPUs this process may use)")
# Read by common.fairseq_bin and lib.sh's hand_over, not by read_knobs: shown at the end of every --help
FAIRSEQ_KNOBS = ["FAIRSEQ_BIN [<repo>/.venv/bin]  the directory of the fairseq commands (fairseq-preprocess)",
                 "PYTHON [$FAIRSEQ_BIN/python]  the python that the scripts hand over to (python -m fairseq_tnn)"]


def workers(value: str) -> int:
    return int(value) or cpus()


def plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def parser(prog: str, args: str, description: str, knobs: Sequence[Knob]) -> argparse.ArgumentParser:
    """An argument parser whose usage names the script the user ran (prog "prepare-corpus.sh": "bash
    scripts/prepare-corpus.sh <args>") and whose --help lists the knobs with their defaults."""
    run = invocation(prog)
    lines = knobs_help(knobs).splitlines()
    lines += [f"  {line}" for line in FAIRSEQ_KNOBS]
    return argparse.ArgumentParser(prog=prog, usage=f"{run} {args}", description=description,
                                   epilog="\n".join(lines), formatter_class=argparse.RawDescriptionHelpFormatter)


def parse(p: argparse.ArgumentParser, argv: Sequence[str]):
    """p.parse_args(argv), with argparse's exit (after --help, or a usage error) returned as an exit status:
    an int, else the namespace."""
    try:
        return p.parse_args(list(argv))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2


def run(prog: str, body: Callable[[], int]) -> int:
    """common.run_main(prog, body), with an exit inside body (argparse's usage error) returned as its status."""
    try:
        return run_main(prog, body)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1


class Stopped(Exception):
    """The process got SIGTERM or SIGHUP: raised where it runs, so that finally-blocks remove what it had only
    half written (SIGINT raises KeyboardInterrupt already)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum, frame):
    raise Stopped(signum)


@contextmanager
def stoppable(prog: str):
    """SIGTERM and SIGHUP raise Stopped while the block runs; a stop by a signal ends the command with one
    line and the shell's status for it (128 + the signal's number)."""
    saved = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    except (Stopped, KeyboardInterrupt) as e:
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        say(prog, f"stopped by {signal.Signals(signum).name}; the files it was writing are removed")
        raise SystemExit(128 + signum)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def fairseq_preprocess(bin_dir: Path, prefixes: Mapping[str, Path], dest: Path, n_workers: int,
                       srcdict: Optional[Path] = None) -> List[str]:
    """The fairseq-preprocess command line that binarises prefixes {split: text file} into dest (one
    dictionary, built from the train split or srcdict)."""
    cmd = [str(bin_dir / "fairseq-preprocess"), "--only-source"]
    if srcdict is not None:
        cmd += ["--srcdict", str(srcdict)]
    for split in SPLITS:
        cmd += [f"--{split}pref", str(prefixes[split])]
    return cmd + ["--destdir", str(dest), "--workers", str(n_workers)]

