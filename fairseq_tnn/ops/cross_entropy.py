"""The summed softmax cross-entropy of a language model's logits, forward and backward each one pass (Triton).

fairseq's ``cross_entropy`` criterion takes the log-probabilities in fp32 (``log_softmax(logits, dtype=float32)``)
and then ``nll_loss``: for the causal wt103 update (8 x 512 tokens, 50,264 symbols, fp16 logits of 412 MB) the forward
writes 824 MB of fp32 log-probabilities, which autograd keeps for the backward, and the backward writes an fp32
gradient of them (824 MB, zeroed first, then the targets' entries) that the softmax's backward reads beside the
log-probabilities to write the logits' gradient: about 4 GB moved, 1.19 ms of the graphed causal TNN update's kernels
on an H200 (``cunn_SoftMaxForward`` and ``cunn_SoftMaxBackward``, docs/performance.md) and the update's largest
kernels after cuFFT's. The loss needs less: per row, the log of its sum of exponentials (``lse``) and its target's
logit; and the logits' gradient is g (softmax - onehot), which the logits and the rows' lse give.

- forward: one program per row reads its logits once (an online maximum and sum of exponentials, in fp32), and writes
  its lse and its loss, lse - logit[target] (0 where the target is ``ignore_index``; NaN for a target outside the
  vocabulary, which the dense ``nll_loss`` refuses with a device-side assert: no wait of the host for the device
  here); the loss is the rows' sum, in fp32.
- backward: one pass reads the logits and writes their gradient in their dtype, g (exp(logit - lse) - [v == target]),
  g the summed loss's gradient read on the device (fp16 training's loss scale included).

About 1.2 GB moved instead of 4, and the fp32 log-probabilities never exist (the logits, which the output layer makes
anyway, are kept for the backward instead). ``reference_cross_entropy_sum`` is fairseq's computation, beside it in
the tests; the result equals it within fp32 rounding (the sum's order differs), the gradient within one rounding of
the logits' dtype. Triton is optional, as for ``toeplitz_direct``: without it, off a CUDA device (except under
Triton's interpreter, the CPU tests' way, ``CPU_INTERPRETED``), for fp64 logits and with ``fast.references()``, the
reference runs.
"""
import contextlib
import logging
from typing import Dict, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import fast
from .toeplitz_direct import AVAILABLE, INTERPRETED, constexpr, tl, triton

logger = logging.getLogger(__name__)

BLOCK = 2048  # vocabulary entries per step of a row's pass (the forward) or per program (the backward)
# Whether the kernels run on the CPU under Triton's interpreter (``INTERPRETED``): only where a test sets this. The
# interpreter runs a program at a time in Python, far slower than fairseq's computation, which the CPU's training
# runs (the tests' fairseq-train runs inherit TRITON_INTERPRET=1 from tests/conftest.py).
CPU_INTERPRETED = False


def reference_cross_entropy_sum(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """fairseq's loss: ``nll_loss(log_softmax(logits, dtype=float32), target, ignore_index, reduction="sum")``, for
    logits (rows, vocab) and target (rows,)."""
    return F.nll_loss(F.log_softmax(logits, dim=-1, dtype=torch.float32), target, ignore_index=ignore_index,
                      reduction="sum")


def _cross_entropy_forward(logits_ptr, target_ptr, lse_ptr, loss_ptr, vocab, stride, ignore_index, BLOCK: constexpr):
    """One row: its lse = log sum_v exp(logit_v), by a running maximum and sum per lane (each lane's sum rescaled as its
    maximum grows), and its loss."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    top = tl.full((BLOCK,), -3.0e38, tl.float32)  # finite: exp(top - new) is 0, never exp(-inf + inf)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        i = start + tl.arange(0, BLOCK)
        inside = i < vocab
        x = tl.load(base + i, mask=inside, other=-float("inf")).to(tl.float32)
        new = tl.maximum(top, x)
        total = total * tl.exp(top - new) + tl.where(inside, tl.exp(x - new), 0.0)
        top = new
    largest = tl.max(top, axis=0)
    lse = largest + tl.log(tl.sum(total * tl.exp(top - largest), axis=0))
    t = tl.load(target_ptr + row)
    scored = t != ignore_index
    known = (t >= 0) & (t < vocab)
    picked = tl.load(base + t, mask=scored & known, other=0.0).to(tl.float32)
    loss = tl.where(known, lse - picked, float("nan"))
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(scored, loss, 0.0))


def _cross_entropy_backward(logits_ptr, target_ptr, lse_ptr, grad_loss_ptr, grad_ptr, vocab, stride, grad_stride,
                            ignore_index, BLOCK: constexpr):
    """One (row, BLOCK entries): d loss / d logit_v = g (exp(logit_v - lse) - [v == target]), 0 for an ignored row."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = i < vocab
    x = tl.load(logits_ptr + row * stride + i, mask=inside, other=0.0).to(tl.float32)
    t = tl.load(target_ptr + row)
    p = tl.exp(x - tl.load(lse_ptr + row))
    g = tl.load(grad_loss_ptr)
    d = tl.where(i == t, p - 1.0, p) * g
    d = tl.where(t != ignore_index, d, 0.0)
    tl.store(grad_ptr + row * grad_stride + i, d.to(grad_ptr.dtype.element_ty), mask=inside)


_KERNELS = []


def _kernels():
    """The forward and backward kernels, jitted at first use (interpreted under ``INTERPRETED``)."""
    if not _KERNELS:
        _KERNELS.extend(triton.jit(k) for k in (_cross_entropy_forward, _cross_entropy_backward))
    return _KERNELS


def supports(logits: torch.Tensor) -> bool:
    """Whether the fused kernels run on ``logits``: Triton is there, the fast paths are on, the logits are fp16, bf16
    or fp32, on a CUDA device (or on the CPU under Triton's interpreter, with ``CPU_INTERPRETED``)."""
    if not AVAILABLE or not fast.enabled() or logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    return logits.device.type == "cuda" or (logits.device.type == "cpu" and INTERPRETED and CPU_INTERPRETED)


def _on(device: torch.device):
    """Triton launches on the current CUDA device and its stream: made ``device`` for the launch, so that logits on
    another GPU than the current one (a model moved to ``cuda:1`` without ``torch.cuda.set_device``) are read there."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class SoftmaxCrossEntropy(torch.autograd.Function):
    """sum over rows of -log softmax(logits)[target] (ignored rows 0), fp32, for logits (rows, vocab) with unit stride
    along the vocabulary and target (rows,) integers."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
        rows, vocab = logits.shape
        target = target.contiguous()
        lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
        losses = torch.empty(rows, device=logits.device, dtype=torch.float32)
        if rows and logits.device.type != "meta":  # meta tensors (benchmarks/memory.py): shapes, no values
            with _on(logits.device):
                _kernels()[0][(rows,)](logits, target, lse, losses, vocab, logits.stride(0), ignore_index, BLOCK=BLOCK)
        ctx.ignore_index = ignore_index
        ctx.save_for_backward(logits, target, lse)
        return losses.sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logits, target, lse = ctx.saved_tensors
        rows, vocab = logits.shape
        out = torch.empty((rows, vocab), device=logits.device, dtype=logits.dtype)
        if rows and logits.device.type != "meta":
            g = grad.to(torch.float32).reshape(1)
            with _on(logits.device):
                _kernels()[1][(rows, triton.cdiv(vocab, BLOCK))](logits, target, lse, g, out, vocab, logits.stride(0),
                                                                  out.stride(0), ctx.ignore_index, BLOCK=BLOCK)
        return out, None, None


# Whether the kernels work for a (dtype, device): checked once per process and device at first use (``_checked``).
_WORKS: Dict[Tuple[torch.dtype, str], bool] = {}


def _checked(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels compile on ``device`` for ``dtype`` logits and give fairseq's loss and gradient on a small
    case (3 rows, a padding row, 2 steps of a row's pass): tried once per process and dtype, before the first real
    call. Where they do not (a Triton that cannot compile them, a wrong result), a warning names why and fairseq's
    computation runs instead, for the rest of the process, on that device. Running out of memory says nothing of the
    kernels: it is raised, as the reference would raise it, and the check is made again at the next call."""
    key = (dtype, str(device))
    if key not in _WORKS:
        try:
            g = torch.Generator().manual_seed(0)
            logits = (torch.randn(3, BLOCK + 5, generator=g) * 4).to(device=device, dtype=dtype).requires_grad_()
            target = torch.tensor([1, 7, BLOCK + 2], device=device)
            with torch.enable_grad():  # a first call in validation, under no_grad, checks the gradient too
                fused = SoftmaxCrossEntropy.apply(logits, target, 1)
                (grad,) = torch.autograd.grad(fused, logits)
                ref = reference_cross_entropy_sum(logits, target, 1)
                (ref_grad,) = torch.autograd.grad(ref, logits)
            error = max(((fused - ref).abs() / ref.abs()).item(), (grad.float() - ref_grad.float()).abs().max().item())
            if not error < 0.02:
                raise RuntimeError(f"the fused loss and gradient differ from fairseq's by {error:.3g}")
            _WORKS[key] = True
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001: any failure of the kernels leaves fairseq's computation
            logger.warning(f"tnn_cross_entropy: the fused loss's kernels do not work for {dtype} logits on "
                           f"{device} ({type(err).__name__}: {err}); fairseq's computation runs instead")
            _WORKS[key] = False
    return _WORKS[key]


def cross_entropy_sum(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The summed cross-entropy of logits (rows, vocab) against target (rows,), rows whose target is ``ignore_index``
    left out: fairseq's ``cross_entropy`` loss (``reference_cross_entropy_sum``), by the fused kernels where they run
    (``supports``) and work (``_checked``), as an fp32 scalar differentiable in the logits."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy_sum: logits (rows, vocab) and target (rows,), got {tuple(logits.shape)} and "
                         f"{tuple(target.shape)}")
    if not supports(logits) or not _checked(logits.dtype, logits.device):
        return reference_cross_entropy_sum(logits, target, ignore_index)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return SoftmaxCrossEntropy.apply(logits, target, ignore_index)
