"""A GPU update's check of its gradient norm made on the device, and read by the host as the next update begins (the
``fp16-overflow-on-device`` rows of the table in ``__init__``).

fairseq's update waits for the GPU once it has launched the backward. Under ``--fp16``, ``FP16Optimizer.clip_grad_norm``
compares the gradient norm with the clipping threshold and hands it to the loss scaler's ``check_overflow`` (three
reads); in every precision ``train_step`` checks ``torch.isfinite`` of it (one more). An fp16 overflow skips the step,
halves the loss scale and leaves the update uncounted; a non-finite norm without a loss scaler (fp32, bf16) stops
training with a ``FloatingPointError``. From that first wait on, the GPU idles while the host launches the optimizer
step, counts and logs the update, goes through fairseq-train's loop and the next batch, and launches the next forward:
with the stack's CUDA graphs a causal TNN update took 14.3 ms for 9.3 ms of kernels and 9.0 ms of host time
(docs/performance.md, the sixth run), its four waits the only ones of the update.

Where this applies (below), the update asks nothing of the device:

- ``Trainer.clip_grad_norm`` computes fairseq's norm and clipping on the device (with a loss scaler, FP16Optimizer's
  comparison made there; without one, fairseq's own code, which reads nothing), and the verdict as a float32 flag
  there (``found_inf``: with a loss scaler, the scaler's test, the norm inf or NaN; without one, ``train_step``'s, the
  norm not finite), copied to pinned host memory behind an event. It hands ``train_step`` :data:`NOT_YET_KNOWN`, a
  finite norm on the CPU, so that its ``isfinite`` check reads nothing from the device; the plugin's
  ``_reduce_and_log_stats`` (``update_stats.py``) knows it, keeps the update's statistics (:func:`keep_stats`) and
  returns a mapping that reads them once the flag is read.
- The step is fairseq's with the flag: torch's fused Adam kernel skips the update on the device where it is set
  (``multi_tensor_optim.py``; the weight decay is multiplied by zero there), and FP16Optimizer's copy of the master
  weights into the model copies unchanged weights. The loss scaler's update waits for the flag (the second row).
- The Trainer counts the update as fairseq counts one that went through (learning rate, ``num_updates``).

The flag is read (:func:`learn`) before the next update begins, when it has long been computed, and wherever the run
acts on the count: at the end of an update after which fairseq-train logs, saves, validates or stops (a multiple of
``--log-interval``, ``--save-interval-updates``, ``--validate-interval-updates``, or ``--max-update``), before a
validation and before a save (``Trainer.state_dict``). Then the host does what fairseq does once it knows:

- no overflow: the loss scaler's ``update`` (its window, its growth), and the update's statistics logged into the
  aggregators that were active during the update (the same meters, the same values);
- an fp16 overflow: the update taken out of the count (the learning rate and Adam's step count as they were), the
  scaler's own ``check_overflow`` bookkeeping (the scale halved), fairseq's note "gradient overflow detected", and
  nothing logged;
- a ``FloatingPointError`` (a non-finite norm without a loss scaler, or fp16's scale at ``--min-loss-scale``): the
  update taken out of the count, and what fairseq's ``train_step`` does on one: ``crash.pt`` saved, the update's
  batches run forward and backward again under fairseq's ``NanDetector`` (which logs where the first NaN or inf
  shows), and the error raised.

So the next update starts from fairseq's state: the same seed, learning rate, loss scale, weights and Adam state, and
training follows fairseq's, update by update (tests/reliability/test_device_overflow.py). What fairseq-train sees
between a skipped update and the next one differs: a provisional count, one higher, at which it takes no action (the
update after which it would act reads the flag at once), and a statistics mapping that reads the flag when looked
into. An overflow's note, or the error, comes at the start of the next update; an update fairseq's overflow handling
would have re-saved at a save interval is not re-saved; the update count printed at the end of an epoch whose last
update overflowed, and was not followed by a validation or a save, is the provisional one.

Where it applies: on CUDA (:data:`ON`; on the CPU the host's check costs nothing), one process (with several,
fairseq's check that the workers' norms agree reads them anyway), fairseq's Adam with the plugin's fused step (not
apex's), and either fairseq's ``FP16Optimizer`` with its flat master copy (``--fp16`` with its dynamic loss scaler,
``--bf16`` without one; ``--fp16-no-flatten-grads`` runs fairseq's code) or no wrapper (fp32 weights: fp32 and
``--bf16-autocast``); not ``--amp``, ``--memory-efficient-fp16``/``-bf16``, TPU, FSDP, EMA, BMUF, SlowMo or
quantization.
"""
import contextlib
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from fairseq import metrics
from fairseq.nan_detector import NanDetector
from fairseq.optim.adam import Adam, FairseqAdam
from fairseq.optim.dynamic_loss_scaler import DynamicLossScaler
from fairseq.optim.fp16_optimizer import FP16Optimizer

from . import base, config_snapshot, fp16_syncs, multi_tensor_optim

FAIRSEQ_LOGGER = logging.getLogger("fairseq.trainer")  # fairseq's note of an overflow, from where fairseq logs it
PENDING = "fairseq_tnn_pending_update"  # the Trainer's attribute holding the update whose flag is not yet read
HOST_FLAG = "fairseq_tnn_overflow_flag"  # ... and its pinned host buffer and event, reused from update to update
SCALER_WAITS = "fairseq_tnn_scaler_waits"  # FP16Optimizer's attribute: its next step leaves the scaler's update
ON = ("cuda",)  # the devices whose updates leave the check to the device
# A Trainer with this attribute set True keeps fairseq's check on the host (benchmarks/gpu_profile.py --host-overflow
# times both side by side)
HOST_CHECK = "fairseq_tnn_host_overflow_check"
# What train_step sees as the gradient norm while the device decides: finite, and on the CPU
NOT_YET_KNOWN = torch.zeros(())


@dataclass
class PendingUpdate:
    """An update whose check (an fp16 overflow, or a non-finite norm) the device has made and the host not yet
    read."""
    norm: torch.Tensor  # the gradient norm, on the device (fairseq's: of the unscaled gradients)
    flag: torch.Tensor  # 1.0 where it overflowed, copied to the host (pinned memory on CUDA)
    event: Optional[torch.cuda.Event]  # recorded after that copy (None on the CPU, where the copy is done)
    updates_before: int  # the Trainer's count before the update
    aggregators: Dict[str, object]  # the metrics aggregators active during the update, by name
    counted: List[dict] = field(default_factory=list)  # Adam's states whose step the update counted
    stats: Optional[tuple] = None  # (logging_outputs, sample_size) for _reduce_and_log_stats once known
    logged: Optional[object] = None  # what _reduce_and_log_stats returned
    overflow: Optional[bool] = None  # the flag, once read: the update was skipped
    scaler: bool = True  # the check is an fp16 loss scaler's (else train_step's, a non-finite norm stops training)
    samples: Optional[list] = None  # the update's batches (for fairseq's NanDetector after a FloatingPointError)


# The rows of the patch table this one works with, by what each replaces
WORKS_WITH = (("fairseq.optim.fp16_optimizer:_FP16OptimizerMixin.step", "fp16-step-skipped-on-device"),
              ("fairseq.trainer:Trainer.train_step", "overflow-known-before-an-update"),
              ("fairseq.trainer:Trainer._reduce_and_log_stats", "update-stats-without-reads"),
              ("fairseq.optim.adam:Adam.step", "fused-adam"))


def applies(trainer) -> Optional[str]:
    """How ``trainer``'s update can leave its check to the device (see the module docstring): "scaler" (fp16's
    dynamic loss scaler), "error" (no loss scaler: a non-finite norm stops training), or None (fairseq's check)."""
    if trainer.__dict__.get(HOST_CHECK) or trainer.device.type not in ON:
        return None
    opt = trainer.__dict__.get("_optimizer")
    if type(opt) is FP16Optimizer:
        if not fp16_syncs._flat(opt) or getattr(opt, "supports_step_with_scale", False):
            return None
        if opt.scaler is not None and type(opt.scaler) is not DynamicLossScaler:
            return None
        adam = opt.fp32_optimizer
    elif type(opt) is FairseqAdam:
        adam = opt
    else:
        return None
    if not isinstance(adam, FairseqAdam) or type(adam.optimizer) is not Adam:
        return None
    if not all(multi_tensor_optim._fusable(adam.optimizer, group) for group in adam.optimizer.param_groups):
        return None
    cfg = config_snapshot.read(trainer)
    if (trainer.data_parallel_world_size != 1 or trainer.tpu or trainer.is_fsdp or trainer.quantizer is not None
            or cfg.common.amp or cfg.ema.store_ema or cfg.optimization.use_bmuf
            or cfg.distributed_training.ddp_backend == "slowmo"):
        return None
    if not all(base.bound(path, patch) for path, patch in WORKS_WITH):
        return None  # (a row skipped: fairseq's code changed)
    return "scaler" if type(opt) is FP16Optimizer and opt.scaler is not None else "error"


def _host_flag(trainer, device: torch.device):
    """The Trainer's host buffer for the flag (pinned on CUDA) and, on CUDA, the event recorded after its copy."""
    held = trainer.__dict__.get(HOST_FLAG)
    if held is None or held[2] != device:
        cuda = device.type == "cuda"
        held = (torch.zeros((), pin_memory=cuda), torch.cuda.Event() if cuda else None, device)
        setattr(trainer, HOST_FLAG, held)
    return held[0], held[1]


def clip_grad_norm(original):
    def clip_grad_norm(self, clip_norm):
        kind = applies(self)
        if kind is None:
            return original(self, clip_norm)
        learn(self)  # (an update left pending by a failed train_step)
        opt = self.optimizer
        if kind == "scaler":
            opt._sync_fp16_grads_to_fp32()
            # fairseq's FP16Optimizer.clip_grad_norm, with the comparisons made on the device: the same norm, and the
            # same factor for the gradients (max_norm / norm is torch's reciprocal times max_norm, as in fairseq)
            norm = opt._multiply_factor * opt.fp32_optimizer.clip_grad_norm(0)
            factor = opt._multiply_factor
            if torch.is_tensor(factor):
                factor = factor.to(norm.device)
            if clip_norm > 0.0:
                factor = factor * torch.where(norm > clip_norm, norm.reciprocal() * clip_norm, 1.0)
            opt._multiply_factor = factor
            found = torch.logical_or(norm == math.inf, norm != norm).float()  # DynamicLossScaler.check_overflow's test
            opt.__dict__[SCALER_WAITS] = True
        else:
            norm = original(self, clip_norm)  # fairseq's: without a loss scaler it reads nothing
            found = torch.logical_not(torch.isfinite(norm)).float()  # train_step's test
        flag, event = _host_flag(self, norm.device)
        flag.copy_(found, non_blocking=True)
        if event is not None:
            event.record()
        pending = PendingUpdate(norm, flag, event, self.get_num_updates(), dict(metrics._active_aggregators),
                                scaler=kind == "scaler")
        self.__dict__[PENDING] = pending
        _adam(self).__dict__[multi_tensor_optim.FOUND_INF] = (found, pending.counted)  # for its next step
        return NOT_YET_KNOWN

    return clip_grad_norm


def step(original):
    def step(self, closure=None, groups=None):
        if not self.__dict__.pop(SCALER_WAITS, False):
            return original(self, closure, groups)
        # fairseq's step (its path without supports_step_with_scale), the flag in Adam's hands, without the loss
        # scaler's update, which waits for the host to read the flag (learn)
        self._sync_fp16_grads_to_fp32()
        self._unscale_grads()
        self.fp32_optimizer.step(closure, groups=groups)
        self._sync_fp32_params_to_fp16()

    return step


@contextlib.contextmanager
def _aggregators(active: Dict[str, object]):
    """fairseq's metrics logged into the aggregators ``active`` (those of an update gone by) for the block."""
    current = metrics._active_aggregators  # fairseq 0.12's {name: MetersDict} that log_scalar & co. log into
    saved = current.copy()
    current.clear()
    current.update(active)
    try:
        yield
    finally:
        current.clear()
        current.update(saved)


def _adam(trainer):
    """The torch optimizer (fairseq's Adam) that ``trainer``'s step runs."""
    opt = trainer.optimizer
    return (opt.fp32_optimizer if type(opt) is FP16Optimizer else opt).optimizer


def learn(trainer) -> Optional[PendingUpdate]:
    """Read the flag of ``trainer``'s pending update, if it has one, and do what fairseq does once it knows (see the
    module docstring); returns that update, or None."""
    pending = trainer.__dict__.pop(PENDING, None)
    if pending is None:
        return None
    trainer.optimizer.__dict__.pop(SCALER_WAITS, None)  # (from a step that did not run)
    _adam(trainer).__dict__.pop(multi_tensor_optim.FOUND_INF, None)
    if pending.event is not None:
        pending.event.synchronize()  # the flag's copy: done long ago, as a rule
    pending.overflow = bool(pending.flag.numpy())  # host memory: no wait for the device
    scaler = trainer.optimizer.scaler if pending.scaler else None
    with _aggregators(pending.aggregators):
        if pending.overflow:
            for state in pending.counted:
                state["step"] -= 1
            trainer.set_num_updates(pending.updates_before)
            if scaler is None:
                _stop(trainer, pending, FloatingPointError("gradients are Nan/Inf"))
            try:
                scaler.check_overflow(math.inf)  # fairseq's bookkeeping of an overflow; it raises
            except OverflowError as e:
                FAIRSEQ_LOGGER.info(f"NOTE: gradient overflow detected, ignoring gradient, {e}")
            except FloatingPointError as e:  # the minimum loss scale
                _stop(trainer, pending, e)
        else:
            if scaler is not None:
                scaler.update()
            if pending.stats is not None:
                pending.logged = trainer._reduce_and_log_stats(*pending.stats, pending.norm)
        if scaler is not None:
            metrics.log_scalar("loss_scale", scaler.loss_scale, priority=700, round=4, weight=0)  # as train_step does
    return pending


def _stop(trainer, pending: PendingUpdate, error: FloatingPointError):
    """What fairseq's ``train_step`` does with a ``FloatingPointError``: ``crash.pt`` saved, the update's batches run
    forward and backward again under its ``NanDetector`` (which logs where the first NaN or inf shows), and the
    error raised."""
    trainer.consolidate_optimizer()
    trainer.save_checkpoint(os.path.join(trainer.cfg.checkpoint.save_dir, "crash.pt"), {})
    trainer.zero_grad()
    with NanDetector(trainer.get_model()):
        for sample in pending.samples or ():
            sample, _ = trainer._prepare_sample(sample)
            trainer.task.train_step(sample, trainer.model, trainer.criterion, trainer.optimizer,
                                    trainer.get_num_updates(), ignore_grad=False)
    raise error


def keep_stats(trainer, logging_outputs, sample_size) -> PendingUpdate:
    """``_reduce_and_log_stats``'s arguments for the pending update of ``trainer``, logged once its overflow is known
    (``update_stats.py``); returns that update."""
    pending = trainer.__dict__[PENDING]
    pending.stats = (logging_outputs, sample_size)
    return pending


def _acts_after(trainer, updates: int) -> bool:
    """Whether fairseq-train logs, saves, validates or stops after the update that makes the count ``updates``."""
    cfg = config_snapshot.read(trainer)
    save, validate, last = (cfg.checkpoint.save_interval_updates, cfg.dataset.validate_interval_updates,
                            cfg.optimization.max_update)
    return (updates % cfg.common.log_interval == 0 or (save > 0 and updates % save == 0)
            or (validate > 0 and updates % validate == 0) or (last > 0 and updates >= last))


def train_step(original):
    def train_step(self, samples, raise_oom=False):
        learn(self)  # the update before: known before this one draws its seed and learning rate
        out = original(self, samples, raise_oom)
        pending = self.__dict__.get(PENDING)
        if pending is not None:
            pending.samples = samples
        if pending is not None and _acts_after(self, pending.updates_before + 1):
            learn(self)
            return None if pending.overflow else pending.logged
        return out

    return train_step


def learn_first(original):
    """A Trainer method that reads the pending overflow first (a validation, a save)."""
    def method(self, *args, **kwargs):
        learn(self)
        return original(self, *args, **kwargs)

    return method
