"""The two deliberate differences from the TNN authors' models (docs/references.md, "The authors' TNN
models"), on our side: padding never mixes into real positions, and a length-1 input works, for the causal
and the masked TNN (float64, so that the figures are round-off). The comparison with the authors' own models
is not re-run here (it needs their repository); that page gives its figures."""
import pytest
import torch

from fairseq_tnn.models.build import build_arch

ARCHS = ["tnn_lm_tiny", "tnn_mlm_tiny"]


def model_and_pad(arch):
    torch.manual_seed(0)
    model = build_arch(arch, 60).double().eval()
    coder = model.decoder if arch.startswith("tnn_lm") else model.encoder
    return model, coder.padding_idx


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens)[0]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("arch", ARCHS)
def test_padding_never_mixes_into_real_positions(arch, side):
    """The logits of 30 real tokens are unchanged (to round-off) when 20 pad tokens are added."""
    model, pad = model_and_pad(arch)
    tokens = torch.randint(4, 60, (1, 30))
    pads = torch.full((1, 20), pad)
    alone = logits(model, tokens)
    if side == "right":
        padded = logits(model, torch.cat([tokens, pads], dim=1))[:, :30]
    else:
        padded = logits(model, torch.cat([pads, tokens], dim=1))[:, 20:]
    assert alone.shape == padded.shape == (1, 30, 60)
    assert (padded - alone).abs().max() < 1e-12


@pytest.mark.parametrize("arch", ARCHS)
def test_length_one_input(arch):
    """One token in, its logits out: for the causal model those of the first position of a longer input,
    for the masked model those of the same token followed by padding."""
    model, pad = model_and_pad(arch)
    tokens = torch.randint(4, 60, (2, 30))
    one = logits(model, tokens[:, :1])
    assert one.shape == (2, 1, 60) and torch.isfinite(one).all()
    if arch.startswith("tnn_lm"):
        longer = logits(model, tokens)[:, :1]
    else:
        longer = logits(model, torch.cat([tokens[:, :1], torch.full((2, 20), pad)], dim=1))[:, :1]
    assert (one - longer).abs().max() < 1e-12
