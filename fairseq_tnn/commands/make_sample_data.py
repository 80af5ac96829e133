"""make-sample-data (scripts/make_sample_data.sh): build the small offline English corpus in data/sample/ (the
King James Bible, public domain).

    bash scripts/make_sample_data.sh
    PYTHON=.venv/bin/python OUT_DIR=/tmp/sample bash scripts/make_sample_data.sh

What it does:
  1. `apt-get download bible-kjv-text bible-kjv` into a temporary folder (running `apt-get update` once if the
     package lists are missing) and unpacks both with `dpkg-deb -x`. bible-kjv-text ships the text only in the
     compressed random-access format of the Bible Retrieval System (usr/lib/bible.data), so the matching
     `bible` reader from bible-kjv (same source package and version) dumps it: one verse per line.
  2. splits the verses by book into {train,valid,test}.txt (verse text only, books in canonical order);
     prepare-corpus trains a sentencepiece BPE model of VOCAB_SIZE pieces on train.txt and encodes the splits
     (its binarised output is not kept: scripts/preprocess.sh makes data-bin/sample from data/sample); and
     writes README.md with the provenance and the counts.
Outputs (in OUT_DIR): {train,valid,test}.txt, {train,valid,test}.bpe, spm.model, spm.vocab, README.md. The
build is deterministic: the same package version and sentencepiece version give byte-identical files.
Needs apt-get and dpkg-deb (Debian/Ubuntu), the apt mirror, libreadline8 (the `bible` binary's) and the venv
of scripts/setup.sh (sentencepiece, fairseq-preprocess; PYTHON must import sentencepiece)."""
import glob
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Mapping, Optional, Sequence

from fairseq_tnn.commands.common import ROOT, CommandError, Knob, fairseq_bin, read_knobs, say
from fairseq_tnn.commands.data import SPLITS, parse, parser, run, stoppable
from fairseq_tnn.commands.prepare_corpus import SPM_SETTINGS, prepare, sha256_file as sha256

KNOBS = [
    Knob("OUT_DIR", str(ROOT / "data" / "sample"), "where the outputs go"),
    Knob("KJV_VERSION", "4.38", "the Debian package version to fetch (as in Debian bookworm); any: whatever apt "
         "offers (the outputs may then differ from the committed ones)"),
    Knob("TRAIN_BOOKS", "Ge Psa John Rom", "books of the train split, as the `bible` program abbreviates them"),
    Knob("VALID_BOOKS", "Dan", "books of the valid split"),
    Knob("TEST_BOOKS", "Rev", "books of the test split"),
    Knob("VOCAB_SIZE", "2000", "sentencepiece pieces", check=lambda v: v.isascii() and v.isdigit() and int(v) > 0,
         allowed="a positive integer"),
    Knob("FORCE", "0", "1 replaces the files of an existing OUT_DIR (without it the command refuses before any "
         "work)", choices=("0", "1")),
]
FILES = ("train.txt", "valid.txt", "test.txt", "train.bpe", "valid.bpe", "test.bpe", "spm.model", "spm.vocab",
         "README.md")
# The environment of the Debian tools and the reader: the same output whatever the user's locale and zone
TOOL_ENV = {"LC_ALL": "C", "TZ": "UTC"}


def main(argv: Sequence[str], prog: str, env: Optional[Mapping[str, str]] = None) -> int:
    p = parser(prog, "  (no arguments; settings are environment variables)", __doc__, KNOBS)
    args = parse(p, argv)
    if isinstance(args, int):
        return args
    def body() -> int:
        with stoppable(prog):  # the temporary folder removed on SIGTERM too
            return build(prog, read_knobs(KNOBS, env), env)

    return run(prog, body)


def tool(cmd, cwd=None, stdout=None) -> bool:
    return subprocess.run(cmd, cwd=cwd, stdout=stdout, env={**os.environ, **TOOL_ENV}).returncode == 0


def build(prog: str, knobs: Mapping[str, str], env: Optional[Mapping[str, str]]) -> int:
    fairseq_bin(env)  # refuses the retired FAIRSEQ_PREPROCESS
    out_dir = Path(knobs["OUT_DIR"])
    if (out_dir / "train.bpe").is_file() and knobs["FORCE"] != "1":
        raise CommandError(f"{out_dir} already holds a corpus; refusing to overwrite it (FORCE=1 rebuilds it, or "
                           "set OUT_DIR)")
    for name in ("apt-get", "dpkg-deb"):
        if shutil.which(name) is None:
            raise CommandError(f"{name} not found (needs a Debian/Ubuntu system)")
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        raise CommandError("this python cannot import sentencepiece; install it (pip install sentencepiece==0.2.3) "
                           "or set PYTHON=/path/to/python") from None
    with tempfile.TemporaryDirectory(prefix="make_sample_data.") as tmp:
        work = Path(tmp)
        # 1. fetch and unpack the Debian packages
        pkgs = ["bible-kjv-text", "bible-kjv"]
        if knobs["KJV_VERSION"] != "any":
            pkgs = [f"{p}={knobs['KJV_VERSION']}" for p in pkgs]
        (work / "debs").mkdir()
        if not tool(["apt-get", "download", *pkgs], cwd=work / "debs"):
            say(prog, "apt-get download failed; running apt-get update once and retrying")
            if not tool(["apt-get", "update", "-qq"]):
                raise CommandError("apt-get update failed (are you root? is the network up?)", 1)
            if not tool(["apt-get", "download", *pkgs], cwd=work / "debs"):
                raise CommandError(f"could not download {' '.join(pkgs)} (set KJV_VERSION=any to accept the "
                                   "version apt offers)", 1)
        text_deb, = glob.glob(str(work / "debs" / "bible-kjv-text_*.deb"))
        reader_deb, = glob.glob(str(work / "debs" / "bible-kjv_*.deb"))
        for deb in (text_deb, reader_deb):
            if not tool(["dpkg-deb", "-x", deb, str(work / "root")]):
                raise CommandError(f"dpkg-deb -x {deb} failed", 1)
        data_files = sorted((work / "root").rglob("bible.data"))
        if not data_files:
            raise CommandError(f"bible.data not found in {text_deb}", 1)
        reader = work / "root" / "usr" / "bin" / "bible"
        if not os.access(reader, os.X_OK):
            raise CommandError(f"usr/bin/bible not found in {reader_deb}", 1)
        # 2. the whole text, one verse per line ("Ge1:1 In the beginning ..."): -f turns pretty-printing off;
        # the reader looks for bible.data in its working directory
        kjv = work / "kjv.txt"
        with open(kjv, "wb") as f:
            if not tool([str(reader), "-f", "-p", ".", "Gen1:1-Rev22:21"], cwd=data_files[0].parent, stdout=f):
                raise CommandError("the bible reader failed (is libreadline8 installed?)", 1)
        # 3. split by books; sentencepiece trained and the splits encoded by prepare-corpus; the README
        books = read_kjv(kjv)
        abbrevs = [b for b, _ in books]
        verses = dict(books)
        by_split = split_books({s: knobs[f"{s.upper()}_BOOKS"] for s in SPLITS}, abbrevs, verses)
        out = work / "out"
        out.mkdir()
        for split in SPLITS:
            with open(out / f"{split}.txt", "w", encoding="ascii", newline="\n") as f:
                for b in by_split[split]:
                    for _, _, text in verses[b]:
                        f.write(text + "\n")
        prepare(prog, str(out), str(work / "bin"),
                {**(os.environ if env is None else env), "VOCAB_SIZE": knobs["VOCAB_SIZE"], "TEXT_DIR": str(out),
                 "FORCE": "0", "BPE": "sentencepiece", "SPM_SENTENCES": "", "TOKENS_PER_SAMPLE": ""})
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(out / "spm.model"))
        write_readme(kjv, text_deb, reader_deb, out, by_split, dict(zip(abbrevs, BOOK_NAMES)), verses,
                     counts(out, sp), sp, spm.__version__)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            shutil.copyfile(out / name, out_dir / name)
    say(prog, f"wrote {' '.join(FILES)} to {out_dir}")
    return 0


# Canonical order of the 66 books; zipped with the abbreviations that the
# `bible` reader prints (in the same order) to give full names in the README.
BOOK_NAMES = [
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon",
    "Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos",
    "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah",
    "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians",
    "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians",
    "1 Thessalonians", "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon",
    "Hebrews", "James", "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude",
    "Revelation",
]

REF_RE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.+)$")


def deb_field(deb, field):
    return subprocess.run(
        ["dpkg-deb", "-f", deb, field], check=True, capture_output=True, text=True
    ).stdout.strip()


def os_name():
    try:
        with open("/etc/os-release") as f:
            info = dict(
                line.rstrip("\n").split("=", 1) for line in f if "=" in line
            )
        return info.get("PRETTY_NAME", "unknown").strip('"')
    except OSError:
        return "unknown"


def read_kjv(path):
    """Return an ordered list of (abbrev, [(chapter, verse, text), ...])."""
    books = []
    with open(path, encoding="ascii") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            m = REF_RE.match(line)
            if not m:
                raise CommandError(f"{path}: cannot parse line {lineno}: {line!r}", 1)
            abbrev, ch, vs, text = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
            if not books or books[-1][0] != abbrev:
                books.append((abbrev, []))
            books[-1][1].append((ch, vs, " ".join(text.split())))
    if len(books) != len(BOOK_NAMES):
        raise CommandError(f"{path}: expected {len(BOOK_NAMES)} books, found {len(books)}", 1)
    return books


def split_books(given, abbrevs, verses):
    """{split: its books in canonical order}, checked against the dump."""
    books = {split: given[split].split() for split in SPLITS}
    seen = set()
    for split, names in books.items():
        if not names:
            raise CommandError(f"{split.upper()}_BOOKS is empty: give at least one book")
        for b in names:
            if b not in verses:
                raise CommandError(f"{split.upper()}_BOOKS: unknown book {b!r}; known: {' '.join(abbrevs)}")
            if b in seen:
                raise CommandError(f"book {b!r} is in more than one of TRAIN_BOOKS, VALID_BOOKS, TEST_BOOKS")
            seen.add(b)
        books[split] = sorted(names, key=abbrevs.index)  # canonical order regardless of the order given
    return books


def counts(out, sp):
    """Per split: bytes of the .txt and .bpe files, lines, words, sentencepiece tokens, unknown tokens."""
    stats = {}
    for split in SPLITS:
        txt, bpe = os.path.join(out, f"{split}.txt"), os.path.join(out, f"{split}.bpe")
        with open(txt, encoding="ascii") as f:
            lines = f.read().splitlines()
        with open(bpe, encoding="utf-8") as f:
            pieces = f.read().split()
        stats[split] = dict(txt_bytes=os.path.getsize(txt), bpe_bytes=os.path.getsize(bpe), lines=len(lines),
                            words=sum(len(line.split()) for line in lines), tokens=len(pieces),
                            unk=sum(1 for p in pieces if sp.piece_to_id(p) == sp.unk_id()))
    return stats


def write_readme(kjv, text_deb, reader_deb, out, split_books, full_name, verses, stats, sp, sp_version):
    pkg = deb_field(text_deb, "Package")
    ver = deb_field(text_deb, "Version")
    rpkg = deb_field(reader_deb, "Package")
    rver = deb_field(reader_deb, "Version")
    rarch = deb_field(reader_deb, "Architecture")
    release = ' (as in Debian 12 "bookworm", `main`)' if ver == "4.38" else ""
    n_verses = sum(len(v) for v in verses.values())

    def describe(split):
        parts = []
        for b in split_books[split]:
            chapters = len({c for c, _, _ in verses[b]})
            parts.append(f"{full_name[b]} (`{b}`, {chapters} chapters)")
        return ", ".join(parts)

    rows = []
    for split in SPLITS:
        s = stats[split]
        rows.append(
            f"| {split} | {s['lines']:,} | {s['words']:,} | {s['tokens']:,} | "
            f"{s['txt_bytes']:,} | {s['bpe_bytes']:,} |"
        )
    total_unk = sum(s["unk"] for s in stats.values())
    settings = ", ".join(
        f"{k}={v}" for k, v in [("vocab_size", sp.get_piece_size())] + list(SPM_SETTINGS.items())
    )

    text = f"""# Sample corpus: King James Bible (public domain)

Small real-English corpus so that the demo, tests and CI run without network
access. Everything in this directory is generated by

```bash
bash scripts/make_sample_data.sh          # PYTHON=... OUT_DIR=... optional
```

Do not edit these files by hand; change the script and rebuild.

## Provenance

- Text: Debian package `{pkg}` version {ver}{release},
  fetched with `apt-get download` and unpacked with `dpkg-deb -x`.
  It stores the King James Version (Authorized Version, 1611) in the
  compressed random-access format of Chip Chapin's Bible Retrieval System
  (`/usr/lib/bible.data`), so the text is dumped with the reader from the
  companion package `{rpkg}` {rver} ({rarch}), same source package:
  `bible -f Gen1:1-Rev22:21` (one verse per line).
- Built on: {os_name()}; sentencepiece {sp_version}.
- SHA-256: `{os.path.basename(text_deb)}` {sha256(text_deb)};
  `{os.path.basename(reader_deb)}` {sha256(reader_deb)};
  full dump ({n_verses:,} verses) {sha256(kjv)}.
- License: the KJV text (translated 1611) is in the public domain (Debian's
  `copyright` file for the package: "The copyright for the King James Version
  text of the Bible is expired"); the one exception is the United Kingdom,
  where the Crown's letters patent still govern printing of the Authorized
  Version. The packaging/reader code is GPL-2+; none of it is included here,
  only the text and files derived from it.

## Format and splits

`{{train,valid,test}}.txt`: plain ASCII, one verse per line, verse references
removed, no blank lines; books whole and in canonical order. Splits are by
book (fixed lists, no randomness), so valid and test are held-out books:

- train: {describe('train')}
- valid: {describe('valid')}
- test: {describe('test')}

`{{train,valid,test}}.bpe`: the same lines encoded with `spm.model` into
space-separated pieces (`▁` marks a word start), line-aligned with the `.txt`
files. These are what `fairseq-preprocess --only-source` reads
(`--trainpref data/sample/train.bpe --validpref data/sample/valid.bpe
--testpref data/sample/test.bpe`). Each line is one sentence/sample, so
`--sample-break-mode eos`, `complete` and `none` all work. Decode with
`spm.decode(line.split())` or `"".join(line.split()).replace("▁", " ").strip()`.

## SentencePiece

BPE model trained on `train.txt` only: {settings}.
`spm.model` / `spm.vocab` hold {sp.get_piece_size()} pieces (including
`<unk>`, `<s>`, `</s>`). Unknown pieces in the encoded splits: {total_unk}.

## Counts

Tokens are sentencepiece pieces (no end-of-sentence marker); words are
whitespace-separated words of the `.txt` file.

| split | lines | words | tokens | .txt bytes | .bpe bytes |
|---|---:|---:|---:|---:|---:|
{chr(10).join(rows)}
"""
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8", newline="\n") as f:
        f.write(text)

