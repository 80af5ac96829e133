"""GPT-2 BPE-encode text files into space-separated token ids, one output line per input line.

    python scripts/gpt2_bpe_encode.py --encoder-json gpt2_bpe/encoder.json --vocab-bpe gpt2_bpe/vocab.bpe \
        --inputs wiki.train.raw --outputs wiki.train.bpe --keep-empty --workers 8

What fairseq's examples/roberta/multiprocessing_bpe_encoder.py does (the pip fairseq ships no
`examples` package), on fairseq's own GPT-2 encoder (fairseq.data.encoders.gpt2_bpe_utils): each line
is stripped of surrounding whitespace and encoded; an empty line stays empty with --keep-empty (so the
output keeps the input's line structure) and is dropped otherwise. The ids are the symbols of
fairseq's GPT-2 dict.txt. Outputs are written to <output>.part and renamed when complete. A UTF-8 byte-order
mark at the start of an input is not text and is dropped. prepare-corpus and prepare-wikitext-103 call
encode_file in their process; scripts/gpt2_bpe_encode.py runs main.
"""
import argparse
import importlib.util
import signal
import sys
from contextlib import contextmanager
from multiprocessing import Pool
from pathlib import Path
from typing import Callable, Optional, Sequence

_encoder = None


def load_gpt2_bpe_utils():
    """fairseq.data.encoders.gpt2_bpe_utils, loaded from its file: it needs only json and regex, while
    importing it through the fairseq package would import torch and all of fairseq in every worker."""
    spec = importlib.util.find_spec("fairseq")  # locates the package without running its __init__
    path = Path(spec.origin).parent / "data" / "encoders" / "gpt2_bpe_utils.py" if spec and spec.origin else None
    if path is None or not path.is_file():
        from fairseq.data.encoders import gpt2_bpe_utils

        return gpt2_bpe_utils
    module_spec = importlib.util.spec_from_file_location("_fairseq_gpt2_bpe_utils", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _init(encoder_json: str, vocab_bpe: str):
    global _encoder
    _encoder = load_gpt2_bpe_utils().get_encoder(encoder_json, vocab_bpe)


def _init_worker(encoder_json: str, vocab_bpe: str):
    """A pool process: the default action for the signals that the command turns into exceptions (its
    handlers are inherited through fork), so that Pool.terminate ends it; then the encoder loaded."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    _init(encoder_json, vocab_bpe)


def encode_line(line: str) -> str:
    return " ".join(map(str, _encoder.encode(line.strip())))


def encode_file(src: Path, dst: Path, keep_empty: bool, pool, chunksize: int = 256,
                on_line: Optional[Callable[[int, int], None]] = None) -> tuple:
    """Encode one file; return (lines written, empty lines dropped). on_line(1, tokens) is called after each
    line written (prepare-corpus's progress)."""
    tmp = dst.with_name(dst.name + ".part")
    written = dropped = 0
    try:
        with open(src, encoding="utf-8-sig") as fin, open(tmp, "w", encoding="utf-8") as fout:
            lines = (line for line in fin)
            encoded = pool.imap(encode_line, lines, chunksize) if pool else map(encode_line, lines)
            for out in encoded:
                if not out and not keep_empty:
                    dropped += 1
                    continue
                fout.write(out + "\n")
                written += 1
                if on_line is not None:
                    on_line(1, len(out.split()))
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)
    return written, dropped


@contextmanager
def encoder_pool(encoder_json: Path, vocab_bpe: Path, workers: int):
    """The pool encode_file takes: workers processes that each load the encoder, or None (the encoder loaded
    in this process) for one worker."""
    args = (str(encoder_json), str(vocab_bpe))
    if workers <= 1:
        _init(*args)
        yield None
        return
    pool = Pool(workers, initializer=_init_worker, initargs=args)
    try:
        yield pool
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="gpt2_bpe_encode.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--encoder-json", required=True, help="GPT-2 encoder.json")
    p.add_argument("--vocab-bpe", required=True, help="GPT-2 vocab.bpe")
    p.add_argument("--inputs", nargs="+", required=True, help="text files, one sentence/paragraph per line")
    p.add_argument("--outputs", nargs="+", required=True, help="one output path per input")
    p.add_argument("--keep-empty", action="store_true", help="keep empty lines (as empty lines)")
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args(argv)
    if len(args.inputs) != len(args.outputs):
        p.error("--inputs and --outputs need the same number of files")
    for path in (args.encoder_json, args.vocab_bpe, *args.inputs):
        if not Path(path).is_file():
            p.error(f"no such file: {path}")

    with encoder_pool(Path(args.encoder_json), Path(args.vocab_bpe), args.workers) as pool:
        for src, dst in zip(args.inputs, args.outputs):
            written, dropped = encode_file(Path(src), Path(dst), args.keep_empty, pool)
            print(f"gpt2_bpe_encode.py: {src} -> {dst}: {written} lines"
                  + (f", {dropped} empty lines dropped" if dropped else ""), file=sys.stderr)
