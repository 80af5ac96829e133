"""The fast paths (fairseq_tnn/ops/fast.py) against their references, forward and gradients, on every device:
the RPE MLP as one operator with a hand-written backward (ops/rpe.py), SKI's band and low-rank spectrum as one GEMM
each (ops/ski.py), and the constants built once per length.
And the point of them: fewer operations dispatched (benchmarks/opcount.py's counter)."""
import pytest
import torch

from helpers import assert_close_rel, assert_on
from benchmarks.opcount import count
from fairseq_tnn.modules import build_tno
from fairseq_tnn.modules.activations import ACTIVATIONS as MODULE_ACTIVATIONS
from fairseq_tnn.modules.norm import SimpleRMSNorm
from fairseq_tnn.modules.rpe import Rpe
from fairseq_tnn.ops import fast
from fairseq_tnn.ops.norm import dtype_eps
from fairseq_tnn.ops.rpe import ACTIVATIONS, rpe_mlp, rpe_mlp_ref, rpe_params


def _rpe(activation, norm_type, layers, device, dtype=torch.float64):
    torch.manual_seed(0)
    rpe = Rpe(6, hidden=8, layers=layers, activation=activation, norm_type=norm_type).to(device, dtype)
    if norm_type == "layernorm":  # away from the identity, so that their gradients are tested
        for norm in rpe.norms:
            torch.nn.init.normal_(norm.weight)
            torch.nn.init.normal_(norm.bias)
    return rpe


def _grads(fn, rpe, g):
    y = fn()
    return y, by_weight(rpe, torch.autograd.grad(y, list(rpe.parameters()), g))


def by_weight(rpe, grads):
    """[(name, gradient)] of ``rpe.parameters()``' ``grads``, the packed parameter's split into each Linear's weight
    and bias (``Rpe.unpacked``), so that a weight whose gradient is wrong is named."""
    out = []
    for (name, _), grad in zip(rpe.named_parameters(), grads):
        out += list(zip(rpe._names, rpe.unpacked(grad))) if name == "packed" else [(name, grad)]
    return out


def test_every_activation_has_a_fast_path():
    assert set(ACTIVATIONS) == set(MODULE_ACTIVATIONS)


@pytest.mark.parametrize("layers", [0, 2])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("norm_type", ["simplermsnorm", "layernorm"])
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_rpe_mlp_matches_reference(activation, norm_type, scaled, layers, device):
    rpe = _rpe(activation, norm_type, layers, device)
    t = torch.arange(-5, 12, dtype=torch.float64, device=device)
    scale = torch.rand(t.shape[0], dtype=torch.float64, device=device) if scaled else None
    g = torch.randn(6, t.shape[0], dtype=torch.float64, device=device)
    y, gs = _grads(lambda: rpe.channel_major(t, scale), rpe, g)
    with fast.references():
        y_ref, gs_ref = _grads(lambda: rpe.channel_major(t, scale), rpe, g)
    assert y.shape == (6, t.shape[0])
    assert_on(device, y, *(gr for _, gr in gs))
    assert_close_rel(y, y_ref, 1e-12)
    assert len(gs) == 2 * (layers + 2) + (2 * (layers + 1) if norm_type == "layernorm" else 0)
    for (name, a), (_, b) in zip(gs, gs_ref):
        assert_close_rel(a, b, 1e-11, name)
    # the functions themselves, as the module calls them
    args = (t, scale, rpe_params(rpe), activation, norm_type, rpe.norms[0].eps, layers, torch.float64)
    assert_close_rel(rpe_mlp(*args), rpe_mlp_ref(*args), 1e-12)


def test_rpe_mlp_gradient_at_a_zero_row_is_finite():
    """A row of zeros before an RMS norm (a lag-0 position with zero biases): the norm's gradient term through
    ||h|| is 0 there, as torch's own norm backward has it, not 0 / 0."""
    rpe = _rpe("relu", "simplermsnorm", 1, "cpu")
    with torch.no_grad():
        rpe.proj.bias.zero_()
    t = torch.arange(4, dtype=torch.float64)
    g = torch.randn(6, 4, dtype=torch.float64)
    _, gs = _grads(lambda: rpe.channel_major(t), rpe, g)
    with fast.references():
        _, gs_ref = _grads(lambda: rpe.channel_major(t), rpe, g)
    for (name, a), (_, b) in zip(gs, gs_ref):
        assert torch.isfinite(a).all(), name
        assert_close_rel(a, b, 1e-11, name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rpe_mlp_half_weights_compute_in_fp32(dtype, device):
    """16-bit weights (a cast of the model leaves the RPE's in fp32, tests/modules/test_rpe_fp32.py; set directly here):
    the MLP still computes in fp32, and each gradient comes back in its parameter's dtype."""
    rpe = _rpe("relu", "simplermsnorm", 2, device, torch.float32)
    for p in rpe.parameters():
        p.data = p.data.to(dtype)
    t = torch.arange(300, dtype=torch.float32, device=device)
    y = rpe.channel_major(t)
    assert y.dtype == torch.float32
    y.sum().backward()
    grads = [p.grad for p in rpe.parameters()]
    assert all(gr is not None and gr.dtype == dtype for gr in grads)
    with fast.references():
        y_ref = rpe.channel_major(t)
    assert_close_rel(y, y_ref, 1e-5)


@pytest.mark.parametrize("scaled", [False, True])
def test_rpe_mlp_compiled_gives_every_weight_its_gradient(scaled, device):
    """The RPE's operator inside torch.compile, as a compiled layer runs it, against the same call eagerly: the
    kernel and every weight's gradient. Under torch 2.11 a per-position scale taken in place on the operator's
    output (TNN's decay) compiled to a zero gradient for every RPE weight, on the CPU and on CUDA, while the output
    and the layer's input gradient stayed right (docs/measurements/2026-11-26-h200-rpe-grads); torch 2.13 does
    not, so there this guards the operator as written."""
    torch._dynamo.reset()
    rpe = _rpe("relu", "simplermsnorm", 2, device, torch.float32)

    def kernel(n):
        t = torch.arange(n, dtype=torch.float32, device=device)
        return rpe.channel_major(t, torch.exp(-0.05 * t) if scaled else None)
    g = torch.randn(6, 40, device=device)
    out = {}
    for name, fn in (("eager", kernel), ("compiled", torch.compile(kernel, fullgraph=True))):
        y = fn(40)
        out[name] = (y, by_weight(rpe, torch.autograd.grad((y * g).sum(), list(rpe.parameters()))))
    assert_close_rel(out["compiled"][0], out["eager"][0], 1e-5)
    for (pname, a), (_, b) in zip(out["compiled"][1], out["eager"][1]):
        assert_close_rel(a, b, 1e-4, pname)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, (1e-14, 1e-12)), (torch.float32, (1e-6, 1e-5))])
@pytest.mark.parametrize("shape", [(2, 16, 64), (5, 24), (3, 1)])
def test_rms_norm_matches_reference(shape, dtype, tol, device):
    """The layers' RMS norm (ops/norm.py) against autograd through the plain operations: output and input gradient,
    a zero row included (a padding position's zero embedding: its gradient stays finite, in float32 too, where
    eps times the smallest normal underflows), and a transposed (non-contiguous) input; and in fewer operations."""
    norm = SimpleRMSNorm(shape[-1])
    x = torch.randn(*shape, dtype=dtype, device=device)
    x.view(-1, shape[-1])[0] = 0.0
    g = torch.randn_like(x)
    for inp in (x, x.transpose(0, -1).contiguous().transpose(0, -1)):
        inp = inp.detach().requires_grad_(True)
        (y, gx), c = count(lambda: (lambda out: (out, torch.autograd.grad(out, inp, g)[0]))(norm(inp)))
        with fast.references():
            (y_ref, gx_ref), c_ref = count(lambda: (lambda out: (out, torch.autograd.grad(out, inp, g)[0]))(norm(inp)))
        assert_on(device, y, gx)
        assert torch.isfinite(gx).all()
        assert_close_rel(y, y_ref, tol[0])
        assert_close_rel(gx, gx_ref, tol[1])
        assert c.total <= c_ref.total - 4, (c.total, c_ref.total)  # 3 + 6 (and the eps constant, built once) vs 4 + 11


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_in_half_precision(dtype, device):
    """16-bit activations: output and gradient in their dtype, as close to the float32 reference as the
    reference's own 16-bit run."""
    norm = SimpleRMSNorm(512)
    x = (torch.randn(4, 32, 512, device=device) * 3).to(dtype)
    g = torch.randn(4, 32, 512, device=device).to(dtype)
    wide = x.float().requires_grad_(True)
    with fast.references():
        y32 = norm(wide)
        g32, = torch.autograd.grad(y32, wide, g.float())
    errors = []
    for ctx in (fast.references, None):
        inp = x.clone().requires_grad_(True)
        if ctx is None:
            y = norm(inp)
            gx, = torch.autograd.grad(y, inp, g)
        else:
            with ctx():
                y = norm(inp)
                gx, = torch.autograd.grad(y, inp, g)
        assert y.dtype == gx.dtype == dtype
        errors.append(((y.float() - y32).abs().max().item(), (gx.float() - g32).abs().max().item()))
    (ref_y, ref_g), (fast_y, fast_g) = errors
    assert fast_y <= 2 * ref_y + 1e-6 and fast_g <= 2 * ref_g + 1e-6, errors


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rms_norm_of_a_zero_vector_is_zero_in_every_dtype(dtype, device):
    """A padding position's zero vector normalises to zero, with a zero gradient where the loss puts none, on both
    paths: in fp16 the layers' eps of 1e-8 rounded to zero and made it 0 / 0 (NaN), which the token mixing then
    spread to every gradient of a padded batch. The eps used is fp16's least positive number there, eps elsewhere;
    vectors whose norm is not tiny normalise to the same bits as with eps itself."""
    assert dtype_eps(1e-8, torch.float16) == 2.0 ** -24
    assert dtype_eps(1e-8, torch.bfloat16) == dtype_eps(1e-8, torch.float32) == 1e-8
    norm = SimpleRMSNorm(64)
    x = torch.randn(3, 5, 64, device=device).to(dtype)
    x[0, 2] = 0.0
    g = torch.randn_like(x)
    g[0, 2] = 0.0  # the criteria put no loss at padding
    others = torch.ones(3, 5, dtype=torch.bool, device=device)
    others[0, 2] = False
    with_eps = x / (x.norm(dim=-1, keepdim=True) * 64 ** -0.5 + 1e-8)  # the formula with eps itself
    for ctx in (fast.references, None):
        inp = x.clone().requires_grad_(True)
        with ctx() if ctx else torch.enable_grad():
            y = norm(inp)
            gx, = torch.autograd.grad(y, inp, g)
        assert torch.isfinite(y).all() and torch.isfinite(gx).all(), (ctx, dtype)
        assert (y[0, 2] == 0).all() and (gx[0, 2] == 0).all(), (ctx, dtype)
        if ctx:  # the reference is that formula bit for bit, but at the zero vector
            assert torch.equal(y.detach()[others], with_eps[others]), dtype


TNOS = [("tnn", True, {}), ("tnn", False, {}), ("tnn", True, {"decay": 1.0}), ("tnn", True, {"rpe_norm_type": "layernorm"}),
        ("fd", True, {}), ("fd", False, {}), ("ski", False, {})]


@pytest.mark.parametrize("tno_type,causal,settings", TNOS)
def test_tno_fast_paths_match_references(tno_type, causal, settings, device):
    """Each TNO, forward and gradients (input and parameters), twice (the second call takes the cached constants)."""
    torch.manual_seed(0)
    tno = build_tno(tno_type, 8, causal, **settings).to(device, torch.float64)
    x = torch.randn(8, 2, 37, dtype=torch.float64, device=device, requires_grad=True)
    g = torch.randn_like(x)
    leaves = [x, *tno.parameters()]
    with fast.references():
        y_ref = tno(x, layout="dbn")
        gs_ref = torch.autograd.grad(y_ref, leaves, g)
    for _ in range(2):
        y = tno(x, layout="dbn")
        gs = torch.autograd.grad(y, leaves, g)
        assert_on(device, y, *gs)
        assert_close_rel(y, y_ref, 1e-11)
        for a, b in zip(gs, gs_ref):
            assert_close_rel(a, b, 1e-10)


@pytest.mark.parametrize("lowrank", ["mean", "sum"])
@pytest.mark.parametrize("n", [3, 37, 64])
def test_ski_fast_paths_match_references(lowrank, n, device):
    """SKI-TNO with knots away from zero (a new model's 'mean' knots start at zero, which hides A's part of the
    output), at lengths below, around and above the rank (8): the band's taps placed by one GEMM and A's spectrum
    taken by one GEMM of the (scaled) knots, against the references (the band by a flipped Hankel view, A's kernel
    and its FFT; float64) and against the dense operator; forward and every gradient, twice (cached constants)."""
    from fairseq_tnn.ops.ski import ski_tno_ref
    torch.manual_seed(0)
    tno = build_tno("ski", 8, False, ski_rank=8, ski_taps=5, ski_lowrank=lowrank, training_length=48)
    tno = tno.to(device, torch.float64)
    torch.nn.init.normal_(tno.knots)
    x = torch.randn(8, 2, n, dtype=torch.float64, device=device, requires_grad=True)
    g = torch.randn_like(x)
    leaves = [x, tno.conv_weight, tno.knots]
    with fast.references():
        y_ref = tno(x, layout="dbn")
        gs_ref = torch.autograd.grad(y_ref, leaves, g)
    y_dense = ski_tno_ref(x, tno.conv_weight, tno.knots, tno.warp_decay, layout="dbn", scale=tno.lowrank_scale(n))
    gs_dense = torch.autograd.grad(y_dense, leaves, g)
    assert (tno.lowrank_scale(n) == 1.0) == (lowrank == "sum")
    for _ in range(2):
        y = tno(x, layout="dbn")
        gs = torch.autograd.grad(y, leaves, g)
        assert_on(device, y, *gs)
        for want, want_grads in ((y_ref, gs_ref), (y_dense, gs_dense)):
            assert_close_rel(y, want, 1e-11)
            for name, a, b in zip(["x", "conv_weight", "knots"], gs, want_grads):
                assert_close_rel(a, b, 1e-10, name)


def test_constants_built_in_inference_mode_serve_training():
    """A length first seen while generating (inference mode) is cached as an ordinary tensor, which training can
    then save for its backward."""
    torch.manual_seed(0)
    tno = build_tno("tnn", 4, True)
    x = torch.randn(4, 1, 23)
    with torch.inference_mode():
        tno(x, layout="dbn")
    y = tno(x.requires_grad_(), layout="dbn")
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("tno_type,causal,settings,fewer_forward,fewer_backward", [
    ("tnn", True, {}, 10, 50), ("tnn", False, {}, 20, 50), ("fd", True, {}, 5, 30), ("ski", False, {}, 8, 15)])
def test_fast_paths_dispatch_fewer_operations(tno_type, causal, settings, fewer_forward, fewer_backward):
    """One TNO (RPE 6 for TNN, 3 for FD), a steady step: the fast paths dispatch at least this many operations
    fewer than the references (measured: TNN causal 58 -> 44 forward, 141 -> 80 backward; SKI 21 -> 12 and
    40 -> 22, of which 31 -> 22 by the band's taps and A's spectrum each placed by one GEMM)."""
    torch.manual_seed(0)
    tno = build_tno(tno_type, 16, causal, **settings)
    x = torch.randn(16, 1, 64, requires_grad=True)

    def counts():
        tno(x, layout="dbn").sum().backward()  # the constants of the length
        tno.zero_grad(set_to_none=True)
        y, fwd = count(lambda: tno(x, layout="dbn"))
        _, bwd = count(lambda: y.sum().backward())
        tno.zero_grad(set_to_none=True)
        return fwd.total, bwd.total

    fast_fwd, fast_bwd = counts()
    with fast.references():
        ref_fwd, ref_bwd = counts()
    assert ref_fwd - fast_fwd >= fewer_forward, (fast_fwd, ref_fwd)
    assert ref_bwd - fast_bwd >= fewer_backward, (fast_bwd, ref_bwd)


def test_constants_are_built_on_their_device_without_copies_from_the_host(monkeypatch):
    """Every constant the TNOs' fast paths build (``fast.constant``), the paired product's among them, is made by
    operations on its device: no copy of host data. While a CUDA graph records, such a copy fails (the ninth GPU run:
    the two-sided spectrum's factors, first built while the stack's graphs recorded the paired forward), and
    ``t[0] = 1.0`` is one (a 0-dim CPU tensor copied onto one element of a CUDA tensor), as is ``torch.tensor([...],
    device=...)``. On the CPU they show among the operations ``make`` dispatches as a tensor made from Python data
    (``lift_fresh``, ``scalar_tensor``), which on a GPU is made on the host and then copied."""
    from collections import OrderedDict

    from torch.utils._python_dispatch import TorchDispatchMode

    from fairseq_tnn.ops import toeplitz

    class Dispatched(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    built = {}
    constant = fast.constant

    def recorded_constant(key, device, make):
        def make_recorded():
            with Dispatched() as mode:
                out = make()
            built[key] = mode.ops
            return out
        return constant(key, device, make_recorded)

    monkeypatch.setattr(fast, "_CACHE", OrderedDict())
    monkeypatch.setattr(fast, "constant", recorded_constant)
    monkeypatch.setattr(toeplitz, "PAIRED_FFT_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(toeplitz, "PAIR_EAGERLY", True)
    monkeypatch.setattr(toeplitz, "PAIRED_FORWARD_MIN_ROWS", 0)
    torch.manual_seed(0)
    for tno_type, causal, settings in TNOS:
        tno = build_tno(tno_type, 8, causal, **settings)
        x = torch.randn(8, 2, 37, requires_grad=True)
        tno(x, layout="dbn").sum().backward()
    x = torch.randn(2, 5, 8, requires_grad=True)
    SimpleRMSNorm(8)(x).sum().backward()
    kinds = {key[0] for key in built}
    # the paired product's (two-sided spectrum, Hermitian part), FFT bins, FD's, TNN's, SKI's, the norm's
    assert {"two-sided", "hermitian-halves", "bin-factor", "causal-fold", "imag-ends-mask", "fd-grid", "tnn-lags",
            "rms-eps"} <= kinds, kinds
    copies = {key: [op for op in ops if op in ("lift_fresh", "lift_fresh_copy", "scalar_tensor")]
              for key, ops in built.items()}
    assert not any(copies.values()), {key: ops for key, ops in copies.items() if ops}


def test_constants_inside_the_stacks_cuda_graphs_are_built_anew_and_not_cached():
    """Inside the stack's CUDA graphs (``fast.cuda_graphs``: their warm-up runs and recording) a constant is built at
    every call and left out of the cache: cached, it would live on in the graphs' memory pool, which the graph trees
    refuse (the ninth GPU run), or be evicted while a recorded graph still reads it. Outside, it is built once."""
    from collections import OrderedDict
    cache = OrderedDict()
    built = []

    def make():
        built.append(torch.arange(3.0))
        return built[-1]

    import fairseq_tnn.ops.fast as fast_module
    saved = fast_module._CACHE
    fast_module._CACHE = cache
    try:
        with fast.cuda_graphs():
            assert fast.in_cuda_graphs()
            a, b = fast.constant("k", "cpu", make), fast.constant("k", "cpu", make)
        assert not fast.in_cuda_graphs() and a is not b and len(built) == 2 and not cache
        c, d = fast.constant("k", "cpu", make), fast.constant("k", "cpu", make)
        assert c is d and len(built) == 3 and len(cache) == 1
    finally:
        fast_module._CACHE = saved
