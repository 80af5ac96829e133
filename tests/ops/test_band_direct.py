"""SKI-TNO's band by direct summation (``fairseq_tnn/ops/band_direct.py``, Triton kernels) against torch's depthwise
convolution of each channel, forward and both gradients, on every device (the CPU under Triton's interpreter, CUDA
where present); and the SKI-TNO with the band method set to it against its dense reference."""

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close_rel, compile_for_hopper, require_triton, ski_inputs

from fairseq_tnn.ops import band_direct, ski


@pytest.fixture(autouse=True)
def triton_kernels(request, monkeypatch):
    """Triton, and on the CPU its interpreter, with the kernels let run there (``CPU_INTERPRETED``)."""
    require_triton(request, device_less_on_cpu=True)
    monkeypatch.setattr(band_direct, "CPU_INTERPRETED", True)


def _conv(x, w):
    """Each channel's centred convolution by torch: x (d, R, n), w (d, m)."""
    m = w.shape[1]
    return F.conv1d(x.transpose(0, 1), w[:, None, :], padding=(m - 1) // 2, groups=w.shape[0]).transpose(0, 1)


def _case(d, rows, n, m, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(d, rows, n, generator=g, dtype=torch.float64)
    w = torch.randn(d, m, generator=g, dtype=torch.float64) / m ** 0.5
    cot = torch.randn(d, rows, n, generator=g, dtype=torch.float64)
    return x.to(device), w.to(device), cot.to(device)


# (d, R, n, m, BLOCK_MAX): one position, taps wider than the sequence, lengths that are and are not powers of 2, one
# tap, many; one block a row, and several (the taps' gradient summed over the blocks; windows across their edges)
CASES = [(3, 2, 1, 17, 1024), (4, 3, 7, 5, 1024), (2, 2, 33, 17, 1024), (2, 3, 300, 3, 1024), (3, 1, 96, 31, 1024),
         (2, 2, 64, 1, 1024), (2, 2, 100, 17, 16), (3, 2, 33, 5, 16), (2, 1, 64, 31, 16)]


@pytest.mark.parametrize("d,rows,n,m,block", CASES)
def test_the_direct_band_is_torchs_depthwise_convolution(d, rows, n, m, block, device, monkeypatch):
    """fp32: the output and both gradients (the input's, the taps') within fp32 rounding of torch's convolution of each
    channel in fp64, and the kernels' Function the one that ran."""
    monkeypatch.setattr(band_direct, "BLOCK_MAX", block)
    assert band_direct._block(n) == max(16, min(block, 1 << (n - 1).bit_length()))
    x64, w64, cot64 = _case(d, rows, n, m, device)
    x, w = x64.float().requires_grad_(), w64.float().requires_grad_()
    y = ski.band_conv(x, w, method="triton")
    assert _ran_direct(y), y.grad_fn
    gx, gw = torch.autograd.grad(y, (x, w), cot64.float())
    xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    y_ref = _conv(xr, wr)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (xr, wr), cot64)
    assert y.dtype == gx.dtype == gw.dtype == torch.float32
    for got, want in ((y, y_ref), (gx, gx_ref), (gw, gw_ref)):
        assert_close_rel(got.double(), want, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_direct_band_computes_in_the_taps_dtype(dtype, device):
    """As the other methods: 16-bit taps on a 16-bit x give a 16-bit band, fp32 taps an fp32 one, the input's gradient
    in x's dtype and the taps' in theirs, each within 16-bit rounding of the fp64 convolution."""
    x64, w64, cot64 = _case(8, 2, 40, 17, device, seed=5)
    xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    y_ref = _conv(xr, wr)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (xr, wr), cot64)
    bound = 2e-2 if dtype == torch.bfloat16 else 3e-3
    for taps in (dtype, torch.float32):
        x, w = x64.to(dtype).requires_grad_(), w64.to(taps).requires_grad_()
        y = ski.band_conv(x, w, method="triton")
        gx, gw = torch.autograd.grad(y, (x, w), cot64.to(taps))
        assert (y.dtype, gx.dtype, gw.dtype) == (taps, dtype, taps)
        for got, want in ((y, y_ref), (gx, gx_ref), (gw, gw_ref)):
            assert (got.double() - want).abs().max() / want.abs().max() < bound


# (n, r, m, d, b, layout, scale, BLOCK_MAX): the rank below the length and above it (r_eff = n, W the identity), one
# position (W = [[1]]), several blocks a row (the interpolation's positions offset by the block), batch rows, both
# layouts, the module's mean scale
SKI_CASES = [(37, 8, 17, 3, 2, "bnd", 1.0, 1024), (5, 8, 3, 4, 2, "dbn", 1.0, 1024), (1, 4, 5, 2, 3, "bnd", 1.0, 1024),
             (100, 6, 9, 2, 3, "dbn", 0.25, 16), (64, 32, 17, 3, 1, "bnd", 1.0, 16)]


@pytest.mark.parametrize("fused", [True, False], ids=["low rank fused", "band alone"])
@pytest.mark.parametrize("n,r,m,d,b,layout,scale,block", SKI_CASES)
def test_the_ski_tno_with_the_direct_band_equals_its_dense_reference(n, r, m, d, b, layout, scale, block, fused,
                                                                       device, monkeypatch):
    """``BAND_METHOD`` set to "triton" for the device: the SKI-TNO (band and low rank, fp32) runs the direct band, with
    the low rank in its kernels (``FUSE_LOWRANK``, ``band_direct.DirectSki``) or after it (``DirectBand``, then
    ``_add_lowrank``), and equals its dense reference, forward and every gradient."""
    monkeypatch.setitem(ski.BAND_METHOD, device, "triton")
    monkeypatch.setattr(ski, "FUSE_LOWRANK", fused)
    monkeypatch.setattr(band_direct, "BLOCK_MAX", block)
    inputs = [t.requires_grad_(True) for t in ski_inputs(n, r, m, torch.float32, layout, d=d, b=b, device=device)]
    g = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1)).to(device)
    y_ref = ski.ski_tno_ref(*[t.double() for t in inputs], lam=0.9, layout=layout, scale=scale)
    grads_ref = torch.autograd.grad(y_ref, inputs, g.double())
    y = ski.ski_tno(*inputs, lam=0.9, layout=layout, scale=scale)
    assert _ran(y, "DirectSkiBackward" if fused else "DirectBandBackward"), "not the expected kernels' Function"
    assert fused or not _ran(y, "DirectSkiBackward")
    assert_close_rel(y.double(), y_ref, 2e-5)
    for name, a, want in zip(("x", "taps", "knots"), torch.autograd.grad(y, inputs, g), grads_ref):
        assert_close_rel(a.double(), want, 2e-5, name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_fused_ski_tno_computes_16_bit_inputs_as_the_unfused_one(dtype, device, monkeypatch):
    """16-bit x and taps (``--fp16``'s half weights): the GEMMs in 16 bits, A z and the sums in fp32, so the fused
    SKI-TNO is within 16-bit rounding of the dense fp64 reference, forward and every gradient, and of the same dtypes
    as the unfused path's (band, then ``_add_lowrank``), and no further from the reference than it (up to 1.5x)."""
    monkeypatch.setitem(ski.BAND_METHOD, device, "triton")
    x, taps, knots = ski_inputs(200, 16, 17, torch.float64, "dbn", d=8, b=2, seed=3, device=device)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(device)
    ref = [t.clone().requires_grad_() for t in (x, taps, knots)]
    y_ref = ski.ski_tno_ref(*ref, lam=0.95, layout="dbn")
    wants = (y_ref, *torch.autograd.grad(y_ref, ref, g))
    errors = {}
    for fused in (True, False):
        monkeypatch.setattr(ski, "FUSE_LOWRANK", fused)
        inputs = [x.to(dtype).requires_grad_(), taps.to(dtype).requires_grad_(), knots.float().requires_grad_()]
        y = ski.ski_tno(*inputs, lam=0.95, layout="dbn")
        assert _ran(y, "DirectSkiBackward") == fused
        gots = (y, *torch.autograd.grad(y, inputs, g.to(dtype)))
        assert [t.dtype for t in gots] == [dtype, dtype, dtype, torch.float32]
        errors[fused] = [float((got.double() - want).abs().max() / want.abs().max()) for got, want in zip(gots, wants)]
    bound = 3e-2 if dtype == torch.bfloat16 else 4e-3
    assert max(errors[True]) < bound, errors
    assert all(a <= 1.5 * b + 1e-4 for a, b in zip(errors[True], errors[False])), errors


def test_the_fused_ski_tno_dispatches_no_fft_and_fewer_operations(device, monkeypatch):
    """The low rank in the band's kernels: forward and backward dispatch no FFT, no ``addmm`` and no separate sum of the
    input's two gradients, and fewer operations than the band followed by ``_add_lowrank`` (the allocations and copies
    of Triton's interpreter, which moves each tensor argument to the host and back, left out)."""
    from benchmarks.opcount import OpCounter
    monkeypatch.setitem(ski.BAND_METHOD, device, "triton")
    inputs = [t.requires_grad_(True) for t in ski_inputs(64, 8, 17, torch.float32, "dbn", device=device)]
    counts = {}
    for fused in (True, False):
        monkeypatch.setattr(ski, "FUSE_LOWRANK", fused)
        ski.ski_tno(*inputs, lam=0.9, layout="dbn").sum().backward()  # the constants built
        counter = OpCounter()
        with counter:
            y = ski.ski_tno(*inputs, lam=0.9, layout="dbn")
            y.backward(torch.ones_like(y))
        counts[fused] = {k: v for k, v in counter.counts.items() if k not in ("empty", "new_empty", "set_", "copy_")}
    assert not any("fft" in k or k in ("addmm", "add") for k in counts[True]), counts[True]
    assert counts[False]["_fft_r2c"] and counts[False]["addmm"], counts[False]
    assert sum(counts[True].values()) < sum(counts[False].values()) * 0.6, counts


def test_where_the_kernels_cannot_run_the_ski_tno_takes_the_convolution(monkeypatch):
    """fp64, which the kernels do not take: the SKI-TNO with the "triton" method runs torch's convolution for its band
    and the unfused low rank."""
    from benchmarks.opcount import OpCounter
    monkeypatch.setitem(ski.BAND_METHOD, "cpu", "triton")
    x, conv_weight, knots = ski_inputs(37, 8, 17, torch.float64)
    assert not ski.fuses_lowrank(x.permute(2, 0, 1), conv_weight)
    counter = OpCounter()
    with counter:
        y = ski.ski_tno(x, conv_weight, knots, lam=0.9)
    assert counter.counts["convolution"] == 1, dict(counter.counts)
    torch.testing.assert_close(y, ski.ski_tno_ref(x, conv_weight, knots, lam=0.9))


def _ran(y, function: str) -> bool:
    """Whether a node of the autograd Function ``function`` (its backward's class name) is in y's graph."""
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == function:
            return True
        todo.extend(n for n, _ in node.next_functions)
    return False


def _ran_direct(y) -> bool:
    """Whether a DirectBand node is in y's autograd graph."""
    return _ran(y, "DirectBandBackward")


def test_where_the_kernels_cannot_run_the_convolution_does(monkeypatch):
    """Off the interpreter on the CPU (``CPU_INTERPRETED`` False, the CPU's training), ``method="triton"`` is the
    depthwise convolution: same band, no kernels."""
    monkeypatch.setattr(band_direct, "CPU_INTERPRETED", False)
    x, w, _ = _case(2, 2, 20, 5, "cpu")
    assert not band_direct.supports(x.float(), w.float())
    y = ski.band_conv(x.float().requires_grad_(), w.float(), method="triton")
    assert not _ran_direct(y)
    torch.testing.assert_close(y.double(), _conv(x, w), rtol=1e-5, atol=1e-5)


# Run in a process where Triton is not in its interpreter (so that its kernels are ``JITFunction``s and the custom
# operators exist): the kernels compiled for an H100 / H200, then the operators traced on fake tensors.
COMPILE_FOR_HOPPER = r'''
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from fairseq_tnn.ops import band_direct as bd
forward, backward = bd._kernels()
ints = {k: "i32" for k in ("rows", "n", "rank")}
for x, taps in (("fp16", "fp16"), ("bf16", "bf16"), ("fp16", "fp32"), ("fp32", "fp32")):
    for lowrank in (False, True):
        extra = ("*fp32", "*i32", "*fp32") if lowrank else ("*" + x,) * 3  # the low rank's rows, index, weight
        constants = {"TAPS": 17, "BLOCK": bd.BLOCK_MAX, "LOWRANK": lowrank}
        # each also as the launcher specializes it for aligned tensors and a length divisible by 16
        for aligned in ((), ("x_ptr", "w_ptr", "y_ptr", "g_ptr", "gx_ptr", "part_ptr", "n")):
            compile(forward, {"x_ptr": "*" + x, "w_ptr": "*" + taps, "y_ptr": "*" + taps,
                              **dict(zip(("az_ptr", "index_ptr", "weight_ptr"), extra)), **ints}, constants,
                    [a for a in aligned if a in forward.arg_names])
            compile(backward, {"g_ptr": "*" + taps, "x_ptr": "*" + x, "w_ptr": "*" + taps, "gx_ptr": "*" + x,
                               "part_ptr": "*fp32", **dict(zip(("gz_ptr", "index_ptr", "weight_ptr"), extra)), **ints},
                    constants, [a for a in aligned if a in backward.arg_names])

# the custom operators torch.compile sees, forward and registered backward, on fake tensors: shapes and dtypes
d, rows, n, m, r = 16, 2, 64, 17, 8
shapes = {}
with FakeTensorMode():
    x = torch.empty(d, rows, n, dtype=torch.float16, requires_grad=True)
    taps = torch.empty(d, m, dtype=torch.float16, requires_grad=True)
    coef = torch.empty(d, 2 * r - 1, requires_grad=True)
    constants = (torch.empty(n, r, dtype=torch.float16), torch.empty(n, 2, dtype=torch.int32), torch.empty(n, 2),
                 torch.empty(2 * r - 1, r * r))
    y, z = bd._ski_op(x, taps, coef, *constants)
    grads = torch.autograd.grad(y, (x, taps, coef), torch.empty_like(y))
    shapes["ski"] = [[list(t.shape), str(t.dtype)] for t in (y, z, *grads)]
    y = bd._band_op(x, taps)
    shapes["band"] = [[list(t.shape), str(t.dtype)] for t in (y, *torch.autograd.grad(y, (x, taps), torch.empty_like(y)))]
print(json.dumps({"built": built, "shapes": shapes}))
'''


def test_the_kernels_compile_for_a_hopper_gpu_and_the_operators_trace(tmp_path):
    """Without a GPU: the band's kernels, with and without the low rank, for each dtype pair the SKI-TNO launches
    (16-bit x and taps, fp16 x with fp32 taps, fp32), each also as Triton's launcher specializes it for aligned
    tensors and lengths, compiled to machine code for an H100 / H200 (sm_90) by Triton's
    compiler and ptxas, in a process where Triton is not in its interpreter (types and the helper's call, which the
    interpreter does not check); and there the custom operators torch.compile traces (``fairseq_tnn::ski_lowrank``,
    ``fairseq_tnn::ski_band`` and their backward), run on fake tensors: their outputs' and gradients' shapes and
    dtypes."""
    (result,) = compile_for_hopper(COMPILE_FOR_HOPPER, tmp_path)
    assert len(result["built"]) == 32 and min(result["built"]) > 3_000, result["built"]  # 32 cubins of real code
    half, single = "torch.float16", "torch.float32"
    assert result["shapes"] == {
        "ski": [[[16, 2, 64], half], [[32, 8], half], [[16, 2, 64], half], [[16, 17], half], [[16, 15], single]],
        "band": [[[16, 2, 64], half], [[16, 2, 64], half], [[16, 17], half]]}, result["shapes"]
