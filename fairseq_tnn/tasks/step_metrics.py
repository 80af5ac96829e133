"""Wall time and peak memory of every update, logged as fairseq training metrics.

An update starts at the first ``train_step`` after the previous optimizer step
and ends when ``optimizer_step`` returns, so with ``--update-freq k`` it covers
all k forward/backward passes plus the optimizer step (data loading excluded).

- ``update_ms``: wall time of the update in milliseconds.
- ``gpu_peak_mb`` (CUDA): peak allocated tensor memory during the update.
- ``max_rss_mb`` (CPU): the process's peak resident set size so far (Linux
  ``ru_maxrss``); CPU tensors have no per-update allocator statistics.
"""
import resource
import time

import torch
from fairseq import metrics


class StepMetricsMixin:
    """Mix into a FairseqTask before the fairseq base class."""

    _update_start = None

    def train_step(self, sample, model, *args, **kwargs):
        if self._update_start is None:
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            self._update_start = time.perf_counter()
        return super().train_step(sample, model, *args, **kwargs)

    def optimizer_step(self, optimizer, model, update_num):
        super().optimizer_step(optimizer, model, update_num)
        if self._update_start is None:
            return
        on_cuda = torch.cuda.is_available() and next(model.parameters()).is_cuda
        if on_cuda:
            torch.cuda.synchronize()
        metrics.log_scalar("update_ms", (time.perf_counter() - self._update_start) * 1000.0, weight=1, round=1)
        if on_cuda:
            metrics.log_scalar("gpu_peak_mb", torch.cuda.max_memory_allocated() / 2 ** 20, weight=1, round=1)
        else:
            metrics.log_scalar("max_rss_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, weight=1, round=1)
        self._update_start = None
