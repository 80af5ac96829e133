"""Using trained models: fairseq's generator with the incremental TNN decoder (exact against the full
forward), the hub interfaces (sample / score / generate / fill_mask), and the numpy-2 shim. In the CLI layer:
its models are checkpoints trained through fairseq-train (conftest's tiny_checkpoints)."""
import inspect
from dataclasses import dataclass, field

import numpy
import pytest
import torch
import torch.nn.functional as F
from fairseq.data import TokenBlockDataset, token_block_dataset
from fairseq.dataclass.configs import GenerationConfig
from fairseq.sequence_generator import SequenceGenerator

from helpers import ROOT
from fairseq_tnn.patches.numpy2_compat_long import NUMPY_FOR_TOKEN_BLOCK
from fairseq_tnn.models.build import build_arch, dictionary_of_size
from fairseq_tnn.models.tnn_lm import TnnLanguageModel, decoding_length
from fairseq_tnn.models.tnn_mlm import TnnMaskedLMModel
from fairseq_tnn.modules.tno import TNO_TYPES, Tno, TnoSettings, register_tno

SPM = str(ROOT / "data/sample/spm.model")
PROMPTS = ["And God said", "In the beginning God created the heaven and the earth", "The LORD"]
REL = 1e-5  # fp32


def test_numpy_shim_is_narrow_and_still_needed():
    """Fails when fairseq's eos block index stops using the alias (then drop the shim) or moves."""
    assert "np.compat.long" in inspect.getsource(TokenBlockDataset._build_slice_indices), \
        ("fairseq's TokenBlockDataset no longer uses np.compat.long: remove the numpy shim, "
         "fairseq_tnn/patches/numpy2_compat_long.py")
    if hasattr(numpy, "compat"):
        pytest.skip("numpy < 2 still has np.compat; the shim is not installed")
    assert token_block_dataset.np is NUMPY_FOR_TOKEN_BLOCK
    assert not hasattr(numpy, "compat")  # numpy itself untouched
    assert NUMPY_FOR_TOKEN_BLOCK.arange is numpy.arange
    ds = TokenBlockDataset([torch.tensor([5, 6, 2]), torch.tensor([7, 2])], [3, 2], block_size=None, pad=1, eos=2,
                           break_mode="eos")
    assert [ds[i].tolist() for i in range(len(ds))] == [[5, 6, 2], [7, 2]]


def assert_rel_close(actual, expected, what):
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= REL * scale, f"{what}: max abs err {err:.3e} > {REL} * {scale:.3e}"


@pytest.fixture(scope="module")
def hubs(tiny_checkpoints, data_bin):
    return {arch: TnnLanguageModel.from_pretrained(str(tiny_checkpoints[arch]), "checkpoint_best.pt", str(data_bin),
                                                   bpe="sentencepiece", sentencepiece_model=SPM)
            for arch in ("tnn_lm_tiny", "fd_tnn_lm_tiny")}


def record_cached_steps(decoder):
    """Wrap decoder.forward to keep (tokens, last-position log-probs) of every incremental call."""
    calls, forward = [], decoder.forward

    def recording(tokens, *args, incremental_state=None, **kwargs):
        out = forward(tokens, *args, incremental_state=incremental_state, **kwargs)
        if incremental_state is not None:
            calls.append((tokens.clone(), out[0][:, -1].float().log_softmax(-1), decoder.decoding_length))
        return out

    decoder.forward = recording
    return calls, lambda: setattr(decoder, "forward", forward)


@pytest.mark.parametrize("arch", ["tnn_lm_tiny", "fd_tnn_lm_tiny"])
@pytest.mark.parametrize("options", [dict(beam=3), dict(beam=1, sampling=True, sampling_topk=20)],
                         ids=["beam3", "sampling"])
def test_cached_generation_equals_full_forward_at_every_position(hubs, arch, options):
    """Through fairseq's SequenceGenerator: batch of 3 prompts of different lengths, beams reordered;
    at every step every row's log-probabilities equal the full forward of that row's tokens."""
    hub = hubs[arch]
    decoder = hub.models[0].decoder
    calls, restore = record_cached_steps(decoder)
    try:
        torch.manual_seed(1)
        hypos = hub.generate([hub.encode(p) for p in PROMPTS], max_len_b=24, min_len=20, **options)
    finally:
        restore()
    assert len(hypos) == 3 and len(calls) >= 20
    assert calls[0][0].shape[0] == 3 * options["beam"] and calls[0][2] == 25  # planned: max_len + 1
    pad = decoder.padding_idx
    with torch.no_grad():
        for tokens, cached, planned in calls:
            # the full forward of the sequence the generation plans (padding on the right changes nothing
            # before it; for FD it fixes the kernel's length, see TnnDecoder.set_decoding_length)
            padded = torch.nn.functional.pad(tokens, (0, planned - tokens.shape[1]), value=pad)
            full = decoder(padded)[0][:, tokens.shape[1] - 1].float().log_softmax(-1)
            assert_rel_close(cached, full, f"{arch} step {tokens.shape[1]}")


@pytest.mark.parametrize("arch", ["tnn_lm_tiny", "fd_tnn_lm_tiny"])
def test_cached_and_uncached_generation_agree(hubs, arch):
    """fairseq's non-incremental path (the whole prefix re-run every step) finds the same beams."""
    hub = hubs[arch]
    generator = hub.task.build_generator(hub.models, GenerationConfig(beam=3, max_len_b=20))
    batch = next(iter(hub._build_batches([hub.encode(p) for p in PROMPTS], False)))
    cached = hub.task.inference_step(generator, hub.models, batch)
    generator.model.has_incremental = False
    uncached = hub.task.inference_step(generator, hub.models, batch)
    for a, b in zip(cached, uncached):
        for ha, hb in zip(a, b):
            assert torch.equal(ha["tokens"], hb["tokens"])
            assert_rel_close(ha["positional_scores"], hb["positional_scores"], arch)


@pytest.mark.parametrize("arch", ["tnn_lm_tiny", "fd_tnn_lm_tiny"])
def test_left_padding_chunks_and_reordering(arch):
    """Direct decoder calls: left-padded prompts of different lengths, a chunked prefill, single steps,
    a beam-style reorder and a cache outgrown (doubling), all equal to the full forward."""
    torch.manual_seed(0)
    model = build_arch(arch, 80).eval()
    dec, pad = model.decoder, model.decoder.padding_idx
    tokens = torch.randint(4, 80, (3, 90))
    tokens[0, :7] = pad  # left padding
    tokens[2, :30] = pad
    planned = 128 if arch.startswith("fd") else None  # FD's kernel follows the planned length; TNN outgrows 64
    dec.set_decoding_length(planned)
    try:
        with torch.no_grad():
            state, order = {}, torch.arange(3)
            outs = [dec(tokens[:, :40], incremental_state=state)[0]]  # prefill (FFT path)
            for t in range(41, 91):
                if t == 60:  # beams: rows swap and one is duplicated
                    order = torch.tensor([2, 0, 0])
                    dec.reorder_incremental_state_scripting(state, order)
                    tokens = tokens[order]
                    outs = [o[order] for o in outs]
                outs.append(dec(tokens[:, :t], incremental_state=state)[0])
            cached = torch.cat(outs, 1).log_softmax(-1)
            full = dec(torch.nn.functional.pad(tokens, (0, (planned or 90) - 90), value=pad))[0][:, :90].log_softmax(-1)
    finally:
        dec.set_decoding_length(None)
    real = tokens.ne(pad)
    assert_rel_close(cached[real], full[real], arch)
    if arch == "tnn_lm_tiny":  # and padding never leaks in: TNN's kernel does not depend on the length, so a
        with torch.no_grad():  # left-padded row equals the same tokens without padding (row 1 is the old row 0)
            alone = dec(tokens[1:2, 7:])[0].log_softmax(-1)
        assert_rel_close(cached[1, 7:], alone[0], "left padding")


@pytest.mark.parametrize("arch", ["tnn_lm_tiny", "fd_tnn_lm_tiny"])
def test_the_planned_length_is_passed_down_not_planted(arch):
    """The planned length reaches the TNOs as the ``kernel_length`` argument of the decoder's forward (by default
    the plan of ``decoding_length``/``set_decoding_length``): FD's full forward applies the kernel of that length,
    the full forward of the tokens right-padded to it; TNN's kernel does not depend on the length. Nothing is
    written on a TNO."""
    torch.manual_seed(0)
    model = build_arch(arch, 60).eval()
    dec, pad = model.decoder, model.decoder.padding_idx
    tokens = torch.randint(4, 60, (2, 20))
    tno_state = [dict(vars(layer.gtu.tno)) for layer in dec.layers]
    with torch.no_grad():
        plain = dec(tokens)[0]
        padded = dec(F.pad(tokens, (0, 20), value=pad))[0][:, :20]
        passed = dec(tokens, kernel_length=40)[0]
        with decoding_length([model], 40):
            planned = dec(tokens)[0]
            assert [dict(vars(layer.gtu.tno)) for layer in dec.layers] == tno_state
            overridden = dec(tokens, kernel_length=20)[0]  # an argument wins over the plan
        after = dec(tokens)[0]
    assert dec.decoding_length is None and torch.equal(after, plain) and torch.equal(overridden, plain)
    assert torch.equal(passed, planned)
    assert_rel_close(passed, padded, arch)
    if arch.startswith("fd"):
        assert (passed - plain).abs().max() > 1e-4
    else:
        assert torch.equal(passed, plain)
    with pytest.raises(ValueError, match="decoding length must be an integer >= 1"):
        dec(tokens, kernel_length=0)


@dataclass
class WindowSettings(TnoSettings):
    window: int = field(default=3, metadata={"help": "positions summed"})


class CausalWindowTno(Tno):
    """A fourth causal type that is not spectral and gives no decoding kernel (``supports_incremental`` is
    False, the base class's): the sum of the last ``window`` positions, a scale per channel."""

    name = "window"
    summary = "window (the sum of the last --window positions)"
    Settings = WindowSettings

    def __init__(self, dim, causal, settings=None, **values):
        super().__init__(dim, causal, settings, **values)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x, layout="bnd"):
        xc = x.permute(2, 0, 1) if layout == "bnd" else x  # (d, *batch, n)
        c = xc.cumsum(-1)
        y = (c - F.pad(c, (self.settings.window, 0))[..., :-self.settings.window]) * self.scale.view(-1, 1, 1)
        return y.permute(1, 2, 0) if layout == "bnd" else y


@pytest.fixture
def window_registered():
    register_tno(CausalWindowTno)
    yield
    del TNO_TYPES["window"]


def test_a_causal_tno_without_a_decoding_kernel_decodes_by_the_full_forward(window_registered):
    """Incremental calls run the full forward of the prefix and return the new positions: the same features,
    left padding included; fairseq's generator with and without its incremental states finds the same beams."""
    torch.manual_seed(0)
    model = build_arch("tnn_lm_tiny", 60, tno_type="window").eval()
    dec, pad = model.decoder, model.decoder.padding_idx
    assert not dec.incremental and not dec.layers[0].supports_incremental
    with pytest.raises(ValueError, match="--tno-type window cannot decode incrementally"):
        dec.layers[0].init_cache(2, 16)
    tokens = torch.randint(4, 60, (3, 20))
    tokens[1, :6] = pad
    with torch.no_grad():
        state = {}
        outs = [dec(tokens[:, :8], incremental_state=state)[0]]
        for t in range(9, 21):
            if t == 14:
                order = torch.tensor([2, 0, 1])
                dec.reorder_incremental_state_scripting(state, order)
                tokens, outs = tokens[order], [o[order] for o in outs]
            outs.append(dec(tokens[:, :t], incremental_state=state)[0])
        full = dec(tokens)[0]
    assert_rel_close(torch.cat(outs, 1), full, "window, incremental calls")
    generator = SequenceGenerator([model], dictionary_of_size(60), beam_size=3, max_len_b=12, min_len=10)
    prompts = torch.randint(4, 60, (2, 5))
    sample = {"net_input": {"src_tokens": prompts, "src_lengths": torch.tensor([5, 5])}}
    cached = generator.generate([model], sample, prefix_tokens=prompts)
    generator.model.has_incremental = False
    uncached = generator.generate([model], sample, prefix_tokens=prompts)
    for a, b in zip(cached, uncached):
        for ha, hb in zip(a, b):
            assert torch.equal(ha["tokens"], hb["tokens"]) and len(ha["tokens"]) >= 10
            assert_rel_close(ha["positional_scores"], hb["positional_scores"], "window")


def test_hub_sample_score_generate(hubs):
    for arch, hub in hubs.items():
        torch.manual_seed(0)
        texts = hub.sample(PROMPTS[:2], beam=1, sampling=True, sampling_topk=10, max_len_b=30, min_len=20)
        assert [t.startswith(p) and len(t) > len(p) for t, p in zip(texts, PROMPTS[:2])] == [True, True], texts
        beam = hub.sample(PROMPTS[0], beam=4, max_len_b=20)
        assert beam.startswith(PROMPTS[0])
        topp = hub.sample(PROMPTS[0], beam=1, sampling=True, sampling_topp=0.9, max_len_b=20)
        assert topp.startswith(PROMPTS[0])
        scored = hub.score("And God said unto Moses")
        n = len(hub.encode("And God said unto Moses")) - 1  # fairseq scores the tokens, not the final </s>
        assert scored["positional_scores"].shape == (n,) and (scored["positional_scores"] < 0).all()
        # per-token log-probabilities: the full forward's, token by token
        tokens = torch.cat([torch.tensor([hub.src_dict.eos()]), hub.encode("And God said unto Moses")[:-1]])
        with torch.no_grad():
            lp = hub.models[0](tokens[None])[0].float().log_softmax(-1)[0, :-1]
        torch.testing.assert_close(scored["positional_scores"], lp.gather(-1, tokens[1:, None])[:, 0], rtol=1e-5,
                                   atol=1e-5)
        hypos = hub.generate(hub.encode(PROMPTS[2]), beam=2, max_len_b=10)
        assert len(hypos) == 2 and hub.decode(hypos[0]["tokens"]).startswith(PROMPTS[2])


def test_hub_bad_input(hubs, tiny_checkpoints, data_bin):
    hub = hubs["tnn_lm_tiny"]
    with pytest.raises(ValueError, match="empty prompt"):
        hub.sample("")
    with pytest.raises(ValueError, match="empty prompt"):
        hub.score("")
    with pytest.raises(ValueError, match=r"a prompt has \d+ tokens but generation stops at 5 tokens.*max_len_b"):
        hub.sample(PROMPTS[1], max_len_b=5)
    with pytest.raises(ValueError, match="fill_mask needs a masked .* Use sample"):
        hub.fill_mask("The <mask> of Egypt")
    with pytest.raises(ValueError, match="not a TnnLanguageModel: load it with TnnMaskedLMModel.from_pretrained"):
        TnnLanguageModel.from_pretrained(str(tiny_checkpoints["tnn_mlm_tiny"]), "checkpoint_best.pt", str(data_bin))


@pytest.fixture(scope="module")
def mlm_hub(tiny_checkpoints, data_bin):
    return TnnMaskedLMModel.from_pretrained(str(tiny_checkpoints["tnn_mlm_tiny"]), "checkpoint_best.pt",
                                            str(data_bin), bpe="sentencepiece", sentencepiece_model=SPM)


def test_fill_mask(mlm_hub):
    out = mlm_hub.fill_mask("The <mask> of Egypt", topk=5)
    assert len(out) == 5
    probs = [p for _, p, _ in out]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1
    for filled, _, word in out:
        assert filled.startswith("The") and filled.endswith("of Egypt") and word.strip() in filled
    # the probabilities are the model's, at the masked position
    tokens = mlm_hub.src_dict.encode_line("<s> " + mlm_hub.apply_bpe("The") + " <mask> " + mlm_hub.apply_bpe("of Egypt")
                                          + " </s>", append_eos=False, add_if_not_exist=False).long()
    with torch.no_grad():
        p = mlm_hub.model(tokens[None])[0][0, 2].float().softmax(-1)
    p[: mlm_hub.src_dict.nspecial] = 0  # special symbols are never proposed
    p[mlm_hub.src_dict.index("<mask>")] = 0
    torch.testing.assert_close(torch.tensor(probs), p.topk(5).values)


def test_fill_mask_bad_input(mlm_hub):
    with pytest.raises(ValueError, match="exactly one <mask>.*got none"):
        mlm_hub.fill_mask("The king of Egypt")
    with pytest.raises(ValueError, match="exactly one <mask>.*got 2"):
        mlm_hub.fill_mask("The <mask> of <mask>")
    with pytest.raises(ValueError, match="topk=0 is invalid"):
        mlm_hub.fill_mask("The <mask> of Egypt", topk=0)
    for method in ("sample", "score", "generate"):
        with pytest.raises(ValueError, match=f"{method} needs a causal language model.*fill_mask"):
            getattr(mlm_hub, method)("The king of Egypt")
