"""``tnn_language_modeling``: fairseq's language modelling task, plus what TNN users need.

- Evaluation at any length: a TNN has no positional limit, so
  ``fairseq-eval-lm --tokens-per-sample L`` scores every block whatever L is.
  Where a model does have a limit, a block longer than it is an error naming
  the option, never a silently skipped block (fairseq's default).
- The time and peak memory of every update are logged (see step_metrics).
- Only causal language models are accepted; bad data stops with a clear message
  (see data_checks).
- Generation (fairseq-interactive, fairseq-generate, the hub interface): every prompt is checked
  (not empty, shorter than the generation's maximum length) before any work, and the TNN decoders
  are told the generation's maximum length, so that their incremental cache computes each layer's
  kernel once (see ``TnnDecoder.set_decoding_length``).
"""
from dataclasses import dataclass
from typing import Optional

from fairseq import utils
from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY, FairseqLanguageModel
from fairseq.tasks import register_task
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

from ..models.config import check_cuda_graphs_for_training
from ..models.tnn_lm import decoding_length
from ..models.tnn_mlm import NOT_FOR_EVAL_LM
from .batches import ResumableBatchesMixin
from .data_checks import check_split, check_tokens_per_sample, split_path
from ..distributed.check import check_joined, refuse_unjoinable
from .precision import Bf16AutocastMixin, bf16_autocast_field, refuse_other_precisions
from .step_metrics import StepMetricsMixin


@dataclass
class TnnLanguageModelingConfig(LanguageModelingConfig):
    bf16_autocast: bool = bf16_autocast_field()


def model_class(cfg):
    name = getattr(cfg, "_name", None) or getattr(cfg, "arch", None)
    return MODEL_REGISTRY.get(name) or ARCH_MODEL_REGISTRY.get(name)


def check_blocks_fit(dataset, max_positions, split: str):
    """Raise if any block is longer than the models accept (instead of skipping it)."""
    limit = utils.resolve_max_positions(max_positions)
    if limit is None or len(dataset) == 0:
        return
    longest = int(dataset.sizes.max())
    if longest > limit:
        raise ValueError(
            f"--tokens-per-sample: the {split} split has blocks of {longest} tokens but the model accepts at most "
            f"{limit} positions; fairseq would silently skip those blocks. Lower --tokens-per-sample or raise the "
            "model's max positions (e.g. --model-overrides)")


def generation_length(generator, src_tokens) -> Optional[int]:
    """The most tokens (prompt included, leading <s>/</s> excluded) fairseq's SequenceGenerator will
    produce for this batch: min(max_len_a * src_len + max_len_b, max_len - 1), as it computes it;
    None for generators without a length limit (the SequenceScorer behind ``score``)."""
    if not all(hasattr(generator, a) for a in ("max_len_a", "max_len_b", "max_len")):
        return None
    if getattr(generator, "match_source_len", False):
        return int(src_tokens.size(1))
    return min(int(generator.max_len_a * src_tokens.size(1) + generator.max_len_b), generator.max_len - 1)


def check_prompts(src_tokens, pad: int, max_len: Optional[int]):
    """Refuse empty prompts and prompts the generator would truncate, naming what to do."""
    lengths = src_tokens.ne(pad).sum(dim=1) - 1  # the first token is the <s>/</s> every prompt starts with
    if bool((lengths <= 0).any()):
        raise ValueError("empty prompt: a language model continues (or scores) a text of at least one token; give "
                         "it some text (to sample from the model unconditioned, start with any word)")
    longest = int(lengths.max())
    if max_len is not None and longest >= max_len:
        raise ValueError(
            f"a prompt has {longest} tokens but generation stops at {max_len} tokens, prompt included "
            "(--max-len-a * (longest prompt + 1) + --max-len-b); fairseq would cut the prompt short. Raise "
            f"--max-len-b (hub interface: max_len_b=...) above {longest}, e.g. to {longest} + the number of new "
            "tokens wanted")


@register_task("tnn_language_modeling", dataclass=TnnLanguageModelingConfig)
class TnnLanguageModelingTask(ResumableBatchesMixin, StepMetricsMixin, Bf16AutocastMixin, LanguageModelingTask):
    @classmethod
    def add_args(cls, parser):
        refuse_unjoinable(parser)  # while fairseq parses the command line, before it sets up distributed training
        refuse_other_precisions(parser)
        super().add_args(parser)

    def __init__(self, args, dictionary, output_dictionary=None, targets=None):
        check_tokens_per_sample(args.tokens_per_sample)
        check_joined()
        super().__init__(args, dictionary, output_dictionary, targets)

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        check_split(split_path(self.args.data, split, epoch), self.dictionary, self.args.tokens_per_sample,
                    str(self.args.sample_break_mode))
        return super().load_dataset(split, epoch, combine, **kwargs)

    def build_model(self, cfg, from_checkpoint=False):
        cls = model_class(cfg)
        if cls is not None and not issubclass(cls, FairseqLanguageModel):
            if from_checkpoint:  # fairseq-eval-lm (or -validate) of a masked checkpoint: name the command that scores it
                raise ValueError(NOT_FOR_EVAL_LM)
            raise ValueError(
                f"--arch {getattr(cfg, '_name', None) or getattr(cfg, 'arch', None)!r} is not a causal language model; "
                "--task tnn_language_modeling needs one (e.g. tnn_lm_*); use --task tnn_masked_lm for masked models")
        if not from_checkpoint:
            check_cuda_graphs_for_training(cfg)
        return super().build_model(cfg, from_checkpoint)

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        src_tokens = sample["net_input"]["src_tokens"]
        max_len = generation_length(generator, src_tokens)
        if prefix_tokens is None:
            check_prompts(src_tokens, self.source_dictionary.pad(), max_len)
        # the decoder sees at most max_len + 1 tokens: the leading </s> (or <s>) and max_len more
        with decoding_length(models, None if max_len is None else max_len + 1):
            return super().inference_step(generator, models, sample, prefix_tokens, constraints)

    def eval_lm_dataloader(self, dataset, *args, max_positions=None, **kwargs):
        check_blocks_fit(dataset, max_positions, "evaluated")
        return super().eval_lm_dataloader(dataset, *args, max_positions=max_positions, **kwargs)
