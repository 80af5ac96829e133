"""The fused-adam and foreach-grad-norm patches (fairseq_tnn/patches/multi_tensor_optim.py): fairseq's Adam step and
gradient clipping as multi-tensor kernels compute fairseq's update, clipped gradients and norm (up to rounding:
the same error against a float64 run as fairseq's own fp32 loop), keep fairseq's optimizer state, dispatch a few
operations whatever the number of parameters, and leave what they do not cover (amsgrad, 16-bit weights, one
gradient) to fairseq's code. On CPU and, where there is one, on a CUDA GPU."""
import copy
import re
import sys

import pytest
import torch

import fairseq.utils
from fairseq.optim.adam import Adam

from benchmarks.opcount import OpCounter
from fairseq_tnn import register
from fairseq_tnn.patches.base import resolve
from helpers import ROOT, command_env, execute

register()  # the plugin as fairseq loads it: the patches installed

FAIRSEQ_STEP = resolve("fairseq.optim.adam:Adam.step")
FAIRSEQ_CLIP = resolve("fairseq.utils:clip_grad_norm_")
SHAPES = [(7, 3), (3,), (5, 2, 2), (1,), (40,)]


def make_params(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(device, dtype)) for s in SHAPES]


def two_groups(params, **kw):
    """fairseq's Adam over ``params`` in two groups with different learning rates and weight decays."""
    return Adam([{"params": params[:2], "lr": 3e-2, "weight_decay": 0.1}, {"params": params[2:]}],
                lr=1e-2, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01, **kw)


def run(opt, params, step_fn, steps, seed=1):
    """``steps`` updates with the same pseudo-random gradients for any ``params`` of these shapes; the parameter
    with index 3 gets no gradient at every third step (fairseq then skips it: its step count falls behind)."""
    g = torch.Generator().manual_seed(seed)
    for t in range(steps):
        grads = [torch.randn(s, generator=g, dtype=torch.float64) * 1e-2 for s in SHAPES]
        for i, (p, grad) in enumerate(zip(params, grads)):
            p.grad = None if (i == 3 and t % 3 == 0) else grad.to(p.device, p.dtype)
        step_fn(opt)


def test_both_patches_are_installed():
    assert Adam.step.fairseq_tnn_patch == "fused-adam"
    assert fairseq.utils.clip_grad_norm_.fairseq_tnn_patch == "foreach-grad-norm"
    assert FAIRSEQ_STEP.__module__ == "fairseq.optim.adam" and FAIRSEQ_CLIP.__module__ == "fairseq.utils"


def test_adams_update_is_fairseqs_up_to_rounding(device):
    """100 updates in fp32 of the fused step and of fairseq's loop, each against fairseq's loop in float64: the
    fused step's error is fairseq's own (the eps placement and the weight decay taken over exactly), and its
    state is fairseq's (an int step per parameter, moments of the parameter's shape and dtype)."""
    fused, loop, exact = (make_params(device, dt) for dt in (torch.float32, torch.float32, torch.float64))
    opts = [two_groups(p) for p in (fused, loop, exact)]
    run(opts[0], fused, lambda o: o.step(), 100)
    run(opts[1], loop, FAIRSEQ_STEP, 100)
    run(opts[2], exact, FAIRSEQ_STEP, 100)
    err_fused = max((a.double() - c).abs().max().item() for a, c in zip(fused, exact))
    err_loop = max((b.double() - c).abs().max().item() for b, c in zip(loop, exact))
    assert err_fused <= 1.5 * err_loop + 1e-7, (err_fused, err_loop)
    for a, b in zip(fused, loop):
        sa, sb = opts[0].state[a], opts[1].state[b]
        assert sorted(sa) == sorted(sb) == ["exp_avg", "exp_avg_sq", "step"]
        assert type(sa["step"]) is int and sa["step"] == sb["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert sa[key].dtype == torch.float32 and sa[key].device == a.device
            torch.testing.assert_close(sa[key], sb[key], rtol=1e-5, atol=1e-9)
    assert opts[0].state[fused[3]]["step"] == 100 - 34  # skipped where it had no gradient


def test_float64_updates_agree_to_rounding(device):
    fused, loop = make_params(device, torch.float64), make_params(device, torch.float64)
    opt_fused, opt_loop = two_groups(fused), two_groups(loop)
    run(opt_fused, fused, lambda o: o.step(), 30)
    run(opt_loop, loop, FAIRSEQ_STEP, 30)
    for a, b in zip(fused, loop):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_a_checkpointed_state_resumes_in_either_implementation(device):
    """The fused step's state_dict, loaded into an optimizer that goes on with fairseq's loop, gives what going on
    with the fused step gives, and the other way round."""
    for first, then in ((lambda o: o.step(), FAIRSEQ_STEP), (FAIRSEQ_STEP, lambda o: o.step())):
        a, b = make_params(device, torch.float32), make_params(device, torch.float32)
        opt_a = two_groups(a)
        run(opt_a, a, first, 10)
        with torch.no_grad():
            for p, q in zip(a, b):
                q.copy_(p)
        opt_b = two_groups(b)
        opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as from a checkpoint: tensors of its own
        run(opt_a, a, then, 10, seed=2)
        run(opt_b, b, first, 10, seed=2)
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_the_fused_step_dispatches_a_few_operations_whatever_the_number_of_parameters():
    """fairseq's loop dispatches about 9 operations per parameter; the fused step a handful per device, step count
    and group."""
    counts = {}
    for n in (5, 50):
        for name, step_fn in (("fused", lambda o: o.step()), ("loop", FAIRSEQ_STEP)):
            params = [torch.nn.Parameter(torch.randn(3)) for _ in range(n)]
            opt = Adam(params, lr=1e-3, weight_decay=0.01)
            for p in params:
                p.grad = torch.randn(3)
            step_fn(opt)  # builds the state
            with OpCounter() as c:
                step_fn(opt)
            counts[name, n] = sum(c.counts.values())
            assert c.counts["_fused_adam_"] == (name == "fused"), c.counts
    # the step tensor, the weight decay, the kernel, and torch's record_function around an optimizer step
    assert counts["fused", 5] == counts["fused", 50] <= 5, counts
    assert counts["loop", 50] >= 8 * 50, counts


def test_the_fused_steps_host_loop_casts_only_moments_that_differ(monkeypatch):
    """The fused step's loop over the parameters (its host time, which on a GPU the device waits for) casts a
    moment to its parameter's device and dtype only where they differ, as a checkpoint's loaded in another dtype,
    not each moment at every step as fairseq's ``.to(p.data)`` does (2 calls per parameter and step: a third of
    the step's host time for tnn_lm_wt103's 171 parameters, 1.5 against 1.0 ms on the 2-core CPU machine)."""
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(50)]
    opt = Adam(params, lr=1e-3, weight_decay=0.01)
    for p in params:
        p.grad = torch.randn(3)
    opt.step()  # builds the state
    opt.state[params[7]]["exp_avg_sq"] = opt.state[params[7]]["exp_avg_sq"].double()  # as loaded in float64
    calls = []
    to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: calls.append(self.shape) or to(self, *a, **kw))
    opt.step()
    assert len(calls) == 1 and opt.state[params[7]]["exp_avg_sq"].dtype == torch.float32, calls
    assert all(opt.state[p]["step"] == 2 for p in params)


@pytest.mark.parametrize("case", ["amsgrad", "fp16 weights"])
def test_what_the_fused_step_does_not_cover_runs_fairseqs_loop(case):
    dtype = torch.float16 if case == "fp16 weights" else torch.float32
    kw = {"amsgrad": True} if case == "amsgrad" else {}
    ours, theirs = make_params("cpu", dtype), make_params("cpu", dtype)
    opt_ours, opt_theirs = two_groups(ours, **kw), two_groups(theirs, **kw)
    run(opt_ours, ours, lambda o: o.step(), 5)
    run(opt_theirs, theirs, FAIRSEQ_STEP, 5)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def grads_of(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s, device=device, dtype=dtype)) for s in SHAPES]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 3).to(device, dtype)
    params[1].grad = None
    params[4].expert = True  # fairseq leaves experts' gradients out of the norm and clips them all the same
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("max_norm", [0.0, 1.0, 1e6])
def test_gradient_clipping_is_fairseqs(device, dtype, max_norm):
    ours, theirs = grads_of(device, dtype), grads_of(device, dtype)
    doubled = lambda norm: norm * 2  # noqa: E731  (an aggregate_norm_fn, as distributed training passes)
    norm_ours = fairseq.utils.clip_grad_norm_(ours, max_norm, doubled)
    norm_theirs = FAIRSEQ_CLIP(theirs, max_norm, doubled)
    assert norm_ours.dtype == norm_theirs.dtype == torch.float32 and norm_ours.device == norm_theirs.device
    torch.testing.assert_close(norm_ours, norm_theirs, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-3 if dtype == torch.float16 else 1e-6, atol=0)
    clipped = max_norm == 1.0
    assert (ours[0].grad.float().norm() < grads_of(device, dtype)[0].grad.float().norm()) == clipped


def test_clipping_many_gradients_takes_one_norm_kernel():
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(50)]
    for p in params:
        p.grad = torch.randn(3)
    with OpCounter() as c:
        fairseq.utils.clip_grad_norm_(params, 1.0)
    ops = c.counts
    assert ops["_foreach_norm"] == 1 and ops["linalg_vector_norm"] == 1 and sum(ops.values()) <= 8, ops
    with OpCounter() as c:
        FAIRSEQ_CLIP(params, 1.0)
    assert c.counts["linalg_vector_norm"] >= 50


def test_clipping_on_one_device_copies_no_norm(monkeypatch):
    """The gradients' norms stay where the multi-tensor kernel put them when that is the device fairseq gathers them
    on (a ``.to`` per norm was host time only there), and the clipped gradients are fairseq's."""
    ours, theirs = grads_of("cpu", torch.float32), grads_of("cpu", torch.float32)
    calls = []
    to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: calls.append(self.shape) or to(self, *a, **kw))
    norm = fairseq.utils.clip_grad_norm_(ours, 1.0)
    assert calls == []
    monkeypatch.setattr(torch.Tensor, "to", to)
    torch.testing.assert_close(norm, FAIRSEQ_CLIP(theirs, 1.0))
    for p, q in zip(ours, theirs):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad)


def test_one_gradient_keeps_fairseqs_code(monkeypatch):
    """The flat fp32 master weights of --fp16: one gradient, which fairseq's own clip_grad_norm_ handles."""
    calls = []
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: calls.append(1))
    p = torch.nn.Parameter(torch.zeros(10))
    p.grad = torch.full((10,), 2.0)
    norm = fairseq.utils.clip_grad_norm_([p], 1.0)
    assert not calls and norm.item() == pytest.approx(2.0 * 10 ** 0.5)
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


def test_the_benchmark_times_both_side_by_side():
    """benchmarks/optimizer_step.py (the figures in docs/performance.md) runs as documented and reports fairseq's
    code and the plugin's for the same parameters."""
    code, out, _ = execute([sys.executable, ROOT / "benchmarks/optimizer_step.py", "--arch", "tnn_lm_tiny",
                            "--rounds", 2], command_env(), 300, merge=True)
    assert code == 0, out[-3000:]
    assert re.search(r"tnn_lm_tiny, (\d+) parameters", out), out
    for name in ("fairseq", "plugin"):
        assert re.search(rf"^\| {name} \| per-parameter \| [0-9,]+ \| [0-9.]+ \|$", out, re.M), out
