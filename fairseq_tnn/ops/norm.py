"""The layers' RMS norm, x / (||x|| d^-1/2 + eps) along the last dimension, as one operator with a hand-written
backward.

``SimpleRMSNorm`` (``modules/norm.py``) normalises the residual stream twice in every layer. Autograd runs its
four operations forward (the norm, its scaling, epsilon, the division) and eleven backward; ``RmsNorm`` runs
three forward (the scaling and epsilon in one ``add`` with ``alpha``) and six backward, the same formula as the
RPE's norms in ``ops/rpe.py``, keeping what autograd keeps: with y = x / den and gd = dL/dy / den,

    dL/dx = gd - x d^-1/2 <gd, y> / ||x||

(the second term 0 at x = 0, as torch's own norm backward has it). Computed in x's dtype, as the reference, with
eps as that dtype holds it (``dtype_eps``).
``simple_rms_norm`` runs it; the module's reference path (autograd through the plain operations, taken within
``fairseq_tnn.ops.fast.references()``) is what tests/ops/test_fast_paths.py compares it with.
"""
import torch
from torch.autograd.function import once_differentiable

from . import fast


def dtype_eps(eps: float, dtype: torch.dtype) -> float:
    """The eps a norm computed in ``dtype`` adds: ``eps``, or the least positive number ``dtype`` holds where ``eps``
    is smaller. fp16 holds nothing below 2^-24 (about 6e-8), so the layers' eps of 1e-8 rounded to zero there, and a
    zero vector normalised to 0 / 0. Padding positions carry one: their embedding starts at zero, and in a new model (zero
    biases, silu(0) = 0, the TNO input masked) the residual stream stays zero there through every layer. The NaN at
    those positions met the criterion's zero gradient in the backward (0 x NaN) and the token mixing spread it to
    every gradient, so that every update of a new eager ``--fp16`` model on a batch with padding overflowed and was
    skipped (the masked recipe's ``--sample-break-mode complete`` pads nearly every batch). With the least positive
    number a zero vector normalises to zero; any vector whose norm x d^-1/2 is above 1e-3 to the same bits as before
    (eps is then below half a unit in the last place). fp32 and bf16 hold 1e-8: eps unchanged."""
    if not dtype.is_floating_point or eps <= 0:
        return eps
    info = torch.finfo(dtype)
    return max(eps, info.tiny * info.eps)  # the smallest subnormal: 2^-24 in fp16


class RmsNorm(torch.autograd.Function):
    """y = x / (||x|| d^-1/2 + eps) along x's last dimension (d)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        width = x.shape[-1]
        eps_t = fast.constant(("rms-eps", eps, x.dtype), x.device,
                              lambda: torch.full((1,), dtype_eps(eps, x.dtype), dtype=x.dtype, device=x.device))
        nrm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        den = torch.add(eps_t, nrm, alpha=width ** -0.5)
        # what autograd keeps (x and the two (..., 1) norms), not y: where nothing after the norm keeps y (a
        # post-norm stack's last layer), keeping it would cost an activation
        ctx.save_for_backward(x, nrm, den)
        return x / den

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, nrm, den = ctx.saved_tensors
        width = x.shape[-1]
        gd = grad / den
        c = torch.bmm(gd.reshape(-1, 1, width), x.reshape(-1, width, 1)).view(nrm.shape)  # <gd, x> = <gd, y> den
        # two divisions, not one by den * ||x||: at x = 0 (a padding position's zero embedding) that product is
        # eps times the smallest normal, which underflows to 0 in float32 and would make 0 / 0
        c.div_(den).div_(nrm.clamp_min(torch.finfo(nrm.dtype).tiny))
        return torch.addcmul(gd, x, c, value=-(width ** -0.5)), None


def simple_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / (||x|| d^-1/2 + eps) along the last dimension, by ``RmsNorm``."""
    return RmsNorm.apply(x, eps)
