"""A stack's TNO spectra computed together (``stacked_spectra``: the layers' RPEs as one batched MLP) against each
TNO's own ``spectrum``, forward and every gradient; where it declines; and in the models, the same outputs and
gradients as the layers computing their own, in fewer operations (the point: eagerly, each operation costs a GPU
10-25 microseconds of host time)."""
import copy

import pytest
import torch

from benchmarks.opcount import count
from helpers import assert_close_rel, assert_on
from fairseq_tnn.models.build import build_arch
from fairseq_tnn.modules import build_tno
from fairseq_tnn.modules.layers import layer_spectra
from fairseq_tnn.modules.tno.base import SpectralTno
from fairseq_tnn.ops import fast

SPECTRAL = [("tnn", True, {}), ("tnn", False, {}), ("tnn", True, {"decay": 1.0}), ("fd", True, {}), ("fd", False, {})]


def _tnos(tno_type, causal, settings, device, count_=3):
    out = []
    for seed in range(count_):
        torch.manual_seed(seed)
        out.append(build_tno(tno_type, 6, causal, rpe_dim=8, rpe_layers=2, **settings)
                   .to(device, torch.float64))
    return out


@pytest.mark.parametrize("tno_type,causal,settings", SPECTRAL)
def test_stacked_spectra_equal_each_tnos_own(tno_type, causal, settings, device):
    tnos = _tnos(tno_type, causal, settings, device)
    n = 37
    params = [p for t in tnos for p in t.parameters()]
    stacked = SpectralTno.stacked_spectra(tnos, n, device)
    with fast.references():  # each TNO's spectrum by the plain operations, differentiated by autograd
        own = [t.spectrum(n, device) for t in tnos]
    assert stacked is not None and [size for _, size in stacked] == [size for _, size in own]
    g = [torch.randn_like(spec) for spec, _ in own]

    def grads(spectra):
        loss = sum((spec * gi.conj()).real.sum() for (spec, _), gi in zip(spectra, g))
        return torch.autograd.grad(loss, params)
    assert_on(device, *(spec for spec, _ in stacked))
    for (a, _), (b, _) in zip(stacked, own):
        assert a.shape == b.shape
        assert_close_rel(a, b, 1e-11)
    names = [f"tno{i}.{name}" for i, t in enumerate(tnos) for name, _ in t.named_parameters()]
    for name, a, b in zip(names, grads(stacked), grads(own)):
        assert_close_rel(a, b, 1e-10, name)


@pytest.mark.parametrize("tno_type,causal,settings", SPECTRAL)
def test_stacked_spectra_cost_one_operation_more_than_one_spectrum(tno_type, causal, settings):
    """The spectra of a stack of TNOs dispatch the operations of one TNO's spectrum and one more: the copy that stacks
    all their RPE weights (one ``torch.stack`` per weight took one operation each, 8 for these 2-layer RPEs)."""
    tnos = _tnos(tno_type, causal, settings, "cpu")
    n = 16
    SpectralTno.stacked_spectra(tnos, n), tnos[0].spectrum(n)  # the constants the fast paths keep, built
    _, stacked = count(lambda: SpectralTno.stacked_spectra(tnos, n))
    _, one = count(lambda: tnos[0].spectrum(n))
    assert stacked.total == one.total + 1, (dict(stacked.counts), dict(one.counts))


def test_stacked_spectra_decline_what_does_not_stack():
    n = 20
    assert SpectralTno.stacked_spectra(_tnos("tnn", True, {}, "cpu", 1), n) is None  # one TNO: nothing to batch
    assert SpectralTno.stacked_spectra(_tnos("tnn", True, {}, "cpu", 1) + _tnos("fd", True, {}, "cpu", 1), n) is None
    mixed = _tnos("tnn", True, {}, "cpu", 1) + _tnos("tnn", True, {"decay": 0.9}, "cpu", 1)
    assert SpectralTno.stacked_spectra(mixed, n) is None  # another decay: other positions' scale
    wider = _tnos("tnn", True, {}, "cpu", 1) + [build_tno("tnn", 6, True, rpe_dim=16, rpe_layers=2).double()]
    assert SpectralTno.stacked_spectra(wider, n) is None  # another shape
    assert SpectralTno.stacked_spectra(_tnos("tnn", True, {"rpe_norm_type": "layernorm"}, "cpu"), n) is None
    assert SpectralTno.stacked_spectra(_tnos("tnn", True, {"rpe_activation": "silu"}, "cpu"), n) is not None
    with fast.references():
        assert SpectralTno.stacked_spectra(_tnos("tnn", True, {}, "cpu"), n) is None


@pytest.mark.parametrize("arch", ["tnn_lm_wt103", "fd_tnn_lm_wt103", "tnn_mlm_wt103", "fd_tnn_mlm_wt103"])
def test_a_model_computes_its_layers_spectra_together(arch, monkeypatch):
    """Eager layers: the model's output and every parameter's gradient as when each layer computes its own
    spectrum (and the output of evaluation, where each does) and as the references compute them, and a third fewer
    operations forward and backward (4 layers)."""
    import fairseq_tnn.models.compile as compiling
    causal = "_mlm_" not in arch
    torch.manual_seed(0)
    sizes = {"decoder_layers" if causal else "encoder_layers": 4,
             "decoder_embed_dim" if causal else "encoder_embed_dim": 16, "glu_dim": 16}
    model = build_arch(arch, 50, dropout=0.0, **sizes).double()
    stack = model.decoder if causal else model.encoder
    tokens = torch.randint(4, 50, (2, 24))
    assert all(s is not None for s in layer_spectra(stack.layers, 24, None, "cpu"))

    def run():
        model.zero_grad(set_to_none=True)
        out, c = count(lambda: model(tokens)[0])
        _, c_back = count(lambda: out.pow(2).mean().backward())
        return out.detach(), {n: p.grad for n, p in model.named_parameters()}, c.total + c_back.total
    together = run()
    with fast.references():  # every operator by its plain operations, differentiated by autograd
        referenced = run()
    model.eval()
    with torch.no_grad():
        evaluated = model(tokens)[0]
    model.train()
    monkeypatch.setattr(compiling, "layer_spectra", lambda layers, *args: [None] * len(layers))
    alone = run()
    assert_close_rel(together[0], alone[0], 1e-12)
    assert_close_rel(evaluated, alone[0], 1e-12)
    assert_close_rel(together[0], referenced[0], 1e-11)
    for name, g in alone[1].items():
        assert g is not None and together[1][name] is not None, name
        assert_close_rel(together[1][name], g, 1e-10, name)
        assert_close_rel(together[1][name], referenced[1][name], 1e-9, name)
    assert together[2] < 0.75 * alone[2], (together[2], alone[2])


def test_layer_spectra_gives_each_layer_its_spectrum():
    """``layer_spectra`` gives every spectral layer of a stack its spectrum, so that no layer computes its own (a
    compiled layer's graph then holds no RPE): stacked while training (compiled layers too: a layer's own
    ``forward`` attribute changes nothing); one layer's own; without autograd each layer's own, computed only when
    the loop reaches its layer (one spectrum alive at a time); None for TNOs that are not spectral (SKI); a causal FD
    stack's spectra are those of the planned kernel length."""
    model = build_arch("tnn_lm_wt103", 50, decoder_layers=2, decoder_embed_dim=16, glu_dim=16)
    layers = model.decoder.layers
    own = [layer.gtu.tno.spectrum(24) for layer in layers]
    together = layer_spectra(layers, 24)
    assert isinstance(together, list) and [size for _, size in together] == [size for _, size in own]
    for (spec, _), (mine, _) in zip(together, own):
        assert_close_rel(spec, mine, 1e-5)
    compiled = copy.deepcopy(layers)
    compiled[1].forward = compiled[1].forward  # an instance attribute, as compile_layers sets one
    assert all(s is not None for s in layer_spectra(compiled, 24))
    alone = list(layer_spectra(layers[:1], 24))
    assert len(alone) == 1 and alone[0][1] == own[0][1]
    assert_close_rel(alone[0][0], own[0][0], 1e-6)
    made = []
    for layer in layers:  # spy on each TNO's spectrum: when is it computed?
        layer.gtu.tno.spectrum = (lambda f: lambda *a: made.append(1) or f(*a))(layer.gtu.tno.spectrum)
    with torch.no_grad():  # evaluation: one spectrum at a time, each freed after its layer
        lazy = iter(layer_spectra(layers, 24))
        assert made == []
        first = next(lazy)
        assert len(made) == 1 and not first[0].requires_grad
        assert_close_rel(first[0], own[0][0], 1e-6)
        next(lazy)
        assert len(made) == 2
    ski = build_arch("ski_tnn_mlm_wt103", 50, encoder_layers=2, encoder_embed_dim=16, glu_dim=16)
    assert layer_spectra(ski.encoder.layers, 24) == [None, None]
    fd = build_arch("fd_tnn_lm_wt103", 50, decoder_layers=2, decoder_embed_dim=16, glu_dim=16).decoder.layers
    planned = layer_spectra(fd, 24, kernel_length=100)
    assert [size for _, size in planned] == [fd[0].gtu.tno.spectrum(100)[1]] * 2
    assert layer_spectra(layers, 24, kernel_length=100)[0][1] == layers[0].gtu.tno.spectrum(24)[1]  # TNN: n's own
