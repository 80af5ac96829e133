"""The Toeplitz product by direct summation (``fairseq_tnn/ops/toeplitz_direct.py``, Triton kernels) against the dense
reference: forward and every gradient, through the spectrum as the TNOs hand it, on every device (the ``device``
fixture: the CPU under Triton's interpreter, CUDA where present, compiled)."""
import os

import pytest
import torch

from benchmarks.opcount import count
from helpers import compile_for_hopper, on, rel, require_triton
from fairseq_tnn.ops import toeplitz, toeplitz_direct
from fairseq_tnn.ops.toeplitz import fft_conv, kernel_spectrum, next_fast_len, toeplitz_ref


@pytest.fixture(autouse=True)
def triton_kernels(request):
    """Triton, and on the CPU its interpreter (``INTERPRETED``); the tests without a device need Triton only."""
    require_triton(request, device_less_on_cpu=False)


def _case(n, batch, causal, dtype, device, seed=0):
    """x (d, *batch, n) in ``dtype``, pos (d, n) and neg (d, n - 1) (None where causal) in fp32: leaves on ``device``."""
    g = torch.Generator().manual_seed(seed)
    d = 3
    x = torch.randn(d, *batch, n, generator=g).to(dtype).requires_grad_()
    pos = (torch.randn(d, n, generator=g) / n ** 0.5).requires_grad_()
    neg = None if causal else (torch.randn(d, n - 1, generator=g) / n ** 0.5).requires_grad_()
    return on(device, x, pos, neg)


def _reference(x, pos, neg, cot):
    """The dense product in fp64 and its gradients (x, pos, neg)."""
    leaves = [t.detach().double().requires_grad_() for t in (x, pos, neg) if t is not None]
    xr, pr = leaves[0], leaves[1]
    nr = leaves[2] if neg is not None else None
    y = toeplitz_ref(xr, pr, nr, layout="dbn")
    return (y, *torch.autograd.grad(y, leaves, cot.double()))


def _direct(x, pos, neg, cot, size, causal=False):
    """The direct product of the spectrum a TNO would hand (``kernel_spectrum``), and its gradients (x, pos, neg)."""
    leaves = [t for t in (x, pos, neg) if t is not None]
    y = toeplitz_direct.direct_conv(x, kernel_spectrum(pos, neg, size, layout="dbn"), size, causal)
    return (y, *torch.autograd.grad(y, leaves, cot))


def _assert_close(got, want, rel):
    assert len(got) == len(want)
    for name, g, w in zip(("output", "x grad", "pos grad", "neg grad"), got, want):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        if not w.numel():
            continue
        err = (g.double() - w).abs().max().item()
        scale = w.abs().max().item()
        assert err <= rel * scale + 1e-12, f"{name}: max difference {err:.3g} against {rel} x {scale:.3g}"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("n,batch", [(1, (2,)), (2, (3,)), (7, (2, 3)), (64, (2,)), (65, (17,)), (130, (5,)),
                                     (20, (70,)), (300, (2, 8)), (128, (2, 4))])
def test_direct_matches_dense_forward_and_gradients(n, batch, causal, device):
    """fp32 x: one tile and several (n = 64, 65, 130, 300: output, input and lag blocks, partial ones; at 300 with 16
    rows, several programs of stacked output tiles per channel and the lag gradient's tile pairs in two products),
    rows of one tile and of two (70 > 64), whole tiles, rows and stacks (128 x 8: ``EVEN``, the input tile's mask
    only whether it is one of x's), extra batch dimensions, the circulant's sizes from ``next_fast_len``
    (padding between the lags) and 2n - 1 (none). A causal kernel both ways: the whole matrix summed, and its lower triangle only
    (``causal``), whose gradient of the kernel's lags is the same."""
    x, pos, neg = _case(n, batch, causal, torch.float32, device)
    rows = x[0].numel() // n
    block_r = toeplitz_direct._block_rows(rows)
    tiles = -(-n // toeplitz_direct.BLOCK_T)
    even = toeplitz_direct._even(rows, n, block_r,
                                 toeplitz_direct._stacked(block_r, tiles, toeplitz_direct.ROWS_PER_PROGRAM))
    assert even == (n == 128), (n, batch)
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(device)
    want = _reference(x, pos, neg, cot)
    for size in sorted({next_fast_len(2 * n - 1), 2 * n - 1}):
        for triangle in ([False, True] if causal else [False]):
            _assert_close(_direct(x, pos, neg, cot, size, triangle), want, rel=1e-5)


def test_the_causal_product_sums_the_lower_triangle_only(device):
    """With ``causal`` the kernel's negative lags are not read: a two-sided kernel gives the product of its causal
    part, and no gradient at the negative lags."""
    x, pos, neg = _case(130, (3,), False, torch.float32, device)
    size = next_fast_len(259)
    kernel = torch.fft.irfft(kernel_spectrum(pos, neg, size, layout="dbn"), n=size).detach().requires_grad_()
    y = toeplitz_direct.direct_toeplitz(x, kernel, causal=True)
    torch.testing.assert_close(y, toeplitz_ref(x, pos, None, layout="dbn"), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert kernel.grad[:, 130:].abs().max() == 0 and kernel.grad[:, :130].abs().min() > 0


def test_direct_matches_dense_for_half_inputs(device):
    """fp16 x (and bf16 on CUDA): the output in x's dtype; fp16 x meets its kernel's coefficients scaled into fp16,
    bf16 x enters the tensor cores as TF32 on a GPU."""
    dtypes = [torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        x, pos, neg = _case(130, (4,), False, dtype, device)
        cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
        got = _direct(x, pos, neg, cot, next_fast_len(259))
        assert got[0].dtype == dtype and got[1].dtype == dtype
        _assert_close(got, _reference(x, pos, neg, cot), rel=1e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("load_bytes", [2, 4, 8, 16])
def test_every_loads_width_lays_out_shifted_copies_and_gives_the_dense_product(load_bytes, device, monkeypatch):
    """``LOAD_BYTES``: the coefficients laid out in load_bytes / (an element's bytes) copies (fp16's for fp16 x,
    fp32's otherwise; at least one), copy s the first shifted by s elements; the product reading each tile's rows
    from the copy that starts them aligned gives the dense product and its gradients, fp32 and fp16, T and T^T (the
    backward), whole and causal, over several tiles."""
    monkeypatch.setattr(toeplitz_direct, "LOAD_BYTES", load_bytes)
    for dtype, element in ((torch.float32, 4), (torch.float16, 2)):
        kernel = torch.randn(3, 300, generator=torch.Generator().manual_seed(2)).to(device)
        copies = max(1, load_bytes // element)
        # 130 positions in whole tiles: 192; the lags from -191 (causal: -63, the diagonal tiles' zeros) to 191
        for causal, origin in ((False, 192), (True, 64)):
            layout, _ = toeplitz_direct._coefficients(kernel, dtype, 130, causal)
            assert layout.shape == (3, copies, origin + 192 + 16), layout.shape
            for shift in range(1, copies):
                assert torch.equal(layout[:, shift, shift:], layout[:, 0, :-shift])
                assert not layout[:, shift, :shift].any()
            # lag 0 at origin - 1 of the first copy, lag 1 after it and lag -1 (kernel[-1]; causal 0) before it
            lags = layout[:, 0, origin - 2:origin + 1].float()
            want = torch.stack([kernel[:, -1] * (not causal), kernel[:, 0], kernel[:, 1]], 1)
            torch.testing.assert_close(lags / lags.abs().amax(1, keepdim=True),
                                       want / want.abs().amax(1, keepdim=True), rtol=2e-3 if element == 2 else 1e-6,
                                       atol=0)
            # zero where |lag| >= n, and causal at the negative lags
            assert not layout[:, 0, origin + 129:].any()
            assert not layout[:, 0, :origin - 1 if causal else origin - 130].any()
        for causal in (False, True):
            x, pos, neg = _case(130, (5,), causal, dtype, device)
            cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
            got = _direct(x, pos, neg, cot, next_fast_len(259), causal)
            _assert_close(got, _reference(x, pos, neg, cot), rel=2e-3 if element == 2 else 1e-5)


@pytest.mark.parametrize("magnitude,x_scale", [(1e-6, 1e3), (1e7, 1e-4)])
def test_fp16_products_scale_each_channels_coefficients(magnitude, x_scale, device):
    """fp16 x takes fp16 coefficients, each channel's divided by its largest before the cast and the product multiplied
    back: kernels far below fp16's range (1e-6: their coefficients would round to zero) and above it (1e7: to
    infinity), each channel beside one of ordinary size, give the dense product to fp16's precision, forward and
    gradients (x and its output's gradient scaled so that the fp16 results are in fp16's normal range)."""
    x, pos, neg = _case(130, (4,), False, torch.float16, device)
    with torch.no_grad():
        x *= x_scale
        pos[1:] *= magnitude
        neg[1:] *= magnitude
    cot = (torch.randn(x.shape, generator=torch.Generator().manual_seed(1)) * x_scale).to(device=device,
                                                                                       dtype=torch.float16)
    want = _reference(x, pos, neg, cot)
    got = _direct(x, pos, neg, cot, next_fast_len(259))
    for channel in range(3):
        _assert_close([t[channel] for t in got], [t[channel] for t in want], rel=2e-3)


def test_fft_conv_takes_the_direct_product_up_to_direct_max_n(device, monkeypatch):
    """``DIRECT_MAX_N``: eager ``dbn`` products of up to that many positions run the kernels (counted), longer ones
    and the ``bnd`` layout the FFTs; the results agree with the FFT product's."""
    calls = []
    apply = toeplitz_direct._apply
    monkeypatch.setattr(toeplitz_direct, "_apply", lambda *a: calls.append(a[0].shape) or apply(*a))
    x, pos, neg = _case(40, (2,), False, torch.float32, device)
    size = next_fast_len(79)
    spectrum = kernel_spectrum(pos, neg, size, layout="dbn")
    fft = fft_conv(x, spectrum, size, layout="dbn")
    assert not calls  # DIRECT_MAX_N = 0: the FFT product everywhere
    monkeypatch.setattr(toeplitz, "DIRECT_MAX_N", 40)
    direct = fft_conv(x, spectrum, size, layout="dbn")
    assert calls == [(3, 2, 40)]
    assert not torch.allclose(fft_conv(x, spectrum, size, layout="dbn", causal=True), fft, atol=1e-3)  # a triangle
    calls.pop()
    torch.testing.assert_close(direct, fft, rtol=1e-5, atol=1e-5)
    fft_conv(x.transpose(0, 2), spectrum.t(), size, layout="bnd")
    monkeypatch.setattr(toeplitz, "DIRECT_MAX_N", 39)
    fft_conv(x, spectrum, size, layout="dbn")
    assert len(calls) == 1


def test_direct_supports_names_what_it_runs_on(monkeypatch):
    """fp64 keeps the FFT product; the CPU runs the kernels only under the interpreter."""
    assert not toeplitz_direct.supports(torch.zeros(2, dtype=torch.float64))
    monkeypatch.setattr(toeplitz_direct, "INTERPRETED", True)
    assert toeplitz_direct.supports(torch.zeros(2))
    assert toeplitz_direct.supports_on(torch.float16, None) and toeplitz_direct.supports_on(torch.bfloat16, "cpu")
    monkeypatch.setattr(toeplitz_direct, "INTERPRETED", False)
    assert not toeplitz_direct.supports(torch.zeros(2))
    assert not toeplitz_direct.supports_on(torch.float32, None)
    assert toeplitz_direct.supports_on(torch.float32, "cuda:1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compiled_direct_product_equals_eager(device, dtype, monkeypatch):
    """Under torch.compile (a CUDA graph of the stack records it) the product runs as Triton operators
    (``TRITON_OPS``) in one graph: the same output and gradients as eagerly. CUDA only: the CPU runs Triton's kernels
    in its interpreter, whose kernels the operators cannot launch."""
    if device != "cuda":
        pytest.skip("compiled Triton operators need a CUDA device (the CPU interprets the kernels eagerly)")
    assert toeplitz_direct.TRITON_OPS
    monkeypatch.setattr(toeplitz, "DIRECT_MAX_N", 512)
    x, pos, neg = _case(130, (4,), False, dtype, device)
    size = next_fast_len(259)
    spectrum = kernel_spectrum(pos, neg, size, layout="dbn").detach().requires_grad_()
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)

    def product(x, spectrum):
        return fft_conv(x, spectrum, size, layout="dbn")

    def with_gradients(fn):
        y = fn(x, spectrum)
        return (y, *torch.autograd.grad(y, (x, spectrum), cot))

    torch._dynamo.reset()
    compiled = with_gradients(torch.compile(product, fullgraph=True))
    eager = with_gradients(product)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("tno_type", ["tnn", "fd"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_the_tnos_train_the_same_with_the_direct_product(tno_type, causal, device, monkeypatch):
    """A TNN and an FD-TNN TNO, causal (the lower triangle summed: their spectra are of causal kernels) and
    bidirectional: output and every parameter's gradient with ``DIRECT_MAX_N`` on equal those with the FFT product."""
    from fairseq_tnn.modules.tno import build_tno
    torch.manual_seed(0)
    tno = build_tno(tno_type, 6, causal).to(device)
    x = torch.randn(6, 3, 50, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(device)

    def run():
        y = tno(x, layout="dbn")
        leaves = [x, *tno.parameters()]
        return (y, *torch.autograd.grad(y, leaves, cot))

    calls = []
    apply = toeplitz_direct._apply
    monkeypatch.setattr(toeplitz_direct, "_apply", lambda *a: calls.append(a[3]) or apply(*a))
    fft = run()
    monkeypatch.setattr(toeplitz, "DIRECT_MAX_N", 50)
    direct = run()
    assert calls == [causal, causal]  # forward and the input's gradient, the triangle where causal
    assert len(direct) == len(fft) >= 3  # y, x and at least the RPE's weights
    for got, want in zip(direct, fft):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())



def _fft_operations(fn):
    """fn()'s result, and the FFT operators (``aten._fft_*``) it dispatched, by name and count
    (``benchmarks/opcount.py``'s counter)."""
    out, counter = count(fn)
    return out, {name: n for name, n in counter.counts.items() if name.startswith("_fft_")}


@pytest.mark.parametrize("tno_type,causal", [("tnn", True), ("tnn", False), ("fd", True)],
                         ids=["tnn-causal", "tnn-bidirectional", "fd-causal"])
def test_a_stack_hands_the_direct_product_its_kernels_in_time(tno_type, causal, device, monkeypatch):
    """Where the product runs by direct summation, a TNN stack's kernels go to it in time, as the RPEs give them
    (``stacked_spectra(direct=True)``: causal the lags 0 .. n - 1, bidirectional the circulant column), and a causal
    FD-TNN stack's as its Hilbert transform makes them (its lags 0 .. N'): no FFT of the kernels and no inverse FFT
    back, forward or backward (FD-TNN: only the Hilbert transform's inverse FFT, and its gradient's), and the same
    output and every gradient as the FFT product; each kernel is the TNO's own ``time_kernel``, whose real FFT is its
    ``spectrum``."""
    from fairseq_tnn.modules.tno import build_tno
    from fairseq_tnn.modules.tno.base import SpectralTno
    n = 50
    tnos = []
    for seed in range(3):
        torch.manual_seed(seed)
        tnos.append(build_tno(tno_type, 6, causal).to(device))
    x = torch.randn(6, 3, n, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(device)
    leaves = [x, *(p for t in tnos for p in t.parameters())]

    def run(direct):
        stacked = SpectralTno.stacked_spectra(tnos, n, device, direct)
        ys = [t(x, layout="dbn", spectrum=k) for t, k in zip(tnos, stacked)]
        return stacked, (*ys, *torch.autograd.grad(sum((y * cot).sum() for y in ys), leaves))

    spectra, fft = run(False)
    monkeypatch.setattr(toeplitz, "DIRECT_MAX_N", n)
    (kernels, direct), ffts = _fft_operations(lambda: run(True))
    assert ffts == ({} if tno_type == "tnn" else {"_fft_c2r": 1, "_fft_r2c": 1})
    for tno, (kernel, size), (spectrum, _) in zip(tnos, kernels, spectra):
        length = {"tnn": n if causal else size, "fd": size // 2 + 1}[tno_type]  # FD: the lags 0 .. N'
        assert not kernel.is_complex() and kernel.shape == (6, length)
        own, own_size = tno.time_kernel(n, device)
        assert own_size == size
        torch.testing.assert_close(kernel, own)
        torch.testing.assert_close(toeplitz.KernelRfft.apply(kernel, size), spectrum)
    assert len(direct) == len(fft) == 3 + 1 + 3 * len(list(tnos[0].parameters()))
    for got, want in zip(direct, fft):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    if device == "cuda":  # compiled, as the stack's CUDA graphs take it: the kernels and the products in one graph
        def product(x):
            stacked = SpectralTno.stacked_spectra(tnos, n, device, True)
            return sum((t(x, layout="dbn", spectrum=k) * cot).sum() for t, k in zip(tnos, stacked))
        torch._dynamo.reset()
        loss = torch.compile(product, fullgraph=True)(x)
        compiled = torch.autograd.grad(loss, leaves)
        for got, want in zip(compiled, direct[3:]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def test_a_kernel_in_time_takes_the_fft_where_the_direct_product_cannot_run(monkeypatch):
    """A TNN layer handed its kernel in time where its product does not run directly (longer than
    ``DIRECT_MAX_N`` here; compiled on the CPU, whose interpreted kernels are no operators) transforms it and takes
    the FFT product: the same output and gradients as from its spectrum. A bidirectional FD-TNN has no kernel in
    time (its RPE gives the spectrum)."""
    from fairseq_tnn.modules.tno import build_tno
    torch.manual_seed(0)
    tno = build_tno("tnn", 6, False)
    x = torch.randn(6, 2, 30, generator=torch.Generator().manual_seed(1), requires_grad=True)
    monkeypatch.setattr(toeplitz, "DIRECT_MAX_N", 29)
    y, ffts = _fft_operations(lambda: tno(x, layout="dbn", spectrum=tno.time_kernel(30)))
    assert ffts["_fft_r2c"] == 2  # the kernel's and the input's
    want = tno(x, layout="dbn", spectrum=tno.spectrum(30))
    torch.testing.assert_close(y, want)
    leaves = [x, *tno.parameters()]
    grads = [torch.autograd.grad(out.square().sum(), leaves) for out in (y, want)]
    for got, ref in zip(*grads):
        torch.testing.assert_close(got, ref)
    # compiled where the kernels are no operators (the CPU's interpreter): traced whole, the FFT product
    monkeypatch.setattr(toeplitz, "DIRECT_MAX_N", 30)
    if not toeplitz_direct.TRITON_OPS:
        kernel, size = tno.time_kernel(30)
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, k: tno(x, layout="dbn", spectrum=(k, size)), backend="aot_eager",
                                 fullgraph=True)(x, kernel)
        torch.testing.assert_close(compiled, want)
    fd = build_tno("fd", 6, False)
    assert not fd.kernel_in_time and build_tno("fd", 6, True).kernel_in_time
    with pytest.raises(NotImplementedError, match="--tno-type fd bidirectional gives its kernel as a spectrum only"):
        fd.time_kernel(30)


@pytest.mark.parametrize("arch", ["tnn_lm_wt103", "tnn_mlm_wt103", "fd_tnn_lm_wt103"])
def test_models_train_the_same_with_the_direct_product_and_no_fft_of_the_kernels(arch, device, monkeypatch):
    """A TNN or causal FD-TNN model's training forward and backward with ``DIRECT_MAX_N`` on: its layers' products
    by direct summation, handed their kernels in time (``layer_spectra``), dispatch no FFT at all (FD-TNN: its
    stack's Hilbert transform's one inverse FFT and its gradient's), and give the same loss and every parameter's
    gradient as with the FFT product."""
    from fairseq_tnn.models.build import build_arch
    side = "decoder" if "_lm_" in arch else "encoder"
    torch.manual_seed(0)
    model = build_arch(arch, 50, **{f"{side}_layers": 3, f"{side}_embed_dim": 16, "glu_dim": 16,
                                    "dropout": 0.0}).to(device)
    tokens = torch.randint(4, 50, (2, 40), generator=torch.Generator().manual_seed(1)).to(device)

    def run():
        model.zero_grad()
        loss = model(tokens)[0].float().logsumexp(-1).sum()
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    fft = run()
    monkeypatch.setattr(toeplitz, "DIRECT_MAX_N", 40)
    calls = []
    apply = toeplitz_direct._apply
    monkeypatch.setattr(toeplitz_direct, "_apply", lambda *a: calls.append(a[3]) or apply(*a))
    direct, ffts = _fft_operations(run)
    assert ffts == ({} if arch.startswith("tnn") else {"_fft_c2r": 1, "_fft_r2c": 1})
    assert len(calls) == 6  # each layer's forward and input gradient
    torch.testing.assert_close(direct[0], fft[0], rtol=1e-5, atol=0)
    assert direct[1].keys() == fft[1].keys()
    for name, g in fft[1].items():
        torch.testing.assert_close(direct[1][name], g, rtol=1e-4, atol=1e-5 * g.abs().max().item(), msg=name)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_stacks_cuda_graphs_take_the_direct_product(monkeypatch):
    """On a CUDA GPU: ``tnn_lm_wt103`` (3 layers) with ``--tnn-cuda-graphs`` (the recipe's default on GPUs: the stack's
    graphs, the model's edges and the layers as regions in them) and ``DIRECT_MAX_N`` on, so that the graphs hold the
    kernels in time and the Triton operators: the logits and every parameter's gradient equal the eager model's with the
    same products, over updates of one micro-batch and of two, with no fallback."""
    import copy
    from fairseq_tnn.models.build import build_arch
    from fairseq_tnn.models.compile import compile_layers
    monkeypatch.setattr(toeplitz, "DIRECT_MAX_N", 512)
    torch.manual_seed(0)
    eager = build_arch("tnn_lm_wt103", 1000, dropout=0.0, decoder_layers=3).cuda()
    model = copy.deepcopy(eager)
    compile_layers(model.decoder.layers, "strict", "layers", cuda_graphs=True)
    stack = model.decoder.layers[0].forward.stack
    for update, micro_batches in enumerate([1, 2, 1]):
        for p in list(eager.parameters()) + list(model.parameters()):
            p.grad = None
        for _ in range(micro_batches):
            tokens = torch.randint(4, 1000, (2, 512), device="cuda")
            ye, yg = eager(tokens)[0], model(tokens)[0]
            assert rel(yg, ye) < 1e-5, ("output", update, float(rel(yg, ye)))
            g = torch.randn_like(ye)
            ye.backward(g)
            yg.backward(g)
        for (name, pe), pg in zip(eager.named_parameters(), model.parameters()):
            assert rel(pg.grad, pe.grad) < 1e-4, (name, update, float(rel(pg.grad, pe.grad)))
    assert stack.error is None and stack.graphs is not None


COMPILE_FOR_HOPPER = r'''
from fairseq_tnn.ops import toeplitz_direct as td
apply_kernel, lag_grad_kernel, layout_kernel = td._kernels()
ints = {k: "i32" for k in ("rows", "n", "size")}
for dtype, precision in (("fp16", "fp16"), ("bf16", "tf32"), ("fp32", "ieee")):
    coefficients = "*fp16" if precision == "fp16" else "*fp32"
    # 8 rows a channel (the causal shape's batch) beside 4 output tiles (32 rows, mma.sync) and beside 8 (64 rows, the
    # default at n = 512: Hopper's warpgroup products); each also as the launcher specializes it at the paper's
    # lengths (aligned tensors; n, the layout's row and the circulant's size divisible by 16), whose input tiles
    # Triton copies asynchronously
    aligned = ("x_ptr", "k_ptr", "scale_ptr", "y_ptr", "n", "origin", "stride")
    copies = td._copies(2 if precision == "fp16" else 4)  # the layout's shifted copies at LOAD_BYTES
    # ... and fp16's at 16 bytes a load (8 copies) at 64 rows, aligned
    for group, aligned, copies in ((4, (), copies), (4, aligned, copies), (8, aligned, copies)) + (
            ((8, aligned, 8),) if precision == "fp16" else ()):
        for sign in (1, -1):
            for causal in (False, True):
                # aligned: at the paper's shapes, whole tiles, rows and stacks (EVEN)
                compile(apply_kernel, {"x_ptr": "*" + dtype, "k_ptr": coefficients, "scale_ptr": "*fp32",
                                       "y_ptr": "*" + dtype, "rows": "i32", "n": "i32", "origin": "i32",
                                       "stride": "i32"},
                        {"SIGN": sign, "CAUSAL": causal, "BLOCK_R": 8, "GROUP": group, "BLOCK_T": td.BLOCK_T,
                         "COPIES": copies, "EVEN": bool(aligned), "PRECISION": precision}, aligned)
    for aligned in ((), ("g_ptr", "x_ptr", "gk_ptr", "n", "size")):
        for causal in (False, True):
            compile(lag_grad_kernel, {"g_ptr": "*" + dtype, "x_ptr": "*" + dtype, "gk_ptr": "*fp32", **ints,
                                      "offset_start": "i32"},
                    {"CAUSAL": causal, "BLOCK_R": 8, "PAIRS": 8, "BLOCK_T": td.BLOCK_T,
                     "PRECISION": "ieee" if dtype == "fp32" else "native"}, aligned)
for scale, coefficients, copies in ((True, "*fp16", td._copies(2)), (False, "*fp32", td._copies(4))):
    for causal in (False, True):
        compile(layout_kernel, {"k_ptr": "*fp32", "out_ptr": coefficients, "scale_ptr": "*fp32", "size": "i32",
                                "n": "i32", "origin": "i32", "stride": "i32"},
                {"CAUSAL": causal, "SCALE": scale, "COPIES": copies, "BLOCK": td.LAYOUT_BLOCK})
print(json.dumps(built))

# the custom operators torch.compile sees, forward and registered backward, on fake tensors: shapes and dtypes
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
shapes = []
with FakeTensorMode():
    for dtype in (torch.float16, torch.bfloat16):
        for causal in (False, True):
            x = torch.empty(4, 8, 100, dtype=dtype, requires_grad=True)
            kernel = torch.empty(4, 100 if causal else 199, requires_grad=True)
            y = td._direct_op(x, kernel, causal)
            shapes.append([[list(t.shape), str(t.dtype)]
                           for t in (y, *torch.autograd.grad(y, (x, kernel), torch.empty_like(y)))])
print(json.dumps(shapes))
'''


def test_the_kernels_compile_for_a_hopper_gpu_and_the_operators_trace(tmp_path):
    """Without a GPU, the Triton kernels are compiled to machine code for an H100 / H200 (sm_90, the GPU
    machines'), every variant the product launches (fp16, bf16 and fp32 x; T and T^T; whole and causal; 32 and 64
    rows; the layout's copies at ``LOAD_BYTES``, and fp16's at 16 bytes; the lag gradient, whole and causal; each also
    as Triton's launcher specializes it for aligned tensors and lengths; the coefficients' layout, scaled for fp16 and
    not, whole and causal), by Triton's own compiler
    and ptxas, in a process where Triton is not in its interpreter: what the interpreter does not check (types,
    layouts, the tensor-core products' shapes) is checked here before a GPU run; and there the custom operators
    torch.compile traces (``fairseq_tnn::direct_toeplitz`` and its backward's two), run on fake tensors: their
    outputs' and gradients' shapes and dtypes."""
    sizes, shapes = compile_for_hopper(COMPILE_FOR_HOPPER, tmp_path)
    assert len(sizes) == 56 and min(sizes) > 3_000, sizes  # 56 cubins of real code
    x_shape, kernel = [4, 8, 100], "torch.float32"
    assert shapes == [[[x_shape, dtype], [x_shape, dtype], [[4, size], kernel]]
                      for dtype in ("torch.float16", "torch.bfloat16") for size in (199, 100)], shapes
