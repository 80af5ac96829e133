"""``tnn_masked_lm``: fairseq's masked LM task (BERT-style masking, ``masked_lm`` criterion)
for bidirectional TNNs, with the per-update wall time and peak memory metrics."""
from dataclasses import dataclass

from fairseq.models import FairseqLanguageModel
from fairseq.tasks import register_task
from fairseq.tasks.masked_lm import MaskedLMConfig, MaskedLMTask

from ..models.tnn_mlm import NOT_FOR_EVAL_LM
from .data_checks import check_split, check_tokens_per_sample, split_path
from .launch_check import check_joined
from .precision import Bf16AutocastMixin, bf16_autocast_field
from .step_metrics import StepMetricsMixin
from .tnn_language_modeling import model_class


@dataclass
class TnnMaskedLMConfig(MaskedLMConfig):
    bf16_autocast: bool = bf16_autocast_field()


@register_task("tnn_masked_lm", dataclass=TnnMaskedLMConfig)
class TnnMaskedLMTask(StepMetricsMixin, Bf16AutocastMixin, MaskedLMTask):
    def __init__(self, cfg, dictionary=None):
        check_tokens_per_sample(cfg.tokens_per_sample, minimum=2)  # one position is the <s> token
        check_joined()
        super().__init__(cfg, dictionary)

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        # blocks are tokens_per_sample - 1 tokens plus <s>
        check_split(split_path(self.cfg.data, split, epoch), self.source_dictionary, self.cfg.tokens_per_sample,
                    str(self.cfg.sample_break_mode), reserved=1)
        return super().load_dataset(split, epoch, combine, **kwargs)

    def eval_lm_dataloader(self, *args, **kwargs):
        """fairseq-eval-lm with --task tnn_masked_lm: refused, naming the command that scores a masked model."""
        raise ValueError(NOT_FOR_EVAL_LM)

    def build_model(self, cfg, from_checkpoint=False):
        cls = model_class(cfg)
        if cls is not None and issubclass(cls, FairseqLanguageModel):
            raise ValueError(
                f"--arch {getattr(cfg, '_name', None) or getattr(cfg, 'arch', None)!r} is a causal language model; "
                "--task tnn_masked_lm needs a bidirectional model (e.g. tnn_mlm_*); use --task tnn_language_modeling")
        return super().build_model(cfg, from_checkpoint)
