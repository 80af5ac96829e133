"""prepare-wikitext-103 (scripts/prepare-wikitext-103.sh): download, GPT-2 BPE-encode and binarise Wikitext-103
as the TNN paper did (docs/references.md#published-configurations; Qin et al., ICLR 2023,
https://github.com/OpenNLPLab/Tnn).

    bash scripts/prepare-wikitext-103.sh [dest]          # dest defaults to <repo>/data-bin/wikitext-103

Steps, each skipped when its outputs exist, so a rerun continues where it stopped:
  1. download wikitext-103-raw-v1.zip and unzip it into RAW_DIR/wikitext-103-raw/wiki.{train,valid,test}.raw
  2. download GPT-2's encoder.json, vocab.bpe and fairseq's dict.txt into RAW_DIR/gpt2_bpe/
  3. BPE-encode each split (fairseq_tnn/commands/gpt2_bpe.py, as scripts/gpt2_bpe_encode.py --keep-empty runs
     it: empty lines kept) -> RAW_DIR/wikitext-103-raw/wiki.<split>.bpe
  4. fairseq-preprocess --only-source --srcdict gpt2_bpe/dict.txt --workers WORKERS -> dest (dict.txt,
     {train,valid,test}.{bin,idx}); the causal and the masked LM both read it.
Without network access it stops at once (exit status 1) and names every file to fetch, from where, and where
to put it; place them by hand and rerun. Downloads go to <file>.part and are renamed when complete."""
import os
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Tuple

from fairseq_tnn.commands.common import ROOT, CommandError, Knob, fairseq_bin, quote_cmd, read_knobs, say
from fairseq_tnn.commands.data import SPLITS, WORKERS, fairseq_preprocess, parse, parser, run, \
    stoppable, workers
from fairseq_tnn.commands.gpt2_bpe import encode_file, encoder_pool

ORIGINAL_URL = "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-raw-v1.zip"
GPT2_FILES = ("encoder.json", "vocab.bpe", "dict.txt")
KNOBS = [
    Knob("RAW_DIR", str(ROOT / "data" / "wikitext-103"), "downloads, raw text and BPE files"),
    Knob("WIKITEXT_URL", "https://wikitext.smerity.com/wikitext-103-raw-v1.zip",
         f"the zip (the original address, {ORIGINAL_URL}, serves the same file where it still works)"),
    Knob("GPT2_BPE_URL", "https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe", "where encoder.json, vocab.bpe and "
         "dict.txt are"),
    Knob("CONNECT_TIMEOUT", "10", "seconds to reach a server before giving up",
         check=lambda v: v.isascii() and v.isdigit() and int(v) > 0, allowed="a positive integer"),
    WORKERS,
    Knob("FORCE", "0", "1 redoes steps 3 and 4 even if their outputs exist (downloads are kept)",
         choices=("0", "1")),
    Knob("DRY_RUN", "0", "1 prints the commands of the steps that would run, and runs nothing", choices=("0", "1")),
]


def main(argv: Sequence[str], prog: str, env: Optional[Mapping[str, str]] = None) -> int:
    p = parser(prog, "[dest-data-bin]", __doc__, KNOBS)
    p.add_argument("dest", nargs="?", type=Path, default=ROOT / "data-bin" / "wikitext-103",
                   help="the binarised output [<repo>/data-bin/wikitext-103]")
    args = parse(p, argv)
    if isinstance(args, int):
        return args

    def body() -> int:
        with stoppable(prog):
            return prepare(prog, args.dest, read_knobs(KNOBS, env), fairseq_bin(env))

    return run(prog, body)


def download(url: str, dest: Path, timeout: str, dry: bool) -> bool:
    """url to dest through dest.part (curl where there is one, else urllib); False when it failed."""
    part = dest.with_name(dest.name + ".part")
    curl = ["curl", "-fL", "--connect-timeout", timeout, "-sS", "-o", str(part), url]
    if dry:
        print(f"mkdir -p {quote_cmd([dest.parent])} && {quote_cmd(curl)} && mv {quote_cmd([part, dest])}")
        return True
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        if shutil.which("curl"):
            ok = subprocess.run(curl).returncode == 0
        else:
            try:
                with urllib.request.urlopen(url, timeout=float(timeout)) as r, open(part, "wb") as f:
                    shutil.copyfileobj(r, f)
                ok = True
            except OSError as e:
                print(f"{url}: {e}", file=sys.stderr)
                ok = False
        if ok:
            os.replace(part, dest)
        return ok
    finally:
        part.unlink(missing_ok=True)


def prepare(prog: str, dest: Path, knobs: Mapping[str, str], bin_dir: Path) -> int:
    dry, force, n_workers = knobs["DRY_RUN"] == "1", knobs["FORCE"] == "1", workers(knobs["WORKERS"])
    raw_dir = Path(knobs["RAW_DIR"])
    zip_path, text, bpe = raw_dir / "wikitext-103-raw-v1.zip", raw_dir / "wikitext-103-raw", raw_dir / "gpt2_bpe"
    raws = {s: text / f"wiki.{s}.raw" for s in SPLITS}

    def have(path: Path) -> bool:
        return path.is_file() and path.stat().st_size > 0

    def have_raw() -> bool:
        return all(have(r) for r in raws.values())

    # 1-2. downloads: (url, destination) for every file still needed
    wanted: List[Tuple[str, Path]] = []
    if not have_raw() and not have(zip_path):
        wanted.append((knobs["WIKITEXT_URL"], zip_path))
    wanted += [(f"{knobs['GPT2_BPE_URL']}/{f}", bpe / f) for f in GPT2_FILES if not have(bpe / f)]
    for url, path in wanted:
        if not dry:
            say(prog, f"downloading {url}")
        if not download(url, path, knobs["CONNECT_TIMEOUT"], dry):
            say(prog, f"cannot download {url} (no network access?).")
            lines = ["Download these files yourself, put them exactly here, and rerun this script:"]
            lines += [f"  {u}\n      -> {d}" for u, d in wanted if not have(d)]
            if not have_raw() and not have(zip_path):
                lines += [f"  (instead of the zip, its unzipped folder also works: {text}/wiki.{{train,valid,test}}.raw;",
                          f"   the original address of the zip is {ORIGINAL_URL})"]
            print("\n".join(lines), file=sys.stderr)
            return 1

    # 1b. unzip
    if have_raw():
        say(prog, f"raw text present in {text}")
    else:
        say(prog, f"unzipping {zip_path}")
        if dry:
            print(quote_cmd([sys.executable, "-m", "zipfile", "-e", zip_path, raw_dir]))
        else:
            with zipfile.ZipFile(zip_path) as z:
                z.extractall(raw_dir)
            if not have_raw():
                raise CommandError(f"{zip_path} did not contain wikitext-103-raw/wiki.{{train,valid,test}}.raw", 1)

    # 3. GPT-2 BPE
    todo = [s for s in SPLITS if force or not have(text / f"wiki.{s}.bpe")]
    if todo:
        say(prog, f"GPT-2 BPE encoding {len(todo)} split(s) with {n_workers} worker(s)")
        outs = [text / f"wiki.{s}.bpe" for s in todo]
        if dry:
            print(quote_cmd([sys.executable, ROOT / "scripts" / "gpt2_bpe_encode.py", "--encoder-json",
                             bpe / "encoder.json", "--vocab-bpe", bpe / "vocab.bpe", "--inputs",
                             *[raws[s] for s in todo], "--outputs", *outs, "--keep-empty", "--workers", n_workers]))
        else:
            with encoder_pool(bpe / "encoder.json", bpe / "vocab.bpe", n_workers) as pool:
                for s, out in zip(todo, outs):
                    written, _ = encode_file(raws[s], out, True, pool)
                    say(prog, f"{raws[s]} -> {out}: {written:,} lines")
    else:
        say(prog, f"BPE files present in {text}")

    # 4. binarise
    binarised = have(dest / "dict.txt") and all(have(dest / f"{s}.{e}") for s in SPLITS for e in ("bin", "idx"))
    if binarised and not force:
        say(prog, f"{dest} already binarised (FORCE=1 redoes it)")
    else:
        say(prog, f"binarising into {dest}")
        cmd = fairseq_preprocess(bin_dir, {s: text / f"wiki.{s}.bpe" for s in SPLITS}, dest, n_workers,
                                 bpe / "dict.txt")
        if dry:
            print(quote_cmd(cmd))
        else:
            status = subprocess.run(cmd).returncode
            if status != 0:
                return status
    if not dry:
        with open(dest / "dict.txt", encoding="utf-8") as f:
            say(prog, f"done: {dest} ({sum(1 for _ in f):,} dictionary entries)")
    return 0
