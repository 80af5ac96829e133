"""``--criterion tnn_cross_entropy``: fairseq's ``cross_entropy`` with the loss and its gradient each taken in one pass
over the logits (``fairseq_tnn.ops.cross_entropy``), the causal recipes' criterion (``fairseq_tnn/recipe.py``).

The same loss, sample size and logged metrics as ``cross_entropy``, whose class it extends: only ``compute_loss``
differs, and only where the model's log-probabilities are fairseq's plain log-softmax of its logits (its own
``get_normalized_probs``, no adaptive softmax) and the loss is summed; anything else (``reduce=False``, another
output layer) runs fairseq's code, as does every device the fused kernels do not run on (``cross_entropy_sum``).
"""
from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from fairseq.models import BaseFairseqModel, FairseqDecoder

from fairseq_tnn.ops.cross_entropy import cross_entropy_sum


def _method(obj, name: str):
    """The function behind ``obj.name`` (through fairseq's DDP wrappers, which hand attribute reads to the model)."""
    return getattr(getattr(obj, name, None), "__func__", None)


def plain_log_softmax(model) -> bool:
    """Whether ``model``'s log-probabilities are fairseq's log-softmax of its decoder's logits, ``net_output[0]``."""
    decoder = getattr(model, "decoder", None)
    return (decoder is not None and getattr(decoder, "adaptive_softmax", None) is None
            and _method(model, "get_normalized_probs") is BaseFairseqModel.get_normalized_probs
            and _method(model, "get_normalized_probs_scriptable") is BaseFairseqModel.get_normalized_probs_scriptable
            and _method(decoder, "get_normalized_probs") is FairseqDecoder.get_normalized_probs
            and _method(decoder, "get_normalized_probs_scriptable") is FairseqDecoder.get_normalized_probs_scriptable)


@register_criterion("tnn_cross_entropy", dataclass=CrossEntropyCriterionConfig)
class TnnCrossEntropyCriterion(CrossEntropyCriterion):
    def compute_loss(self, model, net_output, sample, reduce=True):
        if not reduce or not plain_log_softmax(model):
            return super().compute_loss(model, net_output, sample, reduce=reduce)
        logits = net_output[0]
        target = model.get_targets(sample, net_output).reshape(-1)
        loss = cross_entropy_sum(logits.reshape(-1, logits.size(-1)), target, self.padding_idx)
        return loss, loss
