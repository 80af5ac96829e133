"""The output layer's logits x W^T over a vocabulary, its GEMMs given a leading dimension that is a multiple of 8.

cuBLAS runs a 16-bit GEMM on its tensor-core kernels for aligned memory only: every matrix's leading dimension a
multiple of 8 elements (16 bytes). The output layer's is the vocabulary's size, which for the masked recipes is odd:
the GPT-2 dictionary's 50,264 symbols with fairseq's ``<mask>``, 50,265 (a dictionary of one's own has any size). There
cuBLAS falls back to cutlass's ``..._align1`` kernels: in the sixth GPU run (H200, torch 2.11, fp16), the masked
SKI-TNN update's head spent 1.04 + 0.70 + 0.68 ms in them, one call each (its forward, the features' gradient and the
weight's), 2.4 of the graphed 4 x 2048 update's 24.2 ms of kernels, the longest after the band's convolutions
(docs/measurements/2026-11-27-h200-sixth, masked-graphs).

``vocab_linear`` computes the same logits over the next multiple of 8: the weight padded with zero rows (cast first to
autocast's dtype where autocast runs, as ``F.linear`` would cast it), the GEMM's output (rows, padded) aligned, the
padded columns dropped by a view (row stride the padded size). Autograd's backward then pads the logits' gradient with
zero columns for its two GEMMs, and hands the weight the first rows of the padded weight's gradient. The cost is a
copy of the weight forward (fp16: 77 MB at the masked wt103 width), which the GEMM keeps for its backward, and of the
logits' gradient backward: tens of microseconds where the unaligned GEMMs cost milliseconds.

It pads on the device types of ``ALIGN`` (CUDA), for at least ``MIN_ROWS`` rows of logits, with the fast paths on
(``fast.enabled``), outside torch.compile (inductor pads a GEMM's operands itself,
``torch._inductor.config.shape_padding``), for a vocabulary that is not aligned already; otherwise it is ``F.linear``,
its reference (tests/ops/test_logits.py compares the two, forward and gradients).
"""
from typing import Dict

import torch
import torch.nn.functional as F

from . import fast
from .toeplitz import AUTOCAST_DEVICE_TYPES

# The multiple each device type's output GEMM is padded to (a device type not listed: none): 8 elements, cuBLAS's
# 16 bytes for fp16 and bf16 (and two alignments of fp32's 4). The CPU's BLAS has no such fallback, so it is not padded.
ALIGN: Dict[str, int] = {"cuda": 8}
# The fewest rows of logits that are padded for: fewer (a generation's step scores a beam's few rows) make a GEMM that
# reads the weight more than it computes (fewer than about 200 flops per byte, an H100's or H200's balance of fp16
# tensor-core flops to memory bandwidth), where the weight's copy would cost about as much as the alignment saves. A
# bound from that balance, not a measurement; a training batch scores thousands of rows (the masked recipes' 15% of
# 16 x 512 tokens, 1,229; the causal 4,096).
MIN_ROWS = 256


def padded_vocab(vocab: int, device_type: str) -> int:
    """The vocabulary size ``vocab_linear`` computes over on a device of ``device_type``: the next multiple of its
    ``ALIGN``."""
    align = ALIGN.get(device_type, 1)
    return vocab + (-vocab % align)


def vocab_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` for the output layer, weight (vocab, dim), x (..., dim): logits (..., vocab), the GEMM
    computed over ``padded_vocab`` columns where the device type asks (see the module docstring). The result is then a
    view of the padded logits, of unit stride along the vocabulary."""
    vocab = weight.shape[0]
    size = padded_vocab(vocab, x.device.type)
    if size == vocab or x.numel() < MIN_ROWS * x.shape[-1] or not fast.enabled() or fast.compiling():
        return F.linear(x, weight)
    device = x.device.type
    if device in AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device):
        weight = weight.to(torch.get_autocast_dtype(device))  # cast before padding: one copy of the weight, not two
    return F.linear(x, F.pad(weight, (0, 0, 0, size - vocab)))[..., :vocab]
