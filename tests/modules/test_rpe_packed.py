"""The RPE's Linears as one packed parameter (``Rpe.packed``, fairseq_tnn/modules/rpe.py): one tensor for autograd,
the optimizer and a compiled graph, while the state_dict keeps an ``nn.Linear`` child's names, so that checkpoints
written before the packing load, and every weight's view follows the packed tensor."""
import copy

import pytest
import torch
from torch import nn

from helpers import rel
from fairseq_tnn.models.build import build_arch
from fairseq_tnn.modules.linear import PackedLinear
from fairseq_tnn.modules.rpe import Rpe
from fairseq_tnn.ops import fast
from fairseq_tnn.ops.rpe import rpe_mlp_ref, rpe_params

NAMES = ["proj.weight", "proj.bias", "linears.0.weight", "linears.0.bias", "linears.1.weight", "linears.1.bias",
         "out.weight", "out.bias"]


def unpacked_rpe(monkeypatch, *args, **kwargs):
    """An Rpe as it was before the packing: nn.Linear children, each with its own parameters."""
    with monkeypatch.context() as patch:
        patch.setattr(Rpe, "_pack", lambda self: None)
        return Rpe(*args, **kwargs)


def test_an_rpe_is_one_parameter_saved_under_its_linears_names():
    torch.manual_seed(0)
    rpe = Rpe(6, hidden=8, layers=2)
    assert [name for name, _ in rpe.named_parameters()] == ["packed"]
    assert isinstance(rpe.proj, PackedLinear) and len(rpe.linears) == 2 and rpe.out.out_features == 6
    state = rpe.state_dict()
    assert list(state) == NAMES
    assert [tuple(v.shape) for v in state.values()] == [(8, 1), (8,), (8, 8), (8,), (8, 8), (8,), (6, 8), (6,)]
    assert rpe.packed.numel() == sum(v.numel() for v in state.values())
    # each view is the packed tensor's memory, the same as the attribute an nn.Linear would have
    for name, value in state.items():
        module, kind = name.rsplit(".", 1)
        assert torch.equal(getattr(rpe.get_submodule(module), kind), value), name
        assert value.untyped_storage().data_ptr() == rpe.packed.untyped_storage().data_ptr(), name


def test_packing_keeps_nn_linears_initial_draws(monkeypatch):
    torch.manual_seed(3)
    packed = Rpe(6, hidden=8, layers=2).state_dict()
    torch.manual_seed(3)
    before = unpacked_rpe(monkeypatch, 6, hidden=8, layers=2).state_dict()
    assert list(packed) == list(before)
    assert all(torch.equal(packed[k], before[k]) for k in before)


def test_a_state_dict_of_the_unpacked_layout_loads_and_computes_the_same(monkeypatch):
    torch.manual_seed(1)
    old = unpacked_rpe(monkeypatch, 6, hidden=8, layers=2)
    new = Rpe(6, hidden=8, layers=2)
    new.load_state_dict(old.state_dict())
    t = torch.arange(-4.0, 9.0)
    params = [old.proj.weight, old.proj.bias, *[p for m in old.linears for p in (m.weight, m.bias)],
              old.out.weight, old.out.bias]
    expected = rpe_mlp_ref(t, None, params, "relu", "simplermsnorm", new.norms[0].eps, 2, torch.float32)
    assert rel(new.channel_major(t), expected) < 1e-6
    with fast.references():
        assert rel(new.channel_major(t), expected) < 1e-6
    assert rel(new(t).t(), expected) < 1e-6
    # and back: the packed RPE's state_dict loads into the unpacked layout
    again = unpacked_rpe(monkeypatch, 6, hidden=8, layers=2)
    again.load_state_dict(new.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), old.state_dict().values()))


def test_bad_state_dicts_are_refused_as_nn_module_refuses_them():
    rpe = Rpe(6, hidden=8, layers=2)
    state = rpe.state_dict()
    missing = {k: v for k, v in state.items() if k != "linears.1.bias"}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"linears.1.bias\""):
        rpe.load_state_dict(missing)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"packed\""):
        rpe.load_state_dict({**state, "packed": rpe.packed.detach()})
    with pytest.raises(RuntimeError, match=r"size mismatch for out.weight: copying a param with shape "
                                           r"torch.Size\(\[6, 9\]\)"):
        rpe.load_state_dict({**state, "out.weight": torch.zeros(6, 9)})
    before = rpe.packed.detach().clone()
    result = rpe.load_state_dict({"proj.bias": torch.ones(8), "extra": torch.zeros(1)}, strict=False)
    assert torch.equal(rpe.proj.bias, torch.ones(8)) and rpe.packed[8:16].eq(1).all()
    assert torch.equal(rpe.packed[:8], before[:8]) and torch.equal(rpe.packed[16:], before[16:])
    assert result.missing_keys == [n for n in NAMES if n != "proj.bias"] and result.unexpected_keys == ["extra"]


def test_copies_casts_and_moves_carry_the_views_along():
    rpe = Rpe(6, hidden=8, layers=1)
    twin = copy.deepcopy(rpe)
    with torch.no_grad():
        twin.out.bias.fill_(5.0)  # the copy's own packed tensor
    assert twin.packed[-6:].eq(5).all() and not rpe.packed[-6:].eq(5).any()
    assert twin.out._owner is twin and rpe.out._owner is rpe
    rpe.half()  # a 16-bit cast of the model leaves the RPE in fp32 (docs/design.md)
    assert rpe.packed.dtype == rpe.out.weight.dtype == torch.float32
    rpe.double()
    assert rpe.packed.dtype == rpe.proj.weight.dtype == torch.float64
    assert rpe.channel_major(torch.arange(5.0, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize("layers", [0, 2])
def test_the_packed_gradient_is_each_weights_gradient(layers):
    """Backward through the fast path hands the packed parameter one gradient, made of what each weight's would be."""
    torch.manual_seed(0)
    rpe = Rpe(6, hidden=8, layers=layers).double()
    t = torch.arange(-5.0, 12.0, dtype=torch.float64)
    scale = torch.rand(t.shape[0], dtype=torch.float64)
    g = torch.randn(6, t.shape[0], dtype=torch.float64)
    (packed_grad,) = torch.autograd.grad(rpe.channel_major(t, scale), [rpe.packed], g)
    params = [p.detach().clone().requires_grad_() for p in rpe_params(rpe)]
    y = rpe_mlp_ref(t, scale, params, "relu", "simplermsnorm", rpe.norms[0].eps, layers, torch.float64)
    grads = torch.autograd.grad(y, params, g)
    for name, a, b in zip(rpe._names, rpe.unpacked(packed_grad), grads):
        assert rel(a, b) < 1e-11, name


@pytest.mark.parametrize("arch,per_layer", [("tnn_lm_wt103", 5), ("fd_tnn_lm_wt103", 5), ("tnn_lm_wt103_rpe3", 5)])
def test_a_wt103_stack_has_one_rpe_tensor_per_layer(arch, per_layer):
    """What a compiled stack's graph takes as inputs and autograd accumulates one by one: per layer the GTU's and
    GLU's two Linears (``FusedLinear``: one tensor each, where an ``nn.Linear`` has a weight and a bias) and the RPE's
    one packed tensor, where there were 2 (layers + 2) RPE tensors (16 for RPE 6: 168 tensors for the causal stack,
    63 with the RPE packed, 35 with the Linears fused too)."""
    with torch.device("meta"):
        model = build_arch(arch, 100)
    layers = model.decoder.layers
    assert len(list(layers.parameters())) == per_layer * len(layers)
    assert sum(1 for name, _ in layers.named_parameters() if name.endswith("proj.packed")) == 4 * len(layers)
    assert sum(1 for name, _ in layers.named_parameters() if ".rpe." in name) == len(layers)
    # the state_dict keeps every weight under its own name
    names = [name for name in layers.state_dict() if ".rpe." in name]
    assert len(names) == len(layers) * 2 * (len(layers[0].gtu.tno.rpe.linears) + 2)
    assert all(isinstance(m, nn.Module) for m in layers[0].gtu.tno.rpe.linears)
