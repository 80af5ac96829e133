"""--ski-lowrank: the scale of SKI-TNN's low-rank part (mean, the default; sum; off), each against the dense
reference with the documented f, forward and gradients; the sizes at initialisation that motivated the default;
and checkpoints saved before the option, which load as 'sum' and compute what they computed."""
import logging

import pytest
import torch

from helpers import assert_on
from fairseq_tnn.modules.tno import build_tno
from fairseq_tnn.ops.ski import ski_tno_ref

SETTINGS = dict(ski_rank=8, ski_taps=5, ski_warp_decay=0.9)


def reference(tno, x, knots):
    return ski_tno_ref(x, tno.conv_weight, knots, tno.warp_decay)


def random_knots(tno):
    """Knots drawn N(0, 1) ('mean' starts them at zero), so that the low-rank part is tested."""
    with torch.no_grad():
        tno.knots.normal_()
    return tno


def test_mean_starts_as_the_band_alone_and_sum_as_before():
    torch.manual_seed(0)
    mean = build_tno("ski", 6, False, **SETTINGS)
    assert mean.lowrank == "mean" and torch.count_nonzero(mean.knots) == 0
    off = build_tno("ski", 6, False, **SETTINGS, ski_lowrank="off")
    off.conv_weight.data.copy_(mean.conv_weight.data)
    x = torch.randn(2, 30, 6)
    torch.testing.assert_close(mean(x), off(x), rtol=0, atol=0)
    total = build_tno("ski", 6, False, **{**SETTINGS, "ski_rank": 64}, ski_lowrank="sum")
    assert 0.1 < total.knots.std().item() < 0.15  # N(0, 1/r), r = 64


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 40])
@pytest.mark.parametrize("mode", ["mean", "sum", "off"])
def test_each_mode_is_the_dense_operator_with_its_f(mode, n, device):
    """mean: f = knots (r_eff - 1) / (n - 1); sum: f = knots; off: the band alone (no knots parameter).
    On every device (the `device` fixture: CPU, and CUDA where present)."""
    torch.manual_seed(0)
    tno = build_tno("ski", 6, False, **SETTINGS, ski_lowrank=mode).double().to(device)
    if mode != "off":
        random_knots(tno)
    x = torch.randn(2, n, 6, dtype=torch.float64).to(device).requires_grad_(True)
    if mode == "off":
        assert tno.knots is None and [k for k, _ in tno.named_parameters()] == ["conv_weight"]
        knots = None
    else:
        r_eff = min(8, n)
        scale = (r_eff - 1) / (n - 1) if mode == "mean" and r_eff > 1 else 1.0
        knots = tno.knots * scale
    y = tno(x)
    y_ref = reference(tno, x, knots)
    assert_on(device, y, y_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y)
    params = [x] + [p for p in tno.parameters()]
    grads = torch.autograd.grad(y, params, g)
    grads_ref = torch.autograd.grad(y_ref, params, g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_mean_is_sum_with_knots_divided_by_the_spacing():
    torch.manual_seed(0)
    mean = random_knots(build_tno("ski", 4, False, **SETTINGS))
    total = build_tno("ski", 4, False, **SETTINGS, ski_lowrank="sum")
    total.load_state_dict(mean.state_dict())
    n = 64
    with torch.no_grad():
        total.knots.mul_(7 / 63)  # h = (n - 1) / (r - 1) = 9
    x = torch.randn(3, n, 4)
    torch.testing.assert_close(mean(x), total(x), rtol=1e-6, atol=1e-6)


def old_state_dict(tno):
    """A state dict as the code before --ski-lowrank saved it: no version entry, knots = f."""
    return {k: v for k, v in tno.state_dict().items() if k != "version"}


def test_a_checkpoint_from_before_the_option_loads_as_sum(caplog):
    torch.manual_seed(0)
    old = build_tno("ski", 4, False, **SETTINGS, ski_lowrank="sum")
    x = torch.randn(2, 50, 4)
    expected = old(x)
    new = build_tno("ski", 4, False, **SETTINGS)  # the default, mean
    with caplog.at_level(logging.WARNING):
        new.load_state_dict(old_state_dict(old))
    assert new.lowrank == "sum" and int(new.version) == 1
    assert "saved before --ski-lowrank existed" in caplog.text
    torch.testing.assert_close(new(x), expected, rtol=0, atol=0)
    # saved again and reloaded, it stays what it was
    again = build_tno("ski", 4, False, **SETTINGS)
    again.load_state_dict(new.state_dict())
    assert again.lowrank == "sum"
    torch.testing.assert_close(again(x), expected, rtol=0, atol=0)


def test_a_new_checkpoint_keeps_its_mode():
    torch.manual_seed(0)
    a = random_knots(build_tno("ski", 4, False, **SETTINGS))
    b = build_tno("ski", 4, False, **SETTINGS)
    b.load_state_dict(a.state_dict())
    assert b.lowrank == "mean" and int(b.version) == 3
    x = torch.randn(2, 30, 4)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


@pytest.mark.parametrize("n", [9, 33, 64, 200])
def test_mean_keeps_the_scale_of_the_training_length_at_every_length(n):
    """With a training length n_0 (what a model passes), 'mean' is f = knots (r - 1) / (n_0 - 1) at any n: the
    dense operator with that f, forward and gradients."""
    torch.manual_seed(0)
    tno = random_knots(build_tno("ski", 6, False, **SETTINGS, training_length=33)).double()
    assert int(tno.lowrank_length) == 33 and tno.lowrank_scale(n) == 7 / 32
    x = torch.randn(2, n, 6, dtype=torch.float64, requires_grad=True)
    y, y_ref = tno(x), reference(tno, x, tno.knots * 7 / 32)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y)
    params = [x, *tno.parameters()]
    for a, b in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(y_ref, params, g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_checkpoint_keeps_its_training_length():
    """Loaded into a TNO built for another length (fairseq-validate with --model-overrides tokens_per_sample),
    a checkpoint computes with the training length it was saved with."""
    torch.manual_seed(0)
    trained = random_knots(build_tno("ski", 4, False, **SETTINGS, training_length=33))
    loaded = build_tno("ski", 4, False, **SETTINGS, training_length=256)
    loaded.load_state_dict(trained.state_dict())
    assert int(loaded.lowrank_length) == 33
    x = torch.randn(2, 132, 4)
    torch.testing.assert_close(loaded(x), trained(x), rtol=0, atol=0)


def test_a_version_2_checkpoint_keeps_the_scale_of_each_length():
    """Saved before the training length was kept (version 2, no lowrank_length): 'mean' at each input's own
    length, as it computed then, whatever training length the loading model passes."""
    torch.manual_seed(0)
    v2 = random_knots(build_tno("ski", 4, False, **SETTINGS))  # no training length: each input's length
    state = {k: v for k, v in v2.state_dict().items() if k != "lowrank_length"}
    state["version"] = torch.tensor(2)
    loaded = build_tno("ski", 4, False, **SETTINGS, training_length=33)
    loaded.load_state_dict(state)
    assert int(loaded.version) == 2 and int(loaded.lowrank_length) == 0
    for n in (33, 100):
        x = torch.randn(2, n, 4)
        torch.testing.assert_close(loaded(x), v2(x), rtol=0, atol=0)
        assert loaded.lowrank_scale(n) == 7 / (n - 1)


def test_off_refuses_an_old_checkpoint_with_a_low_rank_part():
    old = build_tno("ski", 4, False, **SETTINGS, ski_lowrank="sum")
    off = build_tno("ski", 4, False, **SETTINGS, ski_lowrank="off")
    with pytest.raises(ValueError, match="--ski-lowrank=off cannot load"):
        off.load_state_dict(old_state_dict(old))


def test_bad_mode_is_refused_by_name():
    with pytest.raises(ValueError, match=r"--ski-lowrank='median' is invalid: must be one of \['mean', 'off', 'sum'\]"):
        build_tno("ski", 4, False, ski_lowrank="median")
