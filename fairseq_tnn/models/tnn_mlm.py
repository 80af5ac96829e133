"""Bidirectional TNN masked language model, registered as ``tnn_mlm``.

Works with fairseq's ``masked_lm`` criterion (forward accepts ``masked_tokens``)
and, through mean-pooled classification heads, with ``sentence_prediction``.
"""
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from fairseq.models import FairseqEncoder, FairseqEncoderModel, register_model, register_model_architecture
from fairseq.models.transformer import Embedding
from torch import nn

from .blocks import build_layers
from .compile import compile_per_config, length_bucket, run_layers
from ..modules import MaskedLMHead
from ..modules.linear import PackedLinear
from ..modules.tno import TnoSettings
from .config import TnnBlockConfig, add_compile_choices, compile_mode, set_defaults, validate_block_config
from .tnn_lm import UNLIMITED_POSITIONS
from .trainer_calls import TrainerCalls


@dataclass
class TnnMlmConfig(TnnBlockConfig):
    encoder_embed_dim: int = field(default=768, metadata={"help": "embedding (model) dimension"})
    encoder_layers: int = field(default=12, metadata={"help": "number of TNN layers"})
    layernorm_embedding: bool = field(default=False, metadata={"help": "LayerNorm on the embeddings"})
    no_scale_embedding: bool = field(default=False, metadata={"help": "do not scale the embeddings by sqrt(dim)"})
    pooler_dropout: float = field(default=0.0, metadata={"help": "dropout in classification heads"})



class MeanPoolClassificationHead(nn.Module):
    """Mean over the non-padding positions (no CLS token), then dense -> tanh -> dropout -> out."""

    def __init__(self, dim: int, inner_dim: int, num_classes: int, dropout: float):
        super().__init__()
        self.dense = nn.Linear(dim, inner_dim)
        self.dropout = nn.Dropout(dropout)
        self.out_proj = nn.Linear(inner_dim, num_classes)

    def forward(self, features: torch.Tensor, pad_mask: Optional[torch.Tensor]) -> torch.Tensor:
        pooled = features.mean(dim=1)
        if pad_mask is not None:
            keep = (~pad_mask).unsqueeze(-1).to(features.dtype)  # (b, n, 1)
            masked = (features * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
            # a training batch's mask may have no padding (TnnEncoder keeps it): the plain mean then, as for
            # None, chosen on the device (no host sync)
            pooled = torch.where(pad_mask.any(), masked, pooled)
        return self.out_proj(self.dropout(torch.tanh(self.dense(self.dropout(pooled)))))


def init_like_roberta(module: nn.Module) -> None:
    """RoBERTa's initialisation (fairseq's ``init_bert_params``), which the TNN authors' and the SKI authors'
    masked models apply to every module of their encoder: each ``nn.Linear`` weight N(0, 0.02) with a zero
    bias, each ``nn.Embedding`` N(0, 0.02) with its padding row zero. For ``model.apply``. The same draws as
    fairseq's function on the CPU; drawn on the tensor's own device (fairseq's copies through the CPU, which a
    model built on the meta device cannot do). An RPE's Linears and the layers' projections (``PackedLinear``s, a
    ``FusedLinear`` among them: views of a packed parameter) are ``nn.Linear``s of the authors' models, and get the
    same."""
    if isinstance(module, (nn.Linear, PackedLinear, nn.Embedding)):
        with torch.no_grad():
            module.weight.normal_(mean=0.0, std=0.02)
            if isinstance(module, (nn.Linear, PackedLinear)) and module.bias is not None:
                module.bias.zero_()
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()


class TnnEncoder(TrainerCalls, FairseqEncoder):
    """The bidirectional stack. A new encoder starts from RoBERTa's initialisation (``init_like_roberta``), as
    the authors' masked models do; its TNOs' own parameters (SKI's taps and knots) keep theirs."""

    def __init__(self, cfg: TnnMlmConfig, dictionary, tno_settings: TnoSettings,
                 training_length: Optional[int] = None):
        super().__init__(dictionary)
        dim = cfg.encoder_embed_dim
        self.padding_idx = dictionary.pad()
        self.embed_tokens = Embedding(len(dictionary), dim, self.padding_idx)
        self.embed_scale = 1.0 if cfg.no_scale_embedding else math.sqrt(dim)
        self.layernorm_embedding = nn.LayerNorm(dim) if cfg.layernorm_embedding else None
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = build_layers(cfg, dim, cfg.encoder_layers, False, tno_settings, training_length=training_length)
        self.final_norm = nn.LayerNorm(dim) if str(cfg.norm_position) == "pre" else None
        self.lm_head = MaskedLMHead(dim, self.embed_tokens.weight)
        # Compiled layers compile once per length: batches (whose length is their longest sample's in
        # --sample-break-mode complete) are padded to a few bucket lengths, the padding masked as usual.
        self.bucket_lengths = compile_mode(cfg) is not None
        self.apply(init_like_roberta)

    def extract_features(self, src_tokens: torch.Tensor, return_all_hiddens: bool = False):
        n = src_tokens.shape[1]
        if self.bucket_lengths and length_bucket(n) > n:
            src_tokens = F.pad(src_tokens, (0, length_bucket(n) - n), value=self.padding_idx)
        # Padding must never mix into real positions: the layers zero the TNO inputs at pad_mask. In training the
        # mask is kept even where no position is padding (applying an all-False mask changes no value): dropping
        # it would need pad_mask.any() on the host, a sync that stalls every update on a GPU. In evaluation a
        # batch without padding gets None (the layers skip the masking). Either way extra["padding_mask"] is True
        # at the padding positions, and None or all False where there are none.
        pad_mask = src_tokens.eq(self.padding_idx)
        if not self.training and not pad_mask.any():
            pad_mask = None
        inner_states = [] if return_all_hiddens else None
        # the embedding, the layers, each handed its spectrum (computed together while training: their RPEs as one
        # batched MLP), and the final norm; or, where the stack's CUDA graphs run, all of it in them (run_layers)
        x = run_layers(self.layers, src_tokens, pad_mask, None, inner_states, edges=self)
        if x.shape[1] > n:  # drop the bucket padding
            x = x[:, :n]
            pad_mask = None if pad_mask is None else pad_mask[:, :n]
            inner_states = None if inner_states is None else [h[:, :n] for h in inner_states]
            if pad_mask is not None and not self.training and not pad_mask.any():
                pad_mask = None
        return x, pad_mask, inner_states

    def stack_input(self, tokens: torch.Tensor) -> torch.Tensor:
        """The layers' input for ``tokens`` (b, n): the scaled embeddings, their norm where there is one, after
        dropout (b, n, d)."""
        x = self.embed_scale * self.embed_tokens(tokens)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        return self.dropout(x)

    def stack_output(self, x: torch.Tensor) -> torch.Tensor:
        """The features from the last layer's output ``x``: the final norm, where there is one. (The head scores
        the masked positions only, a number that changes from batch to batch: outside the stack's CUDA graphs.)"""
        return x if self.final_norm is None else self.final_norm(x)

    def forward(self, src_tokens, src_lengths=None, features_only: bool = False, return_all_hiddens: bool = False,
                masked_tokens: Optional[torch.Tensor] = None, **kwargs):
        x, pad_mask, inner_states = self.extract_features(src_tokens, return_all_hiddens)
        extra = {"inner_states": inner_states, "padding_mask": pad_mask}
        if features_only:
            return x, extra
        if masked_tokens is not None:  # only score the masked positions
            if masked_tokens.dtype == torch.bool:
                x = x[masked_tokens]  # a mask: its number of True values is read from the device
            else:  # flat positions into (batch, length), row-major (patches/masked_positions.py): the same rows
                x = x.reshape(-1, x.size(-1))[masked_tokens]
        return self.lm_head(x), extra

    def max_positions(self):
        return UNLIMITED_POSITIONS


NOT_FOR_EVAL_LM = (
    "this checkpoint is a bidirectional masked language model (tnn_mlm): fairseq-eval-lm scores causal language "
    "models, and a bidirectional model would see the tokens it predicts. Score its masked-token loss with "
    "fairseq-validate DATA --user-dir <fairseq_tnn> --task tnn_masked_lm --path CHECKPOINT "
    "--required-batch-size-multiple 1 (at any length with "
    "--model-overrides \"{'tokens_per_sample': L, 'sample_break_mode': 'none'}\")")


@register_model("tnn_mlm", dataclass=TnnMlmConfig)
class TnnMaskedLMModel(TrainerCalls, FairseqEncoderModel):
    # forward's masked_tokens may be flat positions (a LongTensor) instead of a mask: fairseq's masked_lm criterion
    # hands them over when the batch has them (fairseq_tnn/patches/masked_positions.py)
    scores_masked_positions = True

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_compile_choices(parser)

    @property
    def supported_targets(self):
        # asked only by fairseq's language_modeling task (fairseq-eval-lm's default), which would score this
        # model as a causal LM: a perplexity near 1, silently wrong
        raise ValueError(NOT_FOR_EVAL_LM)

    @classmethod
    def from_pretrained(cls, model_name_or_path, checkpoint_file="checkpoint_best.pt", data_name_or_path=".",
                        **kwargs):
        """A trained checkpoint as a hub interface with ``fill_mask("The <mask> of Egypt", topk=5)``:
        see ``fairseq_tnn.hub.TnnMaskedLMHubInterface`` and docs/using-models.md."""
        from ..hub import TnnMaskedLMHubInterface, load
        return load(cls, TnnMaskedLMHubInterface, model_name_or_path, checkpoint_file, data_name_or_path, **kwargs)

    def __init__(self, cfg: TnnMlmConfig, encoder: TnnEncoder):
        super().__init__(encoder)
        self.cfg = cfg
        self.classification_heads = nn.ModuleDict()

    @classmethod
    def build_model(cls, cfg: TnnMlmConfig, task):
        tno_settings = validate_block_config(cfg, "encoder_embed_dim", "encoder_layers", causal=False)
        # the task's block length: SKI's low rank keeps the scale it has there at every length (a checkpoint
        # keeps the one it was trained with)
        training_length = getattr(getattr(task, "cfg", None), "tokens_per_sample", None)
        model = cls(cfg, TnnEncoder(cfg, task.source_dictionary, tno_settings, training_length))
        compile_per_config(cfg, model.encoder.layers, "encoder.layers")
        return model

    def forward(self, src_tokens, src_lengths=None, features_only: bool = False, return_all_hiddens: bool = False,
                classification_head_name: Optional[str] = None, masked_tokens=None, **kwargs):
        if classification_head_name is not None:
            features_only = True
        x, extra = self.encoder(src_tokens, src_lengths, features_only=features_only,
                                return_all_hiddens=return_all_hiddens, masked_tokens=masked_tokens)
        if classification_head_name is not None:
            x = self.classification_heads[classification_head_name](x, extra["padding_mask"])
        return x, extra

    def register_classification_head(self, name: str, num_classes: Optional[int] = None, inner_dim: Optional[int] = None, **kwargs):
        dim = self.cfg.encoder_embed_dim
        self.classification_heads[name] = MeanPoolClassificationHead(
            dim, inner_dim or dim, num_classes, self.cfg.pooler_dropout)

    def upgrade_state_dict_named(self, state_dict, name):
        """Keep checkpoint heads that the current model lacks (fine-tuning resumes)."""
        prefix = name + "." if name != "" else ""
        super().upgrade_state_dict_named(state_dict, name)
        for key in list(state_dict.keys()):
            if key.startswith(prefix + "classification_heads."):
                head = key[len(prefix + "classification_heads."):].split(".")[0]
                if head not in self.classification_heads:
                    out = state_dict[prefix + f"classification_heads.{head}.out_proj.weight"]
                    inner = state_dict[prefix + f"classification_heads.{head}.dense.weight"]
                    self.register_classification_head(head, out.size(0), inner.size(0))


# The TNO part of a preset: its tno_type's Settings defaults plus the overrides it names (see tnn_lm.py).
MLM_BASE = dict(
    encoder_embed_dim=768, encoder_layers=12, norm_position="post", norm_type="simplermsnorm",
    layernorm_embedding=True, no_scale_embedding=True, expand_ratio=3, gtu_activation="silu",
    glu_activation="silu", tno_type="tnn", dropout=0.1, pooler_dropout=0.0)
TINY = dict(encoder_embed_dim=64, encoder_layers=2, rpe_dim=16, rpe_layers=2, glu_dim=64, dropout=0.0)


def mlm_base(args, **preset):
    """Qin et al.'s published bidirectional configuration (docs/references.md#published-configurations),
    overridable by any flag."""
    set_defaults(args, **{**MLM_BASE, **preset})


@register_model_architecture("tnn_mlm", "tnn_mlm_wt103")
def tnn_mlm_wt103(args):
    """Qin et al.'s bidirectional TNN: 12 x 768, post-norm, LayerNorm on embeddings, no scaling."""
    mlm_base(args)


@register_model_architecture("tnn_mlm", "tnn_mlm_wt103_rpe3")
def tnn_mlm_wt103_rpe3(args):
    """The bidirectional TNN with a 3-layer RPE, the baseline beside FD-TNN's 3-layer RPE."""
    mlm_base(args, rpe_layers=3)


@register_model_architecture("tnn_mlm", "fd_tnn_mlm_wt103")
def fd_tnn_mlm_wt103(args):
    """Bidirectional FD-TNN: complex frequency response from a 3-layer RPE (one FFT fewer than TNN)."""
    mlm_base(args, tno_type="fd")


@register_model_architecture("tnn_mlm", "ski_tnn_mlm_wt103")
def ski_tnn_mlm_wt103(args):
    """SKI-TNN as in the authors' Wikitext runs: r = 32 inducing points, m = 17 taps, lambda = 0.99."""
    mlm_base(args, tno_type="ski")  # the SkiSettings defaults are these published values


@register_model_architecture("tnn_mlm", "tnn_mlm_tiny")
def tnn_mlm_tiny(args):
    """A small bidirectional TNN for tests."""
    mlm_base(args, **TINY)


@register_model_architecture("tnn_mlm", "fd_tnn_mlm_tiny")
def fd_tnn_mlm_tiny(args):
    """A small bidirectional FD-TNN for tests."""
    mlm_base(args, **TINY, tno_type="fd")


@register_model_architecture("tnn_mlm", "ski_tnn_mlm_tiny")
def ski_tnn_mlm_tiny(args):
    """A small SKI-TNN for tests: r = 8, m = 5."""
    mlm_base(args, **TINY, tno_type="ski", ski_rank=8, ski_taps=5)
