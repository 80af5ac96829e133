"""Causal TNN language model, registered as ``tnn_lm``.

Its decoder is a ``FairseqIncrementalDecoder``: fairseq's sequence generator (fairseq-interactive,
fairseq-generate, the hub interface's ``sample``/``generate``) then feeds it one new token per step
and it keeps, per layer, the TNO inputs v of the positions decoded so far, so that a step costs the
per-token layers once plus one Toeplitz sum sum_{s <= t} k[t - s] v_s per layer, with the time kernel
k computed once per generation (``docs/using-models.md``). The decoder talks to its layers only
(``TnnLayer.init_cache`` / ``step``); a TNO type that cannot decode incrementally (its class says
``supports_incremental = False``) is decoded by the full forward of the whole prefix at every step.
"""
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from fairseq.models import FairseqIncrementalDecoder, FairseqLanguageModel, register_model, register_model_architecture
from fairseq.models.transformer import Embedding
from torch import nn

from .blocks import build_layers
from .compile import compile_per_config, run_layers
from ..modules.tno import TnoSettings
from ..ops.logits import vocab_linear
from .config import TnnBlockConfig, add_compile_choices, set_defaults, validate_block_config
from .trainer_calls import TrainerCalls

# A TNN has no positional limit: report a bound no dataset reaches, so fairseq
# never drops a long evaluation block because of the model.
UNLIMITED_POSITIONS = 10 ** 9
# Kernel length (and cache capacity) of an incremental generation nobody planned (see set_decoding_length).
MIN_DECODING_LENGTH = 64


def check_decoding_length(length: Optional[int]) -> None:
    if length is not None and (not isinstance(length, int) or length < 1):
        raise ValueError(f"decoding length must be an integer >= 1 or None, got {length!r}")


@dataclass
class TnnLmConfig(TnnBlockConfig):
    decoder_embed_dim: int = field(default=512, metadata={"help": "embedding (model) dimension"})
    decoder_layers: int = field(default=7, metadata={"help": "number of TNN layers"})
    share_decoder_input_output_embed: bool = field(default=False, metadata={"help": "tie the input and output embeddings"})
    no_scale_embedding: bool = field(default=False, metadata={"help": "do not scale the embeddings by sqrt(dim)"})


class TnnDecoder(FairseqIncrementalDecoder):
    def __init__(self, cfg: TnnLmConfig, dictionary, tno_settings: TnoSettings):
        super().__init__(dictionary)
        dim = cfg.decoder_embed_dim
        self.padding_idx = dictionary.pad()
        self.embed_tokens = Embedding(len(dictionary), dim, self.padding_idx)
        self.embed_scale = 1.0 if cfg.no_scale_embedding else math.sqrt(dim)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = build_layers(cfg, dim, cfg.decoder_layers, True, tno_settings)
        # fairseq's usual final LayerNorm after a pre-norm stack
        self.final_norm = nn.LayerNorm(dim) if str(cfg.norm_position) == "pre" else None
        if cfg.share_decoder_input_output_embed:
            self.output_projection = None
        else:
            self.output_projection = nn.Linear(dim, len(dictionary), bias=False)
            nn.init.normal_(self.output_projection.weight, mean=0, std=dim ** -0.5)
        self.decoding_length: Optional[int] = None
        # Whether every layer decodes incrementally (its TNO gives a causal time kernel); if not, incremental
        # calls run the full forward of the whole prefix (correct, a full forward per generated token).
        self.incremental = all(layer.supports_incremental for layer in self.layers)

    def set_decoding_length(self, length: Optional[int]):
        """Plan a generation of up to ``length`` tokens (None: no plan). The task does this around
        every ``inference_step`` from the generator's --max-len-a/--max-len-b (fairseq's generator calls
        the decoder with the tokens and the incremental state only); the decoder's calls then default their
        ``kernel_length`` to it.

        The incremental cache then computes each layer's time kernel once, for ``length`` positions.
        A TNO whose kernel depends on the sequence length (FD) also uses the kernel of ``length``
        positions in the full forward (the layers pass ``kernel_length`` down to it), so that a
        generation's log-probabilities are those of one causal model whether cached or not (the full
        forward of the sequence right-padded to ``length`` gives the same). Without a plan, the cache
        starts at max(T, 64) positions and doubles when outgrown; for FD, outgrowing it recomputes the
        cache with the longer kernel."""
        check_decoding_length(length)
        self.decoding_length = length

    def _kernel_length(self, kernel_length: Optional[int]) -> Optional[int]:
        """A call's ``kernel_length``: checked, or ``decoding_length`` where None."""
        if kernel_length is None:
            return self.decoding_length
        check_decoding_length(kernel_length)
        return kernel_length

    def _pad_mask(self, tokens: torch.Tensor) -> Optional[torch.Tensor]:
        """Padding (e.g. on the left of a short prompt) must never mix into real positions. Training batches are
        padded on the right only, which a causal model never sees from a real position, so training skips the mask
        and the host sync of pad_mask.any() (a stall per update on a GPU): None then, and where nothing is padding."""
        if self.training:
            return None
        pad_mask = tokens.eq(self.padding_idx)
        return pad_mask if pad_mask.any() else None

    def stack_input(self, tokens: torch.Tensor) -> torch.Tensor:
        """The layers' input for ``tokens`` (b, n): the scaled embeddings, after dropout (b, n, d)."""
        return self.dropout(self.embed_scale * self.embed_tokens(tokens))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The decoder's features from the last layer's output ``x``: the final norm, where there is one."""
        return x if self.final_norm is None else self.final_norm(x)

    def stack_output(self, x: torch.Tensor) -> torch.Tensor:
        """The logits from the last layer's output ``x``: the final norm, then the output layer."""
        return self.output_layer(self.features(x))

    def extract_features(self, prev_output_tokens: torch.Tensor, return_all_hiddens: bool = False,
                         incremental_state: Optional[Dict[str, Dict[str, Optional[torch.Tensor]]]] = None,
                         kernel_length: Optional[int] = None):
        """``kernel_length``: the planned length of a generation (None: ``decoding_length``, the plan
        ``set_decoding_length`` made, if any), the capacity of a new incremental cache and, for a TNO
        whose kernel depends on the length, the length of the kernel it applies."""
        kernel_length = self._kernel_length(kernel_length)
        if incremental_state is not None:
            x = self._extract_features_cached(prev_output_tokens, incremental_state, kernel_length)
            return x, {"attn": [None], "inner_states": None}
        x = self.stack_input(prev_output_tokens)  # (b, n, d)
        inner_states = [x] if return_all_hiddens else None
        # the layers, each handed its spectrum (computed together while training: their RPEs as one batched MLP), or
        # the stack as one CUDA graph (see run_layers)
        x = run_layers(self.layers, x, self._pad_mask(prev_output_tokens), kernel_length, inner_states)
        return self.features(x), {"attn": [None], "inner_states": inner_states}

    def _extract_features_cached(self, tokens: torch.Tensor, incremental_state,
                                 kernel_length: Optional[int]) -> torch.Tensor:
        """Features of the positions of ``tokens`` (b, T) not yet decoded (one per step under fairseq's
        generator; all T on the first call or after a reset). Where a layer's TNO cannot decode incrementally
        (``TnnLayer.supports_incremental``), they are those of the full forward of all T tokens."""
        b, total = tokens.shape
        state = self.get_incremental_state(incremental_state, "tnn_cache")
        if state is not None and state["layers"] is not None and total > state["capacity"]:
            state = self._grow(state, total)
        if state is None:
            capacity = max(total, kernel_length or max(total, MIN_DECODING_LENGTH))
            caches = None
            if self.incremental:
                caches = [layer.init_cache(b, capacity, tokens.device) for layer in self.layers]
            state = {"length": 0, "capacity": capacity, "layers": caches}
        start = state["length"]
        if total <= start:
            raise ValueError(f"incremental decoding got {total} tokens but has already decoded {start}: "
                             "pass the whole prefix, one or more tokens longer than at the previous call")
        if state["layers"] is None:
            x = self.extract_features(tokens, kernel_length=kernel_length)[0][:, start:]
        else:
            new = tokens[:, start:]
            pad_mask = new.eq(self.padding_idx)
            if not pad_mask.any():
                pad_mask = None
            x = self.stack_input(new)  # (b, c, d)
            for layer, cache in zip(self.layers, state["layers"]):
                x = layer.step(x, pad_mask, cache, start)
            x = self.features(x)
        state["length"] = total
        self.set_incremental_state(incremental_state, "tnn_cache", state)
        return x

    def _grow(self, state, total: int):
        """A cache outgrown: double it (at least to ``total``). Where a layer's kernel depends on the length
        (FD), the cached inputs were computed with the old kernel: start again (None)."""
        capacity = max(2 * state["capacity"], total)
        used = state["length"]
        caches = [layer.grow_cache(cache, capacity, used) for layer, cache in zip(self.layers, state["layers"])]
        if any(cache is None for cache in caches):
            return None
        return {"length": used, "capacity": capacity, "layers": caches}

    def reorder_incremental_state(self, incremental_state, new_order: torch.Tensor):
        """Beam search: keep the cached rows of the hypotheses that survive, in their new order."""
        state = self.get_incremental_state(incremental_state, "tnn_cache")
        if state is None or state["layers"] is None:
            return
        batch = state["layers"][0].batch
        if new_order.numel() == batch and bool((new_order == torch.arange(batch, device=new_order.device)).all()):
            return  # nothing moves (fairseq asks at every step, also for beam 1): no copy of the cache
        state["layers"] = [cache.reordered(new_order, state["length"]) for cache in state["layers"]]
        self.set_incremental_state(incremental_state, "tnn_cache", state)

    def output_layer(self, features: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.output_projection is None else self.output_projection.weight
        return vocab_linear(features, weight)  # its GEMMs aligned on a GPU for any vocabulary size

    def forward(self, prev_output_tokens, src_lengths=None, features_only: bool = False,
                return_all_hiddens: bool = False, incremental_state=None, kernel_length: Optional[int] = None,
                **kwargs):
        if features_only or return_all_hiddens or incremental_state is not None:
            x, extra = self.extract_features(prev_output_tokens, return_all_hiddens, incremental_state, kernel_length)
            return (x if features_only else self.output_layer(x)), extra
        # the tokens to the logits in one call of the models' loop, which, where the stack's CUDA graphs run (a
        # training forward on a GPU), computes the embedding and the output layer inside them too (run_layers' edges)
        x = run_layers(self.layers, prev_output_tokens, self._pad_mask(prev_output_tokens),
                       self._kernel_length(kernel_length), edges=self)
        return x, {"attn": [None], "inner_states": None}

    def max_positions(self):
        return UNLIMITED_POSITIONS


@contextmanager
def decoding_length(models, length: Optional[int]):
    """``set_decoding_length(length)`` on every TNN decoder among ``models`` for the duration."""
    decoders = [m.decoder for m in models if isinstance(getattr(m, "decoder", None), TnnDecoder)]
    before = [d.decoding_length for d in decoders]
    try:
        for d in decoders:
            d.set_decoding_length(length)
        yield
    finally:
        for d, old in zip(decoders, before):
            d.set_decoding_length(old)


@register_model("tnn_lm", dataclass=TnnLmConfig)
class TnnLanguageModel(TrainerCalls, FairseqLanguageModel):
    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_compile_choices(parser)

    @classmethod
    def from_pretrained(cls, model_name_or_path, checkpoint_file="checkpoint_best.pt", data_name_or_path=".",
                        **kwargs):
        """A trained checkpoint as fairseq's generator hub interface (``sample``, ``score``,
        ``generate``): see ``fairseq_tnn.hub.TnnLMHubInterface`` and docs/using-models.md."""
        from ..hub import TnnLMHubInterface, load
        return load(cls, TnnLMHubInterface, model_name_or_path, checkpoint_file, data_name_or_path, **kwargs)

    @classmethod
    def build_model(cls, cfg: TnnLmConfig, task):
        tno_settings = validate_block_config(cfg, "decoder_embed_dim", "decoder_layers", causal=True)
        model = cls(TnnDecoder(cfg, task.target_dictionary, tno_settings))
        compile_per_config(cfg, model.decoder.layers, "decoder.layers")
        return model


# The TNO part of a preset is its tno_type's Settings defaults (fairseq_tnn/modules/tno/, the published values)
# plus the overrides a preset names (config.set_defaults).
LM_BASE = dict(
    decoder_embed_dim=512, decoder_layers=7, norm_position="pre", norm_type="simplermsnorm", expand_ratio=3,
    gtu_activation="silu", glu_activation="silu", tno_type="tnn", dropout=0.1, share_decoder_input_output_embed=True,
    no_scale_embedding=False)
TINY = dict(decoder_embed_dim=64, decoder_layers=2, rpe_dim=16, rpe_layers=2, glu_dim=64, dropout=0.0)


def lm_base(args, **preset):
    """Qin et al.'s published causal LM configuration (docs/references.md#published-configurations),
    overridable by any flag."""
    set_defaults(args, **{**LM_BASE, **preset})


@register_model_architecture("tnn_lm", "tnn_lm_wt103")
def tnn_lm_wt103(args):
    """Qin et al.'s Wikitext-103 causal TNN: 7 x 512, RPE 64 x 6, decay 0.99 (48.68M params)."""
    lm_base(args)


@register_model_architecture("tnn_lm", "tnn_lm_wt103_rpe3")
def tnn_lm_wt103_rpe3(args):
    """The 3-layer-RPE TNN baseline the SKI paper compares FD-TNN against."""
    lm_base(args, rpe_layers=3)


@register_model_architecture("tnn_lm", "fd_tnn_lm_wt103")
def fd_tnn_lm_wt103(args):
    """The SKI paper's causal FD-TNN (val/test ppl 23.97 / 24.56): RPE of the frequency, 3 layers, no decay."""
    lm_base(args, tno_type="fd")


@register_model_architecture("tnn_lm", "tnn_lm_tiny")
def tnn_lm_tiny(args):
    """A small TNN LM for tests and the CPU demo."""
    lm_base(args, **TINY)


@register_model_architecture("tnn_lm", "fd_tnn_lm_tiny")
def fd_tnn_lm_tiny(args):
    """A small causal FD-TNN for tests and the CPU demo."""
    lm_base(args, **TINY, tno_type="fd")
