"""Generation from the command line: fairseq-interactive and fairseq-generate with TNN and FD-TNN
checkpoints, greedy / beam / top-k / top-p, text in and out through --bpe sentencepiece."""
import re

import pytest

from helpers import ROOT, USER_DIR, cli, run

SPM = ROOT / "data/sample/spm.model"
PROMPTS = ["And God said", "In the beginning God created the heaven and the earth"]
MODES = {
    "greedy": ["--beam", 1],
    "beam": ["--beam", 4, "--nbest", 2],
    "topk": ["--beam", 1, "--sampling", "--sampling-topk", 10, "--seed", 3],
    "topp": ["--beam", 1, "--sampling", "--sampling-topp", 0.9, "--seed", 3],
}


def interactive(data_bin, checkpoint, stdin, *extra, expect_ok=True):
    cmd = [cli("fairseq-interactive"), data_bin, "--user-dir", USER_DIR, "--task", "tnn_language_modeling",
           "--path", checkpoint, "--cpu", "--bpe", "sentencepiece", "--sentencepiece-model", SPM, *extra]
    return run(cmd, expect_ok=expect_ok, timeout=300, stdin=stdin)


def hypotheses(out):
    """{sentence id: [detokenised hypothesis text, ...]} from fairseq's D- lines."""
    hyps = {}
    for m in re.finditer(r"^D-(\d+)\t(\S+)\t(.*)$", out, re.M):
        hyps.setdefault(int(m.group(1)), []).append(m.group(3))
    return hyps


# Every decoding mode with TNN; FD-TNN (whose kernel depends on the planned length) with beam search, the
# mode that reorders the cache. The samplers are the generator's, the same for every model.
INTERACTIVE_CASES = [("tnn_lm_tiny", mode) for mode in MODES] + [("fd_tnn_lm_tiny", "beam")]


@pytest.mark.parametrize("arch,mode", INTERACTIVE_CASES, ids=[f"{m}-{a}" for a, m in INTERACTIVE_CASES])
def test_interactive_continues_text_prompts(tiny_checkpoints, data_bin, arch, mode):
    out = interactive(data_bin, tiny_checkpoints[arch] / "checkpoint_best.pt", "\n".join(PROMPTS) + "\n",
                      *MODES[mode], "--max-len-b", 30, "--min-len", 16, "--buffer-size", 2, "--batch-size", 2)
    hyps = hypotheses(out)
    assert sorted(hyps) == [0, 1], out[-3000:]
    for i, prompt in enumerate(PROMPTS):
        assert len(hyps[i]) == (2 if mode == "beam" else 1)
        for text in hyps[i]:
            assert text.startswith(prompt) and "\u2581" not in text, (mode, text)  # text, not pieces
    # the longest prompt's best hypothesis is a real continuation (fairseq applies --min-len only after
    # the batch's longest prompt, so a shorter prompt may legitimately end early)
    assert len(hyps[1][0]) > len(PROMPTS[1]) + 5, (mode, hyps[1])
    # the S- line is the prompt as the model saw it: sentencepiece pieces
    assert re.search(r"^S-0\t\u2581And \u2581God \u2581said$", out, re.M), out[-3000:]


# (fairseq-generate with TNN and beam search is docs/using-models.md's example, run by
# tests/scripts/test_docs_using_models.py on the same checkpoint)
@pytest.mark.parametrize("arch,mode", [("fd_tnn_lm_tiny", "topk")])
def test_generate_completes_prompts_from_a_file(tiny_checkpoints, data_bin, tmp_path, arch, mode):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(SPM))
    (tmp_path / "prompts.bpe").write_text("".join(" ".join(sp.encode(p, out_type=str)) + "\n" for p in PROMPTS))
    run([cli("fairseq-preprocess"), "--only-source", "--srcdict", data_bin / "dict.txt",
         "--testpref", tmp_path / "prompts.bpe", "--destdir", tmp_path / "prompts-bin", "--workers", 1])
    out = run([cli("fairseq-generate"), tmp_path / "prompts-bin", "--user-dir", USER_DIR, "--task",
               "tnn_language_modeling", "--path", tiny_checkpoints[arch] / "checkpoint_best.pt", "--cpu",
               "--gen-subset", "test", "--sample-break-mode", "eos", "--batch-size", 2,
               "--required-batch-size-multiple", 1, "--bpe", "sentencepiece", "--sentencepiece-model", SPM,
               *MODES[mode], "--max-len-b", 30, "--min-len", 16])
    hyps = hypotheses(out)
    assert sorted(hyps) == [0, 1], out[-3000:]
    for i, prompt in enumerate(PROMPTS):
        assert all(t.startswith(prompt) for t in hyps[i]), hyps[i]
    assert len(hyps[1][0]) > len(PROMPTS[1]) + 5, hyps[1]


def test_interactive_bad_prompts(tiny_checkpoints, data_bin):
    ckpt = tiny_checkpoints["tnn_lm_tiny"] / "checkpoint_best.pt"
    out = interactive(data_bin, ckpt, "\n", "--beam", 1, expect_ok=False)
    assert "empty prompt" in out, out[-2000:]
    out = interactive(data_bin, ckpt, PROMPTS[1] + "\n", "--beam", 1, "--max-len-b", 5, expect_ok=False)
    assert re.search(r"a prompt has \d+ tokens but generation stops at 5 tokens.*Raise --max-len-b", out), out[-2000:]
