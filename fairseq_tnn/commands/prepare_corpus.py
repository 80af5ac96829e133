"""prepare-corpus (scripts/prepare-corpus.sh): your own plain UTF-8 text to fairseq data in one command: check
it, split it, train a tokenizer on the train split, encode every split and binarise it.

    bash scripts/prepare-corpus.sh <text-dir | text-file> [dest]

Input: a directory with train.txt, valid.txt and test.txt, or one text file, split by lines in order (train =
the first lines, valid = the next VALID_PERCENT, test = the last TEST_PERCENT). dest defaults to
<repo>/data-bin/<name>, <name> the input's name without its extension. Every input is read before anything is
written: a missing, unreadable, empty, binary (NUL byte) or non-UTF-8 file, a train split shorter than one
training block or too small for the vocabulary, and an output directory that holds something else are errors
(exit status 2) that name the file or the knob. A UTF-8 byte-order mark at the start of a file is dropped.
Steps, each skipped when a run with the same input and settings completed it (prepare-corpus.json in TEXT_DIR
and dest records the input's sha256 and the settings):
  1. (one file) the split, into TEXT_DIR/{train,valid,test}.txt
  2. the tokenizer, trained on the train split only: sentencepiece BPE (TEXT_DIR/spm.model, spm.vocab;
     deterministic: the first SPM_SENTENCES lines, no sampling, identity normalization, one thread; a line
     longer than sentencepiece's 8,192-byte limit is cut at sentence ends for the training, the data keep it
     whole), or with BPE=gpt2 the paper's GPT-2 BPE from GPT2_DIR (nothing to train)
  3. every split encoded on WORKERS cores into TEXT_DIR/{train,valid,test}.bpe, with progress
  4. fairseq-preprocess --only-source (--srcdict GPT2_DIR/dict.txt with BPE=gpt2) into a folder beside dest
     (.<name>.tmp-<pid>-*; a later run removes one whose process is gone), the tokenizer copied beside the
     data, then moved to dest; the commands that train, evaluate and generate from it are printed, each
     naming its own run (checkpoints/<name>_tnn_lm_tiny, results/<name>), so a second corpus goes beside the
     first.
The default vocabulary: 6 x sqrt(training words), rounded to a multiple of 500, within [500, 32000] (109,466
words of the bundled sample give 2,000; 1M words 6,000; Wikitext-103's 101M words 32,000)."""
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence

from fairseq_tnn import recipe
from fairseq_tnn.commands.common import ROOT, CommandError, Knob, fairseq_bin, is_count, quote_cmd, read_knobs, say
from fairseq_tnn.commands.data import BIN_FILES, SPLITS, WORKERS, fairseq_preprocess, parse, parser, plural, run, \
    stoppable, workers
from fairseq_tnn.commands.gpt2_bpe import encode_file as gpt2_encode_file, encoder_pool

STAMP = "prepare-corpus.json"
GPT2_FILES = ("encoder.json", "vocab.bpe", "dict.txt")
GPT2_URL = "https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe"
TOKENIZER_FILES = {"sentencepiece": ("spm.model", "spm.vocab"), "gpt2": ("encoder.json", "vocab.bpe")}
SPM_MAX_BYTES = 8192  # sentencepiece's trainer skips longer lines (max_sentence_length, in UTF-8 bytes)
# SentencePiece settings, fixed so that a build is deterministic: every sentence up to SPM_SENTENCES (the
# first ones, no sampling or shuffling), one thread, identity normalization (the text is kept as it is).
SPM_SETTINGS = dict(
    model_type="bpe",
    character_coverage=1.0,
    normalization_rule_name="identity",
    input_sentence_size=0,
    shuffle_input_sentence=False,
    num_threads=1,
    max_sentence_length=SPM_MAX_BYTES,
)
SPM_META_PIECES = 3  # <unk>, <s>, </s>
CHUNK_LINES = 20000  # lines per batch handed to the encoder's threads
PROGRESS_SECONDS = 10.0
SMOKE_PRESET = "tnn_lm_tiny"  # the model of the printed smoke run


def is_percent(text: str) -> bool:
    try:
        return 0 < float(text) < 50
    except ValueError:
        return False


RECIPE_KNOBS = {knob.name: knob for knob in recipe.KNOBS}  # the paper recipe's (scripts/train.sh's)
KNOBS = [
    Knob("BPE", "sentencepiece", "the tokenizer: sentencepiece, or gpt2 (needs encoder.json, vocab.bpe and dict.txt "
         "in GPT2_DIR)", choices=tuple(TOKENIZER_FILES)),
    Knob("VOCAB_SIZE", "0", "sentencepiece pieces (sentencepiece only); 0: the default rule (above)", check=is_count,
         allowed="a positive integer (0: the default rule)"),
    Knob("GPT2_DIR", str(ROOT / "data" / "wikitext-103" / "gpt2_bpe"), "GPT-2's encoder.json, vocab.bpe, dict.txt "
         "(where prepare-wikitext-103 puts them)"),
    Knob("TEXT_DIR", "", "the split text (one input file), the encoded splits and the sentencepiece model; empty: "
         "<repo>/data/<name>"),
    Knob("VALID_PERCENT", "5", "of the lines of one input file", check=is_percent,
         allowed="a number above 0 and below 50"),
    Knob("TEST_PERCENT", "5", "of the lines of one input file", check=is_percent,
         allowed="a number above 0 and below 50"),
    Knob("TOKENS_PER_SAMPLE", RECIPE_KNOBS["TOKENS_PER_SAMPLE"].default, "the training block (the recipe's): "
         "the train split must hold one", check=lambda v: is_count(v) and int(v) > 0, allowed="a positive integer"),
    Knob("SPM_SENTENCES", "1000000", "sentencepiece trains on at most this many lines (the first) of the train "
         "split", check=lambda v: is_count(v) and int(v) > 0, allowed="a positive integer"),
    WORKERS,
    Knob("FORCE", "0", "1 redoes every step and replaces the files this command writes (nothing else) in TEXT_DIR "
         "and dest", choices=("0", "1")),
]


class CorpusError(CommandError):
    """Bad input, found before any work: exit status 2."""


# ---------------------------------------------------------------- reading the input
def read_lines(path: Path) -> Iterator[str]:
    """The lines of a UTF-8 file without their line ends, a byte-order mark at its start dropped."""
    with open(path, encoding="utf-8-sig", newline="\n") as f:
        for line in f:
            yield line.rstrip("\r\n")


class TextStats:
    """A file's sha256, lines, words and bytes (check_text); for the train split also its characters, distinct
    words and the lines longer than sentencepiece reads (vocabulary_stats)."""

    def __init__(self, path: Path):
        self.path, self.lines, self.words, self.bytes, self.sha256 = Path(path), 0, 0, 0, None
        self.chars, self.word_types = set(), {}
        self.long_lines, self.longest = 0, (0, 0)  # (line number, bytes)

    def sizes(self) -> str:
        return f"{plural(self.lines, 'line')}, {plural(self.words, 'word')}, {plural(self.bytes, 'byte')}"


def check_text(path: Path) -> TextStats:
    """Read path once; raise CorpusError for a missing, unreadable, empty, binary or non-UTF-8 file, naming the
    first bad line and its byte offset."""
    path = Path(path)
    if path.is_dir():
        raise CorpusError(f"{path} is a directory, not a text file")
    if not path.exists():
        raise CorpusError(f"{path}: no such file or directory")
    st = TextStats(path)
    digest = hashlib.sha256()
    offset = 0
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                digest.update(raw)
                nul = raw.find(b"\0")
                if nul >= 0:
                    raise CorpusError(f"{path}: a binary file, not text: NUL byte at byte offset {offset + nul} "
                                      f"(line {lineno})")
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    bad = e.start + (3 if lineno == 1 and raw.startswith(b"\xef\xbb\xbf") else 0)
                    raise CorpusError(f"{path}: not UTF-8: invalid byte 0x{raw[bad]:02x} at byte offset "
                                      f"{offset + bad} (line {lineno}); convert it first, e.g. "
                                      f"iconv -f latin1 -t utf-8") from None
                offset += len(raw)
                st.lines += 1
                st.words += len(line.split())
    except OSError as e:
        raise CorpusError(f"{path}: cannot read it: {e.strerror}") from None
    st.bytes, st.sha256 = offset, digest.hexdigest()
    if st.words == 0:
        raise CorpusError(f"{path}: empty (" + (f"{plural(st.lines, 'line')}, only whitespace)" if st.bytes
                                                else "0 bytes)"))
    return st


def vocabulary_stats(path: Path, n_lines: int) -> TextStats:
    """Words, distinct words, characters and long lines of the first n_lines lines of path (the train split)."""
    st = TextStats(path)
    types = st.word_types
    for lineno, line in zip(range(1, n_lines + 1), read_lines(path)):
        for w in line.split():
            types[w] = types.get(w, 0) + 1
        size = len(line.encode("utf-8"))
        if size > SPM_MAX_BYTES:
            st.long_lines += 1
            st.longest = max(st.longest, (size, lineno))
    st.lines, st.words = n_lines, sum(types.values())
    for w in types:
        st.chars.update(w)
    return st


def default_vocab_size(train_words: int) -> int:
    """The rule of this module's docstring and docs/data.md: 6 x sqrt(training words), rounded to a multiple
    of 500, within [500, 32000] (the sample's 109,466 words give 2,000)."""
    return int(min(32000, max(500, 500 * round(6 * math.sqrt(train_words) / 500))))


def vocab_bounds(train: TextStats):
    """(least, most) vocabulary a sentencepiece BPE model of the train split can have: the meta pieces plus
    every character and the word-start mark at least; at most those plus one merge per character pair of
    each distinct word (each merge shortens some word by one symbol)."""
    least = SPM_META_PIECES + len(train.chars) + 1
    return least, least + sum(len(w) for w in train.word_types)


def split_sizes(n_lines: int, valid_percent: float, test_percent: float) -> Dict[str, int]:
    """Lines of train, valid and test when one file of n_lines lines is split (train first, test last)."""
    n_valid = max(1, round(n_lines * valid_percent / 100))
    n_test = max(1, round(n_lines * test_percent / 100))
    return {"train": n_lines - n_valid - n_test, "valid": n_valid, "test": n_test}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- the output directories
def read_stamp(d: Path):
    try:
        return json.loads((Path(d) / STAMP).read_text())
    except (OSError, ValueError):
        return None


def write_json_atomic(path: Path, obj) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def foreign_files(d: Path, allowed=()) -> List[str]:
    """The entries of directory d, sorted, other than the allowed ones (the input's own files)."""
    d = Path(d)
    if not d.is_dir():
        return []
    allowed = {Path(a).resolve() for a in allowed}
    return sorted(p.name for p in d.iterdir() if p.resolve() not in allowed)


def describe(d: Path, stamp, allowed=()) -> str:
    if stamp is not None:
        return f"data prepared from another input or with other settings ({Path(d) / STAMP})"
    return "files this command did not write (" + ", ".join(foreign_files(d, allowed)[:6]) + ")"


def text_dir_files(bpe: str, single_file: bool):
    return ({f"{s}.txt" for s in SPLITS} if single_file else set()) | {f"{s}.bpe" for s in SPLITS} \
        | set(TOKENIZER_FILES[bpe] if bpe == "sentencepiece" else ()) | {STAMP}


def dest_files(bpe: str):
    return {*BIN_FILES, *TOKENIZER_FILES[bpe], STAMP}


def private_dir(beside: Path, kind: str) -> Path:
    """A new folder .<name>.<kind>-<pid>-* beside the directory beside, for a step's outputs until they are
    complete."""
    beside.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=beside.parent, prefix=f".{beside.name}.{kind}-{os.getpid()}-"))


def remove_leftovers(prog: str, beside: Path, kind: str) -> None:
    """Remove the folders private_dir made beside beside whose process is gone (a run killed while it worked;
    one of an older version, without a process id in its name, too)."""
    for p in sorted(beside.parent.glob(f".{beside.name}.{kind}-*")) if beside.parent.is_dir() else []:
        pid = re.match(r"(\d+)-", p.name[len(f".{beside.name}.{kind}-"):])
        if pid and int(pid.group(1)) != os.getpid() and process_alive(int(pid.group(1))):
            continue
        shutil.rmtree(p, ignore_errors=True)
        say(prog, f"removed {p}, left by a run that was stopped")


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def install(tmp_dest: Path, dest: Path, ours) -> None:
    """Move the finished tmp_dest into dest: one rename when dest is new or empty; otherwise (FORCE=1) our
    files are replaced one by one, the stamp last, and everything else in dest is left alone."""
    if dest.is_dir() and not any(dest.iterdir()):
        dest.rmdir()
    if not dest.exists():
        os.replace(tmp_dest, dest)
        return
    (dest / STAMP).unlink(missing_ok=True)
    for name in sorted(ours - {STAMP}):
        (dest / name).unlink(missing_ok=True)
        if (tmp_dest / name).exists():
            os.replace(tmp_dest / name, dest / name)
    os.replace(tmp_dest / STAMP, dest / STAMP)
    shutil.rmtree(tmp_dest)


# ---------------------------------------------------------------- the steps
class Progress:
    """Lines and tokens encoded, with a rate, every PROGRESS_SECONDS and at the end."""

    def __init__(self, prog: str, what: str):
        self.prog, self.what, self.lines, self.tokens = prog, what, 0, 0
        self.start = self.last = time.monotonic()

    def add(self, lines: int, tokens: int) -> None:
        self.lines += lines
        self.tokens += tokens
        now = time.monotonic()
        if now - self.last >= PROGRESS_SECONDS:
            self.last = now
            self.report("")

    def report(self, end: str) -> None:
        secs = max(time.monotonic() - self.start, 1e-9)
        say(self.prog, f"{self.what}: {self.lines:,} lines, {self.tokens:,} tokens, {self.tokens / secs:,.0f} "
                       f"tokens/s ({secs:.1f} s){end}")


def split_single_file(src: Path, out_dir: Path, sizes: Mapping[str, int]) -> None:
    """Write the split of src into out_dir: its first sizes["train"] lines to train.txt, the next
    sizes["valid"] to valid.txt, the rest to test.txt (whole lines, in order)."""
    outs = {s: open(out_dir / f"{s}.txt", "w", encoding="utf-8", newline="\n") for s in SPLITS}
    try:
        for i, line in enumerate(read_lines(src)):
            split = "train" if i < sizes["train"] else "valid" if i < sizes["train"] + sizes["valid"] else "test"
            outs[split].write(line + "\n")
    finally:
        for f in outs.values():
            f.close()


def fit(text: str, limit: int, level: int = 0) -> List[str]:
    """text cut into pieces of at most limit UTF-8 bytes: between sentences (level 0), else between words
    (level 1), else between characters (level 2); as few pieces as that allows."""
    if len(text.encode("utf-8")) <= limit:
        return [text]
    if level == 2:
        pieces, cur, size = [], "", 0
        for ch in text:
            n = len(ch.encode("utf-8"))
            if size + n > limit:
                pieces.append(cur)
                cur, size = "", 0
            cur, size = cur + ch, size + n
        return pieces + [cur]
    parts = re.split(r"(?<=[.!?])\s+", text) if level == 0 else text.split()
    pieces, cur = [], ""
    for part in parts:
        for piece in fit(part, limit, level + 1):
            joined = f"{cur} {piece}" if cur else piece
            if len(joined.encode("utf-8")) <= limit:
                cur = joined
            else:
                pieces.append(cur)
                cur = piece
    return pieces + [cur] if cur else pieces


def train_sentencepiece(train_txt: Path, work: Path, vocab_size: int, max_sentences: int) -> None:
    """Train on train_txt into work/spm.{model,vocab}. The trainer reads a copy, work/train.txt, of its first
    max_sentences lines, each longer than SPM_MAX_BYTES cut at sentence ends (it skips longer ones), and runs
    from inside work (the trainer's spec, input name and model prefix, is stored in spm.model, so absolute or
    temporary paths would make the file differ between runs)."""
    import sentencepiece as spm

    settings = dict(SPM_SETTINGS)
    written = 0
    with open(work / "train.txt", "w", encoding="utf-8", newline="\n") as out:
        for line in read_lines(train_txt):
            for piece in fit(line, SPM_MAX_BYTES):
                out.write(piece + "\n")
                written += 1
                if written == max_sentences:
                    break
            if written == max_sentences:
                break
    if written == max_sentences:
        settings["input_sentence_size"] = max_sentences
    cwd = os.getcwd()
    os.chdir(work)
    try:
        spm.SentencePieceTrainer.train(input="train.txt", model_prefix="spm", vocab_size=vocab_size, minloglevel=2,
                                       **settings)
    except RuntimeError as e:
        most = re.search(r"<= (\d+)", str(e))
        if most:
            raise CorpusError(f"sentencepiece cannot make {vocab_size:,} pieces from the train split: it makes at "
                              f"most {int(most.group(1)):,}; set VOCAB_SIZE to that or less, or use a bigger "
                              "corpus") from None
        raise CommandError(f"sentencepiece failed on the train split: {str(e).strip().splitlines()[-1]}") from None
    finally:
        os.chdir(cwd)
        (work / "train.txt").unlink(missing_ok=True)


def encode_sentencepiece(prog: str, model: Path, src: Path, dst: Path, n_workers: int, what: str) -> int:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    progress = Progress(prog, what)
    tmp = Path(str(dst) + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as out:
            lines = read_lines(src)
            while True:
                chunk = [line for _, line in zip(range(CHUNK_LINES), lines)]
                if not chunk:
                    break
                pieces = sp.encode(chunk, out_type=str, num_threads=n_workers)
                out.write("".join(" ".join(p) + "\n" for p in pieces))
                progress.add(len(chunk), sum(map(len, pieces)))
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    progress.report(f" -> {dst}")
    return progress.tokens


def encode_gpt2(prog: str, gpt2_dir: Path, srcs: Mapping[str, Path], dsts: Mapping[str, Path],
                n_workers: int) -> None:
    """The GPT-2 encoder of prepare-wikitext-103 (empty lines kept)."""
    with encoder_pool(gpt2_dir / "encoder.json", gpt2_dir / "vocab.bpe", n_workers) as pool:
        for split in SPLITS:
            progress = Progress(prog, f"encoding {split} (GPT-2 BPE, {n_workers} worker(s))")
            gpt2_encode_file(srcs[split], dsts[split], True, pool, on_line=progress.add)
            progress.report(f" -> {dsts[split]}")


def binarise(text_dir: Path, tmp_dest: Path, n_workers: int, srcdict: Optional[Path], bin_dir: Path) -> None:
    cmd = fairseq_preprocess(bin_dir, {s: text_dir / f"{s}.bpe" for s in SPLITS}, tmp_dest, n_workers, srcdict)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise CommandError(f"fairseq-preprocess failed (exit status {proc.returncode}): {quote_cmd(cmd)}\n"
                           f"{proc.stdout[-4000:]}")


# ---------------------------------------------------------------- what to run next
def next_steps(dest: Path, bpe: str, tokens_per_sample: int, prompt: str) -> str:
    """The commands that train, evaluate and generate from dest, each naming its run after dest (so that a
    second corpus's go beside the first's): recipe.SMOKE's training (its block no longer than the corpus's),
    the evaluation against length, and generation (fairseq's generation CLIs need the tokenizer named: --bpe is
    not read from the data directory); prompt: the start of a line of the corpus."""
    rel = os.path.relpath(dest, ROOT) if dest.resolve().is_relative_to(ROOT) else str(dest)
    name = re.sub(r"[^A-Za-z0-9._-]", "-", dest.name)
    run_name = f"{name}_{SMOKE_PRESET}"
    ckpt = f"checkpoints/{run_name}/checkpoint_best.pt"
    if bpe == "sentencepiece":
        flags = f"--bpe sentencepiece --sentencepiece-model {rel}/spm.model"
        hub = f'bpe="sentencepiece", sentencepiece_model="{rel}/spm.model"'
    else:
        flags = f"--bpe gpt2 --gpt2-encoder-json {rel}/encoder.json --gpt2-vocab-bpe {rel}/vocab.bpe"
        hub = f'bpe="gpt2", gpt2_encoder_json="{rel}/encoder.json", gpt2_vocab_bpe="{rel}/vocab.bpe"'
    tps = min(int(recipe.SMOKE["TOKENS_PER_SAMPLE"]), tokens_per_sample)
    knobs = {**recipe.SMOKE, "TOKENS_PER_SAMPLE": str(tps), "RUN_NAME": run_name}
    lengths = " ".join(str(tps * f) for f in (1, 2, 4, 8))
    train = quote_cmd(["bash", "scripts/train.sh", SMOKE_PRESET, rel, *recipe.SMOKE_ARGS])
    return "\n".join([
        "next steps, a CPU smoke run (from the repository root; scripts/train.sh's header has the full recipe):",
        "  " + " ".join(f"{k}={v}" for k, v in knobs.items()) + " " + train,
        f"  CPU=1 DATA={rel} LENGTHS=\"{lengths}\" NAME={name} bash scripts/eval_extrapolation.sh {ckpt}",
        f"  echo {quote_cmd([prompt])} | .venv/bin/fairseq-interactive {rel} --user-dir fairseq_tnn "
        f"--task tnn_language_modeling --path {ckpt} --cpu {flags} --beam 1 --sampling --sampling-topk 10 "
        "--seed 1 --min-len 20 --max-len-b 40",
        f"  fairseq-generate and fairseq-interactive decode text with: {flags}",
        f"  from Python: TnnLanguageModel.from_pretrained(\"checkpoints/{run_name}\", \"checkpoint_best.pt\", "
        f"\"{rel}\", {hub})",
    ])


def first_words(path: Path, n: int = 4) -> str:
    """A prompt from the corpus itself: the first n words of the first line of path that starts with n words
    of letters and has at least 2n words (prose, not a heading or a list of names), else of its first line."""
    fallback = None
    for line in read_lines(path):
        words = line.split()
        if len(words) >= 2 * n and all(w.strip(".,;:!?\"'()").isalpha() for w in words[:n]):
            return " ".join(words[:n])
        fallback = fallback or words[:n]
    return " ".join(fallback or [])


# ---------------------------------------------------------------- the command
def main(argv: Sequence[str], prog: str, env: Optional[Mapping[str, str]] = None) -> int:
    p = parser(prog, "<text-dir | text-file> [dest-data-bin]", __doc__, KNOBS)
    p.add_argument("input", help="a directory with train.txt, valid.txt and test.txt, or one text file")
    p.add_argument("dest", nargs="?", help="the binarised output [<repo>/data-bin/<name>]")
    args = parse(p, argv)
    if isinstance(args, int):
        return args

    def body() -> int:
        with stoppable(prog):
            try:
                print(prepare(prog, args.input.rstrip("/") or "/", args.dest, env), flush=True)
            except OSError as e:  # reading a file that check_text read, or writing an output
                raise CommandError(f"{e.filename}: {e.strerror}" if e.filename else str(e), 1) from None
        return 0

    return run(prog, body)


def prepare(prog: str, input_arg: str, dest_arg: Optional[str], env: Optional[Mapping[str, str]]) -> str:
    """The command's work (the module's docstring); returns the next steps to print."""
    knobs = read_knobs(KNOBS, env)
    bin_dir = fairseq_bin(env)
    src = Path(input_arg)
    single = not src.is_dir()
    name = src.name if not single else src.stem
    if not re.fullmatch(r"[A-Za-z0-9._+-]+", name) and not (dest_arg and knobs["TEXT_DIR"]):
        raise CorpusError(f"cannot name the output after '{input_arg}': give dest (and TEXT_DIR) explicitly")
    dest = Path(dest_arg) if dest_arg else ROOT / "data-bin" / name
    text_dir = Path(knobs["TEXT_DIR"]) if knobs["TEXT_DIR"] else ROOT / "data" / name
    bpe, force = knobs["BPE"], knobs["FORCE"] == "1"
    vocab_size, spm_sentences = int(knobs["VOCAB_SIZE"]), int(knobs["SPM_SENTENCES"])
    valid_percent, test_percent = float(knobs["VALID_PERCENT"]), float(knobs["TEST_PERCENT"])
    tokens_per_sample, n_workers = int(knobs["TOKENS_PER_SAMPLE"]), workers(knobs["WORKERS"])
    gpt2_dir = Path(knobs["GPT2_DIR"])
    if bpe == "gpt2":
        if vocab_size:
            raise CorpusError(f"VOCAB_SIZE={vocab_size} applies to sentencepiece only: GPT-2 BPE has its "
                              "fixed vocabulary (fairseq's dict.txt, 50,260 symbols)")
        missing = [f for f in GPT2_FILES if not (gpt2_dir / f).is_file()]
        if missing:
            raise CorpusError("GPT-2 BPE needs " + ", ".join(f"{gpt2_dir}/{f}" for f in missing)
                              + "; download " + " ".join(f"{GPT2_URL}/{f}" for f in missing)
                              + " there (scripts/prepare-wikitext-103.sh fetches them into data/wikitext-103/gpt2_bpe)")
    if not src.exists():
        raise CorpusError(f"{src}: no such file or directory")
    if single:
        texts = {s: text_dir / f"{s}.txt" for s in SPLITS}
    else:
        texts = {s: src / f"{s}.txt" for s in SPLITS}
        missing = [str(t) for t in texts.values() if not t.exists()]
        if missing:
            raise CorpusError(f"{src} is a directory without " + ", ".join(missing)
                              + " (a directory needs train.txt, valid.txt and test.txt; one text file is split)")

    # 1. every input file read, before anything is written
    checked = [check_text(t) for t in ([src] if single else texts.values())]
    inputs = {str(st.path.resolve()): st.sha256 for st in checked}
    if single:
        whole = checked[0]
        sizes = split_sizes(whole.lines, valid_percent, test_percent)
        if sizes["train"] < 1:
            raise CorpusError(f"{src}: {plural(whole.lines, 'line')} {'is' if whole.lines == 1 else 'are'} too few "
                              f"to split into train, valid ({valid_percent:g}%) and test ({test_percent:g}%)")
        train = vocabulary_stats(src, sizes["train"])
        what = f"the train split (lines 1-{sizes['train']:,} of {src})"
    else:
        train = vocabulary_stats(texts["train"], checked[0].lines)
        what = f"the train split ({texts['train']})"

    # 2. what the corpus allows
    if train.words < tokens_per_sample:
        raise CorpusError(f"{what} has {plural(train.words, 'word')}, fewer than one training block of "
                          f"TOKENS_PER_SAMPLE={tokens_per_sample} tokens (a word is at least one token): use a "
                          "bigger corpus, or a shorter block (TOKENS_PER_SAMPLE, the same for scripts/train.sh)")
    vocab = None
    if bpe == "sentencepiece":
        vocab = vocab_size or default_vocab_size(train.words)
        least, most = vocab_bounds(train)
        how = f"VOCAB_SIZE={vocab}" + ("" if vocab_size else f" (the default for {train.words:,} training words)")
        if vocab < least:
            raise CorpusError(f"{how} is too small: {what} has {len(train.chars)} distinct characters, so "
                              f"sentencepiece needs at least {least} pieces; set VOCAB_SIZE to {least} or more")
        if vocab > most:
            raise CorpusError(f"the corpus is too small for {how}: {what} has {train.words:,} words "
                              f"({len(train.word_types):,} distinct), which make at most {most:,} BPE pieces; set "
                              f"VOCAB_SIZE below {most}, or use a bigger corpus")
    key = {"input": inputs, "bpe": bpe, "vocab_size": vocab,
           "split_percent": [valid_percent, test_percent] if single else None,
           "spm_sentences": spm_sentences if bpe == "sentencepiece" else None,
           "gpt2_dict_sha256": sha256_file(gpt2_dir / "dict.txt") if bpe == "gpt2" else None}

    # 3. the output directories: empty, or made from this input with these settings, or refused
    for d, role in ((text_dir, "TEXT_DIR"), (dest, "the destination")):
        if d.exists() and not d.is_dir():
            raise CorpusError(f"{role} {d} is a file, not a directory")
    t_ours, d_ours = text_dir_files(bpe, single), dest_files(bpe)
    t_stamp, d_stamp = read_stamp(text_dir), read_stamp(dest)
    t_same = t_stamp is not None and t_stamp.get("key") == key
    d_same = d_stamp is not None and d_stamp.get("key") == key
    if not force:
        problems = []
        inputs_there = [src] if single else texts.values()  # the input may lie in TEXT_DIR
        if not t_same and foreign_files(text_dir, inputs_there):
            problems.append(f"{text_dir} (TEXT_DIR) holds {describe(text_dir, t_stamp, inputs_there)}")
        if not d_same and foreign_files(dest):
            problems.append(f"{dest} holds {describe(dest, d_stamp)}")
        if problems:
            raise CorpusError("; ".join(problems) + "; refusing to overwrite (FORCE=1 replaces only the files "
                              "this command writes: " + ", ".join(sorted(t_ours | d_ours)) + "; or choose another "
                              "destination)")

    # 4. the work. Folders a stopped run left are removed first; a step that a run with the same key completed
    # is skipped.
    for st in checked:
        say(prog, f"{st.path}: {st.sizes()}")
    remove_leftovers(prog, text_dir, "work")
    remove_leftovers(prog, dest, "tmp")
    if not force and d_same and all((dest / f).exists() for f in d_ours):
        say(prog, f"{dest} is already prepared from this input with these settings (FORCE=1 redoes it)")
        return next_steps(dest, bpe, tokens_per_sample, first_words(texts["valid"]))
    step_files = {"split": [f"{s}.txt" for s in SPLITS], "tokenizer": TOKENIZER_FILES["sentencepiece"],
                  "encode": [f"{s}.bpe" for s in SPLITS]}
    done = {step for step in (t_stamp.get("done", []) if t_same and not force else [])
            if all((text_dir / f).is_file() for f in step_files[step])}  # a step whose files went is redone
    todo = [step for step in ("split",) * single + ("tokenizer",) * (bpe == "sentencepiece") if step not in done]
    for step in sorted({"split", "tokenizer"} & done):
        say(prog, f"{step} present in {text_dir}")
    if todo:  # the split and the tokenizer are made in a private folder and moved into TEXT_DIR together
        work = private_dir(text_dir, "work")
        try:
            made = []
            if "split" in todo:
                split_single_file(src, work, sizes)
                made += [f"{s}.txt" for s in SPLITS]
                first = 0
                for s in SPLITS:
                    say(prog, f"{s}: lines {first + 1:,}-{first + sizes[s]:,} of {src} ({plural(sizes[s], 'line')}, "
                              f"{plural((work / f'{s}.txt').stat().st_size, 'byte')}) -> {texts[s]}")
                    first += sizes[s]
            if "tokenizer" in todo:
                say(prog, f"training sentencepiece BPE, {vocab:,} pieces, on {texts['train']}")
                if train.long_lines:
                    say(prog, f"{plural(train.long_lines, 'line')} of the train split {'is' if train.long_lines == 1 else 'are'} "
                              f"longer than sentencepiece's limit of {SPM_MAX_BYTES:,} bytes (the longest: line "
                              f"{train.longest[1]:,}, {train.longest[0]:,} bytes): its training reads them cut at "
                              "sentence ends; the data keep them whole")
                t0 = time.monotonic()
                (work / "spm").mkdir()
                train_sentencepiece(work / "train.txt" if "split" in todo else texts["train"], work / "spm", vocab,
                                    spm_sentences)
                for name_ in TOKENIZER_FILES["sentencepiece"]:
                    os.replace(work / "spm" / name_, work / name_)
                say(prog, f"trained {text_dir / 'spm.model'} in {time.monotonic() - t0:.1f} s")
                made += list(TOKENIZER_FILES["sentencepiece"])
            text_dir.mkdir(parents=True, exist_ok=True)
            for name_ in made:
                os.replace(work / name_, text_dir / name_)
        finally:
            shutil.rmtree(work)
    done.update(todo)

    def mark(step):
        done.add(step)
        write_json_atomic(text_dir / STAMP, {"key": key, "done": sorted(done)})

    if todo:
        mark(todo[-1])
    bpes = {s: text_dir / f"{s}.bpe" for s in SPLITS}
    if "encode" in done:
        say(prog, f"encoded splits present in {text_dir}")
    else:
        text_dir.mkdir(parents=True, exist_ok=True)
        if bpe == "sentencepiece":
            for s in SPLITS:
                encode_sentencepiece(prog, text_dir / "spm.model", texts[s], bpes[s], n_workers,
                                     f"encoding {s} ({n_workers} thread(s))")
        else:
            encode_gpt2(prog, gpt2_dir, texts, bpes, n_workers)
        mark("encode")

    # 5. binarised into a private folder beside dest, then moved
    tmp_dest = private_dir(dest, "tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_dest, 0o777 & ~umask)  # mkdtemp's folder is private; dest is an ordinary directory
    try:
        say(prog, f"binarising into {dest} (fairseq-preprocess, {n_workers} worker(s))")
        binarise(text_dir, tmp_dest, n_workers, gpt2_dir / "dict.txt" if bpe == "gpt2" else None, bin_dir)
        tok_dir = text_dir if bpe == "sentencepiece" else gpt2_dir
        for name_ in TOKENIZER_FILES[bpe]:
            shutil.copyfile(tok_dir / name_, tmp_dest / name_)
        write_json_atomic(tmp_dest / STAMP, {"key": key})
        install(tmp_dest, dest, d_ours)
    finally:
        if tmp_dest.exists():
            shutil.rmtree(tmp_dest)
    with open(dest / "dict.txt", encoding="utf-8") as f:
        n_dict = sum(1 for _ in f)
    say(prog, f"done: {dest} ({n_dict:,} dictionary entries + 4 special symbols; the tokenizer, "
              f"{' and '.join(TOKENIZER_FILES[bpe])}, beside them)")
    return next_steps(dest, bpe, tokens_per_sample, first_words(texts["valid"]))
