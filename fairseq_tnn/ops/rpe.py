"""The RPE MLP evaluated channel-major, as one operator with a hand-written backward.

The MLP (``modules/rpe.py``) maps m positions (lags or frequencies) to a (d, m) kernel:

    h_0 = Linear(t),  then per hidden layer h_{k+1} = Linear_k(act(norm_k(h_k))),
    kernel = (W_out act(norm_L(h_L))^T + b_out) * scale    (scale (m,) per position, or none)

It is tiny (m x 64 values per layer), so on a GPU its cost is the number of operations dispatched, not
their work. Autograd spends about 19 operations per hidden layer on its backward (the hand-written
``SimpleRMSNorm`` alone takes a dozen); ``RpeMlp.backward`` takes 9: two GEMMs and a sum for the
Linear, one for the activation (torch's own ``*_backward`` kernels) and five for the RMS norm (one for
a LayerNorm: ``native_layer_norm_backward``). Its forward takes 5 per layer instead of 6 (the RMS
norm's denominator in one ``add`` with ``alpha``), and the per-position scale multiplies the (d, m)
output once instead of being folded into a concatenated GEMM operand (two operations instead of five).
One causal TNN TNO of the paper's width (RPE 6) went from 58 to 44 operations forward and from 141
to 80 backward (benchmarks/opcount.py). ``Rpe`` hands it its weights packed in one tensor (``rpe_mlp_packed``):
a cast to the computing dtype, where the weights are in another, is one operation inside the operator, and their
gradient comes back as one tensor.

``rpe_mlp`` runs it; ``rpe_mlp_ref`` is the reference (autograd through the plain operations, what
``Rpe.channel_major`` computed before), and tests/ops/test_fast_paths.py compares the two, forward and
gradients. Everything computes in ``dtype`` (float32 at least, see ``modules/rpe.py``); gradients are
returned in it too, and autograd casts them to each parameter's dtype.
"""
import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import fast

aten = torch.ops.aten

# name -> (forward, backward(grad, input, output)); the activations of modules/activations.py
ACTIVATIONS = {
    "relu": (torch.relu, lambda g, x, y: aten.threshold_backward(g, x, 0)),
    "silu": (F.silu, lambda g, x, y: aten.silu_backward(g, x)),
    "gelu": (F.gelu, lambda g, x, y: aten.gelu_backward(g, x)),
    "elu": (F.elu, lambda g, x, y: aten.elu_backward(g, 1.0, 1, 1, False, x)),
    "sigmoid": (torch.sigmoid, lambda g, x, y: aten.sigmoid_backward(g, y)),
    "tanh": (torch.tanh, lambda g, x, y: aten.tanh_backward(g, y)),
    "identity": (None, lambda g, x, y: g),
}
NORMS = ("simplermsnorm", "layernorm")


def _unpack(params: Sequence[torch.Tensor], layers: int, layernorm: bool):
    """The flat parameter list of ``rpe_params`` as (proj, [(norm, linear)] * layers, final norm, out), each
    Linear a (weight, bias) pair and each norm (weight, bias) or None."""
    it = iter(params)

    def pair():
        return next(it), next(it)

    proj = pair()
    hidden = []
    for _ in range(layers):
        norm = pair() if layernorm else None
        hidden.append((norm, pair()))
    final = pair() if layernorm else None
    return proj, hidden, final, pair()


def rpe_params(rpe) -> List[torch.Tensor]:
    """The parameters of a ``modules.rpe.Rpe`` in the order ``rpe_mlp`` takes them: proj, then per hidden
    layer its norm's (LayerNorm only) and its Linear's, then the last norm's and the output Linear's. The Linears'
    are views of the RPE's packed parameter (``Rpe.unpacked``), which holds them in this order."""
    linears = rpe.unpacked()
    if not isinstance(rpe.norms[0], torch.nn.LayerNorm):
        return linears
    out = linears[:2]
    for i, norm in enumerate(rpe.norms):
        out += [norm.weight, norm.bias] + linears[2 + 2 * i: 4 + 2 * i]
    return out


class RpeMlp(torch.autograd.Function):
    """(L, d, m) kernels of L RPE MLPs of one shape at the same positions t (m,), each parameter stacked with a
    leading dimension of L (one layer's RPE: L = 1); see the module docstring. Every GEMM is one batched GEMM
    over the L MLPs, every other operation one operation on all of them, so that evaluating a model's layers'
    RPEs together costs the operations of one. ``config``: (activation, norm type, norm eps, hidden layers,
    dtype, shapes); a LayerNorm's parameters are taken for L = 1 only. ``shapes`` None: ``params`` are the
    parameters, each (L, *shape), and each gets its gradient; otherwise ``params`` is one (L, P) tensor, each row the
    parameters of ``shapes`` flattened one after another (``rpe_mlp_packed``), and its gradient is one (L, P) tensor."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, scale: Optional[torch.Tensor], config: Tuple, *params: torch.Tensor):
        activation, norm_type, eps, layers, dt, shapes = config
        act = ACTIVATIONS[activation][0]
        layernorm = norm_type == "layernorm"
        if shapes is None:
            ps = [p.to(dt) for p in params]
        else:  # views of the rows, no copy (each block's last dimension is contiguous)
            (packed,) = params
            blocks = packed.to(dt).split([math.prod(shape) for shape in shapes], dim=1)
            ps = [block.view(packed.shape[0], *shape) for block, shape in zip(blocks, shapes)]
        proj, hidden, final, (w_out, b_out) = _unpack(ps, layers, layernorm)
        stacked = w_out.shape[0]
        if layernorm and stacked != 1:
            raise ValueError(f"RpeMlp: LayerNorm RPEs are evaluated one at a time, got {stacked} stacked")
        x0 = t.to(dt).view(1, -1, 1).expand(stacked, -1, 1)  # (L, m, 1)
        h = torch.baddbmm(proj[1].unsqueeze(1), x0, proj[0].transpose(1, 2))  # (L, m, H)
        width = h.shape[-1]
        if not layernorm:
            eps_t = fast.constant(("rpe-eps", eps, dt), h.device, lambda: torch.full((1,), eps, dtype=dt, device=h.device))
        saved = []  # per norm: its state for the backward, its output (the activation's input), the activation's output

        for norm, linear in hidden + [(final, None)]:
            if layernorm:
                y, mean, rstd = aten.native_layer_norm(h, [width], norm[0][0], norm[1][0], eps)
                state = (h, mean, rstd)
            else:  # SimpleRMSNorm: h / (||h|| width^-1/2 + eps)
                nrm = torch.linalg.vector_norm(h, dim=-1, keepdim=True)
                den = torch.add(eps_t, nrm, alpha=width ** -0.5)  # eps + ||h|| width^-1/2 in one operation
                y = h / den
                state = (h, nrm, den)
            a = y if act is None else act(y)
            saved.append((state, y, a))
            if linear is not None:
                h = torch.baddbmm(linear[1].unsqueeze(1), a, linear[0].transpose(1, 2))
        out = torch.baddbmm(b_out.unsqueeze(2), w_out, a.transpose(1, 2))  # (L, d, m)
        if scale is not None:
            # in place eagerly (a stack's (L, d, m) kernels are up to 450 MB for a masked wt103 model at 2048
            # tokens: no second copy), out of place under torch.compile, where torch 2.11 turns an in-place product
            # on an autograd.Function's output into a zero gradient for every parameter (2.13 does not; the
            # compiled graph allocates its own buffers either way; tests/ops/test_fast_paths.py)
            out = out * scale.to(dt) if fast.compiling() else out.mul_(scale.to(dt))
        ctx.config = config
        flat = [x0, scale]
        for state, y, a in saved:
            flat += [*state, y, a]
        ctx.save_for_backward(*flat, *ps)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        activation, norm_type, eps, layers, dt, shapes = ctx.config
        act_backward = ACTIVATIONS[activation][1]
        layernorm = norm_type == "layernorm"
        saved = ctx.saved_tensors
        x0, scale = saved[0], saved[1]
        per = 5  # state (3), y, a
        norms = [saved[2 + k * per: 2 + (k + 1) * per] for k in range(layers + 1)]
        ps = saved[2 + (layers + 1) * per:]
        proj, hidden, final, (w_out, b_out) = _unpack(ps, layers, layernorm)
        g = grad.to(dt)
        if scale is not None:
            g = g * scale.to(dt)
        grads: List[Optional[torch.Tensor]] = []  # in reverse order of the parameters
        a = norms[-1][-1]
        grads += [g.sum(2), torch.bmm(g, a)]  # b_out, w_out
        ga = torch.bmm(g.transpose(1, 2), w_out)  # (L, m, H)
        norm_params = [n for n, _ in hidden] + [final]
        for k in range(layers, -1, -1):
            *state, y, a = norms[k]
            gy = act_backward(ga, y, a)
            width = y.shape[-1]
            if layernorm:
                h, mean, rstd = state
                w, b = norm_params[k]
                gh, gw, gb = aten.native_layer_norm_backward(gy, h, [width], mean, rstd, w[0], b[0], [True, True, True])
                grads += [gb.unsqueeze(0), gw.unsqueeze(0)]
            else:
                h, nrm, den = state
                # d/dh of h / (s ||h|| + eps): gy / den - h s <gy / den, y> / ||h|| (the second term 0 at h = 0,
                # as torch's norm has it)
                gd = gy / den
                # <gd, y> per position: one operation
                c = torch.bmm(gd.view(-1, 1, width), y.view(-1, width, 1)).view(*gd.shape[:-1], 1)
                c.div_(nrm.clamp_min(torch.finfo(dt).tiny))
                gh = torch.addcmul(gd, h, c, value=-(width ** -0.5))
            if k > 0:
                prev_a = norms[k - 1][-1]
                w, b = hidden[k - 1][1]
                grads += [gh.sum(1), torch.bmm(gh.transpose(1, 2), prev_a)]  # b, w of the Linear that made h_k
                ga = torch.bmm(gh, w)
            else:
                grads += [gh.sum(1), torch.bmm(gh.transpose(1, 2), x0)]  # proj's b, w
        grads.reverse()
        if shapes is not None:  # the packed rows' gradient, in one operation
            return None, None, None, torch.cat([g.reshape(g.shape[0], -1) for g in grads], dim=1)
        return (None, None, None, *grads)


def rpe_mlp(t: torch.Tensor, scale: Optional[torch.Tensor], params: Sequence[torch.Tensor], activation: str,
            norm_type: str, eps: float, layers: int, dtype: torch.dtype) -> torch.Tensor:
    """(d, m): the RPE MLP's kernel at positions t (m,), times ``scale`` (m,) per position if given, computed in
    ``dtype`` by ``RpeMlp`` (``params``: ``rpe_params``' order)."""
    return rpe_mlp_stacked(t, scale, [p.unsqueeze(0) for p in params], activation, norm_type, eps, layers,
                           dtype).squeeze(0)


def rpe_mlp_stacked(t: torch.Tensor, scale: Optional[torch.Tensor], params: Sequence[torch.Tensor], activation: str,
                    norm_type: str, eps: float, layers: int, dtype: torch.dtype) -> torch.Tensor:
    """(L, d, m): L RPE MLPs of one shape at the same positions, each of ``params`` (``rpe_params``' order) the L
    MLPs' parameter stacked along a new first dimension, in the operations of one MLP (``RpeMlp``)."""
    return RpeMlp.apply(t, scale, (activation, norm_type, float(eps), layers, dtype, None), *params)


def rpe_mlp_packed(t: torch.Tensor, scale: Optional[torch.Tensor], packed: torch.Tensor, shapes: Sequence[tuple],
                   activation: str, norm_type: str, eps: float, layers: int, dtype: torch.dtype) -> torch.Tensor:
    """(L, d, m): ``rpe_mlp_stacked`` of L RPE MLPs whose parameters are the rows of ``packed`` (L, P), each row the
    parameters of ``shapes`` (``rpe_params``' order, RMS norms: no norm weights) flattened one after another, as
    ``modules.rpe.Rpe.packed`` holds them. The backward returns the rows' gradient as one (L, P) tensor: autograd and
    a compiled graph see one tensor per RPE, not one per weight."""
    return RpeMlp.apply(t, scale, (activation, norm_type, float(eps), layers, dtype, tuple(map(tuple, shapes))), packed)


def rpe_mlp_ref(t: torch.Tensor, scale: Optional[torch.Tensor], params: Sequence[torch.Tensor], activation: str,
                norm_type: str, eps: float, layers: int, dtype: torch.dtype) -> torch.Tensor:
    """Reference for ``rpe_mlp``: the same MLP in plain operations, differentiated by autograd (the bias and the
    scale folded into one GEMM, as ``Rpe.channel_major`` computed it before the fast path)."""
    act = ACTIVATIONS[activation][0] or (lambda v: v)
    layernorm = norm_type == "layernorm"
    proj, hidden, final, (w_out, b_out) = _unpack([p.to(dtype) for p in params], layers, layernorm)
    h = F.linear(t.to(dtype).unsqueeze(-1), *proj)

    def norm(v, p):
        if layernorm:
            return F.layer_norm(v, (v.shape[-1],), p[0], p[1], eps)
        return v / (v.norm(dim=-1, keepdim=True) * v.shape[-1] ** -0.5 + eps)

    for p, linear in hidden:
        h = F.linear(act(norm(h, p)), *linear)
    h = act(norm(h, final))
    if scale is None:
        return torch.addmm(b_out.unsqueeze(1), w_out, h.t().contiguous())
    s = scale.to(dtype).unsqueeze(1)
    return torch.cat([w_out, b_out.unsqueeze(1)], dim=1) @ torch.cat([h * s, s], dim=1).t().contiguous()
