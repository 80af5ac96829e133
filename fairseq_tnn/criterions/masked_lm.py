"""``--criterion tnn_masked_lm``: fairseq's ``masked_lm`` with the loss and its gradient each taken in one pass over
the masked positions' logits (``fairseq_tnn.ops.cross_entropy``), the masked recipes' criterion
(``fairseq_tnn/recipe.py``).

The same loss, sample size and logged metrics as ``masked_lm``, whose class it extends. Its batches come from
``--task tnn_masked_lm``, which names their masked positions, and its models are the plugin's, which take them: the
forward of ``masked_lm`` as the plugin patches it (``patches/masked_positions.py``) scores those rows and sums their
loss with :meth:`summed_cross_entropy`. fairseq's masked_lm writes the rows' log-probabilities in fp32 and keeps them
for the backward (1,229 rows of 50,264 at the paper's 8,192 tokens a GPU: 247 MB, and as much again for their
gradient); the fused loss keeps the logits alone. A batch without the positions, another model or a TPU runs fairseq's
code, and so does every device the fused kernels do not run on (``cross_entropy_sum``: fairseq's computation).
"""
import torch
from fairseq.criterions import register_criterion
from fairseq.criterions.masked_lm import MaskedLmConfig, MaskedLmLoss

from fairseq_tnn.ops.cross_entropy import cross_entropy_sum


@register_criterion("tnn_masked_lm", dataclass=MaskedLmConfig)
class TnnMaskedLmLoss(MaskedLmLoss):
    def summed_cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed loss of logits (rows, vocab) against targets (rows,), padding targets left out."""
        return cross_entropy_sum(logits, targets, self.padding_idx)
