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

fp16, bf16 and fp32 inputs and taps, accumulated in fp32; the output in the taps' dtype and the input's gradient in
the input's, as ``band_conv``'s other methods. Triton is optional, as for ``toeplitz_direct``: without it, off a CUDA
device (except under Triton's interpreter, the CPU tests' way, ``CPU_INTERPRETED``) and for fp64, ``supports`` is
False and ``band_conv`` runs its convolution. Which device type takes this method is ``ski.BAND_METHOD``.
"""
from typing import Tuple

import torch
from torch.autograd.function import once_differentiable

from .toeplitz_direct import AVAILABLE, INTERPRETED, constexpr, tl, triton

BLOCK_MAX = 1024  # positions a program sums (``_block``)
# Whether the kernels run on the CPU under Triton's interpreter (``INTERPRETED``): only where a test sets this (the
# interpreter runs a program at a time in Python, far slower than the CPU's banded GEMM).
CPU_INTERPRETED = False
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supports(x: torch.Tensor, taps: torch.Tensor) -> bool:
    """Whether the kernels run on x and the taps: Triton is there, both are fp16, bf16 or fp32, on a CUDA device (or
    on the CPU under Triton's interpreter, with ``CPU_INTERPRETED``)."""
    if not AVAILABLE or x.dtype not in DTYPES or taps.dtype not in DTYPES or x.device != taps.device:
        return False
    return x.device.type == "cuda" or (x.device.type == "cpu" and INTERPRETED and CPU_INTERPRETED)


def _band_kernel(x_ptr, w_ptr, y_ptr, rows, n, TAPS: constexpr, BLOCK: constexpr):
    """One row (c, r), BLOCK positions i: y[i] = sum_k w[c, k] x[i + k - h], a shifted window of x per tap (from the
    cache after the first), in fp32."""
    row = tl.program_id(0).to(tl.int64)
    c = row // rows
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    base = row * n
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TAPS):
        src = i + (k - (TAPS - 1) // 2)
        xs = tl.load(x_ptr + base + src, mask=(src >= 0) & (src < n), other=0.0)
        acc += xs.to(tl.float32) * tl.load(w_ptr + c * TAPS + k).to(tl.float32)
    tl.store(y_ptr + base + i, acc.to(y_ptr.dtype.element_ty), mask=i < n)


def _band_backward_kernel(g_ptr, x_ptr, w_ptr, gx_ptr, part_ptr, rows, n, TAPS: constexpr, BLOCK: constexpr):
    """One row (c, r), BLOCK positions: gx[j] = sum_k w[c, m - 1 - k] g[j + k - h] at its positions j, and for each
    tap k the block's share of the taps' gradient, sum_i g[i] x[i + k - h] over its positions i, in part[row, block,
    k]."""
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
    tl.store(gx_ptr + base + i, gx.to(gx_ptr.dtype.element_ty), mask=i < n)


_KERNELS = []


def _kernels():
    """The forward and backward kernels, jitted at first use (interpreted under ``INTERPRETED``)."""
    if not _KERNELS:
        _KERNELS.extend(triton.jit(k) for k in (_band_kernel, _band_backward_kernel))
    return _KERNELS


def _same(kernel):
    return kernel


def _block(n: int) -> int:
    """The positions a program sums: ``BLOCK_MAX``, or the next power of 2 of a shorter length (at least 16)."""
    return max(16, min(BLOCK_MAX, triton.next_power_of_2(n)))


def _forward(x: torch.Tensor, taps: torch.Tensor, wrap=_same) -> torch.Tensor:
    """x (d, R, n) and taps (d, m) contiguous: the band of x, in the taps' dtype. ``wrap``: what the Triton kernels are
    launched through (``torch.library.wrap_triton`` inside a ``triton_op``)."""
    d, rows, n = x.shape
    y = torch.empty(x.shape, device=x.device, dtype=taps.dtype)
    block = _block(n)
    wrap(_kernels()[0])[(d * rows, triton.cdiv(n, block))](x, taps, y, rows, n, TAPS=taps.shape[1], BLOCK=block)
    return y


def _backward(grad: torch.Tensor, x: torch.Tensor, taps: torch.Tensor,
              wrap=_same) -> Tuple[torch.Tensor, torch.Tensor]:
    """The input's gradient (x's dtype) and the taps' (their dtype), for grad, x (d, R, n) and taps (d, m) contiguous:
    the taps' from the kernel's (d, R x blocks, m) fp32 shares, summed by torch (in a fixed order: no atomics)."""
    d, rows, n = x.shape
    m = taps.shape[1]
    block = _block(n)
    blocks = triton.cdiv(n, block)
    gx = torch.empty_like(x)
    part = torch.empty(d * rows * blocks, m, device=x.device, dtype=torch.float32)
    wrap(_kernels()[1])[(d * rows, blocks)](grad, x, taps, gx, part, rows, n, TAPS=m, BLOCK=block)
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


# ``DirectBand`` as torch.compile sees it (inside the stack's CUDA graphs): custom operators whose Triton kernels
# inductor calls from its compiled code, the backward traced by AOT autograd. Not under the interpreter, whose kernels
# are not ``JITFunction``s (the CPU's tests run the Function), as for ``toeplitz_direct``.
TRITON_OPS = AVAILABLE and not INTERPRETED and hasattr(torch.library, "triton_op")
if TRITON_OPS:
    @torch.library.triton_op("fairseq_tnn::ski_band", mutates_args=())
    def _band_op(x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        return _forward(x, taps, torch.library.wrap_triton)

    @torch.library.triton_op("fairseq_tnn::ski_band_backward", mutates_args=())
    def _band_backward_op(grad: torch.Tensor, x: torch.Tensor, taps: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return _backward(grad, x, taps, torch.library.wrap_triton)

    def _op_setup(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    def _op_backward(ctx, grad: torch.Tensor):
        x, taps = ctx.saved_tensors
        return _band_backward_op(grad.contiguous(), x, taps)

    _band_op.register_autograd(_op_backward, setup_context=_op_setup)


def direct_band(x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """``band_conv(x, taps)`` by the Triton kernels: x (d, R, n) channel-major, taps (d, m), m odd; the result in the
    taps' dtype, differentiable in both (the input's gradient in x's dtype). ``supports`` says where it runs."""
    if TRITON_OPS and torch.compiler.is_compiling():
        return _band_op(x.contiguous(), taps.contiguous())
    return DirectBand.apply(x, taps)
