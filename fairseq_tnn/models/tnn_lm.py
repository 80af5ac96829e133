"""Causal TNN language model, registered as ``tnn_lm``."""
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from fairseq.models import FairseqDecoder, FairseqLanguageModel, register_model, register_model_architecture
from fairseq.models.transformer import Embedding
from torch import nn

from .blocks import build_layers
from .config import TnnBlockConfig, set_defaults, validate_block_config

# A TNN has no positional limit: report a bound no dataset reaches, so fairseq
# never drops a long evaluation block because of the model.
UNLIMITED_POSITIONS = 10 ** 9


@dataclass
class TnnLmConfig(TnnBlockConfig):
    decoder_embed_dim: int = field(default=512, metadata={"help": "embedding (model) dimension"})
    decoder_layers: int = field(default=7, metadata={"help": "number of TNN layers"})
    share_decoder_input_output_embed: bool = field(default=False, metadata={"help": "tie the input and output embeddings"})
    no_scale_embedding: bool = field(default=False, metadata={"help": "do not scale the embeddings by sqrt(dim)"})


class TnnDecoder(FairseqDecoder):
    def __init__(self, cfg: TnnLmConfig, dictionary):
        super().__init__(dictionary)
        dim = cfg.decoder_embed_dim
        self.padding_idx = dictionary.pad()
        self.embed_tokens = Embedding(len(dictionary), dim, self.padding_idx)
        self.embed_scale = 1.0 if cfg.no_scale_embedding else math.sqrt(dim)
        self.dropout = nn.Dropout(cfg.dropout)
        causal = True
        self.layers = build_layers(cfg, dim, cfg.decoder_layers, causal)
        # fairseq's usual final LayerNorm after a pre-norm stack
        self.final_norm = nn.LayerNorm(dim) if str(cfg.norm_position) == "pre" else None
        if cfg.share_decoder_input_output_embed:
            self.output_projection = None
        else:
            self.output_projection = nn.Linear(dim, len(dictionary), bias=False)
            nn.init.normal_(self.output_projection.weight, mean=0, std=dim ** -0.5)

    def extract_features(self, prev_output_tokens: torch.Tensor, return_all_hiddens: bool = False):
        x = self.dropout(self.embed_scale * self.embed_tokens(prev_output_tokens))  # (b, n, d)
        inner_states = [x] if return_all_hiddens else None
        for layer in self.layers:
            x = layer(x)
            if return_all_hiddens:
                inner_states.append(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, {"attn": [None], "inner_states": inner_states}

    def output_layer(self, features: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.output_projection is None else self.output_projection.weight
        return F.linear(features, weight)

    def forward(self, prev_output_tokens, src_lengths=None, features_only: bool = False,
                return_all_hiddens: bool = False, **kwargs):
        x, extra = self.extract_features(prev_output_tokens, return_all_hiddens)
        if not features_only:
            x = self.output_layer(x)
        return x, extra

    def max_positions(self):
        return UNLIMITED_POSITIONS


@register_model("tnn_lm", dataclass=TnnLmConfig)
class TnnLanguageModel(FairseqLanguageModel):
    @classmethod
    def build_model(cls, cfg: TnnLmConfig, task):
        validate_block_config(cfg, "decoder_embed_dim", "decoder_layers", causal=True)
        return cls(TnnDecoder(cfg, task.target_dictionary))


LM_BASE = dict(
    decoder_embed_dim=512, decoder_layers=7, norm_position="pre", norm_type="simplermsnorm", expand_ratio=3,
    gtu_activation="silu", glu_activation="silu", tno_type="tnn", rpe_dim=64, rpe_layers=6, rpe_activation="relu",
    rpe_norm_type="simplermsnorm", decay=0.99, dropout=0.1, share_decoder_input_output_embed=True,
    no_scale_embedding=False)
TINY = dict(decoder_embed_dim=64, decoder_layers=2, rpe_dim=16, rpe_layers=2, glu_dim=64, dropout=0.0)


def lm_base(args, **preset):
    """Published causal LM configuration (FACTS.md section 1), overridable by any flag."""
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
    lm_base(args, tno_type="fd", rpe_layers=3)


@register_model_architecture("tnn_lm", "tnn_lm_tiny")
def tnn_lm_tiny(args):
    """A small TNN LM for tests and the CPU demo."""
    lm_base(args, **TINY)


@register_model_architecture("tnn_lm", "fd_tnn_lm_tiny")
def fd_tnn_lm_tiny(args):
    """A small causal FD-TNN for tests and the CPU demo."""
    lm_base(args, **TINY, tno_type="fd")
