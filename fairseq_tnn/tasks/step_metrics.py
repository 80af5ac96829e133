"""Time and peak memory of every update, logged as fairseq training metrics, without a host sync.

An update starts at the first ``train_step`` after the previous optimizer step
and ends when ``optimizer_step`` returns, so with ``--update-freq k`` it covers
all k forward/backward passes plus the optimizer step (data loading excluded).

- ``update_ms``: the time of an update in milliseconds. On the CPU, the update's
  wall time, logged with the update. On CUDA, the time between two CUDA events
  recorded on the current stream at the update's start and end (the time the
  GPU took from reaching the first to reaching the second: the update's kernels
  and any gaps in which the GPU waited for the host), logged one update later,
  with the next update's metrics, when the events have certainly completed:
  reading them at once would stall the host until the GPU finished the update
  (``torch.cuda.synchronize`` did that at every update), emptying the queue of
  launched kernels. The last update of a run is never logged.
- ``gpu_peak_mb`` (CUDA): peak allocated tensor memory during the update, logged
  with the update (the caching allocator's own count, kept on the host: reading
  it does not wait for the GPU).
- ``max_rss_mb`` (CPU): the process's peak resident set size so far (Linux
  ``ru_maxrss``); CPU tensors have no per-update allocator statistics.
"""
import resource
import time

import torch
from fairseq import metrics


def _on_cuda(model) -> bool:
    return torch.cuda.is_available() and next(model.parameters()).is_cuda


def peak_allocated() -> int:
    """``torch.cuda.max_memory_allocated()``, read from the allocator's nested statistics: ``max_memory_allocated``
    flattens every one of them into dotted names in Python first (4% of a graphed update's host time in the eighth
    GPU run, docs/performance.md)."""
    return torch.cuda.memory_stats_as_nested_dict().get("allocated_bytes", {}).get("all", {}).get("peak", 0)


def _recorded_event() -> "torch.cuda.Event":
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class StepMetricsMixin:
    """Mix into a FairseqTask before the fairseq base class."""

    # The start of the update in progress: time.perf_counter() on the CPU, a recorded CUDA event on CUDA.
    _update_start = None
    # CUDA: the (start, end) events of the last finished update, whose time the next update logs.
    _unread_update = None

    def train_step(self, sample, model, *args, **kwargs):
        if self._update_start is None:
            if _on_cuda(model):
                torch.cuda.reset_peak_memory_stats()
                self._update_start = _recorded_event()
            else:
                self._update_start = time.perf_counter()
        return super().train_step(sample, model, *args, **kwargs)

    def optimizer_step(self, optimizer, model, update_num):
        super().optimizer_step(optimizer, model, update_num)
        start, self._update_start = self._update_start, None
        if start is None:
            return
        if isinstance(start, float):  # on the CPU
            metrics.log_scalar("update_ms", (time.perf_counter() - start) * 1000.0, weight=1, round=1)
            metrics.log_scalar("max_rss_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
                               weight=1, round=1)
            return
        if self._unread_update is not None:
            before_start, before_end = self._unread_update
            # The previous update's end: passed a whole update ago (fairseq's Trainer itself waits for every
            # update's gradient norm), so this returns at once; it waits for that event only, never for the
            # work launched since.
            before_end.synchronize()
            metrics.log_scalar("update_ms", before_start.elapsed_time(before_end), weight=1, round=1)
        self._unread_update = (start, _recorded_event())
        metrics.log_scalar("gpu_peak_mb", peak_allocated() / 2 ** 20, weight=1, round=1)
