"""`python -m fairseq_tnn export` and `fairseq_tnn.pretrained`: every tiny architecture (causal TNN and FD-TNN;
masked TNN, FD-TNN and SKI-TNN), trained for a few updates, exported and loaded with torch alone, computes what
fairseq computes: the logits of fairseq's model (float64 to round-off, float32 to 1e-5), fairseq-eval-lm's
perplexity, fairseq-interactive's greedy tokens, the hub interface's fill_mask; the cached decoding equals the full
forward; a Wikitext-103 preset exports; the bad inputs are refused with one line. And the docs' example runs as
written where importing fairseq (and sentencepiece, and regex) fails, printing fairseq-eval-lm's perplexity."""
import json
import math
import re
import shutil
import struct
import sys

import pytest
import torch

from helpers import (BIN, ROOT, cli, command_env, doc_blocks, execute, install_core, mlm_train_cmd, run,
                     tiny_gpt2_bpe)

import fairseq_tnn.models  # noqa: F401  (registers the plugin's models, as --user-dir does)
from fairseq_tnn.commands import main as fairseq_tnn_main
from fairseq_tnn.pretrained import TnnForCausalLM, TnnForMaskedLM, TnnPretrained, from_pretrained
from fairseq_tnn.pretrained.safetensors import SafetensorsError, load_file, save_file
from fairseq_tnn.pretrained.tokenizers import Gpt2Tokenizer, PurePythonSentencePiece, read_spm_model

SPM = ROOT / "data" / "sample" / "spm.model"
CAUSAL = ["tnn_lm_tiny", "fd_tnn_lm_tiny"]
MASKED = ["tnn_mlm_tiny", "fd_tnn_mlm_tiny", "ski_tnn_mlm_tiny"]
TNO = {"tnn_lm_tiny": "tnn", "fd_tnn_lm_tiny": "fd", "tnn_mlm_tiny": "tnn", "fd_tnn_mlm_tiny": "fd",
       "ski_tnn_mlm_tiny": "ski"}
FILES = ["config.json", "model.safetensors", "spm.model", "vocab.json"]
ERROR = "fairseq-tnn export: error: "


def export(capsys, *args):
    """The entry point's export command, as `python -m fairseq_tnn export ARGS` runs it (in this process): its
    exit status and what it wrote to stderr."""
    capsys.readouterr()
    status = fairseq_tnn_main(["export", *map(str, args)])
    return status, capsys.readouterr().err


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, data_bin, tmp_path_factory):
    """{arch: checkpoint directory} for the five tiny architectures: the session's three, and FD-TNN and SKI-TNN
    masked trained here the same way (20 updates)."""
    root = tmp_path_factory.mktemp("export-checkpoints")
    out = dict(tiny_checkpoints)
    for arch in ("fd_tnn_mlm_tiny", "ski_tnn_mlm_tiny"):
        run(mlm_train_cmd(data_bin, arch=arch, save_dir=root / arch, batch_size=8, max_update=20,
                          validate_interval_updates=20, no_epoch_checkpoints=True, log_interval=10, lr="0.003",
                          max_valid_steps=2, tokens_per_sample=128))
        out[arch] = root / arch
    return out


@pytest.fixture(scope="module")
def exported(checkpoints, tmp_path_factory):
    """{arch: its exported folder}, made by the export command with the sample's sentencepiece model."""
    root = tmp_path_factory.mktemp("exported")
    out = {}
    for arch in CAUSAL + MASKED:
        status = fairseq_tnn_main(["export", str(checkpoints[arch] / "checkpoint_best.pt"), str(root / arch),
                                   "--tokenizer", str(SPM)])
        assert status == 0, arch
        out[arch] = root / arch
    return out


def fairseq_model(checkpoint_dir, data_bin, name="checkpoint_best.pt"):
    from fairseq import checkpoint_utils
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint_dir / name)],
                                                                    arg_overrides={"data": str(data_bin)})
    return models[0].eval(), task


def sample_lines(vocab, count, offset=0):
    """Token ids of lines of the sample's test split, as fairseq-preprocess binarised them (test.bpe)."""
    lines = (ROOT / "data" / "sample" / "test.bpe").read_text().splitlines()[offset:offset + count]
    return [[vocab.index.get(p, vocab.unk) for p in line.split()] + [vocab.eos] for line in lines]


def padded(rows, pad, first=None):
    rows = [([first] if first is not None else []) + r for r in rows]
    n = max(map(len, rows))
    return torch.tensor([r + [pad] * (n - len(r)) for r in rows])


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("arch", CAUSAL + MASKED)
def test_the_export_computes_what_the_checkpoint_computes(arch, checkpoints, exported, data_bin):
    folder = exported[arch]
    assert sorted(p.name for p in folder.iterdir()) == FILES
    config = json.loads((folder / "config.json").read_text())
    masked = arch in MASKED
    assert (config["model_type"], config["arch"], config["tno_type"]) == ("masked" if masked else "causal", arch, TNO[arch])
    # the tiny presets' sizes (fairseq_tnn/models/tnn_lm.py and tnn_mlm.py: TINY) and the training length
    assert (config["embed_dim"], config["layers"], config["expand_ratio"], config["glu_dim"]) == (64, 2, 3, 64)
    assert config["training_length"] == 128 and config["tokenizer"] == "sentencepiece"
    if TNO[arch] == "ski":
        assert config["tno"] == {"ski_rank": 8, "ski_taps": 5, "ski_warp_decay": 0.99, "ski_lowrank": "mean",
                                 "ski_backward": "recompute"}
    else:
        assert config["tno"]["rpe_dim"] == 16 and config["tno"]["rpe_layers"] == 2
    assert (folder / "spm.model").read_bytes() == SPM.read_bytes()

    reference, task = fairseq_model(checkpoints[arch], data_bin)
    model = TnnPretrained.from_pretrained(folder)
    assert type(model) is (TnnForMaskedLM if masked else TnnForCausalLM) and not model.training
    assert model.vocab.symbols == task.source_dictionary.symbols
    # the weights: the fairseq model's keys, no pickle (an 8-byte length, then a JSON header)
    raw = (folder / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    tied = {"encoder.lm_head.weight"} if masked else set()
    assert set(header) - {"__metadata__"} == set(reference.state_dict()) - tied

    # a batch of two test lines of different lengths, the shorter right-padded
    tokens = padded(sample_lines(model.vocab, 2, offset=3), model.vocab.pad,
                    first=model.vocab.bos if masked else model.vocab.eos)
    real = tokens.ne(model.vocab.pad)
    assert not real.all()
    with torch.no_grad():
        ours32, theirs32 = model(tokens), reference(tokens)[0]
        model64 = TnnPretrained.from_pretrained(folder, dtype=torch.float64)
        ours64, theirs64 = model64(tokens), reference.double()(tokens)[0]
    assert ours32.dtype == torch.float32 and ours64.dtype == torch.float64
    assert rel(ours32[real], theirs32[real]) <= 1e-5
    assert rel(ours64[real], theirs64[real]) <= 1e-12
    # and not by accident: the exported weights matter
    with torch.no_grad():
        weight = model.stack.embed_tokens.weight
        weight.add_(0.1 * weight.std() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
        assert rel(model(tokens)[real], theirs32[real]) > 1e-3


@pytest.mark.parametrize("arch", CAUSAL)
def test_cached_decoding_equals_the_full_forward(arch, exported):
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        model = TnnForCausalLM.from_pretrained(exported[arch], dtype=dtype)
        tokens = torch.tensor([[model.vocab.eos, *sample_lines(model.vocab, 3)[0]][:40]])  # (1, 40)
        n = tokens.shape[1]
        with torch.no_grad():
            full = model(tokens, kernel_length=n)  # the kernel of the planned length, as generation applies it
            caches = [layer.init_cache(1, n) for layer in model.decoder.layers]
            steps = [model.decoder.step(tokens[:, :10], caches, 0)]  # a chunk (the prompt), then one at a time
            steps += [model.decoder.step(tokens[:, t:t + 1], caches, t) for t in range(10, n)]
        assert rel(torch.cat(steps, dim=1), full) <= tolerance, dtype


@pytest.fixture(scope="module")
def eval_lm(checkpoints, data_bin):
    """{arch: (loss base 2, perplexity)} as fairseq-eval-lm prints them for the sample's test split."""
    out = {}
    for arch in CAUSAL:
        log = run([cli("fairseq-eval-lm"), data_bin, "--user-dir", str(ROOT / "fairseq_tnn"), "--task",
                   "tnn_language_modeling", "--path", checkpoints[arch] / "checkpoint_best.pt", "--cpu",
                   "--gen-subset", "test", "--tokens-per-sample", "128", "--batch-size", "8"])
        loss, ppl = re.search(r"Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.]+)", log).groups()
        out[arch] = (loss, ppl)
    return out


@pytest.mark.parametrize("arch", CAUSAL)
def test_perplexity_equals_fairseq_eval_lms(arch, exported, eval_lm):
    model = TnnForCausalLM.from_pretrained(exported[arch])
    text = (ROOT / "data" / "sample" / "test.txt").read_text()
    ppl = model.perplexity(text)  # blocks of the training length, 128
    loss, printed = eval_lm[arch]
    assert f"{ppl:.2f}" == printed and f"{math.log2(ppl):.4f}" == loss, (ppl, printed, loss)
    # the same from a list of lines and from the token ids (the first 40 lines)
    head = "".join(text.splitlines(keepends=True)[:40])
    part = model.perplexity(head)
    assert model.perplexity(head.splitlines()) == part
    assert abs(model.perplexity([i for row in sample_lines(model.vocab, 40) for i in row]) - part) <= 1e-9 * part
    assert model.perplexity(head, tokens_per_sample=256) != part  # the block length is honoured


PROMPTS = ["And God said", "In the beginning God created the heaven", "Behold, I come quickly"]


@pytest.mark.parametrize("arch", CAUSAL)
def test_greedy_generation_gives_fairseq_interactives_tokens(arch, checkpoints, exported, data_bin):
    max_len = 30
    out = run([cli("fairseq-interactive"), data_bin, "--user-dir", str(ROOT / "fairseq_tnn"), "--task",
               "tnn_language_modeling", "--path", checkpoints[arch] / "checkpoint_best.pt", "--cpu", "--bpe",
               "sentencepiece", "--sentencepiece-model", SPM, "--beam", "1", "--max-len-b", str(max_len),
               "--buffer-size", "3", "--batch-size", "3"], stdin="\n".join(PROMPTS) + "\n")
    theirs = dict(re.findall(r"^H-(\d+)\t\S+\t(.*)$", out, re.M))
    assert sorted(theirs) == ["0", "1", "2"], out
    model = TnnForCausalLM.from_pretrained(exported[arch])
    for i, prompt in enumerate(PROMPTS):
        ids = model.tokens(prompt)
        ours = model.generate(ids, max_new_tokens=max_len - len(ids))
        assert " ".join(model.vocab.symbols[t] for t in ids + ours) == theirs[str(i)], (prompt, out)
        text = model.generate(prompt, max_new_tokens=max_len - len(ids))  # text in, text out
        assert text == model.detokenize(ids + ours) and text.startswith(prompt)


def test_sampling(exported):
    model = TnnForCausalLM.from_pretrained(exported["fd_tnn_lm_tiny"])
    greedy = model.generate("And God said", max_new_tokens=15)
    # a draw from the single likeliest token, or from a nucleus smaller than it, is greedy search
    assert model.generate("And God said", max_new_tokens=15, sampling=True, top_k=1, seed=3) == greedy
    assert model.generate("And God said", max_new_tokens=15, sampling=True, top_p=1e-6, seed=3) == greedy
    a = model.generate([14, 30, 36], max_new_tokens=15, sampling=True, top_k=10, seed=1)
    assert a == model.generate([14, 30, 36], max_new_tokens=15, sampling=True, top_k=10, seed=1)  # repeatable
    assert 1 <= len(a) <= 15 and all(isinstance(t, int) for t in a) and model.vocab.pad not in a
    draws = {tuple(model.generate([14, 30, 36], max_new_tokens=15, sampling=True, seed=s)) for s in range(4)}
    assert len(draws) > 1  # sampling samples
    for bad, message in ((dict(top_k=5), "pass sampling=True"), (dict(sampling=True, top_k=0), "top_k=0"),
                         (dict(sampling=True, top_p=1.5), "top_p=1.5"), (dict(max_new_tokens=0), "max_new_tokens=0")):
        with pytest.raises(ValueError, match=re.escape(message)):
            model.generate("And God said", **bad)
    with pytest.raises(ValueError, match="empty prompt"):
        model.generate("")
    # in training mode with dropout, the methods still run the model in evaluation mode, and leave it training
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.5
    model.train()
    assert model.generate("And God said", max_new_tokens=15) == greedy and model.training


def test_loading_and_saving_refuse_the_wrong_folder(exported, tmp_path):
    with pytest.raises(ValueError, match="describes a masked model, not a causal one: load it with TnnForMaskedLM"):
        TnnForCausalLM.from_pretrained(exported["tnn_mlm_tiny"])
    with pytest.raises(FileNotFoundError, match="holds no config.json: not an exported model folder"):
        TnnForCausalLM.from_pretrained(tmp_path)
    model = TnnForCausalLM.from_pretrained(exported["tnn_lm_tiny"])
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="holds other files"):
        model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]
    model.save_pretrained(tmp_path / "copy")  # a new folder; then over itself, the folder it was loaded from
    again = TnnForCausalLM.from_pretrained(tmp_path / "copy")
    again.save_pretrained(tmp_path / "copy")
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == FILES
    tokens = torch.tensor([[2, *range(4, 30)]])
    with torch.no_grad():
        assert torch.equal(TnnForCausalLM.from_pretrained(tmp_path / "copy")(tokens), model(tokens))


@pytest.mark.parametrize("arch", MASKED)
def test_fill_mask_equals_the_hub_interfaces(arch, checkpoints, exported, data_bin):
    from fairseq_tnn.models.tnn_mlm import TnnMaskedLMModel
    hub = TnnMaskedLMModel.from_pretrained(str(checkpoints[arch]), "checkpoint_best.pt", str(data_bin),
                                           bpe="sentencepiece", sentencepiece_model=str(SPM)).eval()
    model = TnnForMaskedLM.from_pretrained(exported[arch])
    for text in ("The <mask> of Egypt", "And God <mask> unto Moses, saying"):
        theirs, ours = hub.fill_mask(text, topk=5), model.fill_mask(text, topk=5)
        assert [(f, t) for f, _, t in ours] == [(f, t) for f, _, t in theirs], (ours, theirs)
        assert all(abs(a[1] - b[1]) <= 1e-6 for a, b in zip(ours, theirs))
    ids = [model.vocab.bos, *model.tokens("The"), model.vocab.mask, *model.tokens("of Egypt"), model.vocab.eos]
    by_ids, by_text = model.fill_mask(ids, topk=5), model.fill_mask("The <mask> of Egypt", topk=5)  # ids in, ids out
    assert [model.detokenize(f) for f, _, _ in by_ids] == [f for f, _, _ in by_text]
    assert [(p, model.detokenize([t]).strip()) for _, p, t in by_ids] == [(p, t.strip()) for _, p, t in by_text]
    with pytest.raises(ValueError, match="exactly one <mask>"):
        model.fill_mask("The <mask> of <mask>")


WT103 = {"fd_tnn_lm_wt103": (512, 7, {"rpe_dim": 64, "rpe_layers": 3}),
         "ski_tnn_mlm_wt103": (768, 12, {"ski_rank": 32, "ski_taps": 17, "ski_warp_decay": 0.99, "ski_lowrank": "mean"})}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(WT103))
def test_a_wt103_preset_exports(arch, data_bin, tmp_path, capsys):
    """The published sizes (one update of SGD on the sample: a checkpoint of the preset, without optimizer state)."""
    masked = "mlm" in arch
    task = ["--task", "tnn_masked_lm", "--criterion", "masked_lm", "--sample-break-mode", "complete"] if masked else \
        ["--task", "tnn_language_modeling", "--criterion", "cross_entropy"]
    run([cli("fairseq-train"), data_bin, "--user-dir", str(ROOT / "fairseq_tnn"), "--cpu", *task, "--arch", arch,
         "--tokens-per-sample", "64", "--batch-size", "2", "--optimizer", "sgd", "--lr", "0.001", "--max-update", "1",
         "--disable-validation", "--num-workers", "0", "--save-dir", tmp_path / "ck", "--seed", "1"])
    status, err = export(capsys, tmp_path / "ck" / "checkpoint_last.pt", tmp_path / "out", "--tokenizer", SPM)
    assert status == 0, err
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    dim, layers, tno = WT103[arch]
    assert (config["embed_dim"], config["layers"], config["expand_ratio"], config["dropout"]) == (dim, layers, 3, 0.1)
    assert {k: config["tno"][k] for k in tno} == tno and config["norm_position"] == ("post" if masked else "pre")
    reference, _ = fairseq_model(tmp_path / "ck", data_bin, "checkpoint_last.pt")
    model = TnnPretrained.from_pretrained(tmp_path / "out")
    tokens = torch.tensor([[2, *range(4, 70)]])
    with torch.no_grad():
        assert rel(model(tokens), reference(tokens)[0]) <= 1e-5


# ---------------------------------------------------------------- what is refused
def refused(status, err, *phrases):
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and lines[0].startswith(ERROR), err
    for phrase in phrases:
        assert phrase in lines[0], (phrase, err)
    return lines[0]


def test_bad_inputs_are_refused_with_one_line(checkpoints, data_bin, tmp_path, capsys):
    ckpt = checkpoints["tnn_lm_tiny"] / "checkpoint_best.pt"
    dest = tmp_path / "out"

    refused(*export(capsys, tmp_path / "missing.pt", dest), "missing.pt is not a file")
    # a checkpoint of a model that is not the plugin's (fairseq's transformer_lm, say)
    state = torch.load(ckpt, weights_only=False)  # fairseq saves its config as plain containers
    state["cfg"]["model"]["_name"] = "transformer_lm"
    foreign = tmp_path / "transformer.pt"
    torch.save(state, foreign)
    refused(*export(capsys, foreign, dest, "--tokenizer", SPM), "holds a transformer_lm model, not one of the plugin's")
    # a destination holding something else: refused, and left as it was
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    refused(*export(capsys, ckpt, tmp_path / "notes", "--tokenizer", SPM), "holds other files (todo.txt)")
    assert sorted(p.name for p in (tmp_path / "notes").iterdir()) == ["todo.txt"]
    (tmp_path / "afile").write_text("x")
    refused(*export(capsys, ckpt, tmp_path / "afile", "--tokenizer", SPM), "is a file, not a directory")
    # no tokenizer beside the data (data-bin/sample holds none): the option that gives it is named
    refused(*export(capsys, ckpt, dest), "no tokenizer found beside the data", "--tokenizer PATH",
            "spm.model")
    refused(*export(capsys, ckpt, dest, "--tokenizer", tmp_path / "nothing"), "no spm.model there")
    # a tokenizer whose symbols are not the dictionary's: a sentencepiece model trained on other text
    import sentencepiece as spm
    (tmp_path / "other.txt").write_text("\n".join(["zebra quagga okapi giraffe"] * 50))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "other.txt"), model_prefix=str(tmp_path / "other"),
                                   vocab_size=30, model_type="bpe", minloglevel=2)
    refused(*export(capsys, ckpt, dest, "--tokenizer", tmp_path / "other.model"), "does not match the dictionary")
    tiny_gpt2_bpe(tmp_path / "gpt2")
    refused(*export(capsys, ckpt, dest, "--tokenizer", tmp_path / "gpt2"), "no spm.model there")
    # a data directory without the dictionary
    refused(*export(capsys, ckpt, dest, "--data", tmp_path / "notes", "--tokenizer", SPM), "--data", "no dict.txt")
    refused(*export(capsys, ckpt, dest, "--data", tmp_path / "gpt2", "--tokenizer", SPM),
            "embeddings have 1888 rows but", "gives 265 symbols", "(--data names")
    refused(*export(capsys, ckpt, dest, "--bogus"), "unrecognized arguments: --bogus")
    assert not dest.exists()  # nothing was written by any of them


def test_the_tokenizer_is_found_beside_the_data_and_an_export_is_replaced(checkpoints, data_bin, tmp_path, capsys):
    data = tmp_path / "data-bin"
    shutil.copytree(data_bin, data)
    shutil.copy(SPM, data / "spm.model")  # where scripts/prepare-corpus.sh leaves it
    ckpt = checkpoints["fd_tnn_lm_tiny"] / "checkpoint_best.pt"
    status, err = export(capsys, ckpt, tmp_path / "out", "--data", data)
    assert status == 0 and f"sentencepiece tokenizer from {data}" in err, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == FILES
    status, err = export(capsys, ckpt, tmp_path / "out", "--data", data)  # an earlier export: replaced
    assert status == 0, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == FILES


def test_a_gpt2_bpe_model_exports_with_the_files_beside_its_data(tmp_path, capsys):
    """Data prepared by scripts/prepare-corpus.sh with GPT-2's BPE (a tiny one: the byte symbols and a few merges)
    leaves encoder.json and vocab.bpe beside the data; the export finds them there, and text goes in and out."""
    gpt2 = tmp_path / "gpt2"
    tiny_gpt2_bpe(gpt2)
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join((ROOT / "data" / "sample" / "train.txt").read_text().splitlines()[:400]) + "\n")
    data = tmp_path / "data-bin"
    status, out, err = execute(["bash", ROOT / "scripts" / "prepare-corpus.sh", text, data],
                               command_env(TEXT_DIR=str(tmp_path / "text"), BPE="gpt2", GPT2_DIR=str(gpt2),
                                           TOKENS_PER_SAMPLE="64", FAIRSEQ_BIN=str(BIN)), 600)
    assert status == 0, out + err
    run([cli("fairseq-train"), data, "--user-dir", str(ROOT / "fairseq_tnn"), "--cpu", "--task",
         "tnn_language_modeling", "--arch", "tnn_lm_tiny", "--tokens-per-sample", "64", "--batch-size", "4",
         "--optimizer", "adam", "--lr", "0.003", "--max-update", "3", "--disable-validation", "--num-workers", "0",
         "--save-dir", tmp_path / "ck"])
    status, err = export(capsys, tmp_path / "ck" / "checkpoint_last.pt", tmp_path / "out")
    assert status == 0 and f"gpt2 tokenizer from {data}" in err, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "encoder.json", "model.safetensors", "vocab.bpe", "vocab.json"]
    model = TnnForCausalLM.from_pretrained(tmp_path / "out")
    ids = model.tokens("And the other said unto them")
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder
    theirs = get_encoder(str(gpt2 / "encoder.json"), str(gpt2 / "vocab.bpe")).encode("And the other said unto them")
    assert [model.vocab.symbols[i] for i in ids] == [str(t) for t in theirs]  # GPT-2 ids as the dictionary's words
    assert model.detokenize(ids) == "And the other said unto them"
    assert model.generate("And the other", max_new_tokens=8).startswith("And the other")


def test_the_entry_point_runs_it(checkpoints, tmp_path):
    """`python -m fairseq_tnn export`, a process of its own: --help, and a refusal on stderr, exit 2."""
    env = command_env()
    status, out, err = execute([sys.executable, "-m", "fairseq_tnn", "--help"], env, 120)
    assert status == 0 and re.search(r"^  export +a checkpoint as a folder", out, re.M), out
    status, out, err = execute([sys.executable, "-m", "fairseq_tnn", "export",
                                checkpoints["tnn_lm_tiny"] / "checkpoint_best.pt", tmp_path / "out"], env, 300)
    assert status == 2 and err.strip().splitlines()[-1].startswith(f"{ERROR}no tokenizer found"), err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the formats
def test_safetensors_follow_the_specification(tmp_path):
    # a file written by hand from the specification: 8-byte little-endian header length, JSON header (any key
    # order, metadata, padded with spaces), the data in the order of the offsets
    a = struct.pack("<3f", 1.0, -2.5, 3.25)
    b = struct.pack("<q", -7)
    header = json.dumps({"b": {"dtype": "I64", "shape": [], "data_offsets": [12, 20]},
                         "__metadata__": {"who": "hand"},
                         "a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}, indent=1).encode() + b"   "
    (tmp_path / "hand.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + a + b)
    tensors, meta = load_file(tmp_path / "hand.safetensors")
    assert meta == {"who": "hand"} and tensors["a"].tolist() == [1.0, -2.5, 3.25] and tensors["b"].item() == -7
    assert tensors["b"].dtype == torch.int64 and tensors["b"].shape == ()

    # what we write: the same layout, read back by hand
    save_file({"x": torch.tensor([[1.5, 2.0]], dtype=torch.float64), "y": torch.tensor(True)}, tmp_path / "w.st",
              {"k": "v"})
    raw = (tmp_path / "w.st").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    assert n % 8 == 0 and raw[8:9] == b"{"
    assert head == {"__metadata__": {"k": "v"}, "x": {"dtype": "F64", "shape": [1, 2], "data_offsets": [0, 16]},
                    "y": {"dtype": "BOOL", "shape": [], "data_offsets": [16, 17]}}
    assert raw[8 + n:] == struct.pack("<2d", 1.5, 2.0) + b"\x01"

    # every dtype round-trips, empty and 0-dim tensors too
    many = {str(d): (torch.arange(6) - 2).to(d).reshape(2, 3) for d in
            (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
             torch.int8, torch.uint8, torch.bool)}
    many["empty"], many["scalar"] = torch.zeros(0, 4), torch.tensor(3.0)
    save_file(many, tmp_path / "many.st")
    back, _ = load_file(tmp_path / "many.st")
    assert back.keys() == many.keys() and all(torch.equal(back[k], v) and back[k].dtype == v.dtype
                                              for k, v in many.items())

    # a damaged file is named, not half-read
    (tmp_path / "cut.st").write_bytes(raw[:-3])
    with pytest.raises(SafetensorsError, match="data_offsets"):
        load_file(tmp_path / "cut.st")
    (tmp_path / "junk.st").write_bytes(b"\xff" * 64)
    with pytest.raises(SafetensorsError, match="header length"):
        load_file(tmp_path / "junk.st")


def test_the_pure_python_tokenizers_encode_as_the_packages():
    import sentencepiece as spm

    package = spm.SentencePieceProcessor(model_file=str(SPM))
    ours = PurePythonSentencePiece(read_spm_model(SPM))
    lines = [line for split in ("train", "valid", "test")
             for line in (ROOT / "data" / "sample" / f"{split}.txt").read_text().splitlines()]
    lines += ["", " ", "  two  spaces ", "caf\u00e9 \u00ff \u4e2d", "x\ty", "unto\u2581them"]
    assert [ours.encode(line) for line in lines] == [package.encode(line, out_type=str) for line in lines]


def test_gpt2_bpe_encodes_as_fairseqs(tmp_path):
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    tiny_gpt2_bpe(tmp_path)
    theirs = get_encoder(str(tmp_path / "encoder.json"), str(tmp_path / "vocab.bpe"))
    ours = Gpt2Tokenizer(tmp_path)
    for text in ("the other thither, the", "The 3 brothers' father said: \"there!\"", "caf\u00e9  \n x", ""):
        ids = ours.encode(text)
        assert ids == [str(i) for i in theirs.encode(text)]
        assert ours.decode(ids) == theirs.decode([int(i) for i in ids]) == text


# ---------------------------------------------------------------- with torch alone
BLOCKER = '''import sys
class Absent:
    """Every import of these fails, as where they are not installed: torch alone."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fairseq", "fairseq_cli", "sentencepiece", "regex"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
'''
DRIVER = '''import runpy, sys
runpy.run_path(sys.argv[1], run_name="__main__")
import fairseq_tnn
print("package:", fairseq_tnn.__file__)
print("imported:", sorted({m.split(".")[0] for m in sys.modules} & {"fairseq", "fairseq_cli", "sentencepiece", "regex"}))
'''


def test_the_docs_example_runs_with_torch_alone(exported, eval_lm, tmp_path):
    """docs/using-models.md's "Without fairseq" example, as written, from a `pip install .` of the package (torch
    alone) in an interpreter where importing fairseq, sentencepiece and regex fails: the demo's FD-TNN prints
    fairseq-eval-lm's test perplexity and samples text; the fine-tuning block trains and saves."""
    site, _ = install_core(tmp_path)

    box = tmp_path / "box"  # laid out as the docs' commands leave it
    (box / "blocker").mkdir(parents=True)
    (box / "blocker" / "sitecustomize.py").write_text(BLOCKER)
    (box / "data" / "sample").mkdir(parents=True)
    for name in ("test.txt", "valid.txt"):
        shutil.copy(ROOT / "data" / "sample" / name, box / "data" / "sample" / name)
    shutil.copytree(exported["fd_tnn_lm_tiny"], box / "exported" / "fd_tnn_lm_tiny")
    use, _fill, tune = doc_blocks(ROOT / "docs" / "using-models.md", "python", "## Without fairseq")
    (box / "use.py").write_text(use)
    (box / "tune.py").write_text(tune)
    (box / "driver.py").write_text(DRIVER)
    env = command_env(PYTHONPATH=f"{box / 'blocker'}:{site}")
    outs = []
    for script in ("use.py", "tune.py"):
        status, out, err = execute([sys.executable, "driver.py", script], env, 300, cwd=box)
        assert status == 0, out + err
        assert f"package: {site / 'fairseq_tnn' / '__init__.py'}\nimported: []" in out, out
        outs.append(out)
    lines = outs[0].splitlines()
    assert lines[0] == f"test perplexity {eval_lm['fd_tnn_lm_tiny'][1]}", (lines[0], eval_lm)
    assert lines[1].startswith("And God said ") and len(lines[1]) > len("And God said ") + 10, lines[1]
    steps = re.findall(r"^step \d loss ([0-9.]+)$", outs[1], re.M)
    assert len(steps) == 8, outs[1]
    before, after = map(float, re.search(r"trained on: ([0-9.]+) before, ([0-9.]+) after", outs[1]).groups())
    assert after < before, outs[1]
    tuned = box / "exported" / "fd_tnn_lm_tiny-tuned"
    assert sorted(p.name for p in tuned.iterdir()) == FILES
    # saved in the same format: the config and vocabulary as exported, the weights trained
    for name in ("config.json", "vocab.json", "spm.model"):
        assert (tuned / name).read_bytes() == (exported["fd_tnn_lm_tiny"] / name).read_bytes(), name
    a, b = from_pretrained(exported["fd_tnn_lm_tiny"]), from_pretrained(tuned)
    changed = [k for k, v in a.state_dict().items() if not torch.equal(v, b.state_dict()[k])]
    assert "decoder.embed_tokens.weight" in changed and len(changed) > 10
