"""Toeplitz matrix-vector products, one Toeplitz matrix per channel.

Shapes: ``x`` is (batch, n, d); a kernel is given by its coefficients per lag,
``pos`` (n, d) for lags 0, 1, ..., n-1 (on and below the diagonal) and ``neg``
(n-1, d) for lags -1, -2, ..., -(n-1) (above the diagonal), so that

    y[b, i, c] = sum_j T_c[i, j] x[b, j, c],   T_c[i, j] = t_c(i - j).

``neg=None`` means a causal (lower-triangular) matrix.

Layouts. Every op takes ``layout="bnd"`` (the default above) or ``layout="dbn"``,
channel-major: ``x`` is (d, *batch, n) and the kernels are (d, n) / (d, n-1), so
the FFTs run along the contiguous last dimension. On CPU that is the biggest
lever (an FFT along a strided dimension copies the data twice), and a layer can
produce (d, batch, n) activations straight from its input projection (one GEMM
with a transposed operand), so nothing is ever transposed.

``toeplitz_fft`` embeds T in a circulant matrix of a fast FFT size >= 2n - 1 and
multiplies in the frequency domain in O(n log n); ``toeplitz_ref`` builds the
dense n x n matrices explicitly. Both have the same signature and the tests
compare them, forward and gradients. FFTs always run in float32 (or float64)
even under fp16/bf16 autocast: cuFFT's half precision only supports powers of
two and its round-off is too large for long kernels.

On a GPU, where the product is compiled or recorded into a CUDA graph (there from
``PAIRED_FORWARD_MIN_ROWS`` rows per kernel), two rows go through one complex FFT each way
(``pair_dim``, ``PAIRED_FFT_DEVICES``): the inverse is then complex-to-complex, whose input torch
does not copy as it copies a complex-to-real one's.

The FFT products have hand-written backward passes (``SpectralConv``,
``KernelRfft``): torch's generic rfft backward runs a full complex-to-complex
FFT, about 4x the cost of the real one, and materialises zero-padded copies.
The backward of y = irfft(rfft(x) * S)[:n] is another such product, with the
conjugate spectrum, so it costs one rfft and one irfft, like the forward.
"""
import contextlib
import math
from typing import Callable, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from . import fast
from .checks import check_circulant_size, check_layout, check_shape


def next_fast_len(m: int) -> int:
    """Smallest integer >= m whose only prime factors are 2, 3 and 5.

    pocketfft / MKL (CPU) and cuFFT are fastest on such sizes; powers of two win
    ties because they are tried first at equal size.
    """
    if m <= 1:
        return 1
    best = 1 << (m - 1).bit_length()  # next power of two
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            p = p35
            while p < m:
                p *= 2
            best = min(best, p)
            p35 *= 3
        p5 *= 5
    return best


def fft_dtype(x: torch.Tensor) -> torch.dtype:
    """The real dtype in which an FFT of ``x`` is computed."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# The device types with autocast, asked once at import: torch.compile (dynamo) traces a set lookup, while before
# torch 2.12 it breaks the graph at torch.amp.is_autocast_available.
AUTOCAST_DEVICE_TYPES = frozenset(d for d in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla", "ipu", "privateuseone")
                                  if torch.amp.is_autocast_available(d))


def autocast_off(device_type: str):
    """A region where autocast is off on ``device_type`` (a no-op context on a device without autocast,
    such as ``meta``, where benchmarks/memory.py runs the models)."""
    if device_type in AUTOCAST_DEVICE_TYPES:
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _half_weights(size: int, device, dtype) -> torch.Tensor:
    """(size//2+1,) 1 at DC (and Nyquist for even size), 2 elsewhere: how often a bin occurs."""
    w = torch.full((size // 2 + 1,), 2.0, device=device, dtype=dtype)
    w[0].fill_(1.0)  # fill_, not ``w[0] = 1.0``, a copy from the host (``fast.constant``)
    if size % 2 == 0:
        w[-1].fill_(1.0)
    return w


def _bin_factor(size: int, device, dtype, inverse: bool) -> torch.Tensor:
    """w / size, or 1 / w with ``inverse`` (w: ``_half_weights``; for an inverse FFT taken unscaled,
    ``_unscaled_irfft``), built once per size and device (``fast.constant``)."""
    def make():
        w = _half_weights(size, device, dtype)
        return 1 / w if inverse else w / size
    return fast.constant(("bin-factor", size, dtype, inverse), device, make)


def _unscaled_irfft(spectrum: torch.Tensor, size: int) -> torch.Tensor:
    """irfft(spectrum, n=size) * size: the inverse FFT without its 1 / size, which the callers fold into a factor
    they multiply by anyway (a spectrum of d x F values, a constant). On CUDA torch scales an inverse FFT's output in
    a pass of its own over the whole output (``_fft_apply_normalization``: one kernel reading and writing the
    batch-sized real buffer, 28 of them in a graphed causal TNN update on an H200); unscaled (``norm="forward"``
    for the inverse) there is none. On the CPU pocketfft scales inside the transform either way."""
    return torch.fft.irfft(spectrum, n=size, norm="forward")


def padded_rfft(x: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """rfft(x.to(dtype), n=size) along the last dim (x (..., n), n <= size), where x is in another dtype (fp16 or bf16
    activations, FFTs in float32) with the cast and the zero padding in one pass: x is copied, cast, into the first n
    entries of a zeroed buffer of ``size`` entries, instead of cast (a pass that reads x and writes it in ``dtype``) and
    then padded by torch (``constant_pad_nd``: the zeroed buffer, and a copy of the cast x into it). Equal to the
    reference to the bit (tests/ops/test_toeplitz.py); the same number of operations. On the 2-core CPU a TNO's
    forward and backward in bf16 took 0.88-0.94x the time (docs/performance.md). An x already in ``dtype`` (fp32
    training), under torch.compile (inductor fuses the cast and the padding into one kernel itself) and with
    ``fast.references()``: the reference."""
    n = x.shape[-1]
    if size == n or x.dtype == dtype or not fast.enabled() or fast.compiling():
        return torch.fft.rfft(x.to(dtype), n=size)
    buf = torch.zeros((*x.shape[:-1], size), dtype=dtype, device=x.device)
    buf[..., :n].copy_(x)
    return torch.fft.rfft(buf)


# The device types on which the Toeplitz product transforms two real rows as one complex row (``pair_dim``). On a GPU
# the product is bound by the bytes it moves, and torch copies the input of every complex-to-real inverse FFT before
# cuFFT runs it (cuFFT may overwrite it): a pass that reads and writes the whole batch-sized spectrum, 16 bytes per
# element of x, in the forward and in the input's gradient. Two real rows x_a, x_b taken as z = x_a + i x_b go
# through complex-to-complex FFTs of the same size, which move the same bytes as the real ones over twice the rows
# and whose inverse needs no copy: ifft(fft(z) K) = y_a + i y_b for the kernel's two-sided spectrum K (real kernel,
# Hermitian K). On the CPU pocketfft's real transforms are the cheaper (the paired forward and backward took 1.10-1.36x
# their time, docs/performance.md), so the CPU keeps them.
PAIRED_FFT_DEVICES = frozenset({"cuda"})
# Where the rows are paired: in code torch.compile traces (the compiled backward, where inductor fuses the packing,
# the two-sided spectrum and the Hermitian part into its kernels) and in a forward the stack's CUDA graphs run
# (``fast.in_cuda_graphs``: they replay its kernels, not its operations; its warm-up runs pair too, so that the
# graph records the path they ran, with its cuFFT plans made); eagerly too only with this on (the tests). An eager
# forward and backward dispatch 17 more operations a TNO paired (the packing, the two-sided spectrum, the Hermitian
# part), and an eager update on a GPU is bound by the host's dispatch, not by the bytes.
PAIR_EAGERLY = False
# The rows per kernel from which a forward that runs its operations (not traced: a CUDA graph records the custom
# operator's forward as it runs) pairs them. Its two-sided spectrum (``two_sided``) costs passes over a d x size
# spectrum, which the inverse's saved copy outweighs only from about 6 rows per kernel: counted by
# benchmarks/fft_bytes.py, paired moves 86 bytes per element of x against 91 at 8 rows, 80 against 90 at 16, and 98
# against 94 at 4 (the masked 4 x 2048). The compiled backward, where inductor fuses the spectrum's operations into its
# kernels, pairs from 2 rows.
PAIRED_FORWARD_MIN_ROWS = 6


def pair_dim(x: torch.Tensor, spectrum_shape) -> Optional[int]:
    """The dimension of x (..., n) whose rows ``spectral_conv`` pairs (even and odd entries, as real and imaginary
    parts of one complex row): the last one of even size along which the spectrum broadcasts (size 1 or absent in
    ``spectrum_shape``), on a device of ``PAIRED_FFT_DEVICES`` with the fast paths on, where ``PAIR_EAGERLY`` says,
    and, where the operations run as dispatched (not traced by torch.compile), with at least
    ``PAIRED_FORWARD_MIN_ROWS`` rows per kernel; None: the rows go through real FFTs one by one."""
    if x.device.type not in PAIRED_FFT_DEVICES or not fast.enabled():
        return None
    if not (PAIR_EAGERLY or fast.compiling() or fast.in_cuda_graphs()):
        return None
    kernels = math.prod(spectrum_shape[:-1])
    if not fast.compiling() and x.numel() // x.shape[-1] < PAIRED_FORWARD_MIN_ROWS * kernels:
        return None
    offset = x.dim() - len(spectrum_shape)
    for i in range(x.dim() - 2, -1, -1):
        broadcast = i < offset or spectrum_shape[i - offset] == 1
        if broadcast and x.shape[i] % 2 == 0:
            return i
    return None


def pack_pairs(x: torch.Tensor, dim: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    """fft of the rows of x (..., n) paired along ``dim`` (of size 2h): z = x[2j] + i x[2j+1] zero-padded to ``size``,
    z of x's shape with h for 2h along ``dim`` and ``size`` for n, complex of the real ``dtype``. x is copied, cast and
    interleaved, into a zeroed buffer in one pass (under torch.compile: cast and padded, which inductor fuses)."""
    n = x.shape[-1]
    pairs = x.unflatten(dim, (x.shape[dim] // 2, 2)).movedim(dim + 1, -1)  # (..., h, ..., n, 2)
    if fast.compiling():
        buf = torch.nn.functional.pad(pairs.to(dtype), (0, 0, 0, size - n))
    else:
        buf = torch.zeros((*pairs.shape[:-2], size, 2), dtype=dtype, device=x.device)
        buf[..., :n, :].copy_(pairs)
    return torch.fft.fft(torch.view_as_complex(buf))


def unpack_pairs(y: torch.Tensor, dim: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``pack_pairs``' pairing: the first n entries of the real and imaginary parts of y (..., size),
    as the even and odd rows along ``dim`` of a compact real tensor in ``dtype``."""
    parts = torch.view_as_real(y)[..., :n, :].movedim(-1, dim + 1)  # (..., h, 2, ..., n)
    if fast.compiling():
        return parts.to(dtype).flatten(dim, dim + 1)
    out = torch.empty(parts.shape, dtype=dtype, device=y.device)
    out.copy_(parts)
    return out.flatten(dim, dim + 1)


def _two_sided_factors(size: int, scale: float, device, dtype) -> torch.Tensor:
    """For ``two_sided``: the factors (size, 2) of each bin's real and imaginary parts, (1, 1); (1, -1) past size / 2,
    where the bin is the conjugate of bin size - f; (1, 0) at the bins the inverse real FFT takes as real (0, and
    size / 2 for an even size); each times ``scale``."""
    def make():
        factors = torch.full((size, 2), scale, device=device, dtype=dtype)
        factors[size // 2 + 1:, 1].fill_(-scale)
        factors[0, 1].fill_(0.0)  # built while the stack's graphs record the paired forward: no copy from the host
        if size % 2 == 0:
            factors[size // 2, 1].fill_(0.0)
        return factors
    return fast.constant(("two-sided", size, scale, dtype), device, make)


def two_sided(spectrum: torch.Tensor, size: int, scale: float = 1.0) -> torch.Tensor:
    """The full spectrum (..., size) that multiplies the rows' spectra as ``irfft(rfft(x) * spectrum)`` does with the
    one-sided ``spectrum`` (..., size // 2 + 1), a Hermitian one: bin f > size / 2 is conj(bin size - f), and the bins
    the inverse real FFT takes as real (0, and size / 2 for an even size) lose their imaginary parts, as it ignores
    them (a spectrum made as one, FD-TNN's bidirectional response, can have them); times ``scale``. Three operations on
    the spectrum's real view."""
    parts = torch.view_as_real(spectrum.resolve_conj())  # (..., size // 2 + 1, 2)
    mirrored = parts[..., 1:(size + 1) // 2, :].flip(-2)  # bins size // 2 + 1 .. size - 1, before conjugation
    factors = _two_sided_factors(size, scale, spectrum.device, spectrum.real.dtype)
    return torch.view_as_complex(torch.cat([parts, mirrored], dim=-2) * factors)


def one_sided_hermitian(parts: torch.Tensor, size: int) -> torch.Tensor:
    """Bins 0 .. size // 2 of (p[f] + conj(p[-f])) / 2 for p (..., size) given as its real and imaginary parts
    ``parts`` (..., size, 2), returned so: summed over the pairs of rows, with p = conj(Z) G the products of two packed
    rows' spectra (``pack_pairs``), sum_rows conj(X) G of the rows one by one (the real rows' spectra are
    (Z[f] + conj(Z[-f])) / 2 and (Z[f] - conj(Z[-f])) / 2i). On real parts, so that inductor fuses it where compiled."""
    # bins -f mod size for f = 0 .. size // 2
    mirrored = torch.cat([parts[..., :1, :], parts[..., (size + 1) // 2:, :].flip(-2)], dim=-2)
    halves = fast.constant(("hermitian-halves", parts.dtype), parts.device,
                           lambda: 0.5 - torch.arange(2, device=parts.device, dtype=parts.dtype))  # 0.5, -0.5
    # (re[f] + re[-f]) / 2, (im[f] - im[-f]) / 2
    return parts[..., : size // 2 + 1, :] * 0.5 + mirrored * halves


class KernelRfft(torch.autograd.Function):
    """rfft(k, n=size) along the last dim, k (..., L) real with L <= size.

    Backward: d/dk_t of Re <Kbar, K> is Re sum_m Kbar_m e^{+2 pi i m t / size}
    (torch's convention: the gradient of a complex tensor is dL/dRe + i dL/dIm),
    which is size * irfft(Kbar / w) with w the bin multiplicities: one real
    inverse FFT, unscaled, instead of torch's complex one.
    """

    @staticmethod
    def forward(ctx, k: torch.Tensor, size: int) -> torch.Tensor:
        ctx.size, ctx.length = size, k.shape[-1]
        return torch.fft.rfft(k, n=size)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        size = ctx.size
        gk = _unscaled_irfft(grad * _bin_factor(size, grad.device, grad.real.dtype, inverse=True), size)[..., : ctx.length]
        return gk, None


class SpectralConv(torch.autograd.Function):
    """y = irfft(rfft(x, size) * spectrum, size)[..., :n] along the last dim, returned in x's dtype.

    x (..., n) real, of any float dtype; spectrum complex, broadcastable to (..., size//2+1). The
    FFTs run in the spectrum's precision (float32 for complex64, also for an fp16 x). With S the
    spectrum, X = rfft(x) and G = rfft(dL/dy) (zero-padded to ``size``):

        dL/dx = irfft(G * conj(S))[..., :n]        (the adjoint: correlation)
        dL/dS = sum over broadcast dims of conj(X) * G * w / size

    (w = bin multiplicities, torch's complex-gradient convention, as for irfft's own backward).

    Memory: the backward keeps x itself, in its own dtype, and recomputes X (one more rfft) when the
    spectrum needs a gradient. Keeping X instead would hold size/2 + 1 (about n) complex64 values per
    sequence, 8 bytes per input element, 4x an fp16 x: it was over a quarter of a TNN layer's
    activation memory (benchmarks/memory.py). y is returned compact, not as a view of the first n
    columns of the size-long irfft buffer, which a later operator that saves y would keep alive
    whole. Every other pass over the activations counts too (on CPU they are bound by memory
    bandwidth): products are taken in place where a buffer is free and the batch reduction of dL/dS
    overwrites the recomputed X.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, spectrum: torch.Tensor, size: int) -> torch.Tensor:
        ctx.size, ctx.n = size, x.shape[-1]
        ctx.spectrum_shape = spectrum.shape
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, spectrum)
        return _spectral_product(x, spectrum, size)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, spectrum = ctx.saved_tensors
        size, n = ctx.size, ctx.n
        ct = spectrum.real.dtype
        dim = pair_dim(grad, ctx.spectrum_shape)
        gf = padded_rfft(grad, size, ct) if dim is None else pack_pairs(grad, dim, size, ct)
        gx = gs = None
        if ctx.needs_input_grad[1]:
            if dim is None:
                gs = _reduce_conj_product(padded_rfft(x, size, ct), gf, ctx.spectrum_shape)
            else:  # the pairs' products summed, then their Hermitian part: the rows' sum
                full_shape = (*ctx.spectrum_shape[:-1], size)
                products = _reduce_conj_product(pack_pairs(x, dim, size, ct), gf, full_shape)
                gs = torch.view_as_complex(one_sided_hermitian(torch.view_as_real(products), size))
            gs = gs * _bin_factor(size, gs.device, ct, inverse=False)
        if ctx.needs_input_grad[0]:
            # a conjugate copy of the spectrum (a spectrum's worth of values, 1/batch of gf's), scaled
            if dim is None:
                gx = _unscaled_irfft(gf.mul_(spectrum.conj_physical().mul_(1.0 / size)), size)[..., :n].to(grad.dtype)
            else:
                full = two_sided(spectrum.conj_physical(), size, 1.0 / size)
                gx = unpack_pairs(torch.fft.ifft(gf.mul_(full), norm="forward"), dim, n, grad.dtype)
        return gx, gs, None


def _spectral_product(x: torch.Tensor, spectrum: torch.Tensor, size: int) -> torch.Tensor:
    """``SpectralConv``'s forward: irfft(rfft(x, size) * spectrum, size)[..., :n], compact, in x's dtype."""
    n, ct = x.shape[-1], spectrum.real.dtype
    dim = pair_dim(x, spectrum.shape)
    if dim is not None:  # two rows in one complex FFT each way, no copy before the inverse (PAIRED_FFT_DEVICES)
        z = pack_pairs(x, dim, size, ct)
        full = two_sided(spectrum, size, 1.0 / size)  # the inverse FFT's 1 / size on the d x size spectrum
        return unpack_pairs(torch.fft.ifft(z.mul_(full), norm="forward"), dim, n, x.dtype)
    xf = padded_rfft(x, size, ct)  # (..., size//2+1)
    y = _unscaled_irfft(xf.mul_(spectrum * (1.0 / size)), size)[..., :n]  # the 1 / size on the d x F spectrum
    return y.to(x.dtype) if x.dtype != ct else y.contiguous()


# ``SpectralConv`` as torch.compile sees it: one custom operator whose backward, the same as the Function's
# (``_compiled_backward``), AOT autograd traces into the compiled backward, where inductor fuses its products. Not the
# autograd.Function itself: dynamo traces a Function's forward and backward into graphs nested in the caller's, and
# under torch 2.11 those of a Function that saves tensors carry inputs without metadata, on which dynamo's comparison
# of two regions fails (``KeyError: example_value``), so that the layers of a stack could not share one compiled
# region (models/compile.py, ``STACK_REGIONS``). The operator's forward runs as eagerly (three kernels and the FFTs);
# the Function's, traced, let inductor fuse the cast of x into the kernel that made it.
@torch.library.custom_op("fairseq_tnn::spectral_conv", mutates_args=())
def spectral_conv(x: torch.Tensor, spectrum: torch.Tensor, size: int) -> torch.Tensor:
    """``SpectralConv.apply(x, spectrum, size)`` as a custom operator, for torch.compile's graphs (``fft_conv``)."""
    return _spectral_product(x, spectrum, size)


@spectral_conv.register_fake
def _spectral_conv_fake(x: torch.Tensor, spectrum: torch.Tensor, size: int) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _spectral_conv_setup(ctx, inputs, output) -> None:
    x, spectrum, size = inputs
    ctx.size, ctx.n, ctx.spectrum_shape = size, x.shape[-1], spectrum.shape
    ctx.save_for_backward(x, spectrum)


def _spectral_conv_backward(ctx, grad: torch.Tensor):
    x, spectrum = ctx.saved_tensors
    dim = pair_dim(grad, ctx.spectrum_shape)
    ct = spectrum.real.dtype
    gf = padded_rfft(grad, ctx.size, ct) if dim is None else pack_pairs(grad, dim, ctx.size, ct)
    return _compiled_backward(ctx, x, spectrum, gf, grad.dtype, dim)


spectral_conv.register_autograd(_spectral_conv_backward, setup_context=_spectral_conv_setup)


def _compiled_backward(ctx, x: torch.Tensor, spectrum: torch.Tensor, gf: torch.Tensor, grad_dtype: torch.dtype,
                       dim: Optional[int] = None):
    """The backward of ``spectral_conv``, ``SpectralConv`` as torch.compile's graphs call it, from gf = rfft(dL/dy)
    (or, with ``dim``, the FFT of dL/dy's rows paired along it, ``pack_pairs``):
    ``SpectralConv.backward``'s gradients, with the complex products written on the real and imaginary parts
    (``torch.view_as_real``). Inductor generates no code for complex tensors: each complex operation of the eager
    backward (the conjugate, the product, the batch sum, the product with the conjugate spectrum) is a kernel of its
    own that reads and writes batch-sized complex buffers (the graphed causal TNN update ran 14 conjugate kernels and
    7 complex products on an H200, docs/performance.md).
    On the real parts inductor fuses them: dL/dS in one reduction that reads X and G once, G * conj(S) in one
    elementwise kernel. In eager mode the real form would dispatch six operations for each complex one."""
    size, n = ctx.size, ctx.n
    ct = spectrum.real.dtype
    g = torch.view_as_real(gf)
    gr, gi = g[..., 0], g[..., 1]
    gx = gs = None
    if ctx.needs_input_grad[1]:
        xf = padded_rfft(x, size, ct) if dim is None else pack_pairs(x, dim, size, ct)
        xr_xi = torch.view_as_real(xf)
        xr, xi = xr_xi[..., 0], xr_xi[..., 1]
        w = _bin_factor(size, gf.device, ct, inverse=False)
        # conj(X) * G = (xr gr + xi gi) + i (xr gi - xi gr), summed where the spectrum broadcasts
        shape = ctx.spectrum_shape if dim is None else (*ctx.spectrum_shape[:-1], size)
        parts = torch.stack([(xr * gr + xi * gi).sum_to_size(shape), (xr * gi - xi * gr).sum_to_size(shape)], dim=-1)
        if dim is not None:  # the Hermitian part of the pairs' products
            parts = one_sided_hermitian(parts, size)
        gs = torch.view_as_complex(parts * w.unsqueeze(-1))  # times w / size
    if ctx.needs_input_grad[0]:
        # the inverse FFT's 1 / size (as ``_unscaled_irfft``)
        s = torch.view_as_real(spectrum) * (1.0 / size) if dim is None else torch.view_as_real(
            two_sided(spectrum, size, 1.0 / size))
        sr, si = s[..., 0], s[..., 1]
        # G * conj(S) = (gr sr + gi si) + i (gi sr - gr si)
        product = torch.view_as_complex(torch.stack([gr * sr + gi * si, gi * sr - gr * si], dim=-1))
        if dim is None:
            gx = _unscaled_irfft(product, size)[..., :n].to(grad_dtype)
        else:
            gx = unpack_pairs(torch.fft.ifft(product, norm="forward"), dim, n, grad_dtype)
    return gx, gs, None


def _reduce_conj_product(a: torch.Tensor, b: torch.Tensor, shape) -> torch.Tensor:
    """sum of conj(a) * b over the dims where ``shape`` broadcasts (a, b of equal shape).

    Overwrites ``a`` (the recomputed forward spectrum, not needed afterwards): conjugating and
    multiplying in place, then summing, beat ``torch.linalg.vecdot`` (which materialises
    the product and then clones it) by ~20%."""
    return a.conj_physical_().mul_(b).sum_to_size(shape)


def seq_shape(x: torch.Tensor, layout: str) -> Tuple[int, int]:
    """(n, d) of activations x: (..., n, d) for ``bnd``, (d, *batch, n) for ``dbn``."""
    check_layout(layout)
    return (x.shape[-2], x.shape[-1]) if layout == "bnd" else (x.shape[-1], x.shape[0])


def swap_kernel_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A 2-D kernel or spectrum between the two layouts: (F, d) for ``bnd``, (d, F) for ``dbn``.

    Transposed for ``bnd``, unchanged for ``dbn``, so the same call converts either way: to the
    channel-major form the last-dim FFTs use, and back."""
    return t.t() if layout == "bnd" else t


def circulant_column(pos: torch.Tensor, neg: torch.Tensor, size: int) -> torch.Tensor:
    """First column (d, size) of the circulant matrix that embeds T: lags 0 .. n-1, zeros, lags -(n-1) .. -1.

    pos (d, n), neg (d, n-1). (A causal T needs no column: its zero padding happens inside the FFT.)"""
    n = pos.shape[-1]
    return torch.cat([pos, pos.new_zeros(pos.shape[0], size - 2 * n + 1), neg.flip(-1)], dim=-1)


def circulant_lags(n: int, size: int, device=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The lag held by each entry of the circulant's first column (``circulant_column``'s layout).

    Returns ``lags`` (size,) float32: 0 .. n-1, then 0 on the ``size - 2n + 1`` padding slots, then
    -(n-1) .. -1; and ``weights`` (size,) float32, 1 on the lags and 0 on the padding slots (None when
    size = 2n - 1 leaves no padding). A kernel given as a function of the lag is then evaluated on
    the circulant column directly, ``f(lags) * weights``, equal to ``circulant_column(f(0 .. n-1),
    f(-1 .. -(n-1)), size)`` without building and concatenating the two halves. The branch is taken
    on Python integers: no device sync, no graph break under torch.compile."""
    check_circulant_size(size, n)
    t = torch.arange(size, device=device)
    lags = torch.where(t < n, t, t - size)
    if size == 2 * n - 1:
        return lags.to(torch.float32), None
    valid = (t < n) | (t > size - n)
    return torch.where(valid, lags, torch.zeros_like(lags)).to(torch.float32), valid.to(torch.float32)


# A Toeplitz kernel as a function of the lag: coefficients(lags (m,), weights (m,) or None) -> (d, m),
# the coefficient of each channel at each (float) lag, multiplied by its weight.
LagFunction = Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def lag_function_spectrum(coefficients: LagFunction, n: int, size: int, causal: bool, device=None) -> torch.Tensor:
    """(d, size // 2 + 1) rfft of the circulant embedding of T[i, j] = coefficients(i - j), n x n.

    Causal: lags 0 .. n-1 only (the FFT zero-pads them to ``size``). Bidirectional: ``coefficients``
    is evaluated once on the circulant column (``circulant_lags``). Equal to
    ``kernel_spectrum(pos, neg, size, layout="dbn")`` with pos, neg the coefficients at lags 0 .. n-1
    and -1 .. -(n-1) (tests/ops/test_toeplitz.py), computed in float32 (float64 for float64
    coefficients), with ``KernelRfft``'s one-real-FFT backward."""
    if causal:
        k = coefficients(torch.arange(n, device=device, dtype=torch.float32), None)  # (d, n)
    else:
        k = coefficients(*circulant_lags(n, size, device))  # (d, size)
    return KernelRfft.apply(k.to(fft_dtype(k)), size)


def kernel_spectrum(pos: torch.Tensor, neg: Optional[torch.Tensor], size: int, layout: str = "bnd") -> torch.Tensor:
    """rfft of the circulant embedding of T, in complex64/128.

    ``bnd``: pos (n, d), neg (n-1, d) -> (size // 2 + 1, d); ``dbn``: pos (d, n),
    neg (d, n-1) -> (d, size // 2 + 1).
    """
    check_layout(layout)
    ct = fft_dtype(pos)
    p = swap_kernel_layout(pos, layout).to(ct)  # (d, n)
    if neg is None:
        spec = KernelRfft.apply(p, size)  # zero-padded to size inside the FFT
    else:
        spec = KernelRfft.apply(circulant_column(p, swap_kernel_layout(neg, layout).to(ct), size), size)
    return swap_kernel_layout(spec, layout)


def spectrum_kernel(spectrum: torch.Tensor, size: int, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``kernel_spectrum`` (``dbn``): the Toeplitz coefficients that a circulant spectrum
    (d, size // 2 + 1), size >= 2n - 1, applies to sequences of length n: pos (d, n) for lags
    0 .. n-1 (column entries 0 .. n-1) and neg (d, n-1) for lags -1 .. -(n-1) (entries size-1 down
    to size-n+1). ``fft_conv(x, spectrum, size)`` equals ``toeplitz_ref(x, pos, neg)`` for such x."""
    check_circulant_size(size, n)
    column = torch.fft.irfft(spectrum, n=size)  # (d, size)
    return column[:, :n], column[:, size - n + 1:].flip(-1)


# The longest sequence whose ``fft_conv`` (``dbn``) runs by direct summation on tensor cores where its kernels can
# (``toeplitz_direct``: Triton and a CUDA device; compiled too, as Triton operators), the same function and gradients;
# 0: the FFT product everywhere. 0 until a GPU has measured the two side by side (benchmarks/toeplitz_direct.py).
DIRECT_MAX_N = 0


def direct_product(n: int, dtype: torch.dtype, device) -> bool:
    """Whether a ``dbn`` product of n positions on a tensor of ``dtype`` on ``device`` runs by direct summation here:
    n <= ``DIRECT_MAX_N`` and the kernels run there (``toeplitz_direct.supports_on``), compiled too where they are
    Triton operators (``TRITON_OPS``: not under the interpreter)."""
    if n > DIRECT_MAX_N:
        return False
    from . import toeplitz_direct  # imports Triton: only where asked for
    return toeplitz_direct.supports_on(dtype, device) and (toeplitz_direct.TRITON_OPS or not fast.compiling())


def fft_conv(x: torch.Tensor, spectrum: torch.Tensor, size: int, layout: str = "bnd", causal: bool = False) -> torch.Tensor:
    """y = first n of irfft(rfft(x, size) * spectrum), in x's dtype.

    ``bnd``: x (..., n, d), spectrum (size // 2 + 1, d); ``dbn``: x (d, *batch, n),
    spectrum (d, size // 2 + 1). The FFTs run along the last dimension in both
    cases; ``bnd`` pays for the two transposing copies. ``dbn`` products of up to ``DIRECT_MAX_N`` positions run by
    direct summation instead (``toeplitz_direct.direct_conv``), which with ``causal`` (the spectrum is a causal
    kernel's, zero at the negative lags) sums the lower triangle only; the FFT product is the same either way.
    """
    check_layout(layout)
    if layout == "dbn" and direct_product(x.shape[-1], x.dtype, x.device):
        from . import toeplitz_direct
        return toeplitz_direct.direct_conv(x, spectrum, size, causal)
    cdt = torch.complex128 if fft_dtype(x) == torch.float64 else torch.complex64
    spec = spectrum.to(cdt)
    conv = spectral_conv if fast.compiling() else SpectralConv.apply  # the same function and gradients
    if layout == "bnd":  # spectrum (d, F) broadcasts over the leading dims of x^T (..., d, n)
        return conv(x.transpose(-1, -2), spec.t(), size).transpose(-1, -2)
    spec = spec.reshape(spec.shape[0], *([1] * (x.dim() - 2)), spec.shape[-1])  # (d, 1.., F)
    return conv(x, spec, size)


def toeplitz_fft(x: torch.Tensor, pos: torch.Tensor, neg: Optional[torch.Tensor] = None,
                 layout: str = "bnd") -> torch.Tensor:
    """T x by FFT. ``bnd``: x (b, n, d), pos (n, d), neg (n-1, d) or None (causal);
    ``dbn``: x (d, *batch, n), pos (d, n), neg (d, n-1) or None."""
    n, _ = seq_shape(x, layout)
    check_toeplitz_args(x, pos, neg, layout)
    size = next_fast_len(2 * n - 1)  # no wrap-around for lags up to n-1 either way
    return fft_conv(x, kernel_spectrum(pos, neg, size, layout), size, layout)


def causal_toeplitz_tail(x: torch.Tensor, kernel: torch.Tensor, start: int,
                         reversed_kernel: bool = False) -> torch.Tensor:
    """Outputs start .. n-1 of a causal Toeplitz product, y[t] = sum_{s <= t} kernel[t - s] x[s].

    Channel-major (``dbn``) only: x (d, *batch, n), kernel (d, L) with L >= n (lag t at index t, as
    built once for the longest sequence and reused for every shorter one; with ``reversed_kernel``,
    lag t at index L - 1 - t, so that the lags n-1 .. 0 a new position needs are the contiguous last n
    columns). Returns (d, *batch, n - start) in x's dtype. This is the step of incremental decoding:
    with the inputs of the positions decoded so far kept in x, one new position costs one weighted sum
    over them (O(d batch n), bound by reading x once); several new positions at once go through the FFT
    (``toeplitz_fft``). Equal to ``toeplitz_ref(x, kernel[:, :n], layout="dbn")[..., start:]``.
    """
    d, n = x.shape[0], x.shape[-1]
    if kernel.dim() != 2 or kernel.shape[0] != d or kernel.shape[1] < n:
        raise ValueError(f"kernel must have shape ({d}, L) with L >= n = {n}, got {tuple(kernel.shape)}")
    if not 0 <= start < n:
        raise ValueError(f"start must be in [0, n) = [0, {n}), got {start}")
    if n - start == 1:
        ct = fft_dtype(x)
        k_rev = kernel[:, kernel.shape[1] - n:] if reversed_kernel else kernel[:, :n].flip(-1)  # lags n-1 .. 0
        rows = x.reshape(d, -1, n).to(ct)  # (d, batch, n)
        y = (rows * k_rev.to(ct).unsqueeze(1)).sum(-1)  # (d, batch): sum_s k[n-1-s] x[s]
        return y.reshape(*x.shape[:-1], 1).to(x.dtype)
    k = kernel[:, kernel.shape[1] - n:].flip(-1) if reversed_kernel else kernel[:, :n]
    return toeplitz_fft(x, k, None, layout="dbn")[..., start:]


def toeplitz_dense(pos: torch.Tensor, neg: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The explicit (d, n, n) Toeplitz matrices (``bnd`` kernels: pos (n, d), neg (n-1, d))."""
    n, d = pos.shape
    lag = torch.arange(n, device=pos.device)
    lag = lag[:, None] - lag[None, :]  # (n, n): i - j
    if neg is None:
        neg = pos.new_zeros(max(n - 1, 0), d)
    coeffs = torch.cat([neg.flip(0), pos], dim=0)  # lags -(n-1) ... n-1
    return coeffs[lag + n - 1].permute(2, 0, 1)  # (d, n, n)


def toeplitz_ref(x: torch.Tensor, pos: torch.Tensor, neg: Optional[torch.Tensor] = None,
                 layout: str = "bnd") -> torch.Tensor:
    """Dense reference for ``toeplitz_fft``: explicit matrices, O(n^2 d)."""
    check_layout(layout)
    check_toeplitz_args(x, pos, neg, layout)
    if layout == "dbn":
        t = toeplitz_dense(pos.t(), None if neg is None else neg.t())  # (d, n, n)
        return torch.einsum("cij,c...j->c...i", t.to(x.dtype), x)
    t = toeplitz_dense(pos, neg)  # (d, n, n)
    return torch.einsum("cij,bjc->bic", t.to(x.dtype), x)


def check_toeplitz_args(x: torch.Tensor, pos: torch.Tensor, neg: Optional[torch.Tensor], layout: str = "bnd") -> None:
    """The kernels of ``toeplitz_fft`` / ``toeplitz_ref`` fit x: pos (n, d), neg (n-1, d) or None (``dbn``: transposed)."""
    n, d = seq_shape(x, layout)
    want_pos, want_neg = ((n, d), (n - 1, d)) if layout == "bnd" else ((d, n), (d, n - 1))
    check_shape("pos", pos, want_pos, f"for layout {layout!r}")
    if neg is not None:
        check_shape("neg", neg, want_neg, f"for layout {layout!r}")
