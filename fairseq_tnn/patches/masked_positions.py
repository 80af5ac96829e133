"""fairseq's ``masked_lm`` criterion scoring the masked positions its batch names, without reading the mask on the
device (the ``masked-lm-positions`` row of the table in ``__init__``).

The criterion finds the masked tokens of a batch on the device it trains on: ``target.ne(pad)`` and then
``targets[masked_tokens]``, and the model's ``x[masked_tokens]`` in forward and again in backward. Indexing by a
boolean mask needs the number of masked tokens on the host before it can allocate its result, so on a GPU each of these
is a wait of the host for the device (the queue of launched kernels drained, the GPU idle until the host launches the
next); the sample size it returns is a device tensor, which fairseq's Trainer (``sample_size or 1.0``) and its meters
(``if n > 0``, three times) read back again: 10 of a masked update's 14 host reads, against the causal models' 4
(``benchmarks/opcount.py``, docs/performance.md).

The batch knew them all along: the masks are drawn on the CPU, where the batch is collated. ``tnn_masked_lm`` adds to
each batch (``masked_positions``, :func:`add_masked_positions`) the flat positions, in row-major order over the target's
(batch, length), of the tokens the loss scores. When the batch has them and the model says it takes them
(``scores_masked_positions``: the plugin's masked models), the criterion hands the model those positions instead of the
mask and gathers the targets with them (the same rows in the same order: the same logits, loss and gradients, bit for
bit), and its sample size is their number, a Python int. Anything else (another task's batch, another model, a TPU) runs
fairseq's code. The loss of those rows is fairseq's (``modules.cross_entropy``), or a subclass's own
``summed_cross_entropy`` (``tnn_masked_lm``'s fused one).
"""
import torch
from fairseq import modules

MASKED_POSITIONS = "masked_positions"  # the batch's key: a LongTensor of flat positions into its target


def masked_positions(target: torch.Tensor, pad: int) -> torch.Tensor:
    """The flat positions (row-major over ``target``'s shape) of the tokens a masked LM's loss scores: those whose
    target is not the padding symbol."""
    return target.reshape(-1).ne(pad).nonzero().reshape(-1)


def add_masked_positions(sample: dict, pad: int) -> dict:
    """``sample`` (a collated masked LM batch, on the CPU) with its :data:`MASKED_POSITIONS`; an empty batch as is."""
    if sample and "target" in sample:
        sample[MASKED_POSITIONS] = masked_positions(sample["target"], pad)
    return sample


def _takes_positions(model) -> bool:
    return bool(getattr(model, "scores_masked_positions", False))


def summed_loss(criterion, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of the scored rows: the criterion's own ``summed_cross_entropy`` where it has one
    (``--criterion tnn_masked_lm``: the fused loss, fairseq_tnn/criterions/masked_lm.py), else fairseq's."""
    own = getattr(criterion, "summed_cross_entropy", None)
    if own is not None:
        return own(logits, targets)
    return modules.cross_entropy(logits, targets, reduction="sum", ignore_index=criterion.padding_idx)


def criterion_forward(original):
    def forward(self, model, sample, reduce=True):
        positions = sample.get(MASKED_POSITIONS) if isinstance(sample, dict) else None
        if positions is None or self.tpu or not _takes_positions(model):
            return original(self, model, sample, reduce)
        sample_size = positions.numel()  # a shape: known on the host
        if sample_size == 0:
            # fairseq's rare case, no masked token at all: every position is scored, against padding targets (loss 0)
            logits = model(**sample["net_input"], masked_tokens=None)[0]
            targets = model.get_targets(sample, [logits])
        else:
            logits = model(**sample["net_input"], masked_tokens=positions)[0]
            targets = model.get_targets(sample, [logits]).reshape(-1)[positions]
        loss = summed_loss(self, logits.view(-1, logits.size(-1)), targets.view(-1))
        logging_output = {"loss": loss.data, "ntokens": sample["ntokens"], "nsentences": sample["nsentences"],
                          "sample_size": sample_size}
        return loss, sample_size, logging_output

    return forward
