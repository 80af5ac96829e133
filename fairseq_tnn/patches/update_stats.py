"""An update's statistics logged without reading values back from the device (the ``update-stats-without-reads`` row
of the table in ``__init__``).

After the optimizer step, fairseq's ``Trainer.train_step`` logs the update (``_reduce_and_log_stats``): the gradient
norm, if ``torch.isfinite`` of it says it is finite, and the update's metrics, which it also returns as a dict of
numbers (``get_smoothed_values``: an ``.item()`` of each loss). On a GPU each read waits for every kernel launched
before it, the optimizer step's included, and the GPU then waits for the host's next launch, through the rest of the
Trainer, fairseq-train's loop and the next batch: time the optimizer's kernels could have overlapped. Two of a causal
update's four host reads, two of a masked one's (``benchmarks/opcount.py``, docs/performance.md).

Neither read decides anything:

- ``train_step`` calls it after a step only with a finite norm: it has raised ``FloatingPointError`` on a non-finite
  one (fairseq's ``torch.isfinite(grad_norm)`` check before the step), or found an overflow (fp16's loss scaler,
  ``--amp``), after which it logs nothing; the check is made there, where the host must wait anyway. So where that
  check ran (not on a TPU, not under SlowMo, which skip or bypass it), the norm is logged as it is.
- fairseq-train's loop only asks whether ``train_step`` returned something (``None`` after an overflow or running out
  of memory); it reads its logs from the aggregators, every ``--log-interval`` updates. The metrics are returned as
  :class:`UpdateStats`, a mapping that reads them from the update's aggregator when it is first looked into: the same
  keys and values (the aggregator no longer changes once the update is logged), read then instead of at once. Only a
  speed meter inside it would differ (its rate is taken when read); fairseq's is ``wps``, which is not returned.

Validation (no gradient norm) and a TPU, SlowMo, or a norm that is not a tensor run fairseq's code. An update whose
overflow the device decides (``device_overflow.py``) hands over :data:`~.device_overflow.NOT_YET_KNOWN` as its norm: its
statistics are kept and logged here, with the norm, once the host knows there was no overflow.
"""
from collections.abc import MutableMapping

import torch
from fairseq import metrics

from . import config_snapshot, device_overflow

NOT_RETURNED = ("ppl", "wps", "wpb", "bsz")  # what fairseq drops from the metrics it returns


class UpdateStats(MutableMapping):
    """An update's smoothed metrics and its ``sample_size``, read from its aggregator (a ``MetersDict``) when first
    looked into."""

    def __init__(self, aggregator, sample_size):
        self._aggregator, self._sample_size, self._values = aggregator, sample_size, None

    def _read(self) -> dict:
        if self._values is None:
            values = self._aggregator.get_smoothed_values()
            values["sample_size"] = self._sample_size
            for key in NOT_RETURNED:
                values.pop(key, None)
            self._values, self._aggregator = values, None
        return self._values

    def __getitem__(self, key):
        return self._read()[key]

    def __setitem__(self, key, value):
        self._read()[key] = value

    def __delitem__(self, key):
        del self._read()[key]

    def __iter__(self):
        return iter(self._read())

    def __len__(self):
        return len(self._read())

    def __repr__(self) -> str:
        return repr(self._read()) if self._values is not None else "UpdateStats(not read yet)"


class StatsOnceKnown(UpdateStats):
    """What ``train_step`` returns for an update whose overflow the device decides (``device_overflow.py``): its
    statistics, read when first looked into, once the overflow is known (none, where it overflowed)."""

    def __init__(self, trainer, pending):
        super().__init__(None, None)
        self._trainer, self._pending = trainer, pending

    def _read(self) -> dict:
        if self._values is None:
            if self._pending.overflow is None:
                device_overflow.learn(self._trainer)
            self._values = dict(self._pending.logged or {})
            self._trainer = self._pending = None
        return self._values


def reduce_and_log_stats(original):
    def _reduce_and_log_stats(self, logging_outputs, sample_size, grad_norm=None):
        if grad_norm is device_overflow.NOT_YET_KNOWN:
            return StatsOnceKnown(self, device_overflow.keep_stats(self, logging_outputs, sample_size))
        cfg = config_snapshot.read(self)  # called between updates too (device_overflow.py)
        if (not torch.is_tensor(grad_norm) or self.tpu
                or cfg.distributed_training.ddp_backend == "slowmo"):
            return original(self, logging_outputs, sample_size, grad_norm)
        # train_step's isfinite check passed this norm (see above): logged as fairseq logs a finite one
        metrics.log_speed("ups", 1.0, priority=100, round=2)
        metrics.log_scalar("gnorm", grad_norm, priority=400, round=3)
        clip_norm = cfg.optimization.clip_norm
        if clip_norm > 0:
            # fairseq's torch.where(norm > clip, new_tensor(100), new_tensor(0)), without its two tensors made from
            # host numbers: each such copy waits for the device (the fifth GPU run's host_syncs found them)
            clipped = (grad_norm > clip_norm).to(grad_norm.dtype) * 100
            metrics.log_scalar("clip", clipped, priority=500, round=1)
        with metrics.aggregate() as aggregator:
            if logging_outputs is not None:
                self.task.reduce_metrics(logging_outputs, self.get_criterion())
            if "loss" not in aggregator:
                # fairseq's warning for a criterion that logs no loss, and its placeholder
                original(self, None, sample_size, None)
        return UpdateStats(aggregator, sample_size)

    return _reduce_and_log_stats
