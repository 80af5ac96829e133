"""Where a new model starts: the masked models from RoBERTa's initialisation, as the TNN and SKI authors'
masked models do (fairseq's init_bert_params over every module), the causal ones from PyTorch's defaults, as
the authors' causal models do (docs/design.md#initialisation)."""
import pytest
import torch
from fairseq.modules.transformer_sentence_encoder import init_bert_params
from torch import nn

from benchmarks.ski_diagnostics import model_init_scales
from fairseq_tnn.models.build import build_arch
from fairseq_tnn.models.tnn_mlm import init_like_roberta
from fairseq_tnn.modules.linear import PackedLinear
from fairseq_tnn.modules.rpe import Rpe

MASKED = ["tnn_mlm_tiny", "fd_tnn_mlm_tiny", "ski_tnn_mlm_tiny"]
WIDE = dict(encoder_embed_dim=256, glu_dim=256)  # weights large enough for their std to be measured


def linears(model):
    """Every Linear, the RPEs' (views of their packed parameter) included."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (nn.Linear, PackedLinear))]


@pytest.mark.parametrize("arch", MASKED)
def test_a_new_masked_model_follows_robertas_scheme(arch):
    torch.manual_seed(0)
    model = build_arch(arch, 1000, **WIDE, **({} if arch.startswith("ski") else {"rpe_dim": 64}))
    found = linears(model)
    assert len(found) >= 2 * 4  # GTU and GLU projections of both layers (and the RPE's, the LM head's dense)
    for name, linear in found:
        w = linear.weight.detach()
        if w.numel() >= 4096:
            assert abs(w.std().item() - 0.02) < 0.002, name
        assert w.abs().max().item() < 0.02 * 7, name  # a normal draw, not PyTorch's uniform +-1/sqrt(fan_in)
        assert linear.bias is None or not linear.bias.any(), name
    emb = model.encoder.embed_tokens
    assert abs(emb.weight[emb.padding_idx + 1:].std().item() - 0.02) < 0.002
    assert not emb.weight[emb.padding_idx].any()
    assert not model.encoder.lm_head.bias.any()


def test_the_draws_are_fairseqs_init_bert_params(monkeypatch):
    """Same seed, same values as fairseq's own function (on the CPU, where it draws) on the authors' layout, where the
    RPE's Linears and the GTU's and GLU's are ``nn.Linear`` modules (here: the RPEs left unpacked, ``Rpe._pack``, and
    ``nn.Linear`` for ``FusedLinear``)."""
    from fairseq_tnn.modules import layers
    torch.manual_seed(0)
    ours = build_arch("tnn_mlm_tiny", 100)
    with monkeypatch.context() as patch:
        patch.setattr(Rpe, "_pack", lambda self: None)
        patch.setattr(layers, "FusedLinear", nn.Linear)
        theirs = build_arch("tnn_mlm_tiny", 100)
    assert any(isinstance(m, nn.Linear) and ".rpe." in name for name, m in theirs.named_modules())
    torch.manual_seed(1)
    ours.apply(init_like_roberta)
    torch.manual_seed(1)
    theirs.apply(init_bert_params)
    ours, theirs = ours.state_dict(), theirs.state_dict()
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


def test_a_causal_model_keeps_pytorchs_defaults():
    """The causal TNN starts as the authors' causal TNN (PyTorch's defaults): uniform Linear weights of std
    1 / sqrt(3 fan_in), non-zero biases."""
    torch.manual_seed(0)
    model = build_arch("tnn_lm_tiny", 1000, decoder_embed_dim=256, glu_dim=256)
    uv = model.decoder.layers[0].gtu.uv_proj
    assert abs(uv.weight.std().item() - (3 * 256) ** -0.5) < 0.1 * (3 * 256) ** -0.5
    assert uv.bias.abs().min().item() > 0
    assert uv.weight.abs().max().item() <= 256 ** -0.5


def test_a_loaded_masked_model_computes_what_it_saved():
    """The initialisation touches new models only: a state dict loaded into a model built from another seed
    computes exactly what the saved model did."""
    torch.manual_seed(0)
    saved = build_arch("ski_tnn_mlm_tiny", 100).eval()
    torch.manual_seed(1)
    loaded = build_arch("ski_tnn_mlm_tiny", 100).eval()
    loaded.load_state_dict(saved.state_dict())
    tokens = torch.randint(4, 100, (2, 40))
    with torch.no_grad():
        assert torch.equal(saved(tokens)[0], loaded(tokens)[0])


@pytest.mark.slow
def test_the_published_masked_tnn_starts_where_the_authors_did():
    """tnn_mlm_wt103 at init (n = 512, unit input): TNO output rms within 15% of the authors' 1.04, logits std
    their 0.554 (docs/design.md#initialisation); the causal tnn_lm_wt103 as before (theirs 2.76)."""
    torch.manual_seed(1)
    model = build_arch("tnn_mlm_wt103", 50264)
    small = []
    for name, linear in linears(model):
        assert linear.bias is None or not linear.bias.any(), name
        if linear.weight.numel() >= 4096:
            assert abs(linear.weight.std().item() - 0.02) < 0.1 * 0.02, name
        else:  # the RPEs' input layers (64 weights each): a 64-draw sample's std scatters by ~9%, so pooled
            small.append(linear.weight.detach().flatten())
    assert len(small) == 12 and abs(torch.cat(small).std().item() - 0.02) < 0.1 * 0.02
    masked = model_init_scales("tnn_mlm_wt103", 512, seed=1)
    assert abs(masked["tno_rms"] - 1.04) < 0.15 * 1.04
    assert abs(masked["logits_std"] - 0.554) < 0.01
    causal = model_init_scales("tnn_lm_wt103", 512, seed=1)
    assert 2.0 < causal["tno_rms"] < 3.3 and abs(causal["logits_std"] - 1.0) < 0.02


def test_ski_taps_start_as_the_ski_authors_draw_them():
    """SKI's band taps N(0, 1), as in the SKI authors' code (measured better than U(+-m^-1/2): docs/design.md);
    'mean' knots at zero, so a new SKI-TNN starts as its band alone."""
    torch.manual_seed(0)
    model = build_arch("ski_tnn_mlm_tiny", 100, encoder_embed_dim=128, ski_taps=17)
    tno = model.encoder.layers[0].gtu.tno
    assert tno.conv_weight.shape == (384, 17) and abs(tno.conv_weight.std().item() - 1.0) < 0.05
    assert not tno.knots.any()
