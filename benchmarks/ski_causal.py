"""Causal SKI-TNO, for the benchmark of the paper's appendix claim (benchmarks/run.py's ``ski_causal_*`` layer
rows, built in benchmarks/measure.py); no model uses it, so it lives here beside its benchmark, not in
fairseq_tnn/ops.

The paper's appendix ("Causal masking negates SKI's benefits") masks SKI's
Toeplitz matrix T = Band + W A W^T to its lower triangle and computes it with
cumulative sums (w_i = row i of W, r-vectors):

    y_i = sum_{j <= i} T_ij x_j = band_i + w_i^T A s_i,    s_i = sum_{j <= i} w_j x_j,

and argues that the cumulative sums s_i (an r-vector per position) cost O(nr)
time and memory and, being sequential, end up slower than the FFT TNN.

Two implementations of the same operator, each checked against the dense
reference ``ski_causal_tno_ref`` (tests/scripts/test_ski_causal.py):

* ``ski_causal_cumsum``: the appendix as written. s_i for every position by a
  cumulative sum over the (n, r) outer products w_j x_j, then y_i = [W A]_i^T s_i.
  O(n r) memory per channel and batch row.
* ``ski_causal_local``: the same sums, using that linear interpolation gives
  w_j two adjacent non-zeros (lo_j, lo_j + 1) with lo_j non-decreasing in j.
  Then s_i = (complete contributions of the segments before lo_i) + (the
  running sums of the current segment), so

      w_i^T A s_i = (1 - f_i) [q1(lo_i) + A_0 c1_i + A_-1 c2_i] + f_i [q2(lo_i) + A_1 c1_i + A_0 c2_i]

  with c1, c2 the within-segment running sums of (1 - f) x and f x (one
  cumulative sum over positions each), A_t the Toeplitz coefficient of A at
  lag t, and q1(L) = (A Z_L)[L], q2(L) = (A Z_L)[L + 1], Z_L the complete part,
  which only needs the r segment totals: O(r^2) per channel and batch row.
  Total O(n + r^2), no (n, r) intermediate.

The causal band keeps the taps of lags 0 .. h (h = (m-1)/2) of the centred
m-tap filter. Layout: channel-major x (d, *batch, n), like ``ski_tno(...,
layout="dbn")`` of fairseq_tnn/ops/ski.py, whose parts (band, interpolation, A's coefficients) it uses;
computation in float32 (float64 for float64 input).
"""
import torch

from fairseq_tnn.ops.ski import (band_conv, band_dense, check_ski_args, interp_matrix, interp_weights, ski_kernel,
                                 ski_lowrank_dense)
from fairseq_tnn.ops.toeplitz import fft_dtype


def causal_taps(conv_weight: torch.Tensor) -> torch.Tensor:
    """The centred taps with those of negative lags (i - j < 0, taps k > h) zeroed."""
    m = conv_weight.shape[1]
    keep = torch.arange(m, device=conv_weight.device) <= (m - 1) // 2
    return conv_weight * keep.to(conv_weight.dtype)


def _prepare(x, conv_weight, knots, lam):
    check_ski_args(x, conv_weight, knots, lam, "dbn")
    ct = fft_dtype(x)
    d, n = x.shape[0], x.shape[-1]
    xc = x.to(ct).reshape(d, -1, n)  # (d, R, n)
    band = band_conv(xc, causal_taps(conv_weight.to(ct)))  # (d, R, n)
    pos, neg = ski_kernel(n, knots.to(ct), lam)  # (r_eff, d), (r_eff - 1, d)
    return ct, xc, band, pos, neg


def ski_causal_cumsum(x: torch.Tensor, conv_weight: torch.Tensor, knots: torch.Tensor, lam: float,
                      chunk: int = 256) -> torch.Tensor:
    """Causal SKI by the appendix's cumulative sums: s_i for every i, then [W A]_i^T s_i.

    x (d, *batch, n). Channels are processed ``chunk`` at a time to bound the
    (chunk, batch, n, r) temporaries; the operator itself is unchanged.
    """
    ct, xc, band, pos, neg = _prepare(x, conv_weight, knots, lam)
    d, rows, n = xc.shape
    r = knots.shape[0] // 2
    w = interp_matrix(n, r, device=x.device, dtype=ct)  # (n, r_eff)
    lag = torch.arange(w.shape[1], device=x.device)
    lag = lag[:, None] - lag[None, :]  # (r_eff, r_eff): k - l
    coeffs = torch.cat([neg.flip(0), pos], dim=0)  # (2 r_eff - 1, d), lags -(r_eff-1) .. r_eff-1
    a = coeffs[lag + w.shape[1] - 1].permute(2, 0, 1)  # (d, r_eff, r_eff)
    wa = torch.matmul(w, a)  # (d, n, r_eff): row i is w_i^T A
    outs = []
    for c in range(0, d, chunk):
        s = torch.cumsum(xc[c:c + chunk, :, :, None] * w, dim=2)  # (chunk, R, n, r_eff): s_i
        outs.append((s * wa[c:c + chunk, None]).sum(-1))  # (chunk, R, n): w_i^T A s_i
    y = band + torch.cat(outs, dim=0)
    return y.view(x.shape).to(x.dtype)


def ski_causal_local(x: torch.Tensor, conv_weight: torch.Tensor, knots: torch.Tensor, lam: float) -> torch.Tensor:
    """Causal SKI in O(n + r^2) per channel and batch row (see the module docstring). x (d, *batch, n).

    With Cx, C2 the running sums of x and f x over all positions, the within-segment sums are
    c1 + c2 = Cx - Cx[start(lo) - 1] and c2 = C2 - C2[start(lo) - 1]; collecting terms,

        y_i = lerp(u1[lo_i], u2[lo_i], f_i) + alpha_i Cx_i + beta_i C2_i,

    alpha_i = (1 - f_i) A_0 + f_i A_1, beta_i = (1 - f_i)(A_-1 - A_0) + f_i (A_0 - A_1), and
    u1, u2 (one value per segment: q1, q2 minus the segment offsets times the same
    coefficients) cost O(r^2). Full-length work: two cumulative sums, one product,
    one thin GEMM spreading the per-segment values over the positions, and two fused
    multiply-adds.
    """
    ct, xc, band, pos, neg = _prepare(x, conv_weight, knots, lam)
    d, rows, n = xc.shape
    r = knots.shape[0] // 2
    r_eff = min(r, n)
    if r_eff == 1:  # n == 1: W = [[1]], y = A_0 x
        return (band + pos[0].view(d, 1, 1) * xc).view(x.shape).to(x.dtype)
    index, weight = interp_weights(n, r, device=x.device, dtype=ct)
    lo = index[:, 0].contiguous()  # (n,) non-decreasing, in [0, r_eff - 2]
    f = weight[:, 1].contiguous()  # (n,) share of lo + 1
    nseg = r_eff - 1
    seg = torch.arange(nseg, device=x.device)
    start = torch.searchsorted(lo, seg)  # first position of each segment
    stop = torch.searchsorted(lo, seg, right=True)  # one past its last (== start if empty)
    cx = torch.cumsum(xc, dim=-1)  # (d, R, n)
    c2 = torch.cumsum(xc * f, dim=-1)

    def before(c, idx):  # running sum before position idx (0 at idx = 0): (d, R, len(idx))
        return torch.cat([c.new_zeros(d, rows, 1), c], dim=-1).index_select(-1, idx)

    cx_s, c2_s = before(cx, start), before(c2, start)  # offsets at the segment starts
    tot_x, tot_p = before(cx, stop) - cx_s, before(c2, stop) - c2_s  # segment totals of x and f x
    tot_q = tot_x - tot_p  # of (1 - f) x
    # q1(L) = sum_{s<L} a_s A[L, s] + b_s A[L, s+1], q2(L) = sum_{s<L} a_s A[L+1, s] + b_s A[L+1, s+1],
    # a = tot_q, b = tot_p; every lag here is >= 0 (the causal part of A), pos[t] = A at lag t
    big_l = seg[:, None]
    small_s = seg[None, :]
    below = (small_s < big_l).to(ct)  # (nseg, nseg)

    def coef(lag):  # (d, 1, nseg, nseg)
        return (pos[lag.clamp(0, r_eff - 1)].permute(2, 0, 1) * below).unsqueeze(1)

    q1 = (coef(big_l - small_s) * tot_q.unsqueeze(2)).sum(-1) + (coef(big_l - small_s - 1) * tot_p.unsqueeze(2)).sum(-1)
    q2 = (coef(big_l + 1 - small_s) * tot_q.unsqueeze(2)).sum(-1) + (coef(big_l - small_s) * tot_p.unsqueeze(2)).sum(-1)
    a0, ap1, am1 = pos[0].view(d, 1, 1), pos[1].view(d, 1, 1), neg[0].view(d, 1, 1)  # lags 0, +1, -1
    u1 = q1 - a0 * cx_s - (am1 - a0) * c2_s  # (d, R, nseg)
    u2 = q2 - ap1 * cx_s - (a0 - ap1) * c2_s
    alpha = torch.lerp(a0, ap1, f)  # (d, 1, n)
    beta = torch.lerp(am1 - a0, a0 - ap1, f)
    # lerp(u1[lo], u2[lo], f) as one GEMM with the (2 nseg, n) matrix [(1 - f) onehot(lo); f onehot(lo)]^T
    # (a gather along the last dim from 31 values is ~5x slower on CPU)
    onehot = (lo[None, :] == seg[:, None]).to(ct)  # (nseg, n)
    interp = torch.cat([onehot * (1 - f), onehot * f], dim=0)  # (2 nseg, n)
    low = torch.mm(torch.cat([u1, u2], dim=-1).view(d * rows, 2 * nseg), interp).view(d, rows, n)
    low = low.addcmul_(alpha, cx).addcmul_(beta, c2)
    return (band + low).view(x.shape).to(x.dtype)


def ski_causal_tno_ref(x: torch.Tensor, conv_weight: torch.Tensor, knots: torch.Tensor, lam: float) -> torch.Tensor:
    """Dense reference: the lower triangle of Band + W A W^T, x (d, *batch, n), O(n^2 d)."""
    check_ski_args(x, conv_weight, knots, lam, "dbn")
    ct = fft_dtype(x)
    n = x.shape[-1]
    t = band_dense(n, conv_weight.to(ct)) + ski_lowrank_dense(n, knots.to(ct), lam)  # (d, n, n)
    t = torch.tril(t)
    return torch.einsum("cij,c...j->c...i", t, x.to(ct)).to(x.dtype)
