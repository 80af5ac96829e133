#!/usr/bin/env python
"""Raw UTF-8 text to fairseq data: check, split, train a tokenizer on the train split, encode, binarise.

    python scripts/prepare_corpus.py --input <text-dir | text-file> --dest data-bin/<name> --text-dir data/<name>

scripts/prepare-corpus.sh runs it with its knobs (that header documents them and the rules). Every input is
checked before anything is written: a missing, empty, binary (NUL byte) or non-UTF-8 file, a corpus too
small for the vocabulary or shorter than one training block, and an output that holds something else are
errors that name the file or the setting. Each step's outputs are written under a temporary name and
renamed when complete; --text-dir and --dest record what they were made from (prepare-corpus.json), so a
rerun with the same input and settings skips the steps already done, and a directory made from something
else is refused unless --force (which replaces only the files this command writes).
"""
import argparse
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROG = os.environ.get("PROG", "prepare_corpus.py")
SPLITS = ("train", "valid", "test")
STAMP = "prepare-corpus.json"
GPT2_FILES = ("encoder.json", "vocab.bpe", "dict.txt")
GPT2_URL = "https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe"
# What fairseq-preprocess writes (scripts/preprocess.sh), then the tokenizer files and the stamp.
BIN_FILES = ("dict.txt", "preprocess.log", *(f"{s}.{e}" for s in SPLITS for e in ("bin", "idx")))
TOKENIZER_FILES = {"sentencepiece": ("spm.model", "spm.vocab"), "gpt2": ("encoder.json", "vocab.bpe")}
# SentencePiece settings, fixed so that a build is deterministic: every sentence up to SPM_SENTENCES (the
# first ones, no sampling or shuffling), one thread, identity normalization (the text is kept as it is).
SPM_SETTINGS = dict(
    model_type="bpe",
    character_coverage=1.0,
    normalization_rule_name="identity",
    input_sentence_size=0,
    shuffle_input_sentence=False,
    num_threads=1,
    max_sentence_length=8192,
)
SPM_META_PIECES = 3  # <unk>, <s>, </s>
CHUNK_LINES = 20000  # lines per batch handed to the encoder's threads
PROGRESS_SECONDS = 10.0


class CorpusError(Exception):
    pass


def say(msg):
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- checking the input
class TextStats:
    """A file's sha256, lines, words and bytes (check_text); for the train split also its characters and
    distinct words, what bounds a BPE vocabulary (vocabulary_stats)."""

    def __init__(self, path):
        self.path, self.lines, self.words, self.bytes, self.sha256 = Path(path), 0, 0, 0, None
        self.chars, self.word_types = set(), {}


def check_text(path):
    """Read path once; raise CorpusError for a missing, empty, binary or non-UTF-8 file, naming the first bad
    line and its byte offset."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such file" + (" (it is a directory)" if path.is_dir() else ""))
    st = TextStats(path)
    digest = hashlib.sha256()
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            digest.update(raw)
            nul = raw.find(b"\0")
            if nul >= 0:
                raise CorpusError(f"{path}: a binary file, not text: NUL byte at byte offset {offset + nul} "
                                  f"(line {lineno})")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CorpusError(f"{path}: not UTF-8: invalid byte 0x{raw[e.start]:02x} at byte offset "
                                  f"{offset + e.start} (line {lineno}); convert it first, e.g. "
                                  f"iconv -f latin1 -t utf-8") from None
            offset += len(raw)
            st.lines += 1
            st.words += len(line.split())
    st.bytes, st.sha256 = offset, digest.hexdigest()
    if st.words == 0:
        raise CorpusError(f"{path}: empty (" + (f"{st.lines} lines, only whitespace)" if st.bytes else "0 bytes)"))
    return st


def vocabulary_stats(path, n_lines):
    """Words, distinct words and characters of the first n_lines lines of path (the train split)."""
    st = TextStats(path)
    types = st.word_types
    for _, line in zip(range(n_lines), read_lines(path)):
        for w in line.split():
            types[w] = types.get(w, 0) + 1
    st.lines, st.words = n_lines, sum(types.values())
    for w in types:
        st.chars.update(w)
    return st


def default_vocab_size(train_words):
    """The rule of scripts/prepare-corpus.sh's header and docs/data.md: 6 x sqrt(training words), rounded to
    a multiple of 500, within [500, 32000] (the sample's 109,466 words give 2,000)."""
    return int(min(32000, max(500, 500 * round(6 * math.sqrt(train_words) / 500))))


def vocab_bounds(train):
    """(least, most) vocabulary a sentencepiece BPE model of the train split can have: the meta pieces plus
    every character and the word-start mark at least; at most those plus one merge per character pair of
    each distinct word (each merge shortens some word by one symbol)."""
    least = SPM_META_PIECES + len(train.chars) + 1
    return least, least + sum(len(w) for w in train.word_types)


# ---------------------------------------------------------------- the output directories
def read_stamp(d):
    try:
        return json.loads((Path(d) / STAMP).read_text())
    except (OSError, ValueError):
        return None


def write_json_atomic(path, obj):
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def foreign_files(d, allowed=()):
    """The entries of directory d, sorted, other than the allowed ones (the input's own files)."""
    d = Path(d)
    if not d.is_dir():
        return []
    allowed = {Path(a).resolve() for a in allowed}
    return sorted(p.name for p in d.iterdir() if p.resolve() not in allowed)


def text_dir_files(bpe, single_file):
    return ({f"{s}.txt" for s in SPLITS} if single_file else set()) | {f"{s}.bpe" for s in SPLITS} \
        | set(TOKENIZER_FILES[bpe] if bpe == "sentencepiece" else ()) | {STAMP}


def dest_files(bpe):
    return {*BIN_FILES, *TOKENIZER_FILES[bpe], STAMP}


# ---------------------------------------------------------------- the steps
class Progress:
    """Lines and tokens encoded, with a rate, every PROGRESS_SECONDS and at the end."""

    def __init__(self, what):
        self.what, self.lines, self.tokens = what, 0, 0
        self.start = self.last = time.monotonic()

    def add(self, lines, tokens):
        self.lines += lines
        self.tokens += tokens
        now = time.monotonic()
        if now - self.last >= PROGRESS_SECONDS:
            self.last = now
            self.report("")

    def report(self, end):
        secs = max(time.monotonic() - self.start, 1e-9)
        say(f"{self.what}: {self.lines:,} lines, {self.tokens:,} tokens, {self.tokens / secs:,.0f} tokens/s"
            f" ({secs:.1f} s){end}")


def read_lines(path):
    with open(path, encoding="utf-8", newline="\n") as f:
        for line in f:
            yield line.rstrip("\r\n")


def split_single_file(src, out_dir, sizes):
    """Write the split of src into out_dir: its first sizes["train"] lines to train.txt, the next
    sizes["valid"] to valid.txt, the rest to test.txt (whole lines, in order)."""
    outs = {s: open(Path(out_dir) / f"{s}.txt", "w", encoding="utf-8", newline="\n") for s in SPLITS}
    try:
        for i, line in enumerate(read_lines(src)):
            split = "train" if i < sizes["train"] else "valid" if i < sizes["train"] + sizes["valid"] else "test"
            outs[split].write(line + "\n")
    finally:
        for f in outs.values():
            f.close()


def train_sentencepiece(work, vocab_size, max_sentences, train_lines):
    """Train on work/train.txt, from inside work (the trainer's spec, input name and model prefix, is stored
    in spm.model, so absolute or temporary paths would make the file differ between runs)."""
    import sentencepiece as spm

    settings = dict(SPM_SETTINGS)
    if train_lines > max_sentences:
        settings["input_sentence_size"] = max_sentences
    cwd = os.getcwd()
    os.chdir(work)
    try:
        spm.SentencePieceTrainer.train(input="train.txt", model_prefix="spm", vocab_size=vocab_size, minloglevel=2,
                                       **settings)
    except RuntimeError as e:
        most = re.search(r"<= (\d+)", str(e))
        raise CorpusError(f"sentencepiece cannot make {vocab_size:,} pieces from the train split"
                          + (f": it makes at most {int(most.group(1)):,}; set VOCAB_SIZE to that or less"
                             if most else f": {str(e).strip().splitlines()[-1]}")
                          + ", or use a bigger corpus") from None
    finally:
        os.chdir(cwd)


def encode_sentencepiece(model, src, dst, workers, what):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    progress = Progress(what)
    tmp = Path(str(dst) + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as out:
        lines = read_lines(src)
        while True:
            chunk = [line for _, line in zip(range(CHUNK_LINES), lines)]
            if not chunk:
                break
            pieces = sp.encode(chunk, out_type=str, num_threads=workers)
            out.write("".join(" ".join(p) + "\n" for p in pieces))
            progress.add(len(chunk), sum(map(len, pieces)))
    os.replace(tmp, dst)
    progress.report(f" -> {dst}")
    return progress.tokens


def encode_gpt2(gpt2_dir, srcs, dsts, workers):
    """scripts/gpt2_bpe_encode.py's encoder (as prepare-wikitext-103.sh runs it: empty lines kept)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpt2_bpe_encode as g
    from multiprocessing import Pool

    args = (str(Path(gpt2_dir) / "encoder.json"), str(Path(gpt2_dir) / "vocab.bpe"))
    pool = Pool(workers, initializer=g._init, initargs=args) if workers > 1 else None
    if pool is None:
        g._init(*args)
    tokens = {}
    try:
        for split, src, dst in zip(SPLITS, srcs, dsts):
            progress = Progress(f"encoding {split} (GPT-2 BPE, {workers} worker(s))")
            g.encode_file(Path(src), Path(dst), True, pool, on_line=progress.add)
            progress.report(f" -> {dst}")
            tokens[split] = progress.tokens
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return tokens


def binarise(text_dir, tmp_dest, workers, srcdict, fairseq_bin):
    env = {**os.environ, "WORKERS": str(workers), "FORCE": "0", "SRCDICT": srcdict or ""}
    if fairseq_bin:
        env["FAIRSEQ_BIN"] = fairseq_bin
    preprocess = Path(__file__).resolve().parent / "preprocess.sh"
    proc = subprocess.run(["bash", str(preprocess), str(text_dir), str(tmp_dest)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise CorpusError(f"fairseq-preprocess failed:\n{proc.stdout[-4000:]}")


def install(tmp_dest, dest, ours):
    """Move the finished tmp_dest into dest: one rename when dest is new or empty; otherwise (FORCE=1) our
    files are replaced one by one, the stamp last, and everything else in dest is left alone."""
    dest = Path(dest)
    if dest.is_dir() and not any(dest.iterdir()):
        dest.rmdir()
    if not dest.exists():
        os.replace(tmp_dest, dest)
        return
    (dest / STAMP).unlink(missing_ok=True)
    for name in sorted(ours - {STAMP}):
        (dest / name).unlink(missing_ok=True)
        if (Path(tmp_dest) / name).exists():
            os.replace(Path(tmp_dest) / name, dest / name)
    os.replace(Path(tmp_dest) / STAMP, dest / STAMP)
    shutil.rmtree(tmp_dest)


# ---------------------------------------------------------------- the command
def next_steps(dest, bpe, tokens_per_sample, prompt):
    """The commands that train, evaluate and generate from dest (fairseq's generation CLIs need the
    tokenizer named: --bpe is not read from the data directory); prompt: the start of a line of the corpus."""
    root = Path(__file__).resolve().parents[1]
    rel = os.path.relpath(dest, root) if Path(dest).resolve().is_relative_to(root) else str(dest)
    if bpe == "sentencepiece":
        flags = f"--bpe sentencepiece --sentencepiece-model {rel}/spm.model"
        hub = f'bpe="sentencepiece", sentencepiece_model="{rel}/spm.model"'
    else:
        flags = f"--bpe gpt2 --gpt2-encoder-json {rel}/encoder.json --gpt2-vocab-bpe {rel}/vocab.bpe"
        hub = f'bpe="gpt2", gpt2_encoder_json="{rel}/encoder.json", gpt2_vocab_bpe="{rel}/vocab.bpe"'
    ckpt = "checkpoints/tnn_lm_tiny/checkpoint_best.pt"
    tps = min(128, tokens_per_sample)  # a CPU smoke run's block
    lengths = " ".join(str(tps * f) for f in (1, 2, 4, 8))
    return "\n".join([
        "next steps, a CPU smoke run (from the repository root; scripts/train.sh's header has the full recipe):",
        f"  CPU=1 MAX_UPDATE=300 TOKENS_PER_SAMPLE={tps} SEQS_PER_UPDATE=16 BATCH_PER_GPU=16 LR=0.003 "
        f"WARMUP_UPDATES=50 NUM_WORKERS=0 bash scripts/train.sh tnn_lm_tiny {rel}",
        f"  CPU=1 DATA={rel} LENGTHS=\"{lengths}\" bash scripts/eval_extrapolation.sh {ckpt}",
        f"  echo {shlex.quote(prompt)} | .venv/bin/fairseq-interactive {rel} --user-dir fairseq_tnn "
        f"--task tnn_language_modeling --path {ckpt} --cpu {flags} --beam 1 --sampling --sampling-topk 10 "
        "--seed 1 --min-len 20 --max-len-b 40",
        f"  fairseq-generate and fairseq-interactive decode text with: {flags}",
        f"  from Python: TnnLanguageModel.from_pretrained(\"checkpoints/tnn_lm_tiny\", \"checkpoint_best.pt\", "
        f"\"{rel}\", {hub})",
    ])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog=PROG)
    p.add_argument("--input", required=True, help="a directory with train.txt, valid.txt, test.txt, or one text file")
    p.add_argument("--dest", required=True, help="the binarised output, e.g. data-bin/<name>")
    p.add_argument("--text-dir", required=True, help="the split text (one input file), the encoded splits and "
                                                     "the tokenizer, e.g. data/<name>")
    # The knobs of scripts/prepare-corpus.sh, its only caller, as the user set them: checked by check_settings,
    # whose errors name the knob
    p.add_argument("--bpe", default="sentencepiece", help="sentencepiece | gpt2")
    p.add_argument("--vocab-size", default="0", help="sentencepiece pieces; 0: the default rule")
    p.add_argument("--spm-sentences", default="1000000",
                   help="sentencepiece trains on at most this many lines of the train split (the first ones)")
    p.add_argument("--valid-percent", default="5")
    p.add_argument("--test-percent", default="5")
    p.add_argument("--tokens-per-sample", default="512", help="the training block; the train split must hold at least one")
    p.add_argument("--workers", default="0", help="encoding threads and fairseq-preprocess workers; 0 (the default): "
                                                  "the CPUs this process may use")
    p.add_argument("--gpt2-dir", default=None, help="encoder.json, vocab.bpe and dict.txt of GPT-2 (--bpe gpt2)")
    p.add_argument("--fairseq-bin", default=None, help="the directory of fairseq-preprocess (scripts/preprocess.sh's "
                                                       "FAIRSEQ_BIN)")
    p.add_argument("--force", action="store_true", help="redo every step; replace only the files this command writes")
    return p.parse_args(argv)


# knob: (convert, accepted, what is allowed); the knob is the option's name in capitals
KNOBS = {
    "vocab_size": (int, lambda v: v >= 0, "a positive integer (0: the default rule)"),
    "spm_sentences": (int, lambda v: v >= 1, "a positive integer"),
    "valid_percent": (float, lambda v: 0 < v < 50, "a number above 0 and below 50"),
    "test_percent": (float, lambda v: 0 < v < 50, "a number above 0 and below 50"),
    "tokens_per_sample": (int, lambda v: v >= 1, "a positive integer"),
    "workers": (int, lambda v: v >= 0, "a positive integer (0: the CPUs this process may use)"),
}


def check_settings(args):
    """Every knob checked and converted, before any work; an error names the knob, its value and what is allowed."""
    if args.bpe not in TOKENIZER_FILES:
        raise CorpusError(f"BPE must be {' or '.join(TOKENIZER_FILES)}, not '{args.bpe}'")
    for name, (convert, accepted, allowed) in KNOBS.items():
        raw = getattr(args, name)
        try:
            value = convert(raw)
        except ValueError:
            value = None
        if value is None or not accepted(value):
            raise CorpusError(f"{name.upper()} must be {allowed}, not '{raw}'")
        setattr(args, name, value)
    if args.workers == 0:
        args.workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if args.bpe == "gpt2":
        if args.vocab_size:
            raise CorpusError(f"VOCAB_SIZE={args.vocab_size} applies to sentencepiece only: GPT-2 BPE has its "
                              "fixed vocabulary (fairseq's dict.txt, 50,260 symbols)")
        missing = [f for f in GPT2_FILES if not (Path(args.gpt2_dir) / f).is_file()]
        if missing:
            raise CorpusError("GPT-2 BPE needs " + ", ".join(f"{args.gpt2_dir}/{f}" for f in missing)
                              + "; download " + " ".join(f"{GPT2_URL}/{f}" for f in missing)
                              + " there (scripts/prepare-wikitext-103.sh fetches them into data/wikitext-103/gpt2_bpe)")


def split_sizes(n_lines, valid_percent, test_percent):
    """Lines of train, valid and test when one file of n_lines lines is split (train first, test last)."""
    n_valid = max(1, round(n_lines * valid_percent / 100))
    n_test = max(1, round(n_lines * test_percent / 100))
    return {"train": n_lines - n_valid - n_test, "valid": n_valid, "test": n_test}


def prepare(args):
    check_settings(args)
    src, text_dir, dest = Path(args.input), Path(args.text_dir), Path(args.dest)
    if not src.exists():
        raise CorpusError(f"{src}: no such file or directory")
    single = not src.is_dir()
    if single:
        texts = {s: text_dir / f"{s}.txt" for s in SPLITS}
    else:
        texts = {s: src / f"{s}.txt" for s in SPLITS}
        missing = [str(p) for p in texts.values() if not p.is_file()]
        if missing:
            raise CorpusError(f"{src} is a directory without " + ", ".join(missing)
                              + " (a directory needs train.txt, valid.txt and test.txt; one text file is split)")

    # 1. every input file read, before anything is written
    checked = [check_text(p) for p in ([src] if single else texts.values())]
    inputs = {str(st.path.resolve()): st.sha256 for st in checked}
    if single:
        whole = checked[0]
        sizes = split_sizes(whole.lines, args.valid_percent, args.test_percent)
        if sizes["train"] < 1:
            raise CorpusError(f"{src}: {whole.lines} lines are too few to split into train, valid "
                              f"({args.valid_percent:g}%) and test ({args.test_percent:g}%)")
        train = vocabulary_stats(src, sizes["train"])
        what = f"the train split (lines 1-{sizes['train']:,} of {src})"
    else:
        train = vocabulary_stats(texts["train"], checked[0].lines)
        what = f"the train split ({texts['train']})"

    # 2. what the corpus allows
    if train.words < args.tokens_per_sample:
        raise CorpusError(f"{what} has {train.words:,} words, fewer than one training block of TOKENS_PER_SAMPLE="
                          f"{args.tokens_per_sample} tokens (a word is at least one token): use a bigger corpus, or "
                          "a shorter block (TOKENS_PER_SAMPLE, the same for scripts/train.sh)")
    vocab = None
    if args.bpe == "sentencepiece":
        vocab = args.vocab_size or default_vocab_size(train.words)
        least, most = vocab_bounds(train)
        how = f"VOCAB_SIZE={vocab}" + ("" if args.vocab_size else f" (the default for {train.words:,} training words)")
        if vocab < least:
            raise CorpusError(f"{how} is too small: {what} has {len(train.chars)} distinct characters, so "
                              f"sentencepiece needs at least {least} pieces; set VOCAB_SIZE to {least} or more")
        if vocab > most:
            raise CorpusError(f"the corpus is too small for {how}: {what} has {train.words:,} words "
                              f"({len(train.word_types):,} distinct), which make at most {most:,} BPE pieces; set "
                              f"VOCAB_SIZE below {most}, or use a bigger corpus")
    key = {"input": inputs, "bpe": args.bpe, "vocab_size": vocab,
           "split_percent": [args.valid_percent, args.test_percent] if single else None,
           "spm_sentences": args.spm_sentences if args.bpe == "sentencepiece" else None,
           "gpt2_dict_sha256": sha256_file(Path(args.gpt2_dir) / "dict.txt") if args.bpe == "gpt2" else None}

    # 3. the output directories: empty, or made from this input with these settings, or refused
    for d, role in ((text_dir, "TEXT_DIR"), (dest, "the destination")):
        if d.exists() and not d.is_dir():
            raise CorpusError(f"{role} {d} is a file, not a directory")
    t_ours, d_ours = text_dir_files(args.bpe, single), dest_files(args.bpe)
    t_stamp, d_stamp = read_stamp(text_dir), read_stamp(dest)
    t_same = t_stamp is not None and t_stamp.get("key") == key
    d_same = d_stamp is not None and d_stamp.get("key") == key
    if not args.force:
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
        if d_same and all((dest / f).exists() for f in d_ours):
            say(f"{dest} is already prepared from this input with these settings (FORCE=1 redoes it)")
            print(next_steps(dest, args.bpe, args.tokens_per_sample, first_words(texts["valid"])))
            return

    # 4. the work; a step that a run with the same key completed is skipped. The split and the tokenizer are
    # made in a private folder and moved into TEXT_DIR together: a vocabulary that sentencepiece finds too large
    # only while training leaves TEXT_DIR as it was.
    if single:
        say(f"{src}: {whole.lines:,} lines, {whole.words:,} words, {whole.bytes:,} bytes")
    step_files = {"split": [f"{s}.txt" for s in SPLITS], "tokenizer": TOKENIZER_FILES["sentencepiece"],
                  "encode": [f"{s}.bpe" for s in SPLITS]}
    done = {step for step in (t_stamp.get("done", []) if t_same and not args.force else [])
            if all((text_dir / f).is_file() for f in step_files[step])}  # a step whose files went is redone
    todo = [step for step in ("split",) * single + ("tokenizer",) * (args.bpe == "sentencepiece") if step not in done]
    for step in sorted(set(("split", "tokenizer")) & done):
        say(f"{step} present in {text_dir}")
    if todo:
        text_dir.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=text_dir.parent, prefix=f".{text_dir.name}.work-"))
        try:
            made = []
            if "split" in todo:
                split_single_file(src, work, sizes)
                made += [f"{s}.txt" for s in SPLITS]
                first = 0
                for s in SPLITS:
                    say(f"{s}: lines {first + 1:,}-{first + sizes[s]:,} of {src} ({sizes[s]:,} lines, "
                        f"{(work / f'{s}.txt').stat().st_size:,} bytes) -> {texts[s]}")
                    first += sizes[s]
            if "tokenizer" in todo:
                if "split" not in todo:
                    os.symlink(texts["train"].resolve(), work / "train.txt")
                say(f"training sentencepiece BPE, {vocab:,} pieces, on {texts['train']}")
                t0 = time.monotonic()
                train_sentencepiece(work, vocab, args.spm_sentences, train.lines)
                say(f"trained {text_dir / 'spm.model'} in {time.monotonic() - t0:.1f} s")
                made += list(TOKENIZER_FILES["sentencepiece"])
            text_dir.mkdir(parents=True, exist_ok=True)
            for name in made:
                os.replace(work / name, text_dir / name)
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
        say(f"encoded splits present in {text_dir}")
    else:
        text_dir.mkdir(parents=True, exist_ok=True)
        if args.bpe == "sentencepiece":
            for s in SPLITS:
                encode_sentencepiece(text_dir / "spm.model", texts[s], bpes[s], args.workers,
                                     f"encoding {s} ({args.workers} thread(s))")
        else:
            encode_gpt2(args.gpt2_dir, [texts[s] for s in SPLITS], [bpes[s] for s in SPLITS], args.workers)
        mark("encode")

    # 5. binarised into a temporary folder beside dest, then moved
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp_dest = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_dest, 0o777 & ~umask)  # mkdtemp's folder is private; dest is an ordinary directory
    try:
        say(f"binarising into {dest} (fairseq-preprocess, {args.workers} worker(s))")
        srcdict = str(Path(args.gpt2_dir) / "dict.txt") if args.bpe == "gpt2" else ""
        binarise(text_dir, tmp_dest, args.workers, srcdict, args.fairseq_bin)
        tok_dir = text_dir if args.bpe == "sentencepiece" else Path(args.gpt2_dir)
        for name in TOKENIZER_FILES[args.bpe]:
            shutil.copyfile(tok_dir / name, tmp_dest / name)
        write_json_atomic(tmp_dest / STAMP, {"key": key})
        install(tmp_dest, dest, d_ours)
    finally:
        if tmp_dest.exists():
            shutil.rmtree(tmp_dest)
    with open(dest / "dict.txt", encoding="utf-8") as f:
        n_dict = sum(1 for _ in f)
    say(f"done: {dest} ({n_dict:,} dictionary entries + 4 special symbols; the tokenizer, "
        f"{' and '.join(TOKENIZER_FILES[args.bpe])}, beside them)")
    print(next_steps(dest, args.bpe, args.tokens_per_sample, first_words(texts["valid"])))


def first_words(path, n=4):
    """A prompt from the corpus itself: the first n words of the first line of path that starts with n words
    of letters and has at least 2n words (prose, not a heading or a list of names), else of its first line."""
    fallback = None
    for line in read_lines(path):
        words = line.split()
        if len(words) >= 2 * n and all(w.strip(".,;:!?\"'()").isalpha() for w in words[:n]):
            return " ".join(words[:n])
        fallback = fallback or words[:n]
    return " ".join(fallback or [])


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def describe(d, stamp, allowed=()):
    if stamp is not None:
        return f"data prepared from another input or with other settings ({Path(d) / STAMP})"
    return "files this command did not write (" + ", ".join(foreign_files(d, allowed)[:6]) + ")"


def main(argv=None):
    args = parse_args(argv)
    try:
        prepare(args)
    except CorpusError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
