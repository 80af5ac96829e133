"""The FFT Toeplitz product against the dense reference: forward and gradients, on every device (the
`device` fixture: CPU, and CUDA where present). The tests without `device` check shapes, errors and sizes:
CPU only, by design."""
import pytest
import torch

from helpers import assert_on, on, tol
from fairseq_tnn.ops.toeplitz import next_fast_len, toeplitz_dense, toeplitz_fft, toeplitz_ref

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float64: dict(rtol=1e-9, atol=1e-9)}


@pytest.fixture(params=[False, True], ids=["real", "paired"])
def paired(request, monkeypatch):
    """Both ways the product transforms its rows, on every device: one by one through real FFTs (the CPU's way), and
    two rows as one complex row (``PAIRED_FFT_DEVICES``: a GPU's way, forced on the CPU too)."""
    from fairseq_tnn.ops import toeplitz
    monkeypatch.setattr(toeplitz, "PAIRED_FFT_DEVICES", frozenset({"cpu", "cuda"} if request.param else ()))
    monkeypatch.setattr(toeplitz, "PAIR_EAGERLY", True)
    monkeypatch.setattr(toeplitz, "PAIRED_FORWARD_MIN_ROWS", 0)
    return request.param


def _inputs(n, d, dtype, causal, b=2, seed=0, device="cpu"):
    """x (b, n, d), pos (n, d), neg (n - 1, d) or None: leaves on device that require grad, drawn on CPU."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, d, generator=g, dtype=dtype, requires_grad=True)
    pos = torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True)
    neg = None if causal else torch.randn(n - 1, d, generator=g, dtype=dtype, requires_grad=True)
    return on(device, x, pos, neg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 2, 7, 64, 513, 1024, 4096])
def test_fft_matches_dense_forward_and_gradients(n, causal, dtype, device, paired):
    d = 3 if n <= 1024 else 2
    x, pos, neg = _inputs(n, d, dtype, causal, device=device)
    leaves = [t for t in (x, pos, neg) if t is not None]
    y_fast = toeplitz_fft(x, pos, neg)
    y_ref = toeplitz_ref(x, pos, neg)
    assert_on(device, y_fast, y_ref)
    scale = y_ref.abs().max().clamp(min=1)
    torch.testing.assert_close(y_fast / scale, y_ref / scale, **tol(TOL, dtype, device))
    grad_out = torch.randn_like(y_ref)
    g_fast = torch.autograd.grad(y_fast, leaves, grad_out)
    g_ref = torch.autograd.grad(y_ref, leaves, grad_out)
    for a, b in zip(g_fast, g_ref):
        if b.numel() == 0:  # n = 1 has no negative lags
            assert a.numel() == 0
            continue
        s = b.abs().max().clamp(min=1)
        torch.testing.assert_close(a / s, b / s, **tol(TOL, dtype, device))


def test_dense_matrix_is_toeplitz_with_the_right_lags():
    pos = torch.tensor([[1.0], [2.0], [3.0]])
    neg = torch.tensor([[-1.0], [-2.0]])
    t = toeplitz_dense(pos, neg)[0]
    assert t.tolist() == [[1, -1, -2], [2, 1, -1], [3, 2, 1]]
    assert toeplitz_dense(pos)[0].tolist() == [[1, 0, 0], [2, 1, 0], [3, 2, 1]]


def test_causal_output_ignores_the_future(device):
    x, pos, _ = _inputs(50, 4, torch.float64, True, b=1, device=device)
    y = toeplitz_fft(x, pos)
    jac = torch.autograd.grad(y[0, 20].sum(), x)[0][0]  # (n, d)
    assert_on(device, y, jac)
    assert jac[21:].abs().max() == 0 or jac[21:].abs().max() < 1e-12
    assert jac[:21].abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_use_fp32_ffts(dtype, device, paired):
    x, pos, neg = _inputs(300, 8, torch.float32, False, device=device)
    ref = toeplitz_ref(x.double(), pos.double(), neg.double())
    y = toeplitz_fft(x.to(dtype), pos.to(dtype), neg.to(dtype))
    assert y.dtype == dtype
    assert_on(device, y, ref)
    # error is the rounding of inputs and output to half precision, not of the FFT
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel < 2e-2


def test_fast_fft_sizes():
    assert [next_fast_len(m) for m in (1, 2, 7, 1023, 1025, 4095)] == [1, 2, 8, 1024, 1080, 4096]
    for m in range(1, 3000):
        s = next_fast_len(m)
        assert s >= m
        r = s
        for p in (2, 3, 5):
            while r % p == 0:
                r //= p
        assert r == 1


def test_bad_shapes_are_refused():
    x = torch.randn(1, 5, 2)
    with pytest.raises(ValueError, match="pos"):
        toeplitz_fft(x, torch.randn(4, 2))
    with pytest.raises(ValueError, match="neg"):
        toeplitz_fft(x, torch.randn(5, 2), torch.randn(5, 2))


# ----------------------------------------------------------------------------
# Channel-major layout ("dbn": x (d, *batch, n)) and the hand-written backward passes
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 2, 7, 64, 513])
def test_channel_major_matches_dense_forward_and_gradients(n, causal, dtype, device, paired):
    x, pos, neg = _inputs(n, 3, dtype, causal, device=device)
    xt = x.detach().permute(2, 0, 1).contiguous().requires_grad_(True)  # (d, b, n)
    post = pos.detach().t().contiguous().requires_grad_(True)  # (d, n)
    negt = None if neg is None else neg.detach().t().contiguous().requires_grad_(True)
    leaves = [t for t in (xt, post, negt) if t is not None]
    y_fast = toeplitz_fft(xt, post, negt, layout="dbn")
    y_ref = toeplitz_ref(xt, post, negt, layout="dbn")
    assert y_fast.shape == xt.shape
    assert_on(device, y_fast, y_ref)
    scale = y_ref.abs().max().clamp(min=1)
    torch.testing.assert_close(y_fast / scale, y_ref / scale, **tol(TOL, dtype, device))
    # the same operator as the default layout
    torch.testing.assert_close(y_fast.permute(1, 2, 0), toeplitz_fft(x, pos, neg).detach(), **tol(TOL, dtype, device))
    grad_out = torch.randn_like(y_ref)
    g_fast = torch.autograd.grad(y_fast, leaves, grad_out)
    g_ref = torch.autograd.grad(y_ref, leaves, grad_out)
    for a, b in zip(g_fast, g_ref):
        if b.numel() == 0:
            continue
        s = b.abs().max().clamp(min=1)
        torch.testing.assert_close(a / s, b / s, **tol(TOL, dtype, device))


def test_channel_major_takes_extra_batch_dims(device, paired):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 4, 10, generator=g, dtype=torch.float64)  # (d, b1, b2, n)
    pos, neg = torch.randn(3, 10, generator=g, dtype=torch.float64), torch.randn(3, 9, generator=g, dtype=torch.float64)
    x, pos, neg = on(device, x, pos, neg)
    y = toeplitz_fft(x, pos, neg, layout="dbn")
    assert_on(device, y)
    torch.testing.assert_close(y, toeplitz_ref(x, pos, neg, layout="dbn"))


@pytest.mark.parametrize("size,length", sorted({(size, length) for size in (8, 9, 16) for length in (1, 4, 8, size)}))
def test_kernel_rfft_backward_is_torchs(size, length, device):
    """The hand-written rfft backward (one real inverse FFT) equals torch's generic one, for kernels from one
    tap to the full FFT size (a kernel is never longer than the FFT it is zero-padded to)."""
    from fairseq_tnn.ops.toeplitz import KernelRfft
    k, cot = on(device, torch.randn(3, length, dtype=torch.float64, requires_grad=True),
                torch.randn(3, size // 2 + 1, dtype=torch.complex128))
    (g_fast,) = torch.autograd.grad(KernelRfft.apply(k, size), k, cot)
    (g_ref,) = torch.autograd.grad(torch.fft.rfft(k, n=size), k, cot)
    assert_on(device, g_fast)
    torch.testing.assert_close(g_fast, g_ref, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: torch.view_as_real(KernelRfft.apply(t, size)), (k,))


@pytest.mark.parametrize("size", [8, 9, 16])
def test_spectral_conv_backward_is_torchs(size, device):
    """SpectralConv's gradients (input, and the complex spectrum in torch's convention) equal autograd's."""
    from fairseq_tnn.ops.toeplitz import SpectralConv
    n = 5
    x, spec, cot = on(device, torch.randn(3, 2, n, dtype=torch.float64, requires_grad=True),
                      torch.randn(3, 1, size // 2 + 1, dtype=torch.complex128, requires_grad=True),
                      torch.randn(3, 2, n, dtype=torch.float64))
    y = SpectralConv.apply(x, spec, size)
    assert_on(device, y)
    y_ref = torch.fft.irfft(torch.fft.rfft(x, n=size) * spec, n=size)[..., :n]
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(torch.autograd.grad(y, (x, spec), cot), torch.autograd.grad(y_ref, (x, spec), cot)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_bad_layout_is_refused():
    with pytest.raises(ValueError, match="layout"):
        toeplitz_fft(torch.randn(1, 5, 2), torch.randn(5, 2), layout="nbd")


@pytest.mark.parametrize("wanted", ["both", "input", "spectrum"])
@pytest.mark.parametrize("spec_shape,x_shape", [((3, 1, 9), (3, 2, 5)), ((3, 9), (2, 3, 5)), ((1, 9), (4, 5))])
def test_spectral_conv_compiled_backward_is_torchs_without_complex_kernels(spec_shape, x_shape, wanted, paired):
    """Compiled, SpectralConv is the custom operator ``spectral_conv``, whose backward writes its complex products on
    the real and imaginary parts, which inductor fuses (it generates no code for complex tensors: each complex
    operation was a kernel of its own): its backward graph holds no complex operation but the FFTs and the views
    between real and complex, and its gradients are autograd's (every broadcast of the spectrum, with either gradient
    alone)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    from fairseq_tnn.ops.toeplitz import spectral_conv
    size, n = 16, x_shape[-1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*x_shape, dtype=torch.float64, generator=g, requires_grad=wanted in ("both", "input"))
    spec = torch.randn(*spec_shape, dtype=torch.complex128, generator=g, requires_grad=wanted in ("both", "spectrum"))
    cot = torch.randn(*x_shape, dtype=torch.float64, generator=g)
    backward_ops = []

    def record(gm, example_inputs):
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            if node.op == "call_function" and isinstance(value, torch.Tensor) and value.is_complex():
                backward_ops.append((node.target.__name__, value.numel()))
        return gm

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, _: g, bw_compiler=record)

    torch._dynamo.reset()  # one lambda's code object for every parametrization: each compiles afresh
    y = torch.compile(lambda a, s: spectral_conv(a, s, size), backend=backend, fullgraph=True)(x, spec)
    y_ref = torch.fft.irfft(torch.fft.rfft(x, n=size) * spec, n=size)[..., :n]
    torch.testing.assert_close(y, y_ref)
    inputs = [t for t in (x, spec) if t.requires_grad]
    for a, b in zip(torch.autograd.grad(y, inputs, cot), torch.autograd.grad(y_ref, inputs, cot)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # the FFTs (complex ones for paired rows) and the views; paired, also the two-sided spectrum made of the
    # one-sided (``two_sided``), a spectrum's worth of values, no batch-sized complex product
    batch_sized = {name for name, numel in backward_ops if numel > spec[..., :1].numel() * size}
    assert backward_ops and batch_sized <= {"_fft_c2c.default" if paired else "_fft_r2c.default",
                                            "view_as_complex.default"}, backward_ops
    assert paired or {name for name, _ in backward_ops} <= {"_fft_r2c.default", "view_as_complex.default"}, backward_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_spectral_conv_operator_is_the_function(dtype, paired):
    """``spectral_conv``, the custom operator torch.compile's graphs call for SpectralConv (``fft_conv`` under
    compile), computes SpectralConv's output and gradients, in x's dtype, with its fake implementation and autograd
    registration consistent (``torch.library.opcheck``); an fp16 x where fp16 FFTs run only in float32 anyway."""
    from fairseq_tnn.ops.toeplitz import SpectralConv, spectral_conv
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 7, generator=g).to(dtype).requires_grad_()
    spec = torch.randn(3, 1, 9, dtype=torch.complex64, generator=g, requires_grad=True)
    cot = torch.randn(3, 2, 7, generator=g).to(dtype)
    y, y_ref = spectral_conv(x, spec, 16), SpectralConv.apply(x, spec, 16)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(y, (x, spec), cot), torch.autograd.grad(y_ref, (x, spec), cot)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if dtype == torch.float32:
        torch.library.opcheck(spectral_conv, (x, spec, 16))


def test_fft_conv_calls_the_operator_under_compile():
    """Under torch.compile ``fft_conv`` hands the product to ``spectral_conv`` (one node of dynamo's graph, where the
    autograd.Function would nest its forward and backward graphs), eagerly to SpectralConv; both compute the same."""
    from fairseq_tnn.ops.toeplitz import fft_conv
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "get_attr"))
        return gm

    x = torch.randn(3, 2, 7, requires_grad=True)
    spec = torch.randn(3, 9, dtype=torch.complex64, requires_grad=True)
    torch._dynamo.reset()
    y = torch.compile(lambda a, s: fft_conv(a, s, 16, layout="dbn"), backend=backend, fullgraph=True)(x, spec)
    assert "fairseq_tnn.spectral_conv.default" in seen and not any("body" in t for t in seen), seen
    torch.testing.assert_close(y, fft_conv(x, spec, 16, layout="dbn"))


def test_inverse_ffts_are_unscaled_their_factor_on_the_spectrum(device, paired):
    """Every inverse FFT of the Toeplitz product, forward and backward (the kernel's gradient included), asks torch for
    no scaling: on CUDA torch scales an inverse FFT's output in a kernel of its own, a pass over the whole batch-sized
    output; the 1 / size is folded into the spectrum or a constant instead. The product is unchanged."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class InverseFfts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.norms = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            inverse_c2c = func.overloadpacket is torch.ops.aten._fft_c2c and not args[3]  # (paired rows)
            if func.overloadpacket is torch.ops.aten._fft_c2r or inverse_c2c:
                self.norms.append(args[2])  # normalization: 0 none, 1 by sqrt(n), 2 by n
            return func(*args, **(kwargs or {}))

    x, pos, neg = _inputs(7, 3, torch.float64, causal=False, device=device)
    with InverseFfts() as mode:
        y = toeplitz_fft(x, pos, neg)
        grads = torch.autograd.grad(y.square().sum(), (x, pos, neg))
    assert len(mode.norms) == 3 and set(mode.norms) == {0}, mode.norms  # forward, the input's and the kernel's gradients
    y_ref = toeplitz_ref(x, pos, neg)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, torch.autograd.grad(y_ref.square().sum(), (x, pos, neg))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", ["bnd", "dbn"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_are_cast_and_padded_in_one_pass(dtype, layout, device, monkeypatch):
    """A half-precision x is copied, cast, into a zeroed float32 buffer for its FFT (``padded_rfft``), forward and in
    both FFTs of the backward, instead of cast and then padded by torch (``constant_pad_nd``). Output and gradients
    equal the reference's (``fast.references()``: a cast, then the padding) to the bit."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode

    from fairseq_tnn.ops import fast, toeplitz
    monkeypatch.setattr(toeplitz, "PAIRED_FFT_DEVICES", frozenset())  # the rows one by one, as the reference

    class Pads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket is torch.ops.aten.constant_pad_nd
            return func(*args, **(kwargs or {}))

    x, pos, neg = _inputs(37, 3, torch.float32, causal=False, device=device)
    if layout == "dbn":  # x (d, b, n), kernels (d, n) and (d, n - 1)
        x, pos, neg = (t.detach().movedim(-1, 0).contiguous().requires_grad_() for t in (x, pos, neg))
    x = x.detach().to(dtype).requires_grad_()
    results = []
    for context in (contextlib.nullcontext, fast.references):
        with context(), Pads() as pads:
            y = toeplitz_fft(x, pos, neg, layout=layout)
            grads = torch.autograd.grad(y.float().square().sum(), (x, pos, neg))
        assert_on(device, y, *grads)
        results.append((y, grads, pads.count))
    (y, grads, count), (y_ref, grads_ref, count_ref) = results
    assert torch.equal(y, y_ref)
    for a, b in zip(grads, grads_ref):
        assert torch.equal(a, b)
    assert (count, count_ref) == (0, 3)  # the reference pads x forward, and the output's gradient and x backward


@pytest.mark.parametrize("batch,pairs", [((2,), True), ((4, 3), True), ((3,), False), ((1,), False)])
def test_paired_rows_replace_the_copied_inverse_ffts(batch, pairs, device, monkeypatch):
    """On a device of ``PAIRED_FFT_DEVICES`` (forced on the CPU here) the rows of an even batch dimension along
    which the kernel broadcasts go through complex FFTs two at a time, forward and backward: no complex-to-real
    inverse FFT of the activations (torch copies the input of each), only the kernel's gradient's; a batch with no
    even such dimension goes through real FFTs. Output and gradients equal the dense product's (float64)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fairseq_tnn.ops import toeplitz
    monkeypatch.setattr(toeplitz, "PAIRED_FFT_DEVICES", frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(toeplitz, "PAIR_EAGERLY", True)
    monkeypatch.setattr(toeplitz, "PAIRED_FORWARD_MIN_ROWS", 0)

    class Ffts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.c2r = self.c2c = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.c2r += func.overloadpacket is torch.ops.aten._fft_c2r
            self.c2c += func.overloadpacket is torch.ops.aten._fft_c2c
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, *batch, 19, generator=g, dtype=torch.float64)  # (d, *batch, n)
    pos = torch.randn(5, 19, generator=g, dtype=torch.float64)
    neg = torch.randn(5, 18, generator=g, dtype=torch.float64)
    x, pos, neg = (t.requires_grad_() for t in on(device, x, pos, neg))
    with Ffts() as ffts:
        y = toeplitz_fft(x, pos, neg, layout="dbn")
        grads = torch.autograd.grad(y, (x, pos, neg), torch.ones_like(y))
    # forward: fft and ifft of the pairs; backward: those of the gradient, and the fft of x's pairs again
    assert (ffts.c2r, ffts.c2c) == ((1, 5) if pairs else (3, 0)), (ffts.c2r, ffts.c2c)
    y_ref = toeplitz_ref(x, pos, neg, layout="dbn")
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, torch.autograd.grad(y_ref, (x, pos, neg), torch.ones_like(y_ref))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_rows_are_paired_where_compiled_not_eagerly(monkeypatch):
    """By default (``PAIR_EAGERLY`` off) an eager product transforms its rows one by one even on a device that pairs
    them (an eager update on a GPU is bound by the host's dispatch, which pairing adds to), while the compiled backward
    of ``spectral_conv`` pairs them (its complex-to-real inverse FFT, whose input torch copies, is gone)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    from fairseq_tnn.ops import toeplitz
    monkeypatch.setattr(toeplitz, "PAIRED_FFT_DEVICES", frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(toeplitz, "PAIR_EAGERLY", False)  # the default
    x = torch.randn(3, 2, 7, dtype=torch.float64, requires_grad=True)
    spec = torch.randn(3, 1, 9, dtype=torch.complex128, requires_grad=True)
    assert toeplitz.pair_dim(x, spec.shape) is None
    backward_ffts = []

    def record(gm, example_inputs):
        backward_ffts.extend(str(n.target) for n in gm.graph.nodes if "fft" in str(n.target))
        return gm

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, _: g, bw_compiler=record)

    torch._dynamo.reset()
    y = torch.compile(lambda a, s: toeplitz.spectral_conv(a, s, 16), backend=backend, fullgraph=True)(x, spec)
    grads = torch.autograd.grad(y, (x, spec), torch.ones_like(y))
    assert backward_ffts and all("_fft_c2c" in t for t in backward_ffts), backward_ffts
    y_ref = torch.fft.irfft(torch.fft.rfft(x, n=16) * spec, n=16)[..., :7]
    for a, b in zip(grads, torch.autograd.grad(y_ref, (x, spec), torch.ones_like(y_ref))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_forward_as_dispatched_pairs_rows_from_enough_of_them(monkeypatch):
    """Where its operations run as dispatched (a forward a CUDA graph records; eagerly here, forced), the product pairs
    its rows only from ``PAIRED_FORWARD_MIN_ROWS`` rows per kernel: its two-sided spectrum costs passes over the
    kernel's spectrum, which a small batch's saved copies do not repay (benchmarks/fft_bytes.py); traced by
    torch.compile, from two rows."""
    from fairseq_tnn.ops import fast, toeplitz
    monkeypatch.setattr(toeplitz, "PAIRED_FFT_DEVICES", frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(toeplitz, "PAIR_EAGERLY", True)
    monkeypatch.setattr(toeplitz, "PAIRED_FORWARD_MIN_ROWS", 6)  # the default
    spectrum_shape, rows = (3, 1, 9), 6
    assert toeplitz.pair_dim(torch.zeros(3, rows, 5), spectrum_shape) == 1
    assert toeplitz.pair_dim(torch.zeros(3, rows - 2, 5), spectrum_shape) is None
    assert toeplitz.pair_dim(torch.zeros(3, rows + 1, 5), spectrum_shape) is None  # enough rows, but an odd number
    monkeypatch.setattr(fast, "compiling", lambda: True)
    assert toeplitz.pair_dim(torch.zeros(3, 2, 5), spectrum_shape) == 1
