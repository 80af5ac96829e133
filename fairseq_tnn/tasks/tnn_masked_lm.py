"""``tnn_masked_lm``: fairseq's masked LM task (BERT-style masking, ``masked_lm`` criterion)
for bidirectional TNNs, with the per-update wall time and peak memory metrics.

Lines longer than a block (``--oversized-blocks``). With a sentence-respecting
``--sample-break-mode`` (complete, complete_doc, eos) fairseq's ``TokenBlockDataset``
makes a line longer than ``--tokens-per-sample - 1`` tokens into one block of its own,
longer than the task's ``max_positions``. What happens to such a block:

- ``drop`` (default; what the RoBERTa-style fairseq pipeline the TNN authors trained
  their masked models with does): in training the block is dropped, through fairseq's
  own ``filter_indices_by_size``; how many blocks (and tokens) of how many is logged when
  the epoch's batches are made, and every training log line carries the metric ``dropped_blocks``. In
  validation and ``fairseq-validate`` the same happens with
  ``--skip-invalid-size-inputs-valid-test`` (the recipe passes it); without that flag the
  blocks are scored at their full length (a TNN has no positional limit) and the log says
  how many, instead of fairseq's error at the first validation, after a training epoch.
- ``error``: any split with such a line stops the run before any work, naming the line.

With ``--sample-break-mode none`` every block fits and nothing is dropped (0 is logged).

Each batch also names its masked positions (``masked_positions``, found on the CPU as it is collated), which fairseq's
``masked_lm`` criterion then scores without reading the mask back from a GPU (``fairseq_tnn/patches/masked_positions.py``).
"""
import logging
from dataclasses import dataclass, field

import numpy as np
from fairseq import metrics
from fairseq.data import BaseWrapperDataset
from fairseq.dataclass import ChoiceEnum
from fairseq.models import FairseqLanguageModel
from fairseq.tasks import register_task
from fairseq.tasks.masked_lm import MaskedLMConfig, MaskedLMTask

from ..models.config import check_cuda_graphs_for_training
from ..models.tnn_mlm import NOT_FOR_EVAL_LM
from ..patches.masked_positions import add_masked_positions
from .batches import ResumableBatchesMixin
from .data_checks import check_split, check_tokens_per_sample, split_path
from ..distributed.check import check_joined, refuse_unjoinable
from .precision import Bf16AutocastMixin, bf16_autocast_field, refuse_other_precisions
from .step_metrics import StepMetricsMixin
from .tnn_language_modeling import model_class

logger = logging.getLogger(__name__)

OVERSIZED_CHOICES = ChoiceEnum(["drop", "error"])


@dataclass
class TnnMaskedLMConfig(MaskedLMConfig):
    bf16_autocast: bool = bf16_autocast_field()
    oversized_blocks: OVERSIZED_CHOICES = field(
        default="drop",
        metadata={"help": "a line longer than a block (--sample-break-mode complete, complete_doc, eos) becomes a "
                          "block longer than --tokens-per-sample: 'drop' drops it from training and says how many "
                          "(the RoBERTa-style pipeline's behaviour; validation drops them too with "
                          "--skip-invalid-size-inputs-valid-test, else scores them in full), 'error' refuses the "
                          "data before any work"})


class MaskedPositionsDataset(BaseWrapperDataset):
    """A masked LM dataset whose batches also hold the flat positions of their masked tokens (``masked_positions``)."""

    def __init__(self, dataset, pad: int):
        super().__init__(dataset)
        self.pad = pad

    def collater(self, samples):
        return add_masked_positions(super().collater(samples), self.pad)


@register_task("tnn_masked_lm", dataclass=TnnMaskedLMConfig)
class TnnMaskedLMTask(ResumableBatchesMixin, StepMetricsMixin, Bf16AutocastMixin, MaskedLMTask):
    items_follow_epoch = True  # each block's mask is drawn from the seed, the epoch and the index

    @classmethod
    def add_args(cls, parser):
        refuse_unjoinable(parser)  # while fairseq parses the command line, before it sets up distributed training
        refuse_other_precisions(parser)
        super().add_args(parser)

    def __init__(self, cfg, dictionary=None):
        check_tokens_per_sample(cfg.tokens_per_sample, minimum=2)  # one position is the <s> token
        check_joined()
        super().__init__(cfg, dictionary)
        self.dropped_blocks = {}  # split -> number of blocks dropped by the last size filtering
        self._train_split = None

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        # blocks are tokens_per_sample - 1 tokens plus <s>
        strict = str(getattr(self.cfg, "oversized_blocks", "drop")) == "error"
        check_split(split_path(self.cfg.data, split, epoch), self.source_dictionary, self.cfg.tokens_per_sample,
                    str(self.cfg.sample_break_mode), reserved=1, check_line_length=strict,
                    hint=" (or leave out --oversized-blocks error: the default, drop, drops such blocks from "
                         "training and says how many)")
        if "data_selector" in kwargs:  # fairseq's Trainer.get_train_iterator loads the training split so
            self._train_split = split
        super().load_dataset(split, epoch, combine, **kwargs)
        self.datasets[split] = MaskedPositionsDataset(self.datasets[split], self.source_dictionary.pad())

    def _split_of(self, dataset):
        return next((name for name, ds in self.datasets.items() if ds is dataset), "?")

    def filter_indices_by_size(self, indices, dataset, max_positions=None, ignore_invalid_inputs=False):
        """fairseq's size filter (``FairseqDataset.filter_indices_by_size``) with the policy above.
        fairseq's Trainer asks training to skip oversized blocks (``ignore_invalid_inputs=True``) and
        validation to skip them only with --skip-invalid-size-inputs-valid-test."""
        split = self._split_of(dataset)
        kept, ignored = dataset.filter_indices_by_size(indices, max_positions)
        ignored = np.asarray(ignored, dtype=np.int64)
        total = len(indices)
        if len(ignored) == 0:
            self.dropped_blocks[split] = 0
            logger.info(f"{split}: all {total:,} blocks fit in --tokens-per-sample={self.cfg.tokens_per_sample}; "
                        "none dropped")
            return kept
        sizes = np.asarray([dataset.size(int(i)) for i in ignored]).reshape(len(ignored), -1).max(axis=1)
        what = (f"{len(ignored):,} of {total:,} blocks of the {split} split ({int(sizes.sum()):,} tokens) are longer "
                f"than --tokens-per-sample={self.cfg.tokens_per_sample} (the longest has {int(sizes.max())}): "
                f"lines longer than a block in --sample-break-mode {self.cfg.sample_break_mode}")
        if ignore_invalid_inputs:
            self.dropped_blocks[split] = len(ignored)
            logger.warning(f"{what}; dropped (--oversized-blocks drop; --oversized-blocks error refuses such data)")
            return kept
        # validation without --skip-invalid-size-inputs-valid-test: a TNN scores blocks of any length
        self.dropped_blocks[split] = 0
        logger.warning(f"{what}; scored at their full length (--skip-invalid-size-inputs-valid-test drops them)")
        return indices

    def train_step(self, sample, model, *args, **kwargs):
        metrics.log_scalar("dropped_blocks", self.dropped_blocks.get(self._train_split or "train", 0), weight=1,
                           round=0)
        return super().train_step(sample, model, *args, **kwargs)

    def eval_lm_dataloader(self, *args, **kwargs):
        """fairseq-eval-lm with --task tnn_masked_lm: refused, naming the command that scores a masked model."""
        raise ValueError(NOT_FOR_EVAL_LM)

    def build_model(self, cfg, from_checkpoint=False):
        cls = model_class(cfg)
        if cls is not None and issubclass(cls, FairseqLanguageModel):
            raise ValueError(
                f"--arch {getattr(cfg, '_name', None) or getattr(cfg, 'arch', None)!r} is a causal language model; "
                "--task tnn_masked_lm needs a bidirectional model (e.g. tnn_mlm_*); use --task tnn_language_modeling")
        if not from_checkpoint:
            check_cuda_graphs_for_training(cfg)
        return super().build_model(cfg, from_checkpoint)
