"""``FusedLinear`` (fairseq_tnn/modules/linear.py): an ``nn.Linear`` whose weight and bias are one parameter, used for
the GTU's and GLU's projections: the same draws, function, gradients and state_dict as ``nn.Linear``, and a model whose
parameters, flattened in order, are what they were with ``nn.Linear``s (fairseq's flat fp32 master copy)."""
import pytest
import torch
from torch import nn

from fairseq_tnn.models.build import build_arch
from fairseq_tnn.modules import layers
from fairseq_tnn.modules.linear import FusedLinear


def test_fused_linear_is_an_nn_linear_in_one_tensor():
    torch.manual_seed(0)
    linear = nn.Linear(5, 3)
    torch.manual_seed(0)
    fused = FusedLinear(5, 3)
    assert [name for name, _ in fused.named_parameters()] == ["packed"]
    assert list(fused.state_dict()) == ["weight", "bias"]
    for key, value in linear.state_dict().items():
        assert torch.equal(fused.state_dict()[key], value), key  # the same draws
    x = torch.randn(4, 5)
    torch.testing.assert_close(fused(x), linear(x), rtol=0, atol=0)
    fused(x).square().sum().backward()
    linear(x).square().sum().backward()
    torch.testing.assert_close(fused.packed.grad, torch.cat([linear.weight.grad.flatten(), linear.bias.grad]))
    weight, bias = fused.parts()
    assert weight.shape == (3, 5) and bias.shape == (3,)
    assert weight.untyped_storage().data_ptr() == fused.packed.untyped_storage().data_ptr()


def test_fused_linear_loads_an_nn_linears_state_dict_and_reports_what_does_not_fit():
    linear = nn.Linear(5, 3)
    fused = FusedLinear(5, 3)
    fused.load_state_dict(linear.state_dict())
    torch.testing.assert_close(fused.weight, linear.weight)
    torch.testing.assert_close(fused.bias, linear.bias)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"bias\""):
        fused.load_state_dict({"weight": linear.weight.detach()})
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"scale\""):
        fused.load_state_dict({**linear.state_dict(), "scale": torch.ones(1)})
    before = fused.packed.detach().clone()
    with pytest.raises(RuntimeError, match=r"size mismatch for weight: copying a param with shape torch.Size\(\[3, 4\]\)"):
        fused.load_state_dict({"weight": torch.zeros(3, 4), "bias": torch.zeros(3)})
    assert torch.equal(fused.packed.detach()[:15], before[:15])  # the mismatched weight is not written


@pytest.mark.parametrize("arch", ["tnn_lm_tiny", "ski_tnn_mlm_tiny"])
def test_a_model_with_fused_linears_keeps_its_parameters_order_and_state_dict(arch, monkeypatch):
    """Built from one seed with ``FusedLinear``s and with ``nn.Linear``s: the same state_dict (names and values), and
    the parameters flattened in ``model.parameters()``' order equal (the flat master copy of ``--fp16`` lines up with
    one written before the fusion), from fewer tensors; each loads the other's state_dict."""
    torch.manual_seed(0)
    fused = build_arch(arch, 100)
    monkeypatch.setattr(layers, "FusedLinear", nn.Linear)
    torch.manual_seed(0)
    plain = build_arch(arch, 100)
    assert list(fused.state_dict()) == list(plain.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(fused.state_dict()[key], value), key
    flat = [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in (fused, plain)]
    assert torch.equal(flat[0], flat[1])
    stack = fused.encoder.layers if hasattr(fused, "encoder") else fused.decoder.layers
    n_fused, n_plain = (len(list(m.parameters())) for m in (fused, plain))
    assert n_plain - n_fused == 4 * len(stack)  # the GTU's two Linears and the GLU's two, a tensor each fewer
    monkeypatch.undo()
    torch.manual_seed(1)
    other = build_arch(arch, 100)
    assert isinstance((other.encoder.layers if hasattr(other, "encoder") else other.decoder.layers)[0].gtu.uv_proj,
                      FusedLinear)
    other.load_state_dict(plain.state_dict())
    assert torch.equal(torch.cat([p.detach().flatten() for p in other.parameters()]), flat[0])
