#!/usr/bin/env python
"""Helper for scripts/make_sample_data.sh: the King James Bible's split by books, and its README.

Not meant to be run on its own; see scripts/make_sample_data.sh for usage.

    make_sample_data.py split --kjv DUMP --out-dir DIR --train-books ... --valid-books ... --test-books ...
    make_sample_data.py readme --kjv DUMP --out-dir DIR (same books) --text-deb DEB --reader-deb DEB

The input is the output of `bible -f Gen1:1-Rev22:21` (one verse per line, each line
"<BookAbbrev><chapter>:<verse> <text>"). `split` writes {train,valid,test}.txt into --out-dir (verse text
only, one verse per line, books in canonical order); scripts/prepare-corpus.sh then trains sentencepiece on
train.txt and encodes the splits (spm.model, spm.vocab, {train,valid,test}.bpe); `readme` writes README.md
with the provenance and the counts of those files.
"""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

try:
    import sentencepiece as spm
except ImportError:  # pragma: no cover - checked by the shell script too
    sys.exit("make_sample_data.py: error: sentencepiece is not importable by " + sys.executable)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prepare_corpus import SPM_SETTINGS, sha256_file as sha256  # noqa: E402  (SPM_SETTINGS: the sample's spm.model's)

SPLITS = ("train", "valid", "test")

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
                sys.exit(f"make_sample_data.py: error: cannot parse line {lineno}: {line!r}")
            abbrev, ch, vs, text = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
            if not books or books[-1][0] != abbrev:
                books.append((abbrev, []))
            books[-1][1].append((ch, vs, " ".join(text.split())))
    if len(books) != len(BOOK_NAMES):
        sys.exit(f"make_sample_data.py: error: expected {len(BOOK_NAMES)} books, found {len(books)}")
    return books


def split_books(args, abbrevs, verses):
    """{split: its books in canonical order}, checked against the dump."""
    books = {"train": args.train_books.split(), "valid": args.valid_books.split(), "test": args.test_books.split()}
    seen = set()
    for split, names in books.items():
        if not names:
            sys.exit(f"make_sample_data.py: error: no books given for {split}")
        for b in names:
            if b not in verses:
                sys.exit(f"make_sample_data.py: error: unknown book {b!r}; known: {' '.join(abbrevs)}")
            if b in seen:
                sys.exit(f"make_sample_data.py: error: book {b!r} is in more than one split")
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("split", "readme"))
    ap.add_argument("--kjv", required=True, help="dump from `bible -f Gen1:1-Rev22:21`")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--train-books", required=True)
    ap.add_argument("--valid-books", required=True)
    ap.add_argument("--test-books", required=True)
    ap.add_argument("--text-deb", help="readme: the bible-kjv-text package")
    ap.add_argument("--reader-deb", help="readme: the bible-kjv package")
    args = ap.parse_args()

    books = read_kjv(args.kjv)
    abbrevs = [b for b, _ in books]
    verses = dict(books)
    by_split = split_books(args, abbrevs, verses)
    out = args.out_dir
    if args.stage == "split":
        os.makedirs(out, exist_ok=True)
        for split in SPLITS:
            with open(os.path.join(out, f"{split}.txt"), "w", encoding="ascii", newline="\n") as f:
                for b in by_split[split]:
                    for _, _, text in verses[b]:
                        f.write(text + "\n")
        return
    sp = spm.SentencePieceProcessor(model_file=os.path.join(out, "spm.model"))
    write_readme(args, out, by_split, dict(zip(abbrevs, BOOK_NAMES)), verses, counts(out, sp), sp)


def write_readme(args, out, split_books, full_name, verses, stats, sp):
    pkg = deb_field(args.text_deb, "Package")
    ver = deb_field(args.text_deb, "Version")
    rpkg = deb_field(args.reader_deb, "Package")
    rver = deb_field(args.reader_deb, "Version")
    rarch = deb_field(args.reader_deb, "Architecture")
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
- Built on: {os_name()}; sentencepiece {spm.__version__}.
- SHA-256: `{os.path.basename(args.text_deb)}` {sha256(args.text_deb)};
  `{os.path.basename(args.reader_deb)}` {sha256(args.reader_deb)};
  full dump ({n_verses:,} verses) {sha256(args.kjv)}.
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


if __name__ == "__main__":
    main()
