"""SKI-TNO's band by direct summation in Triton: ``band_conv``'s function in one pass over the input each way.

The band is a centred depthwise convolution of m taps per channel, channel-major x (d, R, n) (``ops/ski.py``):

- forward: y[c, r, i] = sum_k w[c, k] x[c, r, i + k - h], h = (m - 1) / 2, zeros beyond the ends   (``_band_kernel``)
- input's gradient: gx[c, r, j] = sum_k w[c, m - 1 - k] g[c, r, j + k - h], the same with the taps reversed
- taps' gradient: gw[c, k] = sum_r sum_i g[c, r, i] x[c, r, i + k - h]                   (both ``_band_backward_kernel``)

cuDNN's depthwise convolution, which the GPU ran until now (``BAND_METHOD["cuda"] = "conv1d"``), moved the band's
bytes at a fraction of the memory's bandwidth: in the sixth GPU run (H200, fp16, masked 16 x 512, d1 = 2,304) its
``conv1D_NCHW`` kernels took 106 us a call (forward and input gradient; 75 MB moved, 0.7 TB/s against the plain copy's
4.2) and ``conv1D_NCHW_wgrad`` 167 us, 2.0 + 2.5 ms of the eager update's 31.9 ms of kernels, 4.0 of the graphed
4 x 2048 update's 24.2 (the SKI-TNO's whole floor: 45 us a layer); and the gate's recomputation in the backward
(``--ski-backward recompute``) runs the forward once more.

Here a program takes a block of up to ``BLOCK_MAX`` positions of one row (c, r): for each tap in turn (the taps
unrolled at compile time) it reads the block's window of the input shifted by that tap, from the cache after the
first (the input is read from memory once), and adds it times the tap, in fp32. The backward's program reads the
output gradient's shifted windows for the input's gradient (against the reversed taps) and the input's windows
times the block's gradient for the taps' (one sum per block and tap, which torch then sums over the rows and blocks:
deterministic, no atomics). So the forward moves x and y once, the backward g, x and gx once: the least bytes the
band needs.

The SKI-TNO's low rank W A W^T x joins the same passes (``direct_ski``, ``ski.FUSE_LOWRANK``): W has two non-zeros
a position, so the forward's program adds W (A W^T x) to its block as it writes y, and the backward's adds W (A^T
W^T g) to the input's gradient, from the (d R, r_eff) rows A W^T x and A^T W^T g that a GEMM with W, then a batched
GEMM with each channel's A, make beforehand (r_eff fp32 values a row).

fp16, bf16 and fp32 inputs and taps, accumulated in fp32; the output in the taps' dtype and the input's gradient in
the input's, as ``band_conv``'s other methods. Triton is optional, as for ``toeplitz_direct``: without it, off a CUDA
device (except under Triton's interpreter, the CPU tests' way, ``CPU_INTERPRETED``) and for fp64, ``supports`` is
False and ``band_conv`` runs its convolution. Which device type takes this method is ``ski.BAND_METHOD``.
"""
from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from .toeplitz_direct import AVAILABLE, INTERPRETED, constexpr, tl, triton

BLOCK_MAX = 1024  # positions a program sums (``_block``)
# Whether the kernels run on the CPU under Triton's interpreter (``INTERPRETED``): only where a test sets this (the
# interpreter runs a program at a time in Python, far slower than the CPU's banded GEMM).
CPU_INTERPRETED = False
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LowRank = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a row's low-rank values (d, R, r_eff) fp32, index, weight


def supports(x: torch.Tensor, taps: torch.Tensor) -> bool:
    """Whether the kernels run on x and the taps: Triton is there, both are fp16, bf16 or fp32, on a CUDA device (or
    on the CPU under Triton's interpreter, with ``CPU_INTERPRETED``)."""
    if not AVAILABLE or x.dtype not in DTYPES or taps.dtype not in DTYPES or x.device != taps.device:
        return False
    return x.device.type == "cuda" or (x.device.type == "cpu" and INTERPRETED and CPU_INTERPRETED)


def _band_kernel(x_ptr, w_ptr, y_ptr, az_ptr, index_ptr, weight_ptr, rows, n, rank, TAPS: constexpr,
                 BLOCK: constexpr, LOWRANK: constexpr):
    """One row (c, r), BLOCK positions i: y[i] = sum_k w[c, k] x[i + k - h], a shifted window of x per tap (from the
    cache after the first), in fp32; with ``LOWRANK``, plus the row's interpolated low rank (W az)[i] = weight[i, 0]
    az[index[i, 0]] + weight[i, 1] az[index[i, 1]] (az (d R, rank) fp32: 128 bytes a row at r = 32)."""
    row = tl.program_id(0).to(tl.int64)
    c = row // rows
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    base = row * n
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TAPS):
        src = i + (k - (TAPS - 1) // 2)
        xs = tl.load(x_ptr + base + src, mask=(src >= 0) & (src < n), other=0.0)
        acc += xs.to(tl.float32) * tl.load(w_ptr + c * TAPS + k).to(tl.float32)
    if LOWRANK:
        acc += _interpolated(az_ptr + row * rank, index_ptr, weight_ptr, i, n)
    tl.store(y_ptr + base + i, acc.to(y_ptr.dtype.element_ty), mask=i < n)


def _interpolated(row_ptr, index_ptr, weight_ptr, i, n):
    """(W a)[i] for one row a of r_eff values (fp32) at row_ptr and W's two non-zeros of each position i: index and
    weight (n, 2), as ``ski.interp_weights`` gives them."""
    inside = i < n
    lo = tl.load(index_ptr + 2 * i, mask=inside, other=0)
    hi = tl.load(index_ptr + 2 * i + 1, mask=inside, other=0)
    w_lo = tl.load(weight_ptr + 2 * i, mask=inside, other=0.0)
    w_hi = tl.load(weight_ptr + 2 * i + 1, mask=inside, other=0.0)
    return (w_lo * tl.load(row_ptr + lo, mask=inside, other=0.0)
            + w_hi * tl.load(row_ptr + hi, mask=inside, other=0.0))


def _band_backward_kernel(g_ptr, x_ptr, w_ptr, gx_ptr, part_ptr, gz_ptr, index_ptr, weight_ptr, rows, n, rank,
                          TAPS: constexpr, BLOCK: constexpr, LOWRANK: constexpr):
    """One row (c, r), BLOCK positions: gx[j] = sum_k w[c, m - 1 - k] g[j + k - h] at its positions j (with
    ``LOWRANK``, plus the row's (W gz)[j], the low rank's share of the input's gradient), and for each tap k the
    block's share of the taps' gradient, sum_i g[i] x[i + k - h] over its positions i, in part[row, block, k]."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    c = row // rows
    i = block * BLOCK + tl.arange(0, BLOCK)
    base = row * n
    g = tl.load(g_ptr + base + i, mask=i < n, other=0.0).to(tl.float32)
    gx = tl.zeros((BLOCK,), dtype=tl.float32)
    parts = part_ptr + (row * tl.num_programs(1) + block) * TAPS
    for k in tl.static_range(TAPS):
        src = i + (k - (TAPS - 1) // 2)
        inside = (src >= 0) & (src < n)
        gs = tl.load(g_ptr + base + src, mask=inside, other=0.0).to(tl.float32)
        gx += gs * tl.load(w_ptr + c * TAPS + (TAPS - 1 - k)).to(tl.float32)
        xs = tl.load(x_ptr + base + src, mask=inside, other=0.0).to(tl.float32)
        tl.store(parts + k, tl.sum(xs * g, axis=0))
    if LOWRANK:
        gx += _interpolated(gz_ptr + row * rank, index_ptr, weight_ptr, i, n)
    tl.store(gx_ptr + base + i, gx.to(gx_ptr.dtype.element_ty), mask=i < n)


_KERNELS = []


def _kernels():
    """The forward and backward kernels, jitted at first use (interpreted under ``INTERPRETED``), with the helper they
    call (a global, which Triton resolves when it compiles them)."""
    global _interpolated
    if not _KERNELS:
        _interpolated = triton.jit(_interpolated)
        _KERNELS.extend(triton.jit(k) for k in (_band_kernel, _band_backward_kernel))
    return _KERNELS


def _same(kernel):
    return kernel


def _block(n: int) -> int:
    """The positions a program sums: ``BLOCK_MAX``, or the next power of 2 of a shorter length (at least 16)."""
    return max(16, min(BLOCK_MAX, triton.next_power_of_2(n)))


def _forward(x: torch.Tensor, taps: torch.Tensor, lowrank: Optional[LowRank] = None, wrap=_same) -> torch.Tensor:
    """x (d, R, n) and taps (d, m) contiguous: the band of x, in the taps' dtype; ``lowrank`` (az (d, R, r_eff) fp32,
    index, weight): plus W az in the same pass. ``wrap``: what the Triton kernels are launched through
    (``torch.library.wrap_triton`` inside a ``triton_op``)."""
    d, rows, n = x.shape
    y = torch.empty(x.shape, device=x.device, dtype=taps.dtype)
    block = _block(n)
    az, index, weight = lowrank if lowrank is not None else (x, x, x)  # unread without the low rank
    wrap(_kernels()[0])[(d * rows, triton.cdiv(n, block))](
        x, taps, y, az, index, weight, rows, n, az.shape[-1], TAPS=taps.shape[1], BLOCK=block,
        LOWRANK=lowrank is not None)
    return y


def _backward(grad: torch.Tensor, x: torch.Tensor, taps: torch.Tensor, lowrank: Optional[LowRank] = None,
              wrap=_same) -> Tuple[torch.Tensor, torch.Tensor]:
    """The input's gradient (x's dtype) and the taps' (their dtype), for grad, x (d, R, n) and taps (d, m) contiguous:
    the taps' from the kernel's (d, R x blocks, m) fp32 shares, summed by torch (in a fixed order: no atomics).
    ``lowrank`` (gz (d, R, r_eff) fp32, index, weight): the input's gradient plus W gz."""
    d, rows, n = x.shape
    m = taps.shape[1]
    block = _block(n)
    blocks = triton.cdiv(n, block)
    gx = torch.empty_like(x)
    part = torch.empty(d * rows * blocks, m, device=x.device, dtype=torch.float32)
    gz, index, weight = lowrank if lowrank is not None else (x, x, x)
    wrap(_kernels()[1])[(d * rows, blocks)](grad, x, taps, gx, part, gz, index, weight, rows, n, gz.shape[-1], TAPS=m,
                                            BLOCK=block, LOWRANK=lowrank is not None)
    return gx, part.view(d, rows * blocks, m).sum(1).to(taps.dtype)


class DirectBand(torch.autograd.Function):
    """y = Band x per channel for channel-major x (d, R, n) and taps (d, m), m odd: ``band_conv``'s function."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        x, taps = x.contiguous(), taps.contiguous()
        ctx.save_for_backward(x, taps)
        return _forward(x, taps)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, taps = ctx.saved_tensors
        return _backward(grad.contiguous(), x, taps)


# The SKI-TNO whole: y = Band x + W A W^T x, the low rank's interpolation in the band's kernels. W^T x and W^T g are
# GEMMs of the activations with the (n, r_eff) interpolation matrix ``w``; A z and A^T (W^T g) batched GEMMs of
# each channel's r_eff x r_eff Toeplitz A, built from its 2 r_eff - 1 coefficients ``coef`` (d, 2 r_eff - 1), lags
# -(r_eff - 1) .. r_eff - 1, by one GEMM with the 0/1 ``placement`` (2 r_eff - 1, r_eff^2), whose transpose sums A's
# gradient back into them (no atomics); W az and W gz are added where the kernels write y and the input's gradient,
# from W's two non-zeros a position (``index`` int32 and ``weight`` fp32, (n, 2)). So the low rank reads x once
# forward (for W^T x) and g once backward, where ``band_conv`` then ``addmm`` read and wrote y once more, and the
# input's gradient was a GEMM's output added to the band's.


def _toeplitz_a(coef: torch.Tensor, placement: torch.Tensor, r: int) -> torch.Tensor:
    """Each channel's A (d, r, r) from its lag coefficients: built in the forward and again in the backward rather than
    kept between them (9.4 MB a layer in fp32 at the masked wt103 width)."""
    return torch.mm(coef, placement).view(coef.shape[0], r, r)


def _lowrank_forward(x, taps, coef, w, index, weight, placement, wrap=_same) -> Tuple[torch.Tensor, torch.Tensor]:
    """y = Band x + W A W^T x (the taps' dtype) and z = W^T x ((d R, r_eff), w's dtype, which backward needs)."""
    d, rows, n = x.shape
    r = w.shape[1]
    z = torch.mm(x.view(d * rows, n).to(w.dtype), w)
    a = _toeplitz_a(coef, placement, r)
    az = torch.bmm(z.view(d, rows, r).to(coef.dtype), a.transpose(1, 2))  # (d, R, r): az = z A^T, each row A z
    return _forward(x, taps, (az, index, weight), wrap), z


def _lowrank_backward(grad, x, taps, coef, z, w, index, weight, placement,
                      wrap=_same) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of x, the taps and the coefficients, for grad, x (d, R, n) contiguous."""
    d, rows, n = x.shape
    r = w.shape[1]
    gaz = torch.mm(grad.view(d * rows, n).to(w.dtype), w).view(d, rows, r).to(coef.dtype)  # W^T g
    a = _toeplitz_a(coef, placement, r)
    gz = torch.bmm(gaz, a)  # A^T W^T g, a row at a time
    ga = torch.bmm(gaz.transpose(1, 2), z.view(d, rows, r).to(coef.dtype))  # (d, r, r): sum over rows of gaz z^T
    gx, gtaps = _backward(grad, x, taps, (gz, index, weight), wrap)
    return gx, gtaps, torch.mm(ga.view(d, r * r), placement.t())


class DirectSki(torch.autograd.Function):
    """The SKI-TNO y = Band x + W A W^T x for channel-major x (d, R, n), taps (d, m) and A's coefficients (d, 2 r_eff -
    1), differentiable in these three; w, index, weight and placement are constants (``direct_ski``)."""

    @staticmethod
    def forward(ctx, x, taps, coef, w, index, weight, placement):
        x, taps = x.contiguous(), taps.contiguous()
        y, z = _lowrank_forward(x, taps, coef, w, index, weight, placement)
        ctx.save_for_backward(x, taps, coef, z, w, index, weight, placement)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        return (*_lowrank_backward(grad.contiguous(), *ctx.saved_tensors), None, None, None, None)


# ``DirectBand`` and ``DirectSki`` as torch.compile sees them (inside the stack's CUDA graphs): custom operators whose
# Triton kernels inductor calls from its compiled code, the backward traced by AOT autograd. Not under the
# interpreter, whose kernels are not ``JITFunction``s (the CPU's tests run the Functions), as for ``toeplitz_direct``.
TRITON_OPS = AVAILABLE and not INTERPRETED and hasattr(torch.library, "triton_op")
if TRITON_OPS:
    @torch.library.triton_op("fairseq_tnn::ski_band", mutates_args=())
    def _band_op(x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        return _forward(x, taps, wrap=torch.library.wrap_triton)

    @torch.library.triton_op("fairseq_tnn::ski_band_backward", mutates_args=())
    def _band_backward_op(grad: torch.Tensor, x: torch.Tensor, taps: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return _backward(grad, x, taps, wrap=torch.library.wrap_triton)

    def _op_setup(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    def _op_backward(ctx, grad: torch.Tensor):
        x, taps = ctx.saved_tensors
        return _band_backward_op(grad.contiguous(), x, taps)

    _band_op.register_autograd(_op_backward, setup_context=_op_setup)

    @torch.library.triton_op("fairseq_tnn::ski_lowrank", mutates_args=())
    def _ski_op(x: torch.Tensor, taps: torch.Tensor, coef: torch.Tensor, w: torch.Tensor, index: torch.Tensor,
                weight: torch.Tensor, placement: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return _lowrank_forward(x, taps, coef, w, index, weight, placement, torch.library.wrap_triton)

    @torch.library.triton_op("fairseq_tnn::ski_lowrank_backward", mutates_args=())
    def _ski_backward_op(grad: torch.Tensor, x: torch.Tensor, taps: torch.Tensor, coef: torch.Tensor, z: torch.Tensor,
                         w: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                         placement: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _lowrank_backward(grad, x, taps, coef, z, w, index, weight, placement, torch.library.wrap_triton)

    def _ski_setup(ctx, inputs, output) -> None:
        x, taps, coef, *constants = inputs
        ctx.save_for_backward(x, taps, coef, output[1], *constants)  # output[1]: z = W^T x

    def _ski_backward(ctx, grad: torch.Tensor, _grad_z):
        return (*_ski_backward_op(grad.contiguous(), *ctx.saved_tensors), None, None, None, None)

    _ski_op.register_autograd(_ski_backward, setup_context=_ski_setup)


def direct_band(x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """``band_conv(x, taps)`` by the Triton kernels: x (d, R, n) channel-major, taps (d, m), m odd; the result in the
    taps' dtype, differentiable in both (the input's gradient in x's dtype). ``supports`` says where it runs."""
    if TRITON_OPS and torch.compiler.is_compiling():
        return _band_op(x.contiguous(), taps.contiguous())
    return DirectBand.apply(x, taps)


def direct_ski(x: torch.Tensor, taps: torch.Tensor, coef: torch.Tensor, w: torch.Tensor, index: torch.Tensor,
               weight: torch.Tensor, placement: torch.Tensor) -> torch.Tensor:
    """Band x + W A W^T x by the Triton kernels: x (d, R, n) channel-major, taps (d, m) (the GEMMs' dtype), A's
    coefficients coef (d, 2 r_eff - 1) fp32, and the constants of ``ski._fused_constants``; the result in the taps'
    dtype, differentiable in x, the taps and the coefficients. ``supports`` says where it runs."""
    if TRITON_OPS and torch.compiler.is_compiling():
        return _ski_op(x.contiguous(), taps.contiguous(), coef, w, index, weight, placement)[0]
    return DirectSki.apply(x, taps, coef, w, index, weight, placement)
