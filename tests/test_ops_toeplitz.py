"""The FFT Toeplitz product against the dense reference: forward and gradients."""
import pytest
import torch

from fairseq_tnn.ops.toeplitz import next_fast_len, toeplitz_dense, toeplitz_fft, toeplitz_ref

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float64: dict(rtol=1e-9, atol=1e-9)}


def _inputs(n, d, dtype, causal, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, d, generator=g, dtype=dtype, requires_grad=True)
    pos = torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True)
    neg = None if causal else torch.randn(n - 1, d, generator=g, dtype=dtype, requires_grad=True)
    return x, pos, neg


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 2, 7, 64, 513, 1024, 4096])
def test_fft_matches_dense_forward_and_gradients(n, causal, dtype):
    d = 3 if n <= 1024 else 2
    x, pos, neg = _inputs(n, d, dtype, causal)
    leaves = [t for t in (x, pos, neg) if t is not None]
    y_fast = toeplitz_fft(x, pos, neg)
    y_ref = toeplitz_ref(x, pos, neg)
    scale = y_ref.abs().max().clamp(min=1)
    torch.testing.assert_close(y_fast / scale, y_ref / scale, **TOL[dtype])
    grad_out = torch.randn_like(y_ref)
    g_fast = torch.autograd.grad(y_fast, leaves, grad_out)
    g_ref = torch.autograd.grad(y_ref, leaves, grad_out)
    for a, b in zip(g_fast, g_ref):
        if b.numel() == 0:  # n = 1 has no negative lags
            assert a.numel() == 0
            continue
        s = b.abs().max().clamp(min=1)
        torch.testing.assert_close(a / s, b / s, **TOL[dtype])


def test_dense_matrix_is_toeplitz_with_the_right_lags():
    pos = torch.tensor([[1.0], [2.0], [3.0]])
    neg = torch.tensor([[-1.0], [-2.0]])
    t = toeplitz_dense(pos, neg)[0]
    assert t.tolist() == [[1, -1, -2], [2, 1, -1], [3, 2, 1]]
    assert toeplitz_dense(pos)[0].tolist() == [[1, 0, 0], [2, 1, 0], [3, 2, 1]]


def test_causal_output_ignores_the_future():
    x, pos, _ = _inputs(50, 4, torch.float64, True, b=1)
    y = toeplitz_fft(x, pos)
    jac = torch.autograd.grad(y[0, 20].sum(), x)[0][0]  # (n, d)
    assert jac[21:].abs().max() == 0 or jac[21:].abs().max() < 1e-12
    assert jac[:21].abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_use_fp32_ffts(dtype):
    x, pos, neg = _inputs(300, 8, torch.float32, False)
    ref = toeplitz_ref(x.double(), pos.double(), neg.double())
    y = toeplitz_fft(x.to(dtype), pos.to(dtype), neg.to(dtype))
    assert y.dtype == dtype
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
