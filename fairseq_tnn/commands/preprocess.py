"""preprocess (scripts/preprocess.sh): binarise a corpus already encoded into pieces, e.g. data/sample.

    bash scripts/preprocess.sh <text-dir> <dest-dir>

<text-dir> holds train.bpe, valid.bpe and test.bpe (space-separated pieces, one line per sentence); this runs
fairseq-preprocess --only-source on them into <dest-dir> (dict.txt, {train,valid,test}.{bin,idx},
preprocess.log), and does nothing when <dest-dir>/dict.txt exists (FORCE=1 redoes it, replacing only those
files)."""
import subprocess
from pathlib import Path
from typing import Mapping, Optional, Sequence

from fairseq_tnn.commands.common import CommandError, Knob, fairseq_bin, read_knobs, say
from fairseq_tnn.commands.data import BIN_FILES, SPLITS, WORKERS, fairseq_preprocess, parse, parser, \
    run, workers

KNOBS = [
    Knob("FORCE", "0", "1 redoes an existing dest-dir (replaces the files fairseq-preprocess writes, nothing else)",
         choices=("0", "1")),
    WORKERS,
    Knob("SRCDICT", "", "a fixed dictionary (fairseq-preprocess --srcdict, e.g. GPT-2's dict.txt); empty: the "
         "dictionary is built from train.bpe"),
]


def main(argv: Sequence[str], prog: str, env: Optional[Mapping[str, str]] = None) -> int:
    p = parser(prog, "<text-dir> <dest-dir>", __doc__, KNOBS)
    p.add_argument("text_dir", type=Path, help="holds train.bpe, valid.bpe and test.bpe")
    p.add_argument("dest", type=Path, help="the binarised output")
    args = parse(p, argv)
    if isinstance(args, int):
        return args

    def body() -> int:
        knobs = read_knobs(KNOBS, env)
        bin_dir = fairseq_bin(env)
        srcdict = Path(knobs["SRCDICT"]) if knobs["SRCDICT"] else None
        if srcdict is not None and not srcdict.is_file():
            raise CommandError(f"SRCDICT={srcdict} is not a file (a fairseq dict.txt)")
        prefixes = {split: args.text_dir / f"{split}.bpe" for split in SPLITS}
        for path in prefixes.values():
            if not path.is_file():
                p.error(f"missing {path}")
        if (args.dest / "dict.txt").is_file():
            if knobs["FORCE"] != "1":
                say(prog, f"{args.dest} already binarised (FORCE=1 to redo)")
                return 0
            for name in BIN_FILES:  # fairseq-preprocess refuses an existing dict.txt
                (args.dest / name).unlink(missing_ok=True)
        cmd = fairseq_preprocess(bin_dir, prefixes, args.dest, workers(knobs["WORKERS"]), srcdict)
        return subprocess.run(cmd, env=None if env is None else dict(env)).returncode

    return run(prog, body)
