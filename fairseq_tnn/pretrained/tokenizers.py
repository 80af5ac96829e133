"""Text to the symbols of a model's vocabulary and back, as fairseq's ``--bpe sentencepiece`` and ``--bpe gpt2``
do, with the tokenizer files an exported model carries (fairseq_tnn/commands/export.py): torch is not needed,
nor fairseq.

- sentencepiece (``spm.model``): with the ``sentencepiece`` package when it is installed (an optional import;
  it is in the fairseq extra). Without it, a pure-Python reader of the model file encodes as sentencepiece does
  for the BPE models with identity normalisation that scripts/prepare-corpus.sh and data/sample's builder train
  (tests/cli/test_export.py checks it against the package on the sample corpus); another kind of model
  (unigram, or a normalisation rule) then asks for the package by name. Decoding needs no package at all.
- GPT-2 BPE (``encoder.json``, ``vocab.bpe``): pure Python, as fairseq's own encoder; its pre-tokenising pattern
  needs the ``regex`` package (an optional import; fairseq requires it), which is asked for by name if missing.
"""
import json
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Tuple

SPM_FILE = "spm.model"
GPT2_FILES = ("encoder.json", "vocab.bpe")
WORD_START = "\u2581"  # sentencepiece's mark of a space (a word's start)


# ---------------------------------------------------------------- sentencepiece's model file
def _varint(buf: bytes, i: int) -> Tuple[int, int]:
    value, shift = 0, 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of a protobuf message: an int for varints, bytes for length-delimited
    fields, the raw 4 or 8 bytes for fixed-width ones."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, wire, value


# sentencepiece_model.proto: ModelProto.pieces = 1, trainer_spec = 2, normalizer_spec = 3; SentencePiece.piece
# = 1, score = 2, type = 3 (1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte); TrainerSpec
# .model_type = 3 (1 unigram, 2 bpe, 3 word, 4 char), byte_fallback = 35; NormalizerSpec.name = 1,
# add_dummy_prefix = 3, remove_extra_whitespaces = 4, escape_whitespaces = 5.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}


def read_spm_model(path) -> dict:
    """What the pure-Python encoder needs from a sentencepiece model file: its pieces (piece, score, type),
    model type, byte fallback and normalisation."""
    import struct
    pieces, model_type, byte_fallback = [], 1, False
    norm = {"name": "nmt_nfkc", "add_dummy_prefix": True, "remove_extra_whitespaces": True,
            "escape_whitespaces": True}
    for number, wire, value in _fields(Path(path).read_bytes()):
        if number == 1 and wire == 2:
            piece, score, kind = "", 0.0, NORMAL
            for n, w, v in _fields(value):
                if n == 1:
                    piece = v.decode("utf-8")
                elif n == 2 and w == 5:
                    score = struct.unpack("<f", v)[0]
                elif n == 3:
                    kind = v
            pieces.append((piece, score, kind))
        elif number == 2 and wire == 2:
            for n, w, v in _fields(value):
                if n == 3:
                    model_type = v
                elif n == 35:
                    byte_fallback = bool(v)
        elif number == 3 and wire == 2:
            for n, w, v in _fields(value):
                if n == 1:
                    norm["name"] = v.decode("utf-8")
                elif n in (3, 4, 5):
                    norm[{3: "add_dummy_prefix", 4: "remove_extra_whitespaces", 5: "escape_whitespaces"}[n]] = bool(v)
    return {"pieces": pieces, "model_type": MODEL_TYPES.get(model_type, str(model_type)),
            "byte_fallback": byte_fallback, "normalizer": norm}


class PurePythonSentencePiece:
    """sentencepiece's BPE encoding without the package: the text's whitespace becomes the word-start mark
    (after the model's dummy prefix), then, within each word, the adjacent pair whose concatenation is a
    piece of the highest score is merged until none is (the leftmost of equal scores first), as sentencepiece's
    bpe_model.cc does; its pieces never span a word boundary (split_by_whitespace), so words are encoded one
    by one. Characters outside the vocabulary stay as they are (fairseq's dictionary maps them to <unk>), or
    become <0xNN> byte pieces where the model has byte fallback. Only identity normalisation: other models
    need the package (``sentencepiece_tokenizer`` says so)."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.score = {p: s for p, s, t in spec["pieces"] if t in (NORMAL, USER_DEFINED)}
        self.user_defined = sorted((p for p, _, t in spec["pieces"] if t == USER_DEFINED), key=len, reverse=True)
        self.byte_pieces = {p for p, _, t in spec["pieces"] if t == BYTE}
        self.norm = spec["normalizer"]

    def encode(self, text: str) -> List[str]:
        if self.norm["remove_extra_whitespaces"]:
            text = " ".join(w for w in text.split(" ") if w)
        if not text:
            return []
        if self.norm["add_dummy_prefix"]:
            text = " " + text
        out = []
        # split before each space: every word but a first one without the dummy prefix starts with the mark
        words, start = [], 0
        for i in range(1, len(text) + 1):
            if i == len(text) or text[i] == " ":
                words.append(text[start:i])
                start = i
        for word in words:
            out.extend(self._word(word.replace(" ", WORD_START) if self.norm["escape_whitespaces"] else word))
        return out

    @lru_cache(maxsize=1 << 16)
    def _word(self, word: str) -> Tuple[str, ...]:
        symbols, i = [], 0
        while i < len(word):  # user-defined pieces are never split; everything else starts as characters
            match = next((p for p in self.user_defined if word.startswith(p, i)), None)
            symbols.append(match or word[i])
            i += len(symbols[-1])
        fixed = set(self.user_defined)
        while len(symbols) > 1:
            best, where = None, -1
            for j in range(len(symbols) - 1):
                if symbols[j] in fixed or symbols[j + 1] in fixed:
                    continue
                score = self.score.get(symbols[j] + symbols[j + 1])
                if score is not None and (best is None or score > best):
                    best, where = score, j
            if best is None:
                break
            symbols[where:where + 2] = [symbols[where] + symbols[where + 1]]
        if not self.spec["byte_fallback"]:
            return tuple(symbols)
        out = []
        for s in symbols:
            if s in self.score:
                out.append(s)
            else:
                out.extend(f"<0x{b:02X}>" for b in s.encode("utf-8"))
        return tuple(out)


class SentencePieceTokenizer:
    """fairseq's ``--bpe sentencepiece``: text to pieces (``encode``) and pieces to text (``decode``)."""

    kind = "sentencepiece"
    files = (SPM_FILE,)

    def __init__(self, folder, prefer_package: bool = True):
        path = Path(folder) / SPM_FILE
        self.processor = None
        if prefer_package:
            try:
                import sentencepiece
            except ImportError:
                sentencepiece = None
            if sentencepiece is not None:
                self.processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        if self.processor is None:
            spec = read_spm_model(path)
            if spec["model_type"] != "bpe" or spec["normalizer"]["name"] != "identity":
                raise ImportError(
                    f"{path} is a sentencepiece {spec['model_type']} model with normalization "
                    f"{spec['normalizer']['name']!r}: encoding text with it needs the sentencepiece package "
                    "(pip install sentencepiece); without it, pass token ids (encode them yourself) or use a BPE "
                    "model with identity normalization, as scripts/prepare-corpus.sh trains")
            self.python = PurePythonSentencePiece(spec)

    def encode(self, text: str) -> List[str]:
        if self.processor is not None:
            return self.processor.encode(text, out_type=str)
        return self.python.encode(text)

    @staticmethod
    def decode(symbols: List[str]) -> str:
        """As fairseq's SentencepieceBPE.decode: pieces joined, the word-start mark a space, the ends stripped."""
        return "".join(symbols).replace(WORD_START, " ").strip()


@lru_cache()
def _byte_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters (its encoder.py)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# GPT-2's pre-tokenising pattern (letters and numbers by Unicode category: the regex package's \p{...})
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class Gpt2Tokenizer:
    """fairseq's ``--bpe gpt2``: text to GPT-2 token ids written as strings (the symbols of fairseq's GPT-2
    dictionary) and back."""

    kind = "gpt2"
    files = GPT2_FILES

    def __init__(self, folder):
        folder = Path(folder)
        self.encoder = json.loads((folder / "encoder.json").read_text(encoding="utf-8"))
        self.decoder = {v: k for k, v in self.encoder.items()}
        lines = (folder / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]  # the first line: a version
        self.ranks = {tuple(line.split()): i for i, line in enumerate(line for line in lines if line.strip())}
        self.byte_char = _byte_to_unicode()
        self.char_byte = {c: b for b, c in self.byte_char.items()}
        self._pattern = None

    def _words(self, text: str) -> List[str]:
        if self._pattern is None:
            try:
                import regex
            except ImportError:
                raise ImportError("encoding text with GPT-2's BPE needs the regex package (pip install regex), "
                                  "for its Unicode-category pattern; or pass token ids") from None
            self._pattern = regex.compile(GPT2_PATTERN)
        return self._pattern.findall(text)

    @lru_cache(maxsize=1 << 16)
    def _bpe(self, word: str) -> Tuple[str, ...]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), float("inf")), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, _ = min(pairs)
            if rank == float("inf"):
                break
            first, second = parts[min(pairs)[1]], parts[min(pairs)[1] + 1]
            merged, i = [], 0  # every occurrence of the best pair, left to right
            while i < len(parts):
                if i < len(parts) - 1 and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return tuple(parts)

    def encode(self, text: str) -> List[str]:
        out = []
        for word in self._words(text):
            for piece in self._bpe("".join(self.byte_char[b] for b in word.encode("utf-8"))):
                out.append(str(self.encoder[piece]))
        return out

    def decode(self, symbols: List[str]) -> str:
        text = "".join(self.decoder.get(int(s), s) if s.isdigit() else s for s in symbols)
        return bytes(self.char_byte[c] for c in text if c in self.char_byte).decode("utf-8", errors="replace")


TOKENIZERS = {"sentencepiece": SentencePieceTokenizer, "gpt2": Gpt2Tokenizer}


def load_tokenizer(kind: Optional[str], folder):
    """The tokenizer of an exported model's folder (None where it was exported without one)."""
    if kind is None:
        return None
    if kind not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {kind!r} in the config (one of {sorted(TOKENIZERS)})")
    return TOKENIZERS[kind](folder)
