"""SKI-TNO: sparse + low-rank Toeplitz operator (bidirectional only).

Paper section 3.2 (Algorithm 1). For each channel c the n x n Toeplitz matrix is

    T_c = Band_c + W A_c W^T

* Band_c: m diagonals (m odd), applied as a depthwise 1-D convolution with zero
  padding. Tap k of ``conv_weight[c]`` multiplies lag i - j = (m-1)/2 - k:

      y_sparse[i, c] = sum_k conv_weight[c, k] * x[i + k - (m-1)/2, c]

  (torch's conv1d convention, cross-correlation), i.e. Band_c[i, j] =
  conv_weight[c, j - i + (m-1)/2] for |i - j| <= (m-1)/2.
* W (n x r_eff): linear interpolation from r_eff = min(r, n) inducing points
  p_k = k h, h = (n-1)/(r_eff-1), evenly spaced over positions [0, n-1]. Each row
  has two non-zeros, non-negative, summing to 1. If r > n (e.g. evaluating on a
  sequence shorter than r) the rank is reduced to n; then h = 1 and W is the
  identity (exact interpolation). For n = 1 the single inducing point is 0 and
  W = [[1]]. Shared by all channels.
* A_c (r_eff x r_eff): Toeplitz, A_c[k, l] = f_c(x(p_k - p_l)) with the inverse
  time warp x(t) = sign(t) lam^|t| (0 < lam < 1) mapping lags into [-1, 1], and
  f_c a learned piecewise-linear function on [-1, 1] with 2r+1 knots at
  -1, -(r-1)/r, ..., 0, ..., 1 and f_c(0) = 0 fixed. So A_c has zero diagonal.

``knots`` (2r, d) holds the learned values: rows 0..r-1 at x = -1 .. -1/r, rows
r..2r-1 at x = 1/r .. 1. The number of knots per side is the rank r.

The fast path runs channel-major (``layout="dbn"``: x (d, *batch, n); the
default ``"bnd"`` (b, n, d) is transposed to it): the band by batched GEMMs
over blocks of the sequence (``BlockedBand``; or torch's depthwise convolution
where ``BAND_METHOD`` says so for the device type), W^T and W as dense matmuls and
A_c by an FFT of size O(r) (``toeplitz_fft``); where the band runs in Triton kernels (``BAND_METHOD`` "triton"),
the low rank runs in them too (``FUSE_LOWRANK``: W^T x a GEMM, A z a batched GEMM, W (A z) added as the band's
kernel writes y). ``ski_tno_ref`` builds every
matrix densely from independent formulas (hat functions for W and f).
Computation is in float32 (float64 for float64 input); the output is cast to
``x.dtype``.
"""
import functools
import math
from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from torch.autograd.function import once_differentiable

from . import band_direct, fast
from .checks import check_lam, check_layout, check_length, check_rank, check_taps
from .toeplitz import (AUTOCAST_DEVICE_TYPES, autocast_off, fft_conv, fft_dtype, next_fast_len, seq_shape,
                       toeplitz_fft)


# ----------------------------------------------------------------------------
# Validation (the shared checks are in checks.py)
# ----------------------------------------------------------------------------


def _rank_of(knots: torch.Tensor) -> int:
    if knots.dim() != 2 or knots.shape[0] % 2:
        raise ValueError(f"knots must have shape (2r, d), got {tuple(knots.shape)}")
    r = knots.shape[0] // 2
    check_rank(r)
    return r


def check_ski_args(x: torch.Tensor, conv_weight: torch.Tensor, knots: Optional[torch.Tensor],
                   lam: Union[float, torch.Tensor], layout: str = "bnd", scale: float = 1.0) -> None:
    """The arguments of ``ski_tno`` / ``ski_tno_ref``: x (b, n, d) (``dbn``: (d, *batch, n)), conv_weight (d, m)
    with m odd, knots (2r, d) with r >= 2 or None, 0 < lam < 1, a finite real scale."""
    if isinstance(scale, (bool, torch.Tensor)) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale={scale!r} is invalid: must be a finite real number (f = scale * knots)")
    if layout == "bnd" and x.dim() != 3:
        raise ValueError(f"x must have shape (b, n, d), got {tuple(x.shape)}")
    if layout == "dbn" and x.dim() < 2:
        raise ValueError(f"x must have shape (d, *batch, n) for layout 'dbn', got {tuple(x.shape)}")
    _, d = seq_shape(x, layout)
    if conv_weight.dim() != 2 or conv_weight.shape[0] != d:
        raise ValueError(f"conv_weight must have shape (d, m) with d={d}, got {tuple(conv_weight.shape)}")
    check_taps(conv_weight.shape[1])
    check_lam(lam)
    if knots is None:
        return
    _rank_of(knots)
    if knots.shape[1] != d:
        raise ValueError(f"knots must have shape (2r, d) with d={d}, got {tuple(knots.shape)}")


# ----------------------------------------------------------------------------
# Inducing points and interpolation weights
# ----------------------------------------------------------------------------


def inducing_points(n: int, r: int, device=None) -> torch.Tensor:
    """The r_eff = min(r, n) inducing positions k (n-1)/(r_eff-1), float64 (just [0.] when n = 1)."""
    check_rank(r)
    r_eff = min(r, n)
    if r_eff == 1:
        return torch.zeros(1, dtype=torch.float64, device=device)
    k = torch.arange(r_eff, dtype=torch.float64, device=device)
    return k * (n - 1) / (r_eff - 1)


def interp_weights(n: int, r: int, device=None, dtype=torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """Linear interpolation weights: index (n, 2) long and weight (n, 2).

    Row i holds the bracketing inducing points lo, lo + 1 (lo = floor(i / h)
    clamped to [0, r_eff - 2]) and the weights 1 - frac, frac with
    frac = (i - p_lo) / h in [0, 1]. Integer arithmetic for lo and frac keeps
    inducing points exact: W[p_k, k] = 1 whenever p_k is an integer.
    """
    check_rank(r)
    check_length(n)
    r_eff = min(r, n)
    i = torch.arange(n, device=device)
    if r_eff == 1:  # n == 1
        index = torch.zeros(1, 2, dtype=torch.long, device=device)
        weight = torch.zeros(1, 2, dtype=dtype, device=device)
        weight[0, 0].fill_(1.0)  # no copy from the host (``fast.constant``)
        return index, weight
    num = i * (r_eff - 1)  # i / h = num / (n - 1)
    lo = torch.div(num, n - 1, rounding_mode="floor")
    frac = (num - lo * (n - 1)).to(torch.float64) / (n - 1)
    last = lo > r_eff - 2  # only i = n - 1, which sits on the last inducing point
    lo = torch.where(last, torch.full_like(lo, r_eff - 2), lo)
    frac = torch.where(last, torch.ones_like(frac), frac)
    index = torch.stack([lo, lo + 1], dim=1)  # (n, 2)
    weight = torch.stack([1.0 - frac, frac], dim=1).to(dtype)  # (n, 2)
    return index, weight


def interp_matrix(n: int, r: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Dense W (n, r_eff) from ``interp_weights``."""
    index, weight = interp_weights(n, r, device=device, dtype=dtype)
    w = torch.zeros(n, min(r, n), dtype=dtype, device=device)
    return w.scatter_add_(1, index, weight)


# ----------------------------------------------------------------------------
# The learned function f and the warped Toeplitz matrix A
# ----------------------------------------------------------------------------


def time_warp(t: torch.Tensor, lam: float) -> torch.Tensor:
    """Inverse time warp x(t) = sign(t) lam^|t|, mapping lags into [-1, 1] (x(0) = 0)."""
    check_lam(lam)
    return torch.sign(t) * torch.pow(float(lam), t.abs())


def piecewise_linear(knots: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """f(xq) for the piecewise-linear f with knots (2r, d) on [-1, 1] and f(0) = 0.

    xq: any shape, values in [-1, 1]. Returns xq.shape + (d,) in knots.dtype,
    differentiable in knots. Knot j (0..2r) sits at x = (j - r) / r with value
    knots[j] for j < r, 0 for j = r, knots[j - 1] for j > r.
    """
    r = _rank_of(knots)
    zero = knots.new_zeros(1, knots.shape[1])
    values = torch.cat([knots[:r], zero, knots[r:]], dim=0)  # (2r+1, d)
    u = (xq.to(torch.float64).clamp(-1.0, 1.0) + 1.0) * r  # in [0, 2r]
    lo = u.floor().clamp(0, 2 * r - 1)
    frac = (u - lo).to(knots.dtype)[..., None]  # (..., 1)
    lo = lo.long()
    return values[lo] * (1.0 - frac) + values[lo + 1] * frac  # (..., d)


def warped_lags(n: int, r_eff: int, lam: float, device) -> torch.Tensor:
    """x(k h) for k = -(r_eff-1) .. r_eff-1 (float64), the 2 r_eff - 1 lags of A."""
    k = torch.arange(-(r_eff - 1), r_eff, dtype=torch.float64, device=device)
    lags = k * (n - 1) / (r_eff - 1) if r_eff > 1 else k
    return time_warp(lags, lam)


def ski_kernel(n: int, knots: torch.Tensor, lam: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """pos (r_eff, d) and neg (r_eff - 1, d): the coefficients of the Toeplitz A per channel.

    f is linear in its knots, so pos and neg are fixed (n, r, lam)-dependent matrices times
    ``knots`` (``_kernel_matrices``, cached): two small GEMMs per call instead of a dozen ops."""
    r = _rank_of(knots)
    check_lam(lam)
    m_pos, m_neg = _kernel_matrices(n, r, float(lam), knots.device, knots.dtype)
    return m_pos @ knots, m_neg @ knots


@functools.lru_cache(maxsize=64)
def _kernel_matrices(n: int, r: int, lam: float, device, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """(r_eff, 2r) and (r_eff - 1, 2r): piecewise_linear at the warped lags of A, as matrices."""
    r_eff = min(r, n)
    eye = torch.eye(2 * r, dtype=torch.float64, device=device)
    vals = piecewise_linear(eye, warped_lags(n, r_eff, lam, device))  # (2 r_eff - 1, 2r)
    return vals[r_eff - 1:].to(dtype).contiguous(), vals[: r_eff - 1].flip(0).to(dtype).contiguous()


@functools.lru_cache(maxsize=64)
def _interp_matrix_cached(n: int, r: int, device, dtype) -> torch.Tensor:
    """``interp_matrix`` for the fast path (read-only; built once per length)."""
    return interp_matrix(n, r, device=device, dtype=dtype)


# ----------------------------------------------------------------------------
# The operator
# ----------------------------------------------------------------------------

BAND_BLOCK = 16  # block length of the banded GEMM (see ``band_conv``; 16 measured fastest of 16 .. 128)


def band_matrix(conv_weight: torch.Tensor, block: int) -> torch.Tensor:
    """(d, block + m - 1, block) per-channel band blocks: K[c, q, p] = w[c, q - p] for 0 <= q - p < m.

    Row q of a block's window is position (block start - h + q), column p is
    output position (block start + p), h = (m - 1) / 2. K is linear in the
    taps: the fast path (``fast.enabled``) takes it as one GEMM of the taps with a
    0/1 matrix that places tap k on the k-th diagonal (``_band_placement``, built
    once per (m, block)), whose backward is one GEMM as well; the reference builds
    it as a Hankel view of the zero-padded taps, flipped (a Toeplitz matrix), so
    autograd carries dL/dK back to the m taps by summing its diagonals (4
    operations forward and 4 backward instead of 1 and 1).
    """
    d, m = conv_weight.shape
    rows = block + m - 1
    if fast.enabled():
        placement = fast.constant(("ski-band-placement", m, block, conv_weight.dtype), conv_weight.device,
                                  lambda: _band_placement(m, block, conv_weight.device, conv_weight.dtype))
        return torch.mm(conv_weight, placement).view(d, rows, block)
    v = torch.cat([conv_weight.new_zeros(d, block - 1), conv_weight, conv_weight.new_zeros(d, rows - m)], dim=1)
    return v.unfold(1, block, 1).flip(-1)  # (d, rows, block): v[q + block - 1 - p] = w[q - p]


def _band_placement(m: int, block: int, device, dtype) -> torch.Tensor:
    """(m, (block + m - 1) * block): entry (k, (q, p)) is 1 where q - p = k, so that taps (d, m) times it are the
    band blocks of ``band_matrix``, flattened (each entry one tap times 1: exact in any dtype)."""
    q = torch.arange(block + m - 1, device=device)
    lag = q[:, None] - torch.arange(block, device=device)[None, :]  # (rows, block)
    return (torch.arange(m, device=device)[:, None, None] == lag[None]).to(dtype).view(m, -1)


def _windows(x: torch.Tensor, block: int, h: int) -> torch.Tensor:
    """x (d, R, n), n a multiple of block -> (d, R * n / block, block + 2h): each block with
    h neighbours on either side, zeros beyond the ends of each row (pad, then one copy of
    the overlapping unfold view: faster than assembling the pieces by strided copies)."""
    d = x.shape[0]
    xp = F.pad(x, (h, h)) if h else x
    # contiguous: with one row (batch 1) reshape would return the overlapping view itself, which
    # torch's bmm cannot hand to BLAS and multiplies matrix by matrix, copying each (10x slower)
    return xp.unfold(-1, block + 2 * h, block).contiguous().view(d, -1, block + 2 * h)


class BlockedBand(torch.autograd.Function):
    """y = Band x per channel, channel-major x (d, R, n), by one batched GEMM per pass.

    The sequence is cut into blocks of B positions; each block of y is its
    window of B + 2h inputs times the (B + 2h, B) band block K of its channel:
    one ``bmm`` over the d channels of (R n / B, B + 2h) @ (B + 2h, B). No
    transposes, 2 (B + 2h) flops per output instead of m, but at GEMM speed,
    where torch's depthwise conv1d runs at a few GFLOP/s and its weight
    gradient far slower. Backward: dL/dx is the band with reversed taps
    (K flipped in both dims) applied to dL/dy the same way; dL/dK is
    windows(x)^T @ dL/dy, one more bmm. x may have any float dtype: the GEMMs
    run in K's, and the backward keeps x in its own (an fp16 x: half the
    memory of an fp32 copy).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, k: torch.Tensor, h: int) -> torch.Tensor:
        d, rows, n = x.shape
        block = k.shape[-1]
        ctx.h = h
        ctx.save_for_backward(x, k)
        return torch.bmm(_windows(x.to(k.dtype), block, h), k).view(d, rows, n)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, k = ctx.saved_tensors
        h, block = ctx.h, k.shape[-1]
        d, rows, n = x.shape
        grad = grad.contiguous()
        gk = gx = None
        if ctx.needs_input_grad[1]:
            gk = torch.bmm(_windows(x.to(k.dtype), block, h).transpose(1, 2), grad.view(d, -1, block))  # (d, B + 2h, B)
        if ctx.needs_input_grad[0]:
            gx = torch.bmm(_windows(grad, block, h), k.flip(1, 2)).view(d, rows, n).to(x.dtype)
        return gx, gk, None


# How the band is applied, by device type: "gemm", the banded GEMM over blocks of ``BAND_BLOCK`` positions
# (``BlockedBand``), or "conv1d", torch's depthwise convolution (``depthwise_band``). Device types not listed take
# "gemm". On the CPU the GEMM is the faster by far: at ski_tnn_mlm_wt103's width (d1 = 2304), fp32, 2 cores, forward
# and backward, 15.6 against 45.6 ms at 1 x 512 and 39.3 against 175.4 ms at 1 x 2048, the whole SKI-TNO 23.7 against
# 62.8 and 72.8 against 148.5 ms (``python benchmarks/ski_band.py --device cpu --batch-scale 16 --rounds 2``; torch's
# weight gradient of a depthwise convolution is slow there). The convolution dispatches 3 operations forward and 3
# backward where the GEMM takes 4 and 9, and copies no overlapping windows of the input (about twice the input for
# blocks of 16). On a GPU the convolution is the faster, eagerly, and the lighter: the whole SKI-TNO, fp16, forward
# and backward, 20 steps queued, 2.49 against 2.73 ms at 16 x 512 and 2.54 against 2.78 ms at 4 x 2048, peak 108-110
# against 151 MiB; compiled (4 x 2048) as fast within 2% (2.79 against 2.74 ms queued, 3.18 against 3.28 synchronised),
# peak 73 against 115 MiB (H200, torch 2.11, ``python benchmarks/ski_band.py --device cuda --compiled``, the fifth GPU
# run, docs/measurements/2026-11-27-h200-fifth).
# "triton": the band by direct summation in Triton kernels (``ops/band_direct.py``: one pass over the input each way,
# where cuDNN's depthwise kernels moved the band's bytes at a sixth of the memory's bandwidth in the sixth GPU run);
# where it cannot run (no Triton, fp64), the convolution runs instead. Not yet any device type's default: no GPU has
# timed it (``python benchmarks/ski_band.py --device cuda --compiled`` times it beside the other two).
BAND_METHODS = ("gemm", "conv1d", "triton")
BAND_METHOD = {"cpu": "gemm", "cuda": "conv1d"}


def band_conv(x: torch.Tensor, conv_weight: torch.Tensor, block: int = BAND_BLOCK,
              method: Optional[str] = None) -> torch.Tensor:
    """Centred depthwise convolution, channel-major: x (d, R, n), conv_weight (d, m) -> (d, R, n),
    computed and returned in conv_weight's dtype (x may be in a lower precision).

    Same result as ``F.conv1d(x.transpose(0, 1), conv_weight[:, None], padding=(m-1)//2, groups=d)``
    (tap k multiplies x[i + k - (m-1)/2], zeros beyond the ends). ``method``: "gemm" (the banded GEMM over
    blocks of ``block`` positions), "conv1d" (``depthwise_band``) or "triton" (``band_direct.direct_band``, the
    convolution where it cannot run); None: the device type's (``BAND_METHOD``).
    """
    method = method or BAND_METHOD.get(x.device.type, "gemm")
    if method not in BAND_METHODS:
        raise ValueError(f"method={method!r} is invalid: must be one of {list(BAND_METHODS)}")
    if method == "triton":
        if band_direct.supports(x, conv_weight):
            return band_direct.direct_band(x, conv_weight)
        method = "conv1d"
    if method == "conv1d":
        with autocast_off(x.device.type):  # the taps' dtype, as the GEMM's path computes
            return depthwise_band(x, conv_weight)
    h = (conv_weight.shape[1] - 1) // 2
    n = x.shape[-1]
    block = max(block, h)
    pad = -n % block
    xp = F.pad(x, (0, pad)) if pad else x.contiguous()
    with autocast_off(x.device.type):  # the taps' dtype, as the backward assumes
        y = BlockedBand.apply(xp, band_matrix(conv_weight, block), h)
    return y[..., :n] if pad else y


def depthwise_band(x: torch.Tensor, conv_weight: torch.Tensor) -> torch.Tensor:
    """``band_conv`` by torch's depthwise convolution, without moving the channel-major x (d, R, n): its d * R rows
    are the channels of one convolution (``groups`` = d * R), row (c, b) taking channel c's taps (the taps expanded
    over the R rows, so that autograd sums their gradient over them). In conv_weight's dtype."""
    d, m = conv_weight.shape
    rows, n = x.shape[1], x.shape[-1]
    dt = conv_weight.dtype
    # fp16 on the CPU in float32, the result rounded to fp16: oneDNN's fp16 depthwise convolution never returned on an
    # Intel Xeon with AMX (torch 2.13.0+cpu: its kernel generator loops; a 16-channel, 17-tap conv1d of 40 positions
    # hung tests/ops/test_ski.py and .ci/run with it). bf16 and every GPU type run as they are.
    compute = torch.float32 if dt == torch.float16 and x.device.type == "cpu" else dt
    taps = conv_weight[:, None, :].expand(d, rows, m).reshape(d * rows, 1, m).to(compute)
    y = F.conv1d(x.to(compute).reshape(1, d * rows, n), taps, padding=(m - 1) // 2, groups=d * rows)
    return y.view(d, rows, n).to(dt)


def ski_tno(x: torch.Tensor, conv_weight: torch.Tensor, knots: Optional[torch.Tensor], lam: float,
            layout: str = "bnd", scale: float = 1.0) -> torch.Tensor:
    """SKI-TNO: y = Band x + W A W^T x per channel (see the module docstring).

    x: (b, n, d) (``layout="dbn"``: (d, *batch, n)); conv_weight: (d, m), m odd;
    knots: (2r, d), r >= 2, or None for the band alone; 0 < lam < 1; ``scale``: f is
    ``scale`` times the knots (the module's ``--ski-lowrank mean``). Returns x's
    shape in x.dtype; computes in float32 (float64 for float64 x), but for the
    GEMMs of a 16-bit x with taps of that dtype or under autocast to it (``band_dtype``).

    Everything runs channel-major ((d, batch, n), the layout the TNN layer
    produces, so ``dbn`` needs no copies): the band by batched GEMMs over
    blocks (``BlockedBand``; ``band_conv``'s method of the device type), W^T x and W z as single dense GEMMs of the
    (d * batch, n) activations with the (n, r) interpolation matrix, A z by an
    FFT of size O(r) (torch's CPU bmm of d tiny r x r matrices loops over the
    channels and was 20x slower).

    Measured on CPU (2 cores, torch 2.13, b=4, d=1536, r=32, float32, forward +
    backward): the dense W matmuls beat the sparse form (index_add for W^T x,
    two index_selects for W z) and einsum; for the band, torch's depthwise
    conv1d took ~200 ms at n = 512 (its weight gradient dominating), a sum of
    m shifted slices and unfold + einsum were slower still, and oneDNN's
    channels-last depthwise conv is fast forward but its weight gradient is
    not; the blocked GEMM costs a few times the bare data movement.
    """
    check_layout(layout)
    check_ski_args(x, conv_weight, knots, lam, layout, scale)
    gemm = band_dtype(x, conv_weight)
    # Autocast off: the GEMMs run in the dtype chosen here (``band_dtype``), which the hand-written band backward
    # assumes (its saved input cast to the taps' dtype).
    with autocast_off(x.device.type):
        return _ski_tno(x, conv_weight, knots, lam, layout, gemm, float(scale))


def band_dtype(x: torch.Tensor, conv_weight: torch.Tensor) -> torch.dtype:
    """The dtype of the SKI-TNO's GEMMs (the band's and the low rank's with W): x's where x is 16-bit and the taps
    are in the same dtype (``--fp16``'s half weights) or autocast runs GEMMs in it (``--bf16-autocast``, which
    rounds every Linear's float32 weights so); float32 (float64 for float64 x) otherwise. A 16-bit GEMM
    multiplies exactly and accumulates in float32 (on a GPU on the tensor cores, where a float32 one runs on the
    CUDA cores), and rounds its output to 16 bits, as every other layer of a half or autocast model does. The low
    rank's Toeplitz part A, an FFT of size O(r), always computes in float32 (float64). Asked before the operator
    turns autocast off."""
    if x.dtype in (torch.float16, torch.bfloat16):
        if conv_weight.dtype == x.dtype:
            return x.dtype
        device = x.device.type
        if device in AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device) \
                and torch.get_autocast_dtype(device) == x.dtype:
            return x.dtype
    return fft_dtype(x)


def _ski_tno(x, conv_weight, knots, lam, layout, gemm, scale):
    ct = fft_dtype(x)
    xd = x.permute(2, 0, 1) if layout == "bnd" else x  # (d, *batch, n), x's dtype
    d, n = xd.shape[0], xd.shape[-1]
    xd = xd.reshape(d, -1, n)  # (d, R, n), R = batch
    taps = conv_weight.to(gemm)
    if knots is not None and fuses_lowrank(xd, taps):
        y = _fused_lowrank(xd, taps, knots.to(ct), lam, scale)
    else:
        y = band_conv(xd, taps)  # (d, R, n) in the GEMMs' dtype; its backward keeps x in x's dtype
        if knots is not None:
            y = _add_lowrank(y, xd, knots.to(ct), lam, scale)
    if layout == "bnd":
        return y.view(d, x.shape[0], n).permute(1, 2, 0).to(x.dtype)
    return y.view(x.shape).to(x.dtype)


def _add_lowrank(y, xd, knots, lam, scale):
    """y + W A W^T x, channel-major y and xd (d, R, n): the GEMMs with W in y's dtype (the band's, see
    ``band_dtype``), A's kernel from ``scale`` times the knots in theirs and its FFT in float32 (float64).

    A's kernel, its circulant embedding and that column's rfft are all linear in the knots, so the fast path
    (``fast.enabled``) takes A's spectrum as one GEMM of the knots with their composition
    (``_lowrank_spectrum_matrix``, built once per length, rank, lambda and scale): 1 operation forward and 1
    backward where the reference (``ski_kernel``, the scale's product and ``toeplitz_fft``'s kernel spectrum)
    dispatches 7 and about as many."""
    d, rows, n = xd.shape
    gt = y.dtype
    r = knots.shape[0] // 2
    w = _interp_matrix_cached(n, r, xd.device, gt)  # (n, r_eff)
    z = torch.mm(xd.reshape(d * rows, n).to(gt), w).view(d, rows, -1)  # (d, R, r_eff) = W^T x
    if fast.enabled():
        ct = knots.dtype
        matrix, size = fast.constant(("ski-lowrank-spectrum", n, r, float(lam), float(scale), ct), knots.device,
                                     lambda: _lowrank_spectrum_matrix(n, r, float(lam), float(scale), knots.device, ct))
        spectrum = torch.view_as_complex(torch.mm(knots.t(), matrix).view(d, -1, 2))  # (d, size // 2 + 1)
        az = fft_conv(z, spectrum, size, layout="dbn")  # (d, R, r_eff) = A W^T x, z's dtype
    else:
        pos, neg = ski_kernel(n, knots * scale if scale != 1.0 else knots, lam)  # (r_eff, d), (r_eff - 1, d)
        az = toeplitz_fft(z, pos.t(), neg.t(), layout="dbn")  # (d, R, r_eff) = A W^T x, FFT of size O(r), z's dtype
    return y.reshape(d * rows, n).addmm(az.reshape(d * rows, -1), w.t()).view(d, rows, n)  # + W A W^T x


# Whether the "triton" band (``BAND_METHOD``) takes the low rank into its kernels too (``band_direct.direct_ski``): W A
# W^T x added where the band's kernel writes y, and W A^T W^T g where its backward writes the input's gradient, A z by
# a batched GEMM of each channel's r x r Toeplitz A. It moves x and g once less each than ``band_conv`` followed by
# ``_add_lowrank`` (whose addmm reads and writes y again, and whose input's gradient is a GEMM's output added to the
# band's): by the bytes, some 6 activations less a layer forward and backward, 2 more for the gate's recomputation
# (``--ski-backward recompute``). Only on the fast path; like the direct band, timed by no GPU yet
# (``benchmarks/ski_band.py`` times it beside the band alone).
FUSE_LOWRANK = True


def fuses_lowrank(x: torch.Tensor, taps: torch.Tensor) -> bool:
    """Whether the SKI-TNO of channel-major x and taps in the GEMMs' dtype runs band and low rank in the direct band's
    kernels: ``FUSE_LOWRANK``, the fast path, the device type's band method "triton", and kernels that run there."""
    return (FUSE_LOWRANK and fast.enabled() and BAND_METHOD.get(x.device.type, "gemm") == "triton"
            and band_direct.supports(x, taps))


def _fused_lowrank(xd, taps, knots, lam, scale):
    """Band x + W A W^T x by ``band_direct.direct_ski``: A's coefficients at its 2 r_eff - 1 lags one GEMM of the knots
    (f is linear in them), the rest constants of the length (``_fused_constants``)."""
    n, r = xd.shape[-1], knots.shape[0] // 2
    key = ("ski-fused-lowrank", n, r, float(lam), float(scale), taps.dtype, knots.dtype)
    w, index, weight, lags, placement = fast.constant(
        key, knots.device, lambda: _fused_constants(n, r, float(lam), float(scale), knots.device, taps.dtype,
                                                    knots.dtype))
    return band_direct.direct_ski(xd, taps, torch.mm(knots.t(), lags), w, index, weight, placement)


def _fused_constants(n: int, r: int, lam: float, scale: float, device, gemm: torch.dtype, dtype: torch.dtype):
    """For ``band_direct.direct_ski`` at length n: W (n, r_eff) in the GEMMs' dtype; its two non-zeros a position,
    index (n, 2) int32 and weight (n, 2) fp32; ``lags`` (2r, 2 r_eff - 1), which takes the knots to A's coefficients
    at lags -(r_eff - 1) .. r_eff - 1 (``scale`` times f at the warped lags); the 0/1 ``placement`` (2 r_eff - 1,
    r_eff^2) that puts the coefficient of lag k - l at A[k, l]."""
    r_eff = min(r, n)
    index, weight = interp_weights(n, r, device=device, dtype=torch.float32)
    m_pos, m_neg = _kernel_matrices(n, r, lam, device, torch.float64)  # lags 0 .. r_eff - 1; -1 .. -(r_eff - 1)
    lags = (torch.cat([m_neg.flip(0), m_pos]) * scale).t().to(dtype).contiguous()
    i = torch.arange(r_eff, device=device)
    lag = (i[:, None] - i[None, :] + r_eff - 1).view(1, -1)  # A[k, l]'s coefficient index
    placement = (torch.arange(2 * r_eff - 1, device=device)[:, None] == lag).to(dtype)
    return (interp_matrix(n, r, device=device, dtype=gemm), index.to(torch.int32).contiguous(), weight.contiguous(),
            lags, placement)


def _lowrank_spectrum_matrix(n: int, r: int, lam: float, scale: float, device, dtype) -> Tuple[torch.Tensor, int]:
    """(2r, 2 (size // 2 + 1)) real matrix M and the FFT size of A's circulant embedding at length n: knots^T M,
    viewed as complex (d, size // 2 + 1), is the rfft of the circulant column of A's kernel for ``scale`` times
    the knots (pos: lags 0 .. r_eff - 1, then zeros, then the negative lags; ``toeplitz_fft``'s embedding),
    interleaved real and imaginary parts. Computed in float64, returned in ``dtype``."""
    r_eff = min(r, n)
    size = next_fast_len(2 * r_eff - 1)
    m_pos, m_neg = _kernel_matrices(n, r, lam, device, torch.float64)  # (r_eff, 2r), (r_eff - 1, 2r)
    columns = torch.zeros(2 * r, size, dtype=torch.float64, device=device)  # knot j's circulant column in row j
    columns[:, :r_eff] = m_pos.t()
    if r_eff > 1:
        columns[:, size - r_eff + 1:] = m_neg.flip(0).t()
    # along the last dim (torch 2.11's compiled rfft along dim 0 expects another stride than it returns)
    spectra = torch.fft.rfft(columns * scale)  # (2r, size // 2 + 1)
    return torch.view_as_real(spectra).reshape(2 * r, -1).to(dtype), size


# ----------------------------------------------------------------------------
# References: every matrix dense, from independent formulas.
# ----------------------------------------------------------------------------


def _hat_interp_matrix(points: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """(len(points), len(grid)) hat-function weights max(0, 1 - |x - g_k| / h) on a uniform grid."""
    if grid.numel() == 1:
        return torch.ones(points.numel(), 1, dtype=points.dtype, device=points.device)
    h = grid[1] - grid[0]
    return (1.0 - (points[:, None] - grid[None, :]).abs() / h).clamp_min(0.0)


def _piecewise_linear_ref(knots: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """f(xq) = sum_j value_j * hat_j(xq), over the 2r+1 knots (the knot at 0 has value 0)."""
    r = _rank_of(knots)
    grid = torch.arange(-r, r + 1, dtype=torch.float64, device=knots.device) / r
    basis = _hat_interp_matrix(xq.reshape(-1).to(torch.float64), grid)  # (q, 2r+1)
    basis = torch.cat([basis[:, :r], basis[:, r + 1 :]], dim=1).to(knots.dtype)  # drop the 0 knot
    return (basis @ knots).reshape(*xq.shape, knots.shape[1])


def _dense_parts(n: int, knots: torch.Tensor, lam: float):
    """Dense W (n, r_eff) and A (d, r_eff, r_eff), from hat functions and direct lags."""
    r = _rank_of(knots)
    p = inducing_points(n, r, device=knots.device)  # (r_eff,)
    positions = torch.arange(n, dtype=torch.float64, device=knots.device)
    w = _hat_interp_matrix(positions, p).to(knots.dtype)  # (n, r_eff)
    a = _piecewise_linear_ref(knots, time_warp(p[:, None] - p[None, :], lam))  # (r_eff, r_eff, d)
    return w, a.permute(2, 0, 1)


def ski_lowrank_dense(n: int, knots: torch.Tensor, lam: float) -> torch.Tensor:
    """The (d, n, n) low-rank matrices W A_c W^T, densely."""
    check_lam(lam)
    w, a = _dense_parts(n, knots, lam)
    return w @ a @ w.t()


def ski_approx_dense(n: int, r: int, kfun: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """(n, n) SKI approximation W A W^T of T[i, j] = kfun(i - j), with A[k, l] = kfun(p_k - p_l).

    kfun maps a float64 tensor of lags to kernel values. W is ``interp_matrix``.
    """
    p = inducing_points(n, r)
    w = interp_matrix(n, r, dtype=torch.float64)
    a = kfun(p[:, None] - p[None, :])
    return w @ a @ w.t()


def band_dense(n: int, conv_weight: torch.Tensor) -> torch.Tensor:
    """(d, n, n) banded matrices, Band[c, i, j] = conv_weight[c, j - i + (m-1)/2]."""
    d, m = conv_weight.shape
    half = (m - 1) // 2
    i = torch.arange(n, device=conv_weight.device)
    offset = i[None, :] - i[:, None]  # j - i
    band = conv_weight.new_zeros(d, n, n)
    for k in range(m):
        band = band + conv_weight[:, k, None, None] * (offset == k - half).to(conv_weight.dtype)
    return band


def ski_tno_ref(x: torch.Tensor, conv_weight: torch.Tensor, knots: Optional[torch.Tensor], lam: float,
                layout: str = "bnd", scale: float = 1.0) -> torch.Tensor:
    """Dense reference for ``ski_tno``: y = (Band + W A W^T) x per channel, O(n^2 d), f = ``scale`` times the knots."""
    check_layout(layout)
    check_ski_args(x, conv_weight, knots, lam, layout, scale)
    ct = fft_dtype(x)
    n, _ = seq_shape(x, layout)
    t = band_dense(n, conv_weight.to(ct))  # (d, n, n)
    if knots is not None:
        t = t + ski_lowrank_dense(n, knots.to(ct) * scale, lam)
    if layout == "dbn":
        return torch.einsum("cij,c...j->c...i", t, x.to(ct)).to(x.dtype)
    return torch.einsum("cij,bjc->bic", t, x.to(ct)).to(x.dtype)
