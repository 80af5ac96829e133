"""Trained TNN models in plain PyTorch: load, score, generate, fill in masks, fine-tune and save, with torch
alone (neither fairseq nor its checkpoints needed).

``python -m fairseq_tnn export CHECKPOINT DIR`` (fairseq_tnn/commands/export.py) writes a fairseq checkpoint
of any plugin architecture as a folder:

- ``config.json``: every hyperparameter the model needs (``model_type`` causal or masked, sizes, norms,
  activations, the TNO type and its settings, the training length, the tokenizer's kind);
- ``model.safetensors``: the weights, under the fairseq model's own state_dict keys (tied weights once);
- ``vocab.json``: the vocabulary, symbol i at index i, and the special symbols' indices;
- the tokenizer files of the data: ``spm.model`` (sentencepiece) or ``encoder.json`` and ``vocab.bpe`` (GPT-2).

:class:`TnnForCausalLM` and :class:`TnnForMaskedLM` load such a folder (``from_pretrained``) into a
``torch.nn.Module`` built from ``fairseq_tnn.modules``, computing what the fairseq model computes (the same
state_dict keys and layers; tests/cli/test_export.py compares the logits, fairseq-eval-lm's perplexity and
fairseq-interactive's greedy tokens), and write one back (``save_pretrained``). Text in and out goes through
the exported tokenizer (``fairseq_tnn.pretrained.tokenizers``); every method also takes and returns token
ids (lists of ints, indices of ``vocab.json``) for a tokenizer of your own. docs/using-models.md#without-fairseq
shows them, with a fine-tuning loop.
"""
import functools
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..modules import Glu, Gtu, MaskedLMHead, TnnLayer
from ..modules.layers import layer_spectra
from ..modules.tno import tno_class
from ..ops.logits import vocab_linear
from .safetensors import load_file, save_file
from .tokenizers import load_tokenizer

FORMAT = "fairseq-tnn"
FORMAT_VERSION = 1
CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE = "config.json", "model.safetensors", "vocab.json"
MASK = "<mask>"

Text = Union[str, Sequence[int]]


def inference(method):
    """A method that runs the model without gradients and in evaluation mode (no dropout), whatever mode the model
    is in (a fine-tuning loop's training mode comes back afterwards)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                return method(self, *args, **kwargs)
        finally:
            self.train(was_training)
    return wrapper


def is_exported(folder) -> bool:
    """Whether ``folder`` holds an exported model (its config.json names this format)."""
    try:
        return json.loads((Path(folder) / CONFIG_FILE).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


class Vocabulary:
    """The model's symbols (index i: symbol i) and its special symbols, as fairseq's Dictionary holds them."""

    def __init__(self, symbols: List[str], bos: int, pad: int, eos: int, unk: int, mask: Optional[int] = None):
        self.symbols = list(symbols)
        self.index = {s: i for i, s in enumerate(self.symbols)}
        self.bos, self.pad, self.eos, self.unk, self.mask = bos, pad, eos, unk, mask

    def __len__(self) -> int:
        return len(self.symbols)

    @property
    def specials(self) -> List[int]:
        """The indices never proposed as words: fairseq's 4 special symbols (and <mask>)."""
        return sorted({self.bos, self.pad, self.eos, self.unk} | ({self.mask} if self.mask is not None else set()))

    def encode(self, symbols: Sequence[str]) -> List[int]:
        return [self.index.get(s, self.unk) for s in symbols]

    def decode(self, ids: Sequence[int]) -> List[str]:
        """The symbols of ``ids`` without <s>, <pad> and </s> (as fairseq's Dictionary.string)."""
        skip = {self.bos, self.pad, self.eos}
        return [self.symbols[i] for i in ids if i not in skip]

    def to_json(self) -> dict:
        return {"symbols": self.symbols, "bos": self.bos, "pad": self.pad, "eos": self.eos, "unk": self.unk,
                "mask": self.mask}

    @classmethod
    def from_json(cls, d: dict) -> "Vocabulary":
        return cls(d["symbols"], d["bos"], d["pad"], d["eos"], d["unk"], d.get("mask"))


def build_layers(config: dict, causal: bool) -> nn.ModuleList:
    """The stack of TNN layers a config describes, as the fairseq models build it (models/blocks.py)."""
    dim = config["embed_dim"]
    tno_cls = tno_class(config["tno_type"])
    settings = tno_cls.checked_settings(causal, **config["tno"])
    extra = {"training_length": config.get("training_length")} if tno_cls.uses_training_length else {}
    layers = []
    for _ in range(config["layers"]):
        d1 = config["expand_ratio"] * dim
        gtu = Gtu(dim, d1, tno_cls(d1, causal, settings, **extra), activation=config["gtu_activation"])
        glu = Glu(dim, config["glu_dim"] or dim, activation=config["glu_activation"])
        layers.append(TnnLayer(dim, gtu, glu, norm_type=config["norm_type"],
                               normalize_before=config["norm_position"] == "pre", dropout=config["dropout"]))
    return nn.ModuleList(layers)


def _embedding(vocab: Vocabulary, dim: int) -> nn.Embedding:
    return nn.Embedding(len(vocab), dim, padding_idx=vocab.pad)


class CausalStack(nn.Module):
    """The causal model's ``decoder`` (fairseq_tnn.models.tnn_lm.TnnDecoder without fairseq): the same
    submodules and state_dict keys, the same full forward and the same per-layer incremental cache."""

    def __init__(self, config: dict, vocab: Vocabulary):
        super().__init__()
        dim = config["embed_dim"]
        self.padding_idx = vocab.pad
        self.embed_tokens = _embedding(vocab, dim)
        self.embed_scale = 1.0 if config["no_scale_embedding"] else math.sqrt(dim)
        self.dropout = nn.Dropout(config["dropout"])
        self.layers = build_layers(config, causal=True)
        self.final_norm = nn.LayerNorm(dim) if config["norm_position"] == "pre" else None
        self.output_projection = None if config["share_input_output_embed"] else nn.Linear(dim, len(vocab), bias=False)

    def output_layer(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.output_projection is None else self.output_projection.weight
        return vocab_linear(x, weight)

    def forward(self, tokens: torch.Tensor, kernel_length: Optional[int] = None) -> torch.Tensor:
        """Logits (b, n, vocab) of the next token at every position of ``tokens`` (b, n). As the fairseq decoder:
        in evaluation, padding is masked out of the token mixing; ``kernel_length``, for a TNO whose kernel
        depends on the length (FD), applies the kernel of that many positions (a planned generation's)."""
        pad_mask = None
        if not self.training:
            pad_mask = tokens.eq(self.padding_idx)
            if not pad_mask.any():
                pad_mask = None
        x = self.dropout(self.embed_scale * self.embed_tokens(tokens))  # (b, n, d)
        # the layers' spectra, computed together while training (their RPEs as one batched MLP), as in the fairseq models
        spectra = layer_spectra(self.layers, x.shape[1], kernel_length, x.device, x.dtype)
        for layer, spectrum in zip(self.layers, spectra):
            x = layer(x, pad_mask, kernel_length, spectrum)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.output_layer(x)

    def step(self, tokens: torch.Tensor, caches, start: int) -> torch.Tensor:
        """Incremental decoding: the logits of positions start .. start + c - 1, ``tokens`` (b, c) being those
        positions' tokens; ``caches`` (one per layer, ``TnnLayer.init_cache``) hold positions 0 .. start - 1."""
        pad_mask = tokens.eq(self.padding_idx)
        if not pad_mask.any():
            pad_mask = None
        x = self.dropout(self.embed_scale * self.embed_tokens(tokens))  # (b, c, d)
        for layer, cache in zip(self.layers, caches):
            x = layer.step(x, pad_mask, cache, start)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.output_layer(x)


class BidirectionalStack(nn.Module):
    """The masked model's ``encoder`` (fairseq_tnn.models.tnn_mlm.TnnEncoder without fairseq), eager."""

    def __init__(self, config: dict, vocab: Vocabulary):
        super().__init__()
        dim = config["embed_dim"]
        self.padding_idx = vocab.pad
        self.embed_tokens = _embedding(vocab, dim)
        self.embed_scale = 1.0 if config["no_scale_embedding"] else math.sqrt(dim)
        self.layernorm_embedding = nn.LayerNorm(dim) if config["layernorm_embedding"] else None
        self.dropout = nn.Dropout(config["dropout"])
        self.layers = build_layers(config, causal=False)
        self.final_norm = nn.LayerNorm(dim) if config["norm_position"] == "pre" else None
        self.lm_head = MaskedLMHead(dim, self.embed_tokens.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (b, n, vocab) of the token at every position of ``tokens`` (b, n), seen from both sides."""
        pad_mask = tokens.eq(self.padding_idx)
        if not self.training and not pad_mask.any():
            pad_mask = None
        x = self.embed_scale * self.embed_tokens(tokens)  # (b, n, d)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = self.dropout(x)
        for layer, spectrum in zip(self.layers, layer_spectra(self.layers, x.shape[1], None, x.device, x.dtype)):
            x = layer(x, pad_mask, None, spectrum)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.lm_head(x)


class TnnPretrained(nn.Module):
    """What the causal and the masked model share: the config, vocabulary and tokenizer, loading and saving."""

    model_type = ""
    # state_dict keys that name a tensor stored under another key (tied weights): written once
    tied: Dict[str, str] = {}

    def __init__(self, config: dict, vocab: Vocabulary, tokenizer=None, tokenizer_dir: Optional[Path] = None):
        super().__init__()
        if config.get("model_type") != self.model_type:
            raise ValueError(f"this config describes a {config.get('model_type')} model, not a {self.model_type} one: "
                             f"load it with {CLASSES.get(config.get('model_type'), TnnPretrained).__name__}")
        self.config, self.vocab, self.tokenizer = dict(config), vocab, tokenizer
        self.tokenizer_dir = tokenizer_dir

    # ---------------------------------------------------------------- loading and saving
    @classmethod
    def from_pretrained(cls, folder, device="cpu", dtype: torch.dtype = torch.float32):
        """The model exported to ``folder`` (config.json, model.safetensors, vocab.json, tokenizer files), in
        evaluation mode, its floating-point weights in ``dtype`` on ``device`` (under a 16-bit ``dtype`` the RPEs'
        weights stay fp32, as in training: fairseq_tnn/modules/rpe.py)."""
        folder = Path(folder)
        for name in (CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE):
            if not (folder / name).is_file():
                raise FileNotFoundError(f"{folder} holds no {name}: not an exported model folder (python -m "
                                        "fairseq_tnn export CHECKPOINT DIR writes one)")
        config = json.loads((folder / CONFIG_FILE).read_text())
        if config.get("format") != FORMAT or config.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{folder / CONFIG_FILE} is not a {FORMAT} config of version {FORMAT_VERSION} (format "
                             f"{config.get('format')!r}, version {config.get('format_version')!r})")
        vocab = Vocabulary.from_json(json.loads((folder / VOCAB_FILE).read_text(encoding="utf-8")))
        tokenizer = load_tokenizer(config.get("tokenizer"), folder)
        model = CLASSES[config["model_type"]] if cls is TnnPretrained else cls
        model = model(config, vocab, tokenizer, folder if tokenizer is not None else None)
        state, _ = load_file(folder / WEIGHTS_FILE)
        model.load_weights(state)
        return model.to(device=device, dtype=dtype).eval()

    def load_weights(self, state: Dict[str, torch.Tensor]) -> None:
        """Load ``state`` (the exported keys: tied weights under one key), every key used, none missing."""
        state = dict(state)
        for alias, key in self.tied.items():
            if alias in state:
                raise ValueError(f"the weights hold {alias}, which is tied to {key} and must not be stored")
            state[alias] = state[key]
        own = self.state_dict()
        for key, value in state.items():
            if key in own and own[key].is_floating_point():
                state[key] = value.to(own[key].dtype)
        self.load_state_dict(state, strict=True)

    def save_pretrained(self, folder) -> None:
        """Write this model to ``folder`` in the format ``from_pretrained`` reads (its weights in their current
        dtype, moved to the CPU). ``folder`` must be new, empty, or hold an exported model, which is replaced
        (the folder it was loaded from, say); each file is written whole and then renamed into place."""
        folder = Path(folder)
        check_destination(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v for k, v in self.state_dict().items() if k not in self.tied}
        files = {CONFIG_FILE: lambda p: p.write_text(json.dumps(self.config, indent=2) + "\n"),
                 VOCAB_FILE: lambda p: p.write_text(json.dumps(self.vocab.to_json(), ensure_ascii=False) + "\n",
                                                    encoding="utf-8"),
                 WEIGHTS_FILE: lambda p: save_file(state, p, {"format": FORMAT})}
        if self.tokenizer is not None and self.tokenizer_dir is not None:
            for name in self.tokenizer.files:
                src = self.tokenizer_dir / name
                if not (folder / name).exists() or not os.path.samefile(src, folder / name):
                    files[name] = lambda p, src=src: shutil.copyfile(src, p)
        write_files(folder, files)

    # ---------------------------------------------------------------- text and ids
    def tokens(self, text: Text) -> List[int]:
        """Token ids of ``text``: a string, encoded with the exported tokenizer and mapped to the vocabulary
        (unknown symbols: <unk>); a sequence of ints is taken as ids as it is."""
        if isinstance(text, str):
            if self.tokenizer is None:
                raise ValueError("this model was exported without a tokenizer: pass token ids (ints) instead of text")
            return self.vocab.encode(self.tokenizer.encode(text))
        ids = [int(i) for i in text]
        bad = [i for i in ids if not 0 <= i < len(self.vocab)]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0 .. {len(self.vocab) - 1})")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of token ids (<s>, <pad>, </s> dropped), as fairseq's decode gives it."""
        if self.tokenizer is None:
            raise ValueError("this model was exported without a tokenizer: it returns token ids only")
        return self.tokenizer.decode(self.vocab.decode([int(i) for i in ids]))

    @property
    def device(self) -> torch.device:
        return self.stack.embed_tokens.weight.device


class TnnForCausalLM(TnnPretrained):
    """A causal TNN / FD-TNN language model (an exported ``tnn_lm_*``): ``forward(tokens)`` gives logits,
    ``score`` per-token log-probabilities, ``perplexity`` fairseq-eval-lm's figure, ``generate`` a continuation
    (greedy, top-k or top-p sampling) with the layers' exact incremental cache."""

    model_type = "causal"

    def __init__(self, config: dict, vocab: Vocabulary, tokenizer=None, tokenizer_dir: Optional[Path] = None):
        super().__init__(config, vocab, tokenizer, tokenizer_dir)
        self.decoder = CausalStack(config, vocab)

    @property
    def stack(self) -> CausalStack:
        return self.decoder

    def forward(self, tokens: torch.Tensor, kernel_length: Optional[int] = None) -> torch.Tensor:
        """tokens (b, n) -> logits (b, n, vocab): at position t, the distribution of the token t + 1."""
        return self.decoder(tokens, kernel_length)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy (base e) of predicting tokens[:, 1:] from the ones before them, <pad>
        ignored: the training loss (fairseq's cross_entropy criterion, per token)."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), ignore_index=self.vocab.pad)

    def batch(self, texts: Sequence[Text]) -> torch.Tensor:
        """Texts (or id lists) as a training batch (b, n): each </s> + its tokens + </s> (a line as fairseq
        binarises it, after the </s> that ends the line before), right-padded with <pad>."""
        rows = [[self.vocab.eos, *self.tokens(t), self.vocab.eos] for t in texts]
        n = max(len(r) for r in rows)
        return torch.tensor([r + [self.vocab.pad] * (n - len(r)) for r in rows], device=self.device)

    @inference
    def score(self, text: Text) -> Dict[str, object]:
        """The log-probability (base e) of each token of ``text`` given the ones before it, the first given the
        start of a line (</s>), and of the </s> that ends the line: {"tokens": ids (the text's, then </s>),
        "log_probs": tensor of as many, "perplexity": exp of minus their mean}."""
        ids = self.tokens(text)
        if not ids:
            raise ValueError("empty text: score needs at least one token")
        target = torch.tensor([*ids, self.vocab.eos], device=self.device)
        source = torch.cat([target.new_tensor([self.vocab.eos]), target[:-1]])
        logp = self(source.unsqueeze(0))[0].float().log_softmax(-1).gather(-1, target.unsqueeze(-1))[:, 0]
        return {"tokens": target.tolist(), "log_probs": logp.cpu(), "perplexity": math.exp(-logp.mean().item())}

    @inference
    def perplexity(self, text: Union[str, Sequence[str], Sequence[int]], tokens_per_sample: Optional[int] = None,
                   batch_size: int = 8) -> float:
        """The perplexity of a corpus as ``fairseq-eval-lm`` scores a split of it (``--sample-break-mode none``,
        ``--context-window 0``): every line (of a string, split at newlines, or a list of lines) encoded and
        ended by </s>, the lines' tokens concatenated and cut into blocks of ``tokens_per_sample`` (default: the
        training length) whose every token is scored given the block's tokens before it and the one before the
        block (</s> for the first); exp of the mean negative log-likelihood. A list of ints is taken as the
        corpus's token ids, line ends included. Blocks are run ``batch_size`` at a time, each right-padded to the
        block length (as fairseq-eval-lm batches them)."""
        n = tokens_per_sample or self.config.get("training_length")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"tokens_per_sample={n!r} is invalid: must be an integer >= 1")
        if isinstance(text, str):
            lines = text.split("\n")
            ids = corpus_ids(self, lines[:-1] if text.endswith("\n") else lines)
        elif len(text) and all(isinstance(t, str) for t in text):
            ids = corpus_ids(self, text)
        else:
            ids = self.tokens(text)
        if not ids:
            raise ValueError("empty corpus: perplexity needs at least one token")
        stream = torch.tensor([self.vocab.eos, *ids], device=self.device)
        total, count = 0.0, 0
        starts = list(range(0, len(ids), n))
        for i in range(0, len(starts), batch_size):
            chunk = starts[i:i + batch_size]
            source = torch.full((len(chunk), min(n, len(ids))), self.vocab.pad, device=self.device)
            target = torch.full_like(source, self.vocab.pad)
            for row, s in enumerate(chunk):
                e = min(s + n, len(ids))
                source[row, :e - s] = stream[s:e]
                target[row, :e - s] = stream[s + 1:e + 1]
            logp = self(source).float().log_softmax(-1)
            keep = target.ne(self.vocab.pad)
            total -= logp.gather(-1, target.unsqueeze(-1))[..., 0][keep].sum().item()
            count += int(keep.sum())
        return math.exp(total / count)

    @inference
    def generate(self, prompt: Text, max_new_tokens: int = 50, sampling: bool = False, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, temperature: float = 1.0, seed: Optional[int] = None):
        """A continuation of ``prompt``, at most ``max_new_tokens`` tokens, ending early where the model ends the
        line (</s>). Greedy (the most likely token at each step, as fairseq's --beam 1), or with ``sampling``
        drawn from the distribution, restricted to the ``top_k`` most likely tokens and/or the smallest set whose
        probability reaches ``top_p`` (nucleus), logits divided by ``temperature``; ``seed`` makes a draw
        repeatable. <pad> is never produced. Returns the prompt and its continuation as text for a text prompt,
        the continuation's token ids for ids.

        Decoding is incremental and exact: each layer caches its TNO inputs and applies the causal time kernel of
        the planned length (prompt + max_new_tokens + the leading </s>), which is what the full forward of that
        length applies (fairseq's generator plans the same length from --max-len-b)."""
        ids = self.tokens(prompt)
        if not ids:
            raise ValueError("empty prompt: a language model continues a text of at least one token")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid: must be an integer >= 1")
        if not sampling and (top_k is not None or top_p is not None or temperature != 1.0 or seed is not None):
            raise ValueError("top_k, top_p, temperature and seed apply to sampling: pass sampling=True with them "
                             "(greedy search takes none)")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k={top_k!r} is invalid: must be an integer >= 1 (or None: no limit)")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={top_p!r} is invalid: must be in (0, 1] (or None: no limit)")
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} is invalid: must be > 0")
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        tokens = torch.tensor([[self.vocab.eos, *ids]], device=self.device)  # (1, 1 + prompt)
        capacity = tokens.shape[1] + max_new_tokens
        layers = self.decoder.layers
        if all(layer.supports_incremental for layer in layers):
            caches = [layer.init_cache(1, capacity, self.device) for layer in layers]
            next_logits = lambda toks, start: self.decoder.step(toks[:, start:], caches, start)[:, -1]  # noqa: E731
        else:  # a TNO type without a decoding kernel: the full forward of the prefix at every step
            next_logits = lambda toks, start: self.decoder(toks, capacity)[:, -1]  # noqa: E731
        out, start = [], 0
        for _ in range(max_new_tokens):
            logits = next_logits(tokens, start).float()[0]  # (vocab,)
            start = tokens.shape[1]
            logits[self.vocab.pad] = -math.inf
            token = pick(logits, sampling, top_k, top_p, temperature, generator)
            if token == self.vocab.eos:
                break
            out.append(token)
            tokens = torch.cat([tokens, tokens.new_tensor([[token]])], dim=1)
        return self.detokenize(ids + out) if isinstance(prompt, str) else out


def pick(logits: torch.Tensor, sampling: bool, top_k: Optional[int], top_p: Optional[float], temperature: float,
         generator: Optional[torch.Generator]) -> int:
    """The next token from the logits (vocab,): their argmax, or a draw as ``generate`` describes."""
    if not sampling:
        return int(logits.argmax())
    probs = (logits / temperature).softmax(-1)
    order = probs.argsort(descending=True)
    sorted_probs = probs[order]
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k is not None:
        keep[top_k:] = False
    if top_p is not None:
        # the smallest set of most likely tokens whose probability reaches top_p: each token whose predecessors'
        # sum is still below it
        before = sorted_probs.cumsum(0) - sorted_probs
        keep &= before < top_p
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    return int(order[torch.multinomial(kept / kept.sum(), 1, generator=generator)])


def corpus_ids(model: TnnPretrained, lines: Sequence[str]) -> List[int]:
    """A corpus's token ids as fairseq-preprocess binarises it: each line's tokens, then </s>."""
    ids = []
    for line in lines:
        ids.extend(model.tokens(line))
        ids.append(model.vocab.eos)
    return ids


class TnnForMaskedLM(TnnPretrained):
    """A bidirectional TNN / FD-TNN / SKI-TNN masked language model (an exported ``tnn_mlm_*``):
    ``forward(tokens)`` gives logits at every position, ``fill_mask`` the likeliest fillings of a <mask>."""

    model_type = "masked"
    tied = {"encoder.lm_head.weight": "encoder.embed_tokens.weight"}

    def __init__(self, config: dict, vocab: Vocabulary, tokenizer=None, tokenizer_dir: Optional[Path] = None):
        super().__init__(config, vocab, tokenizer, tokenizer_dir)
        if vocab.mask is None:
            raise ValueError(f"a masked model's vocabulary needs a {MASK} symbol")
        self.encoder = BidirectionalStack(config, vocab)

    @property
    def stack(self) -> BidirectionalStack:
        return self.encoder

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (b, n) -> logits (b, n, vocab) of the token at each position."""
        return self.encoder(tokens)

    @inference
    def fill_mask(self, text: Union[str, Sequence[int]], topk: int = 5) -> List[Tuple[object, float, object]]:
        """The ``topk`` likeliest fillings of the one <mask> of ``text``, best first, each (filled text,
        probability, the token as text with its leading space where it starts a word), as the fairseq hub
        interface's fill_mask; the special symbols are never proposed. Token ids in (one of them the vocabulary's
        <mask>, the sequence as the model is to see it: <s> ... </s>), ids out: (filled ids, probability, id)."""
        if isinstance(text, str):
            if text.count(MASK) != 1:
                raise ValueError(f"fill_mask needs a text with exactly one {MASK}, e.g. 'The {MASK} of Egypt'; got "
                                 f"{text.count(MASK) or 'none'} in {text!r}")
            left, right = (self.tokens(span.strip()) for span in text.split(MASK))
            ids = [self.vocab.bos, *left, self.vocab.mask, *right, self.vocab.eos]
        else:
            ids = self.tokens(text)
            if ids.count(self.vocab.mask) != 1:
                raise ValueError(f"fill_mask needs exactly one <mask> id ({self.vocab.mask}) among the token ids; got "
                                 f"{ids.count(self.vocab.mask) or 'none'}")
        specials = self.vocab.specials
        words = len(self.vocab) - len(specials)
        if not isinstance(topk, int) or not 1 <= topk <= words:
            raise ValueError(f"topk={topk!r} is invalid: must be an integer from 1 to the number of words {words}")
        position = ids.index(self.vocab.mask)
        probs = self(torch.tensor([ids], device=self.device))[0, position].float().softmax(-1)
        probs[specials] = 0.0  # the model's probabilities of the words, not renormalised
        values, indices = probs.topk(topk)
        out = []
        for p, idx in zip(values.tolist(), indices.tolist()):
            filled = list(ids)
            filled[position] = idx
            if not isinstance(text, str):
                out.append((filled, p, idx))
                continue
            word = self.detokenize([idx])
            if self.tokenizer.kind == "sentencepiece" and self.vocab.symbols[idx].startswith("\u2581"):
                word = " " + word
            out.append((self.detokenize(filled), p, word))
        return out


CLASSES = {"causal": TnnForCausalLM, "masked": TnnForMaskedLM}


def from_pretrained(folder, device="cpu", dtype: torch.dtype = torch.float32) -> TnnPretrained:
    """The exported model of ``folder``, a TnnForCausalLM or a TnnForMaskedLM as its config says."""
    return TnnPretrained.from_pretrained(folder, device, dtype)


def check_destination(folder: Path) -> None:
    """Refuse a destination that exists and holds something other than an exported model."""
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder} is a file, not a directory")
    if folder.is_dir() and any(folder.iterdir()) and not is_exported(folder):
        first = sorted(p.name for p in folder.iterdir())[:3]
        raise FileExistsError(f"{folder} holds other files ({', '.join(first)}{', ...' if len(first) == 3 else ''}), "
                              "not an exported model: choose a new or empty directory")


def write_files(folder: Path, files) -> None:
    """Each of ``files`` (name -> function writing a path) written under a temporary name in ``folder``, then
    renamed into place; config.json last, so that a folder is an exported model only once it is complete."""
    names = sorted(files, key=lambda n: n == CONFIG_FILE)
    umask = os.umask(0)
    os.umask(umask)
    for name in names:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
        os.close(fd)
        try:
            files[name](Path(tmp))
            os.chmod(tmp, 0o666 & ~umask)  # as an ordinary file (mkstemp's are private)
            os.replace(tmp, folder / name)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


__all__ = ["TnnForCausalLM", "TnnForMaskedLM", "TnnPretrained", "Vocabulary", "from_pretrained", "is_exported"]
