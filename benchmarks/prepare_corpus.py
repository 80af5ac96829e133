"""Throughput of scripts/prepare-corpus.sh (raw text to fairseq data) on this machine, and the time it predicts
for a Wikitext-103-sized corpus (540 MB of raw text).

    .venv/bin/python benchmarks/prepare_corpus.py --out results/prepare-corpus            # Debian's copyright files
    .venv/bin/python benchmarks/prepare_corpus.py --text my.txt --vocab-size 32000 --out results/prepare-corpus

Runs the command as a user does, on one text file (default: every /usr/share/doc/*/copyright of this machine
concatenated, real English prose of some MB), into a fresh folder, and time-stamps its progress lines as they
arrive, which splits the wall time into its steps: checking the input (UTF-8, words, the vocabulary bound),
splitting, training sentencepiece, encoding (lines, tokens and tokens per second, on every core) and binarising
(fairseq-preprocess). Writes ``prepare-corpus.json`` and ``prepare-corpus.md`` into ``--out``.

The prediction for 540 MB scales each step by the corpus size in bytes, except sentencepiece's training, which
reads at most SPM_SENTENCES lines (1,000,000 by default; Wikitext-103's train split has 1.8 million, so it
would read about 1/1.8 of its bytes) and is scaled by the bytes it reads: a linear model of steps that are
linear in the text (reading, encoding, binarising) and a rough one for the training, whose cost also grows
with the vocabulary and the number of distinct words (measure it at the vocabulary you will use with
--vocab-size; the default rule gives Wikitext-103 32,000).
"""
import argparse
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WT103_BYTES = 540e6
WT103_TRAIN_LINES = 1.8e6
SPM_SENTENCES = 1000000  # prepare-corpus.sh's default
STEPS = [  # (step, the progress line that ends it)
    ("check", re.compile(r": [\d,]+ lines, [\d,]+ words, [\d,]+ bytes$")),
    ("split", re.compile(r"training sentencepiece BPE")),
    ("train", re.compile(r": trained .* in [\d.]+ s$")),
    ("encode", re.compile(r"binarising into ")),
    ("binarise", re.compile(r": done: ")),
]
ENCODED = re.compile(r"encoding (\w+) .*: ([\d,]+) lines, ([\d,]+) tokens, [\d,]+ tokens/s \(([\d.]+) s\) -> ")


def debian_copyright(path):
    files = sorted(glob.glob("/usr/share/doc/*/copyright"))
    if not files:
        sys.exit("prepare_corpus.py: error: no /usr/share/doc/*/copyright files on this machine; name a text with --text")
    with open(path, "wb") as out:
        for f in files:
            with open(f, "rb") as src:
                shutil.copyfileobj(src, out)
    return f"/usr/share/doc/*/copyright ({len(files)} files)"


def run(text, out, env):
    """Run prepare-corpus.sh; return {step: seconds}, {split: (lines, tokens, seconds)} and its output."""
    cmd = ["bash", os.path.join(ROOT, "scripts", "prepare-corpus.sh"), text, os.path.join(out, "bin")]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TEXT_DIR": os.path.join(out, "text"), **env})
    ends, encoded, lines = {}, {}, []
    for line in proc.stderr:
        now = time.monotonic() - start
        lines.append(line)
        for step, pattern in STEPS:
            if step not in ends and pattern.search(line.rstrip("\n")):
                ends[step] = now
        m = ENCODED.search(line)
        if m:
            encoded[m.group(1)] = tuple(int(m.group(i).replace(",", "")) for i in (2, 3)) + (float(m.group(4)),)
    stdout = proc.stdout.read()
    if proc.wait() != 0:
        sys.exit("prepare_corpus.py: error: prepare-corpus.sh failed:\n" + "".join(lines[-20:]))
    ends["total"] = time.monotonic() - start
    seconds, before = {}, 0.0
    for step, _ in STEPS:
        seconds[step] = ends[step] - before
        before = ends[step]
    seconds["total"] = ends["total"]
    return seconds, encoded, "".join(lines) + stdout


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", help="one UTF-8 text file (default: this machine's /usr/share/doc/*/copyright)")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "prepare-corpus"))
    p.add_argument("--vocab-size", type=int, default=0, help="VOCAB_SIZE (default: the command's rule)")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="WORKERS (default: every CPU)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)
    if os.path.exists(args.out) and os.listdir(args.out):
        if not args.force:
            p.error(f"{args.out} exists; --force replaces it")
        shutil.rmtree(args.out)
    os.makedirs(args.out)
    text, source = args.text, args.text
    if text is None:
        text = os.path.join(args.out, "corpus.txt")
        source = debian_copyright(text)
    env = {"WORKERS": str(args.workers), "TOKENS_PER_SAMPLE": "64"}
    if args.vocab_size:
        env["VOCAB_SIZE"] = str(args.vocab_size)
    seconds, encoded, log = run(text, args.out, env)
    size = os.path.getsize(text)
    n_lines = sum(encoded[s][0] for s in encoded)
    n_tokens = sum(encoded[s][1] for s in encoded)
    vocab = int(re.search(r"training sentencepiece BPE, ([\d,]+) pieces", log).group(1).replace(",", ""))
    spm_bytes = 0  # what sentencepiece read: the first SPM_SENTENCES lines of the train split
    with open(os.path.join(args.out, "text", "train.txt"), "rb") as f:
        for _, line in zip(range(SPM_SENTENCES), f):
            spm_bytes += len(line)
    scale = WT103_BYTES / size
    predicted = {s: seconds[s] * scale for s in ("check", "split", "encode", "binarise")}
    predicted["train"] = seconds["train"] * WT103_BYTES * min(1.0, SPM_SENTENCES / WT103_TRAIN_LINES) / spm_bytes
    result = {
        "text": source, "bytes": size, "lines": n_lines, "tokens": n_tokens, "vocab_size": vocab,
        "workers": args.workers, "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        "seconds": seconds, "encode_tokens_per_s": n_tokens / seconds["encode"],
        "bytes_per_s": size / seconds["total"],
        "predicted_wt103_seconds": predicted, "predicted_wt103_total_s": sum(predicted.values()),
    }
    with open(os.path.join(args.out, "prepare-corpus.json"), "w") as f:
        json.dump(result, f, indent=1)
    rows = "\n".join(f"| {s} | {seconds[s]:.1f} | {predicted[s] / 60:.1f} |" for s, _ in STEPS)
    md = (f"prepare-corpus.sh on {source}: {size / 1e6:.1f} MB, {n_lines:,} lines, {n_tokens:,} tokens "
          f"(sentencepiece BPE, {vocab:,} pieces), {args.workers} worker(s) on {os.cpu_count()} CPU(s).\n\n"
          f"Encoding: {result['encode_tokens_per_s']:,.0f} tokens/s; the whole command: "
          f"{result['bytes_per_s'] / 1e6:.2f} MB/s ({seconds['total']:.1f} s).\n\n"
          "| step | seconds here | predicted for 540 MB (minutes) |\n|---|---:|---:|\n" + rows +
          f"\n| total | {seconds['total']:.1f} | {result['predicted_wt103_total_s'] / 60:.1f} |\n")
    with open(os.path.join(args.out, "prepare-corpus.md"), "w") as f:
        f.write(md)
    print(md, end="")


if __name__ == "__main__":
    main()
