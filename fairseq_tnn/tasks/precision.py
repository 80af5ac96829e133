"""bf16 mixed-precision training for both tasks: ``--bf16-autocast``.

fairseq 0.12's own ``--bf16`` means TPU training (``--bf16`` implies ``--tpu``, which fails on a
GPU in ``get_tpu_device``), and its ``--amp`` autocasts to fp16 only. With ``--bf16-autocast`` the
weights, gradients and optimizer state stay fp32 (fairseq's ordinary fp32 path: no loss scaler,
which bf16's fp32-sized exponent range does not need) and every training and validation forward
runs under ``torch.autocast(dtype=torch.bfloat16)`` on the model's device, CUDA or CPU. The
operators keep their FFTs and the RPE MLP in fp32 (see ops/toeplitz.py and modules/rpe.py).
"""
import argparse
import contextlib
import sys
from dataclasses import field

import torch
from fairseq.optim.amp_optimizer import AMPOptimizer


def bf16_autocast_field():
    return field(default=False, metadata={
        "help": "train and validate under torch.autocast(bfloat16) with fp32 weights and optimizer (what "
                "PRECISION=bf16 of scripts/train.sh uses; fairseq's own --bf16 means TPU). Not with --fp16, "
                "--bf16 or --amp"})


def refuse_other_precisions(parser, argv=None):
    """Called while fairseq parses a command line (the plugin's tasks' ``add_args``): ``--bf16-autocast`` with
    fairseq's ``--fp16``, ``--bf16`` or ``--amp``, and fairseq's ``--bf16`` (bf16 weights, ``patches/bf16.py``) with
    an fp16 precision, are refused there, before anything is loaded or written, with one
    line on stderr, ``<prog>: error: ...``, exit status 2 (the first update refused it before; ``_autocast_for``
    still does, for a task built otherwise)."""
    if not isinstance(parser, argparse.ArgumentParser):
        return  # fairseq's import of the task, which builds a parser of its options for the documentation
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if "--bf16-autocast" in argv:
        others = [a for a in ("--fp16", "--bf16", "--memory-efficient-bf16", "--amp") if a in argv]
        if others:
            parser.error(f"--bf16-autocast (fp32 weights under bf16 autocast) cannot be combined with "
                         f"{' and '.join(others)}; drop one of them (scripts/train.sh: PRECISION=fp16 or PRECISION=bf16)")
    bf16 = [a for a in ("--bf16", "--memory-efficient-bf16") if a in argv]
    others = [a for a in ("--fp16", "--memory-efficient-fp16", "--amp") if a in argv]
    if bf16 and others:
        parser.error(f"{bf16[0]} (bf16 weights) cannot be combined with {' and '.join(others)} (fp16); drop one of them")


def _autocast_for(model, optimizer=None):
    p = next(model.parameters())
    if p.dtype != torch.float32 or isinstance(optimizer, AMPOptimizer):
        what = "--amp" if isinstance(optimizer, AMPOptimizer) else f"{p.dtype} weights (--fp16 / --bf16)"
        raise ValueError(f"--bf16-autocast trains fp32 weights under bf16 autocast and cannot be combined with {what}; "
                         "drop one of them")
    return torch.autocast(p.device.type, dtype=torch.bfloat16)


def _wanted(task) -> bool:
    """Whether ``--bf16-autocast`` was given to ``task``: in its ``cfg``, or, for a legacy task such as fairseq's
    language modeling (whose ``cfg`` is None), in its ``args`` (reading ``cfg`` alone ignored the option there)."""
    return bool(getattr(task.cfg if task.cfg is not None else getattr(task, "args", None), "bf16_autocast", False))


class Bf16AutocastMixin:
    """Mix into a FairseqTask (before the fairseq base class) whose config has ``bf16_autocast``."""

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        if not _wanted(self):
            return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)
        # FairseqTask.train_step with the autocast region ours: its own
        # torch.cuda.amp.autocast(enabled=False) would switch a CUDA bf16 region off.
        model.train()
        model.set_num_updates(update_num)
        with torch.autograd.profiler.record_function("forward"), _autocast_for(model, optimizer):
            loss, sample_size, logging_output = criterion(model, sample)
        if ignore_grad:
            loss *= 0
        with torch.autograd.profiler.record_function("backward"):
            optimizer.backward(loss)
        return loss, sample_size, logging_output

    def valid_step(self, sample, model, criterion):
        ctx = _autocast_for(model) if _wanted(self) else contextlib.nullcontext()
        with ctx:
            return super().valid_step(sample, model, criterion)
