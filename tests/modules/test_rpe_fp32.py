"""The RPE keeps its weights in fp32 when the model is cast to a 16-bit float (fairseq's model.half() under --fp16):
its gradients, the model's largest (every lag, channel and sequence feeds them; the input projection multiplies
the raw lag), overflowed fp16 where no other gradient did. Device moves and other casts apply as usual, and a
half model's output matches the fp32 model's to fp16's rounding."""
import pytest
import torch

from fairseq_tnn.models.build import build_arch
from fairseq_tnn.modules.rpe import Rpe


def dtypes(model, rpe: bool):
    return {p.dtype for n, p in model.named_parameters() if (".rpe." in n) == rpe}


@pytest.mark.parametrize("arch", ["tnn_lm_tiny", "fd_tnn_lm_tiny", "tnn_mlm_tiny"])
@pytest.mark.parametrize("cast", ["half", "bfloat16"])
def test_a_16_bit_model_keeps_its_rpe_in_fp32(arch, cast):
    torch.manual_seed(0)
    ref = build_arch(arch, 50, dropout=0.0).eval()
    model = build_arch(arch, 50, dropout=0.0).eval()
    model.load_state_dict(ref.state_dict())
    model = model.half() if cast == "half" else model.to(torch.bfloat16)
    low = torch.float16 if cast == "half" else torch.bfloat16
    assert dtypes(model, rpe=True) == {torch.float32} and dtypes(model, rpe=False) == {low}
    # the RPE's weights are the fp32 model's, not rounded to 16 bits
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if ".rpe." in name:
            assert torch.equal(p, q), name
    tokens = torch.randint(4, 50, (2, 24))
    with torch.no_grad():
        y, y_ref = model(tokens)[0].float(), ref(tokens)[0]
    assert torch.isfinite(y).all()
    assert (y - y_ref).norm() / y_ref.norm() < (2e-2 if cast == "half" else 6e-2)
    # back to fp32 and to fp64: every weight follows
    assert dtypes(model.float(), True) == dtypes(model, False) == {torch.float32}
    assert dtypes(model.double(), True) == dtypes(model, False) == {torch.float64}
    assert dtypes(model.half(), True) == {torch.float32}  # from fp64 too


def test_the_rpe_moves_between_devices_with_the_model():
    assert {p.device.type for p in Rpe(4, hidden=8, layers=1).to("meta").parameters()} == {"meta"}
    moved = Rpe(4, hidden=8, layers=1).to("meta", torch.float16)  # a move and a cast at once: the move only
    assert {(p.device.type, p.dtype) for p in moved.parameters()} == {("meta", torch.float32)}
