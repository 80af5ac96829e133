"""The Toeplitz product by direct summation on tensor cores (Triton): ``fft_conv``'s function for short sequences.

For each channel c, y_c = T_c x_c with T_c[t, s] = k_c[(t - s) mod size], k_c the circulant column a spectrum
describes (``spectrum_kernel``'s layout: lags 0 .. n-1 first, lags -1 .. -(n-1) last). The FFT product moves
complex fp32 spectra, each four times an fp16 activation's bytes, through four transforms of the batch each way
(docs/performance.md, "the mixing over its floor": 41-61 times the bytes its inputs and outputs need). Summed
directly, the product is a matrix product per channel, (rows x n) times (n x n), whose Toeplitz operand is never
stored: each tile of it is gathered from the channel's 2n - 1 coefficients (a few KB, held in cache) as the
product needs it. It reads x once per output tile and writes y once, and costs 2 n^2 multiply-adds per row, which
tensor cores do at hundreds of TFLOPS: at n = 512 about as much time as reading and writing the activations.

- forward: y[c, r, t] = sum_s k[c, (t - s) mod size] x[c, r, s]                 (``_apply``, sign +1)
- input's gradient: gx[c, r, s] = sum_t k[c, (t - s) mod size] gy[c, r, t]    (``_apply``, sign -1: T transposed)
- kernel's gradient: gk[c, L mod size] = sum_r sum_t gy[c, r, t] x[c, r, t - L] for |L| < n, 0 elsewhere: for
  each offset D between an output and an input tile, the products P = gy^T x on tensor cores, summed over the rows
  and the tile pairs at that offset (the inner dimension), then P's diagonals summed into the lags they hold
  (``_lag_grad``: each lag gets the sums of two neighbouring offsets, added atomically).

A tile of T depends only on its offset from the diagonal, so ``_apply`` gathers each once per program and applies it
to several output tiles' inputs stacked as rows (``ROWS_PER_PROGRAM``). It gathers the tile from the channel's
coefficients laid out by lag first (``_layout_kernel``: lags -(m - 1) .. m - 1 in order, m the length rounded up to
whole tiles, -63 .. m - 1 where causal; zero where |lag| >= n and, causal, where lag < 0), so that every entry of
every tile it reads is at a fixed offset from the tile's first, in range and zero where T is: one address each, no
wrap-around, bounds or triangle to test in the product's loop; and in several copies, each shifted by one element
(``LOAD_BYTES``), so that each of the tile's rows starts aligned in one of them and the tile is copied to shared
memory as the input's is. fp16 x meets fp16 coefficients, each channel's scaled to at most 1 by that layout (the
10-bit significand TF32 would give them, at twice its rate), bf16 x enters as TF32 (which holds it exactly) with the
coefficients rounded to TF32, fp32 as it is; all accumulate in fp32. ``direct_conv`` is the
product of a spectrum, the coefficients taken by one irfft of the (channels x size) spectrum, whose gradient
autograd carries back to the spectrum: the same function and gradients as ``fft_conv``, within rounding. A TNO that
makes its kernel in time before transforming it (TNN's RPE, causal FD-TNN's Hilbert transform:
``SpectralTno.kernel_in_time``) hands ``direct_toeplitz`` that kernel instead, with no FFT either way.

Triton is optional: it ships with torch's CUDA builds; without it (a CPU-only torch) ``AVAILABLE`` is False and
nothing here runs. On the CPU the kernels run only under Triton's interpreter (``INTERPRETED``), which the tests use
to compare them with the dense reference. Where the product takes this path is ``toeplitz.DIRECT_MAX_N``.
"""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch: no Triton, the FFT product everywhere
    triton = tl = None

AVAILABLE = triton is not None
constexpr = tl.constexpr if AVAILABLE else None  # the kernels' compile-time arguments

# Tile sizes. A program of the product computes ``ROWS_PER_PROGRAM`` rows of output tiles at once: a channel's
# sequences (its rows, at most ``BLOCK_ROWS_MAX`` a program) times consecutive output tiles of BLOCK_T positions, so
# that each tile of T it gathers (T's tiles depend only on their offset from the diagonal) serves all of them, and a
# batch of 8 fills a tensor-core product without padding. 64 rows (where the channel's rows times its tiles reach them:
# n >= 512 at the paper's batches) make each product 64 x 64 x 64, which Triton gives Hopper's warpgroup products
# (``wgmma``; 32 rows take ``mma.sync``, at about half their rate) and which doubles the products each gathered tile
# serves (benchmarks/kernel_code.py --rows 32 / 64, docs/performance.md); ``benchmarks/toeplitz_direct.py`` times 32
# and 64 side by side on a GPU. The lag gradient's products sum over rows times pairs of an output and an input tile
# at one offset, ``LAG_PRODUCT_DEPTH`` at once.
BLOCK_ROWS_MAX = 64
ROWS_PER_PROGRAM = 64
LAG_PRODUCT_DEPTH = 64
BLOCK_T = 64
LAYOUT_BLOCK = 1024  # the coefficients' layout kernel's chunk

# How many bytes of T's tile a thread loads at once. A tile's rows (T) or columns (T^T) are consecutive lags, each
# starting one element from the one before, so in one layout of the coefficients only one in eight starts aligned
# for a 16-byte load, and Triton gathers the tile two bytes at a time (fp16), each value stored to shared memory from
# a register: 32 loads and 4-32 stores a thread and tile at 64 rows a program. ``_layout_kernel`` lays the
# coefficients out LOAD_BYTES / (an element's bytes) times instead, each copy shifted by one element more than the
# one before, so that every row starts aligned in one of them; Triton then copies the tile to shared memory
# asynchronously, pipelined as it does the input's tile (8 bytes: 8 asynchronous copies a thread and tile at 64 rows,
# from 4 copies of the fp16 layout or 2 of fp32's; 16 bytes: 4, from 8 copies). The layout grows as many times (at 8
# bytes and n = 512 in fp16, 1,536 channels: 12.8 MB a bidirectional product, 7.3 MB a causal one), read through L1,
# where a tile's overlapping rows meet. 2 is one layout. ``benchmarks/kernel_code.py --load-bytes`` shows each one's
# loop, and ``benchmarks/toeplitz_direct.py`` times them side by side on a GPU.
LOAD_BYTES = 8
LOAD_BYTES_CHOICES = (2, 4, 8, 16)  # one to eight fp16 elements a load


# Whether Triton runs the kernels in its interpreter, on CPU tensors (the tests' way without a GPU): Triton decides when
# it is imported, by ``TRITON_INTERPRET=1`` (tests/conftest.py sets it on a machine without CUDA).
INTERPRETED = AVAILABLE and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def supports(x: torch.Tensor) -> bool:
    """Whether the kernels can run on ``x``'s device: Triton is there, and x is on a CUDA device (or on the CPU under
    the interpreter); fp16, bf16 or fp32 (fp64 keeps the FFT product)."""
    return supports_on(x.dtype, x.device)


def supports_on(dtype: torch.dtype, device) -> bool:
    """``supports`` for a tensor of ``dtype`` on ``device`` (a ``torch.device`` or its string; None: the CPU, where
    tensors are made by default)."""
    if not AVAILABLE or dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    kind = "cpu" if device is None else torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and INTERPRETED)


def _at_lags(k_row, size, n, lag, CAUSAL: constexpr):
    """A channel's coefficients k[lag mod size] at ``lag``, where |lag| < n (and, ``CAUSAL``, lag >= 0); 0 elsewhere."""
    valid = (lag < n) & (lag > -n)
    if CAUSAL:
        valid = valid & (lag >= 0)
    return tl.load(k_row + tl.where(lag < 0, lag + size, lag), mask=valid, other=0.0)


def _layout_kernel(k_ptr, out_ptr, scale_ptr, size, n, origin, stride, CAUSAL: constexpr, SCALE: constexpr,
                   COPIES: constexpr, BLOCK: constexpr):
    """One channel: the coefficients the product reads, by lag, in ``COPIES`` copies, each shifted by one element more
    than the one before. out[s, q] = k[lag mod size] for lag = q - s - center, center = origin - 1, where |lag| < n
    (and, ``CAUSAL``, lag >= 0), 0 elsewhere, for q < stride, each copy's row (``_apply_kernel`` reads copy s at
    q = center + s + SIGN (d BLOCK_T + b - a), all within it: ``_layout``). ``SCALE``: divided by the largest
    magnitude among the lags the product reads (1 where all are zero), in out's fp16, that magnitude stored at
    ``scale_ptr``: fp16 operands with the 10-bit significand TF32 would give them, in fp16's range whatever the
    kernel's; otherwise as they are."""
    c = tl.program_id(0).to(tl.int64)
    k_row = k_ptr + c * size
    center = origin - 1
    scale = 1.0
    if SCALE:
        largest = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, stride, BLOCK):  # the lags the product reads, then zeros (|lag| >= n)
            k = _at_lags(k_row, size, n, start + tl.arange(0, BLOCK) - center, CAUSAL)
            largest = tl.maximum(largest, tl.abs(k))
        scale = tl.max(largest, axis=0)
        scale = tl.where(scale > 0, scale, 1.0)
        tl.store(scale_ptr + c, scale)
    for s in tl.static_range(COPIES):
        for start in range(0, stride, BLOCK):
            q = start + tl.arange(0, BLOCK)
            k = _at_lags(k_row, size, n, q - s - center, CAUSAL)
            tl.store(out_ptr + (c * COPIES + s) * stride + q, (k / scale).to(out_ptr.dtype.element_ty),
                     mask=q < stride)


def _apply_kernel(x_ptr, k_ptr, scale_ptr, y_ptr, rows, n, origin, stride, SIGN: constexpr, CAUSAL: constexpr,
                  BLOCK_R: constexpr, GROUP: constexpr, BLOCK_T: constexpr, COPIES: constexpr, EVEN: constexpr,
                  PRECISION: constexpr):
    """One (channel, GROUP output tiles, BLOCK_R rows): y[r, o] = sum_i x[r, i] k[(SIGN (o - i)) mod size]; with
    ``CAUSAL`` the terms of lags SIGN (o - i) >= 0 only. The output tiles o0 + j (j < GROUP) are stacked as rows of
    one product, (GROUP BLOCK_R rows) x (BLOCK_T inputs) times the BLOCK_T x BLOCK_T tile of T at tile offset D
    (output tile minus input tile), which T's Toeplitz structure makes the same for every j: the tile is gathered once
    per D and each row j reads the input tile o0 + j - D. k: the coefficients by lag (``_layout_kernel``, ``COPIES``
    rows of ``stride`` a channel), whose zeros outside T's lags (and, ``CAUSAL``, its upper triangle) make each tile's
    gather one load at a fixed offset from D's: the tile's entry (i, o) holds lag SIGN (D BLOCK_T + o - i), read from
    the copy that starts the entry's row (T) or column (T^T) aligned to ``COPIES`` elements. ``PRECISION`` "fp16": x
    fp16 and k the scaled fp16 coefficients, the result times ``scale_ptr``'s; "tf32" or "ieee": k fp32. Both tiles
    are loaded through L1 (``.ca``): a program reads each input tile and each copy's lags once per output tile.
    ``EVEN`` (``_even``: whole tiles, rows and stacks): every row and column of every program exists, so the input
    tile's mask is only whether it is one of x's, and causal only on the side the triangle can leave."""
    c = tl.program_id(0)
    o0 = tl.program_id(1) * GROUP
    rr = tl.arange(0, GROUP * BLOCK_R)
    j = rr // BLOCK_R
    r = tl.program_id(2) * BLOCK_R + rr % BLOCK_R
    cols = tl.arange(0, BLOCK_T)
    tiles = tl.cdiv(n, BLOCK_T)
    row_ok = (r < rows) & (o0 + j < tiles)
    x_rows = x_ptr + c.to(tl.int64) * rows * n + r * n
    # The tile at offset D = 0, (inputs a, outputs b): lag SIGN (b - a), at q = center + SIGN (b - a) of the layout,
    # center = origin - 1; at D, SIGN D BLOCK_T further along. Its rows (T: along b) or columns (T^T: along a) are
    # consecutive, each starting one element before (T) or after (T^T) the one before it: the u-th of them is read
    # from the copy shifted by s = (u + 1) mod COPIES, where it starts at center + s - u = origin - COPIES ((u + 1) //
    # COPIES), a multiple of COPIES (origin is one of BLOCK_T).
    # (One copy: the same addresses written as lags, which Triton stores to shared memory in wider pieces for T^T.)
    if COPIES == 1:
        tile = k_ptr + c.to(tl.int64) * stride + (origin - 1) + SIGN * (cols[None, :] - cols[:, None])
    else:
        if SIGN > 0:
            u, v = cols[:, None], cols[None, :]
        else:
            u, v = cols[None, :], cols[:, None]
        tile = (k_ptr + c.to(tl.int64) * COPIES * stride + ((u + 1) % COPIES) * stride
                + (origin - COPIES * ((u + 1) // COPIES)) + v)
    acc = tl.zeros((GROUP * BLOCK_R, BLOCK_T), dtype=tl.float32)
    first = o0 - (tiles - 1)  # the tile offsets D = output tile - input tile this program meets
    last = tl.minimum(o0 + GROUP, tiles) - 1
    if CAUSAL:
        if SIGN > 0:  # T: the inputs up to the output
            first = 0
        else:  # T^T: the inputs from the output on
            last = 0
    for d in range(first, last + 1):
        ins_tile = o0 + j - d
        ins = ins_tile[:, None] * BLOCK_T + cols[None, :]
        if not EVEN:
            inside = (row_ok & (ins_tile >= 0))[:, None] & (ins < n)
        elif CAUSAL and SIGN > 0:  # T: the input tiles up to the output's, o0 + j - d <= o0 + j < tiles
            inside = (ins_tile >= 0)[:, None]
        elif CAUSAL:  # T^T: from the output's on (d <= 0)
            inside = (ins_tile < tiles)[:, None]
        else:
            inside = ((ins_tile >= 0) & (ins_tile < tiles))[:, None]
        x = tl.load(x_rows[:, None] + ins, mask=inside, other=0.0,
                    cache_modifier=".ca")
        w = tl.load(tile + SIGN * d * BLOCK_T, cache_modifier=".ca")
        if PRECISION == "fp16":
            acc += tl.dot(x, w)
        else:
            acc += tl.dot(x.to(tl.float32), w, input_precision=PRECISION)
    if PRECISION == "fp16":
        acc = acc * tl.load(scale_ptr + c)
    outs = (o0 + j)[:, None] * BLOCK_T + cols[None, :]
    tl.store(y_ptr + c.to(tl.int64) * rows * n + r[:, None] * n + outs, acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (outs < n))


def _lag_grad_kernel(g_ptr, x_ptr, gk_ptr, rows, n, size, offset_start, CAUSAL: constexpr, BLOCK_R: constexpr,
                     PAIRS: constexpr, BLOCK_T: constexpr, PRECISION: constexpr):
    """One (channel, tile offset D = offset_start + block: output tile t against input tile t - D; offset_start
    -(tiles - 1), or 0 for the causal lags): P[j, a] = sum over rows and such pairs of g[r, t0 + j] x[r, s0 + a], on
    the tensor cores with (PAIRS pairs) x (BLOCK_R rows) as the inner dimension; P's entry (j, a) belongs to the lag
    D BLOCK_T + j - a, so its diagonals j - a = m >= 0 go to the lags D BLOCK_T + m and those below to the lags
    (D - 1) BLOCK_T + (m + BLOCK_T). Each lag thus gets two sums, from the programs of two neighbouring offsets, added
    atomically into the zeroed gk: two terms onto zero, the same sum in either order. gk[L mod size] = sum_r sum_t
    g[r, t] x[r, t - L], for |L| < n (causal: 0 <= L < n). ``PRECISION`` "ieee" for fp32 g and x; otherwise their
    own 16-bit type (whose products the tensor cores form exactly)."""
    c = tl.program_id(0)
    d = tl.program_id(1) + offset_start
    tiles = tl.cdiv(n, BLOCK_T)
    j = tl.arange(0, BLOCK_T)
    kk = tl.arange(0, PAIRS * BLOCK_R)  # the inner dimension: (pair, row)
    base = c.to(tl.int64) * rows * n
    first = tl.maximum(d, 0)  # the output tiles t whose input tile t - d is one of x's
    last = tl.minimum(tiles, tiles + d)
    products = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
    for t in range(first, last, PAIRS):
        tile = t + kk // BLOCK_R
        for rb in range(0, tl.cdiv(rows, BLOCK_R)):
            r = rb * BLOCK_R + kk % BLOCK_R
            ok = (tile < last) & (r < rows)
            out = tile[None, :] * BLOCK_T + j[:, None]  # (BLOCK_T, inner)
            g = tl.load(g_ptr + base + r[None, :] * n + out, mask=ok[None, :] & (out < n), other=0.0)
            ins = (tile - d)[:, None] * BLOCK_T + j[None, :]  # (inner, BLOCK_T)
            x = tl.load(x_ptr + base + r[:, None] * n + ins, mask=ok[:, None] & (ins < n), other=0.0)
            if PRECISION == "ieee":
                products += tl.dot(g, x, input_precision=PRECISION)
            else:
                products += tl.dot(g, x)
    u = j[None, :]
    above = j[:, None] - u  # (j, u): the column of diagonal m = u, lag d BLOCK_T + u
    upper = tl.sum(tl.where(above >= 0, tl.gather(products, tl.maximum(above, 0), axis=1), 0.0), axis=0)
    below = above + BLOCK_T  # diagonal m = u - BLOCK_T, lag (d - 1) BLOCK_T + u
    lower = tl.sum(tl.where(below < BLOCK_T, tl.gather(products, tl.minimum(below, BLOCK_T - 1), axis=1), 0.0),
                   axis=0)
    row = gk_ptr + c.to(tl.int64) * size
    least = 0 if CAUSAL else 1 - n
    lags = d * BLOCK_T + j
    tl.atomic_add(row + tl.where(lags < 0, lags + size, lags), upper, mask=(lags >= least) & (lags < n))
    lags = lags - BLOCK_T
    tl.atomic_add(row + tl.where(lags < 0, lags + size, lags), lower, mask=(lags >= least) & (lags < n))


_KERNELS = []


def _kernels():
    """The three kernels (apply, lag gradient, layout), jitted at first use (interpreted under ``INTERPRETED``), with
    the helper the layout calls (a global, which Triton resolves when it compiles it)."""
    global _at_lags
    if not _KERNELS:
        _at_lags = triton.jit(_at_lags)
        _KERNELS.extend(triton.jit(k) for k in (_apply_kernel, _lag_grad_kernel, _layout_kernel))
    return _KERNELS


def _precision(dtype: torch.dtype) -> str:
    """How the product's operands enter the tensor cores: fp16 x with its scaled fp16 coefficients (the 10-bit
    significand TF32 would give them, at twice TF32's rate), bf16 x as TF32 (which holds it exactly) with fp32
    coefficients rounded to TF32, fp32 as it is."""
    return {torch.float16: "fp16", torch.bfloat16: "tf32"}.get(dtype, "ieee")


def _block_rows(rows: int) -> int:
    return min(BLOCK_ROWS_MAX, triton.next_power_of_2(rows))


def _stacked(block_r: int, tiles: int, target: int) -> int:
    """How many output tiles a product stacks beside ``block_r`` rows: about ``target`` rows in all, no more tiles
    than there are (``tiles``, rounded up to a power of 2), and at least 16 rows (a tensor-core product's least)."""
    return max(1, 16 // block_r, min(target // block_r, triton.next_power_of_2(tiles)))


def _same(kernel):
    return kernel


def _copies(element_size: int) -> int:
    """How many shifted copies of the layout give loads of ``LOAD_BYTES`` for coefficients of ``element_size`` bytes
    (at least one; at most 16, the copies' rows' slack)."""
    return min(16, max(1, LOAD_BYTES // element_size))


def _layout(n: int, causal: bool):
    """(origin, stride) of the coefficients' layout for length ``n``: the lags the product reads are -(origin - 1) ..
    half - 1, half = BLOCK_T ceil(n / BLOCK_T) (whole tiles), from origin = half, or BLOCK_T where causal (T's lower
    triangle and the diagonal tiles' negative lags, zero), each copy's row ``stride`` = origin + half + 16 long (room
    for copies shifted by up to 15)."""
    half = BLOCK_T * triton.cdiv(n, BLOCK_T)
    origin = BLOCK_T if causal else half
    return origin, origin + half + 16


def _coefficients(kernel: torch.Tensor, dtype: torch.dtype, n: int, causal: bool, wrap=_same):
    """The coefficients the product reads for x of ``dtype`` and length ``n``, by lag (``_layout_kernel``: (c, copies,
    stride), ``_layout``), and their scale: for fp16 x each channel's scaled to at most 1 in fp16 and the (c,) scales;
    otherwise fp32 as they are (no scale: the product reads none, and is handed the coefficients in its place).
    ``causal``: the negative lags zero."""
    c, size = kernel.shape
    origin, stride = _layout(n, causal)
    scaled = _precision(dtype) == "fp16"
    element = torch.float16 if scaled else torch.float32
    copies = _copies(element.itemsize)
    out = torch.empty(c, copies, stride, device=kernel.device, dtype=element)
    scale = torch.empty(c, device=kernel.device, dtype=torch.float32) if scaled else out
    wrap(_kernels()[2])[(c,)](kernel, out, scale, size, n, origin, stride, CAUSAL=causal, SCALE=scaled,
                              COPIES=copies, BLOCK=LAYOUT_BLOCK)
    return out, scale


def _even(rows: int, n: int, block_r: int, group: int) -> bool:
    """Whether every program of the product has all its rows and columns: n in whole tiles, the rows in whole blocks
    and the tiles in whole stacks (the paper's shapes)."""
    return n % BLOCK_T == 0 and rows % block_r == 0 and (n // BLOCK_T) % group == 0


def _apply(x: torch.Tensor, kernel: torch.Tensor, sign: int, causal: bool, wrap=_same) -> torch.Tensor:
    """x (c, rows, n) contiguous, kernel (c, size) fp32 contiguous: T x (sign 1) or T^T x (sign -1), in x's dtype;
    ``causal``: the kernel's lags 0 .. n - 1 only (its negative ones taken as the zeros a causal kernel has there).
    ``wrap``: what the Triton kernels are launched through (``torch.library.wrap_triton`` inside a ``triton_op``)."""
    c, rows, n = x.shape
    y = torch.empty_like(x)
    coefficients, scale = _coefficients(kernel, x.dtype, n, causal, wrap)
    block_r = _block_rows(rows)
    group = _stacked(block_r, triton.cdiv(n, BLOCK_T), ROWS_PER_PROGRAM)
    grid = (c, triton.cdiv(triton.cdiv(n, BLOCK_T), group), triton.cdiv(rows, block_r))
    wrap(_kernels()[0])[grid](x, coefficients, scale, y, rows, n, *_layout(n, causal), SIGN=sign, CAUSAL=causal,
                              BLOCK_R=block_r, GROUP=group, BLOCK_T=BLOCK_T, COPIES=coefficients.shape[1],
                              EVEN=_even(rows, n, block_r, group), PRECISION=_precision(x.dtype))
    return y


def _lag_grad(g: torch.Tensor, x: torch.Tensor, size: int, causal: bool, wrap=_same) -> torch.Tensor:
    """(c, size) fp32: the kernel's gradient, for g and x (c, rows, n) contiguous; ``causal``: at lags 0 .. n - 1
    only (zero at the negative ones, which a causal product does not read)."""
    c, rows, n = x.shape
    gk = torch.zeros(c, size, device=x.device, dtype=torch.float32)
    tiles = triton.cdiv(n, BLOCK_T)
    block_r = _block_rows(rows)
    offsets = tiles if causal else 2 * tiles - 1
    wrap(_kernels()[1])[(c, offsets)](g, x, gk, rows, n, size, 0 if causal else 1 - tiles, CAUSAL=causal,
                                      BLOCK_R=block_r, PAIRS=_stacked(block_r, tiles, LAG_PRODUCT_DEPTH),
                                      BLOCK_T=BLOCK_T, PRECISION="ieee" if x.dtype == torch.float32 else "native")
    return gk


class DirectToeplitz(torch.autograd.Function):
    """y = T x for x (c, rows, n) and T[t, s] = kernel[c, (t - s) mod size], kernel (c, size) fp32, size >= 2n - 1;
    ``causal``: T's upper triangle taken as zero (a causal kernel's), neither summed nor given a gradient, and
    size >= n is enough (the lags 0 .. n - 1 are the entries read)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kernel: torch.Tensor, causal: bool) -> torch.Tensor:
        x, kernel = x.contiguous(), kernel.contiguous()
        ctx.causal = causal
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, kernel)
        return _apply(x, kernel, 1, causal)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, kernel = ctx.saved_tensors
        grad = grad.contiguous()
        gx = _apply(grad, kernel, -1, ctx.causal) if ctx.needs_input_grad[0] else None
        gk = _lag_grad(grad, x, kernel.shape[-1], ctx.causal) if ctx.needs_input_grad[1] else None
        return gx, gk, None


# ``DirectToeplitz`` as torch.compile sees it (a CUDA graph of the stack records it): custom operators whose Triton
# kernels inductor calls from its compiled code (``torch.library.triton_op``), the backward traced by AOT autograd.
# Not under the interpreter, whose kernels are not ``JITFunction``s (the CPU's tests run the Function).
TRITON_OPS = AVAILABLE and not INTERPRETED and hasattr(torch.library, "triton_op")
if TRITON_OPS:
    @torch.library.triton_op("fairseq_tnn::direct_toeplitz", mutates_args=())
    def _direct_op(x: torch.Tensor, kernel: torch.Tensor, causal: bool) -> torch.Tensor:
        return _apply(x, kernel, 1, causal, torch.library.wrap_triton)

    @torch.library.triton_op("fairseq_tnn::direct_toeplitz_transposed", mutates_args=())
    def _transposed_op(x: torch.Tensor, kernel: torch.Tensor, causal: bool) -> torch.Tensor:
        return _apply(x, kernel, -1, causal, torch.library.wrap_triton)

    @torch.library.triton_op("fairseq_tnn::direct_toeplitz_lag_grad", mutates_args=())
    def _lag_grad_op(g: torch.Tensor, x: torch.Tensor, size: int, causal: bool) -> torch.Tensor:
        return _lag_grad(g, x, size, causal, torch.library.wrap_triton)

    def _op_setup(ctx, inputs, output) -> None:
        x, kernel, ctx.causal = inputs
        ctx.save_for_backward(x, kernel)

    def _op_backward(ctx, grad: torch.Tensor):
        x, kernel = ctx.saved_tensors
        grad = grad.contiguous()
        return (_transposed_op(grad, kernel, ctx.causal), _lag_grad_op(grad, x, kernel.shape[-1], ctx.causal),
                None)

    _direct_op.register_autograd(_op_backward, setup_context=_op_setup)


def _direct(x: torch.Tensor, kernel: torch.Tensor, causal: bool) -> torch.Tensor:
    """``DirectToeplitz.apply``, or under torch.compile its operator (``TRITON_OPS``)."""
    if TRITON_OPS and torch.compiler.is_compiling():
        return _direct_op(x.contiguous(), kernel.contiguous(), causal)
    return DirectToeplitz.apply(x, kernel, causal)


def direct_toeplitz(x: torch.Tensor, kernel: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """T x along x's last dim for x (c, *batch, n), T the circulant column ``kernel`` (c, size), size >= 2n - 1,
    restricted to n x n; ``causal``: its lower triangle, the lags 0 .. n - 1, which is all the product reads, so
    that a causal kernel may also be given as its lags alone (c, m), m >= n. In x's dtype, differentiable in both."""
    c, n = x.shape[0], x.shape[-1]
    y = _direct(x.reshape(c, -1, n), kernel.float(), causal)
    return y.view(x.shape)


def direct_conv(x: torch.Tensor, spectrum: torch.Tensor, size: int, causal: bool = False) -> torch.Tensor:
    """``fft_conv(x, spectrum, size, layout="dbn", causal=causal)`` by direct summation: x (c, *batch, n), spectrum
    (c, size // 2 + 1) (or with ones between, broadcasting over the batch), computed through its circulant column
    (one irfft of the spectrum, differentiable). ``causal``: the spectrum is a causal kernel's (zero at the negative
    lags, as every causal TNO's is), so only T's lower triangle is summed, half the work; the gradient reaches the
    spectrum through the lags 0 .. n - 1 only, which is the whole gradient of the parameters a causal kernel is made
    from."""
    spectrum = spectrum.reshape(spectrum.shape[0], spectrum.shape[-1])
    return direct_toeplitz(x, torch.fft.irfft(spectrum.to(torch.complex64), n=size), causal)
