"""Hub interfaces: trained TNN models from Python, the way fairseq's own models are used.

``TnnLanguageModel.from_pretrained(checkpoint_dir, "checkpoint_best.pt", data_dir, bpe="sentencepiece",
sentencepiece_model=...)`` returns a :class:`TnnLMHubInterface`: fairseq's ``GeneratorHubInterface``
(``sample``, ``score``, ``generate``, ``encode``/``decode``) whose generation goes through the
``tnn_language_modeling`` task (prompt checks, incremental decoding). ``TnnMaskedLMModel.from_pretrained``
returns a :class:`TnnMaskedLMHubInterface` with ``fill_mask`` as in fairseq's RoBERTa hub interface.
Calling the wrong one (``sample`` on a masked model, ``fill_mask`` on a causal one) is an error naming
the right one.
"""
from typing import List, Tuple

import torch
from fairseq import hub_utils, utils

MASK = "<mask>"

CAUSAL_HAS_NO_MASK = (
    "fill_mask needs a masked (bidirectional) language model, and this is a causal one (tnn_lm): it predicts "
    "the next token from the left context only. Use sample(text) to continue a text or score(text) for per-token "
    "log-probabilities; for fill_mask load a tnn_mlm checkpoint (--task tnn_masked_lm) with "
    "TnnMaskedLMModel.from_pretrained")

MASKED_CANNOT_GENERATE = (
    "{what} needs a causal language model, and this is a masked (bidirectional) one (tnn_mlm): it fills in "
    "a <mask> from both sides, e.g. fill_mask('The <mask> of Egypt', topk=5). To sample, score or generate "
    "text load a tnn_lm checkpoint (--task tnn_language_modeling) with TnnLanguageModel.from_pretrained")


def load(model_cls, hub_cls, model_name_or_path, checkpoint_file, data_name_or_path, **kwargs):
    """fairseq's ``from_pretrained`` loading, wrapped in ``hub_cls``."""
    x = hub_utils.from_pretrained(model_name_or_path, checkpoint_file, data_name_or_path,
                                  archive_map=model_cls.hub_models(), **kwargs)
    models = x["models"]
    if not all(isinstance(m, model_cls) for m in models):
        kinds = sorted({type(m).__name__ for m in models})
        raise ValueError(f"{checkpoint_file} holds a {', '.join(kinds)}, not a {model_cls.__name__}: load it with "
                         f"{kinds[0]}.from_pretrained")
    return hub_cls(x["args"], x["task"], models)


class TnnLMHubInterface(hub_utils.GeneratorHubInterface):
    """fairseq's generator hub interface for a causal TNN language model.

    ``sample(text, beam=1, sampling=True, sampling_topk=10, max_len_b=50)`` returns the prompt and its
    continuation as text; ``score(text)`` a dict with ``positional_scores`` (the log-probability of each
    token given the ones before it, base e) and ``tokens``; ``generate(token_tensors, ...)`` fairseq's
    hypotheses. Keyword arguments are fairseq's generation options (``beam``, ``sampling``,
    ``sampling_topk``, ``sampling_topp``, ``temperature``, ``max_len_b``, ...).
    """

    def fill_mask(self, masked_input: str, topk: int = 5):
        raise ValueError(CAUSAL_HAS_NO_MASK)


class TnnMaskedLMHubInterface(hub_utils.GeneratorHubInterface):
    """Hub interface for a masked TNN: ``fill_mask`` (as fairseq's RoBERTa hub interface), ``encode``,
    ``decode``; generation methods are refused."""

    @property
    def model(self):
        return self.models[0]

    def sample(self, *args, **kwargs):
        raise ValueError(MASKED_CANNOT_GENERATE.format(what="sample"))

    def score(self, *args, **kwargs):
        raise ValueError(MASKED_CANNOT_GENERATE.format(what="score"))

    def generate(self, *args, **kwargs):
        raise ValueError(MASKED_CANNOT_GENERATE.format(what="generate"))

    def fill_mask(self, masked_input: str, topk: int = 5) -> List[Tuple[str, float, str]]:
        """The ``topk`` most likely fillings of the one ``<mask>`` in ``masked_input``, best first:
        (filled text, probability, predicted token as text, with its leading space if it starts a word).
        Candidates are the dictionary's words (special symbols such as </s> are never proposed)."""
        if not isinstance(masked_input, str) or masked_input.count(MASK) != 1:
            found = masked_input.count(MASK) if isinstance(masked_input, str) else "no text"
            raise ValueError(f"fill_mask needs a text with exactly one {MASK}, e.g. 'The {MASK} of Egypt'; "
                             f"got {found if found != 0 else 'none'} in {masked_input!r}")
        mask_idx = self.src_dict.index(MASK)
        specials = sorted({*range(self.src_dict.nspecial), mask_idx})  # <s> <pad> </s> <unk> <mask>: never proposed
        vocab = len(self.src_dict) - len(specials)
        if not isinstance(topk, int) or not 1 <= topk <= vocab:
            raise ValueError(f"topk={topk!r} is invalid: must be an integer from 1 to the number of words {vocab}")
        left, right = masked_input.split(MASK)
        pieces = [self.apply_bpe(self.tokenize(span.strip())) for span in (left, right)]
        line = " ".join(p for p in (self.src_dict.bos_word, pieces[0], MASK, pieces[1], self.src_dict.eos_word) if p)
        tokens = self.src_dict.encode_line(line, append_eos=False, add_if_not_exist=False).long()
        position = int((tokens == mask_idx).nonzero()[0, 0])
        with torch.no_grad(), utils.model_eval(self.model):
            logits, _ = self.model(tokens.unsqueeze(0).to(self.device))
        probs = logits[0, position].float().softmax(dim=-1)
        probs[specials] = 0.0  # the model's probabilities of the words, not renormalised
        values, indices = probs.topk(topk)
        out = []
        for p, idx in zip(values.tolist(), indices.tolist()):
            filled = tokens.clone()
            filled[position] = idx
            piece = self.src_dict[idx]
            word = self.remove_bpe(piece)
            if piece.startswith("\u2581"):  # sentencepiece's word-start mark: the token starts a word
                word = " " + word
            out.append((self.decode(filled[1:-1]), p, word))
        return out
