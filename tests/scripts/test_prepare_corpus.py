"""scripts/prepare-corpus.sh run as a user runs it: the sample's text gives the committed sample; one file is
split, encoded and binarised so that fairseq's data decodes back to the text; a rerun skips, an interrupted
run leaves nothing that looks complete; GPT-2 BPE; and every bad input of issue 35 refused before any work,
leaving what exists as it was."""
import json
import os
import shlex
import shutil
import stat

import pytest

from helpers import BIN, ROOT, SCRIPTS, command_env, execute, ok, script_env, sh, tiny_gpt2_bpe

SAMPLE = ROOT / "data" / "sample"
PREPARE = SCRIPTS / "prepare-corpus.sh"
SPLITS = ("train", "valid", "test")


def prepare(src, dest, text_dir, env=None, expect=0):
    """Run the command; return (stdout, stderr) after checking its exit status."""
    rc, out, err = sh(["bash", PREPARE, src, dest], {"TEXT_DIR": str(text_dir), **(env or {})})
    assert rc == expect, (rc, out, err)
    return out, err


def snapshot(*dirs):
    """Every file under dirs, with its bytes and modification time (None for a missing directory)."""
    out = {}
    for d in dirs:
        out[str(d)] = None if not d.exists() else {
            str(p.relative_to(d)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(d.rglob("*")) if p.is_file()}
    return out


@pytest.fixture(scope="module")
def small_text(tmp_path_factory):
    """One file of 1,200 lines of the sample's text, a blank line and a line of non-ASCII UTF-8 among them."""
    lines = (SAMPLE / "train.txt").read_text().splitlines()[:1200]
    lines[10] = ""
    lines[20] = "Ἐν ἀρχῇ ἦν ὁ λόγος — the théâtre of “quotes”"
    path = tmp_path_factory.mktemp("text") / "small.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_the_sample_text_gives_the_committed_sample_byte_for_byte(tmp_path, data_bin):
    """data/sample was built by the earlier make_sample_data.py (its own sentencepiece call); a directory of its
    .txt files, with the default vocabulary (6 x sqrt(109,466 words) -> 2,000), gives the same model and
    encodings, and the data-bin of scripts/preprocess.sh (conftest's data_bin) plus the tokenizer."""
    src = tmp_path / "kjv"
    src.mkdir()
    for s in SPLITS:
        shutil.copy(SAMPLE / f"{s}.txt", src / f"{s}.txt")
    out, err = prepare(src, tmp_path / "bin", src)
    for name in ("spm.model", "spm.vocab", *(f"{s}.bpe" for s in SPLITS)):
        assert (src / name).read_bytes() == (SAMPLE / name).read_bytes(), name
    for name in ("dict.txt", *(f"{s}.{e}" for s in SPLITS for e in ("bin", "idx"))):
        assert (tmp_path / "bin" / name).read_bytes() == (data_bin / name).read_bytes(), name
    assert (tmp_path / "bin" / "spm.model").read_bytes() == (SAMPLE / "spm.model").read_bytes()
    assert "training sentencepiece BPE, 2,000 pieces" in err and "tokens/s" in err
    assert f"--bpe sentencepiece --sentencepiece-model {tmp_path / 'bin' / 'spm.model'}" in out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


@pytest.mark.runs_doc(r'^bash scripts/prepare-corpus\.sh ')
def test_one_file_is_split_and_fairseqs_data_decodes_back_to_it(tmp_path, small_text):
    import sentencepiece as spm
    from fairseq.data import Dictionary, data_utils

    dest, text = tmp_path / "bin", tmp_path / "text"
    out, err = prepare(small_text, dest, text, {"VOCAB_SIZE": "600", "TOKENS_PER_SAMPLE": "64"})
    lines = small_text.read_text(encoding="utf-8").splitlines()
    # 5% of 1,200 lines each for valid and test, in order, the sizes printed
    assert f"train: lines 1-1,080 of {small_text} (1,080 lines" in err
    assert "valid: lines 1,081-1,140" in err and "test: lines 1,141-1,200" in err
    assert "".join((text / f"{s}.txt").read_text(encoding="utf-8") for s in SPLITS) == small_text.read_text("utf-8")
    sp = spm.SentencePieceProcessor(model_file=str(dest / "spm.model"))
    assert sp.get_piece_size() == 600 and (dest / "spm.model").read_bytes() == (text / "spm.model").read_bytes()
    d = Dictionary.load(str(dest / "dict.txt"))
    start = {"train": 0, "valid": 1080, "test": 1140}
    for s in SPLITS:
        ds = data_utils.load_indexed_dataset(str(dest / s), d)
        assert len(ds) == (1080 if s == "train" else 60)
        for i in range(len(ds)):
            ids = ds[i].tolist()
            assert ids[-1] == d.eos()
            assert sp.decode([d[t] for t in ids[:-1]]) == lines[start[s] + i]
    assert "Ἐν ἀρχῇ ἦν ὁ λόγος" in (text / "train.txt").read_text("utf-8")
    # the stamp records the input and the settings; a rerun with them does nothing
    stamp = json.loads((dest / "prepare-corpus.json").read_text())
    assert stamp["key"]["vocab_size"] == 600 and stamp["key"]["split_percent"] == [5.0, 5.0]
    before = snapshot(dest, text)
    out2, err2 = prepare(small_text, dest, text, {"VOCAB_SIZE": "600", "TOKENS_PER_SAMPLE": "64"})
    assert "already prepared from this input with these settings" in err2 and snapshot(dest, text) == before
    assert out2 == out  # the next steps again
    assert stat.S_IMODE(dest.stat().st_mode) == 0o777 & ~_umask()


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_an_interrupted_binarisation_leaves_nothing_complete_and_the_rerun_resumes(tmp_path, small_text):
    """fairseq-preprocess dies half way: dest does not appear (the work went to a temporary folder), and the
    next run reuses the tokenizer and the encoded splits of the first; a step whose files are gone is redone."""
    fake = tmp_path / "fake-bin"
    fake.mkdir()
    (fake / "fairseq-preprocess").write_text('#!/bin/sh\nfor a; do [ "$prev" = --destdir ] && d="$a"; prev="$a"; done\n'
                                             'echo half > "$d/dict.txt"; echo killed >&2; exit 137\n')
    (fake / "fairseq-preprocess").chmod(0o755)
    dest, text = tmp_path / "data-bin" / "small", tmp_path / "text"
    env = {"VOCAB_SIZE": "600", "TOKENS_PER_SAMPLE": "64"}
    _, err = prepare(small_text, dest, text, {**env, "FAIRSEQ_BIN": str(fake)}, expect=2)
    assert "fairseq-preprocess failed" in err and "killed" in err
    assert list((tmp_path / "data-bin").iterdir()) == []
    _, err = prepare(small_text, dest, text, {**env, "FAIRSEQ_BIN": str(BIN)})
    assert "split present" in err and "tokenizer present" in err and "encoded splits present" in err
    assert "training sentencepiece" not in err and "encoding" not in err
    assert (dest / "dict.txt").read_text() != "half\n" and (dest / "train.bin").stat().st_size > 0
    (text / "test.bpe").unlink()
    shutil.rmtree(dest)
    _, err = prepare(small_text, dest, text, env)
    assert "tokenizer present" in err and "encoding test" in err and (text / "test.bpe").is_file()


def test_gpt2_bpe_uses_the_gpt2_dictionary_and_keeps_the_encoder_beside_the_data(tmp_path, small_text):
    from fairseq.data import Dictionary, data_utils
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    gpt2 = tmp_path / "gpt2"
    tiny_gpt2_bpe(gpt2)
    dest, text = tmp_path / "bin", tmp_path / "text"
    out, err = prepare(small_text, dest, text, {"BPE": "gpt2", "GPT2_DIR": str(gpt2), "TOKENS_PER_SAMPLE": "64"})
    assert (dest / "dict.txt").read_bytes() == (gpt2 / "dict.txt").read_bytes()
    for f in ("encoder.json", "vocab.bpe"):
        assert (dest / f).read_bytes() == (gpt2 / f).read_bytes()
    assert not (text / "spm.model").exists() and "encoding valid (GPT-2 BPE" in err
    assert f"--bpe gpt2 --gpt2-encoder-json {dest / 'encoder.json'} --gpt2-vocab-bpe {dest / 'vocab.bpe'}" in out
    enc = get_encoder(str(dest / "encoder.json"), str(dest / "vocab.bpe"))
    d = Dictionary.load(str(dest / "dict.txt"))
    ds = data_utils.load_indexed_dataset(str(dest / "valid"), d)
    lines = small_text.read_text(encoding="utf-8").splitlines()
    assert [enc.decode([int(d[t]) for t in ds[i][:-1]]) for i in range(len(ds))] == [l.strip() for l in lines[1080:1140]]


def write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def corpus_with_a_directory(d, name):
    for s in SPLITS:
        if f"{s}.txt" != name:
            write(d / f"{s}.txt", b"some words here\n")
    (d / name).mkdir()
    return d


# (name, make the input under tmp_path -> path, env, what the error says)
BAD_INPUTS = [
    ("missing file", lambda t: t / "nope.txt", {}, ["nope.txt: no such file or directory"]),
    ("directory without test.txt",
     lambda t: [write(t / "c" / f"{s}.txt", b"some words here\n") for s in ("train", "valid")][0].parent, {},
     ["without", "c/test.txt", "needs train.txt, valid.txt and test.txt"]),
    ("a directory where a file is expected", lambda t: corpus_with_a_directory(t / "c", "valid.txt"), {},
     ["c/valid.txt is a directory, not a text file"]),
    ("one line", lambda t: write(t / "one.txt", b"a single line of words\n"), {},
     ["one.txt: 1 line is too few to split into train, valid (5%) and test (5%)"]),
    ("empty file", lambda t: write(t / "empty.txt", b""), {}, ["empty.txt: empty (0 bytes)"]),
    ("blank file", lambda t: write(t / "blank.txt", b"\n  \n\t\n"), {}, ["blank.txt: empty (3 lines, only whitespace)"]),
    ("binary file", lambda t: write(t / "a.bin", b"hello world\nabc\x00def\n" * 50), {},
     ["a.bin: a binary file, not text: NUL byte at byte offset 15 (line 2)"]),
    ("latin-1 file", lambda t: write(t / "latin.txt", b"line one\nline two\ncaf\xe9 au lait\n" * 50), {},
     ["latin.txt: not UTF-8: invalid byte 0xe9 at byte offset 21 (line 3)", "iconv"]),
    ("latin-1 valid split", lambda t: [write(t / "c" / f"{s}.txt", b"ok words\n" * 600 if s != "valid" else
                                             b"fine\nna\xefve\n") for s in SPLITS][0].parent, {"VOCAB_SIZE": "30"},
     ["c/valid.txt: not UTF-8: invalid byte 0xef at byte offset 7 (line 2)"]),
    ("vocabulary too large", None, {"VOCAB_SIZE": "100000", "TOKENS_PER_SAMPLE": "64"},
     ["the corpus is too small for VOCAB_SIZE=100000", "which make at most", "set VOCAB_SIZE below"]),
    ("vocabulary below the characters", None, {"VOCAB_SIZE": "20", "TOKENS_PER_SAMPLE": "64"},
     ["VOCAB_SIZE=20 is too small", "distinct characters"]),
    ("vocabulary beyond what sentencepiece makes", None, {"VOCAB_SIZE": "9000", "TOKENS_PER_SAMPLE": "64"},
     ["sentencepiece cannot make 9,000 pieces from the train split: it makes at most", "set VOCAB_SIZE to that"]),
    ("shorter than one block", None, {"TOKENS_PER_SAMPLE": "100000"},
     ["fewer than one training block of TOKENS_PER_SAMPLE=100000 tokens"]),
    ("GPT-2 files missing", None, {"BPE": "gpt2", "GPT2_DIR": "/no/such/gpt2", "TOKENS_PER_SAMPLE": "64"},
     ["GPT-2 BPE needs /no/such/gpt2/encoder.json", "https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe/dict.txt"]),
    ("VOCAB_SIZE with GPT-2", None, {"BPE": "gpt2", "VOCAB_SIZE": "1000"}, ["VOCAB_SIZE=1000 applies to sentencepiece only"]),
    ("BPE not a tokenizer", None, {"BPE": "wordpiece"}, ["BPE must be sentencepiece or gpt2, not 'wordpiece'"]),
    ("VOCAB_SIZE not a number", None, {"VOCAB_SIZE": "32k"},
     ["VOCAB_SIZE must be a positive integer (0: the default rule), not '32k'"]),
    ("VALID_PERCENT out of range", None, {"VALID_PERCENT": "60"},
     ["VALID_PERCENT must be a number above 0 and below 50, not '60'"]),
    ("WORKERS negative", None, {"WORKERS": "-1"}, ["WORKERS must be a positive integer (0: the CPUs this process may use), not '-1'"]),
    ("FORCE neither 0 nor 1", None, {"FORCE": "yes"}, ["FORCE must be 0 or 1, not 'yes'"]),
]


@pytest.mark.parametrize("name,make,env,says", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_one_clear_error_before_any_work(tmp_path, capsys, small_text, name, make, env, says):
    """Exit status 2, the message names the file (line and byte offset) or the setting, and an existing
    data-bin and text directory are left exactly as they were. Every error comes before any work but one:
    sentencepiece finds the largest vocabulary it can make only while training (the check before is a bound).
    The command's entry point runs in this process, as the script runs it (tests/scripts/test_script_conventions.py
    runs the script's own usage errors)."""
    src = make(tmp_path) if make else small_text
    dest, text = tmp_path / "out" / "bin", tmp_path / "out" / "text"
    write(dest / "notes.txt", b"mine\n")
    write(text / "notes.txt", b"mine too\n")
    before = snapshot(tmp_path / "out")
    rc, out, err = prepare_here(capsys, src, dest, text, defaults=False, **{"FORCE": "1", **env})
    assert rc == 2 and out == "", (rc, out, err)
    lines = err.splitlines()
    assert lines[-1].startswith("prepare-corpus.sh: error: ") and "error" not in "".join(lines[:-1]), err
    assert len(lines) == 1 or name == "vocabulary beyond what sentencepiece makes", err
    for s in says:
        assert s in err, (s, err)
    assert snapshot(tmp_path / "out") == before


def test_an_output_that_holds_something_else_is_refused_and_force_replaces_only_our_files(tmp_path, small_text,
                                                                                           data_bin):
    dest, text = tmp_path / "bin", tmp_path / "text"
    shutil.copytree(data_bin, dest)  # a data-bin that scripts/preprocess.sh made, and a file of the user's
    write(dest / "notes.txt", b"keep me\n")
    env = {"VOCAB_SIZE": "600", "TOKENS_PER_SAMPLE": "64"}
    before = snapshot(dest)
    _, err = prepare(small_text, dest, text, env, expect=2)
    assert f"{dest} holds files this command did not write (dict.txt, notes.txt" in err
    assert "refusing to overwrite (FORCE=1 replaces only the files this command writes: dict.txt," in err
    assert snapshot(dest) == before and not text.exists()
    # FORCE=1: our files replaced, the user's kept
    prepare(small_text, dest, text, {**env, "FORCE": "1"})
    assert (dest / "notes.txt").read_bytes() == b"keep me\n"
    assert (dest / "dict.txt").read_bytes() != before[str(dest)]["dict.txt"][0]
    assert json.loads((dest / "prepare-corpus.json").read_text())["key"]["vocab_size"] == 600
    # the same data-bin and text directory for another input (or other settings): refused, untouched
    other = write(tmp_path / "other.txt", small_text.read_bytes().replace(b"God", b"Dog"))
    before = snapshot(dest, text)
    _, err = prepare(other, dest, text, env, expect=2)
    assert f"{text} (TEXT_DIR) holds data prepared from another input or with other settings" in err
    assert f"{dest} holds data prepared from another input or with other settings" in err
    _, err = prepare(small_text, dest, text, {**env, "VOCAB_SIZE": "700"}, expect=2)
    assert snapshot(dest, text) == before


def printed_steps(out):
    """The commands of the printed next steps: train.sh, eval_extrapolation.sh, echo ... | fairseq-interactive."""
    steps = [line.strip() for line in out.splitlines() if line.startswith("  ") and
             ("bash scripts/" in line or line.strip().startswith("echo "))]
    assert len(steps) == 3, out
    return steps


def run_printed(step, tmp_path, **env):
    """A printed train.sh or eval_extrapolation.sh command as printed, its knobs first, its checkpoints and
    results under tmp_path (SAVE_ROOT, RESULTS_ROOT), env's knobs winning over the printed ones (shorter runs)."""
    argv = [str(tmp_path / a) if a.startswith("checkpoints/") else a for a in shlex.split(step)]
    env = {"SAVE_ROOT": str(tmp_path / "checkpoints"), "RESULTS_ROOT": str(tmp_path / "results"), **env}
    while "=" in argv[0]:
        k, v = argv.pop(0).split("=", 1)
        env.setdefault(k, v)
    return ok(argv, env)


@pytest.mark.runs_doc(r'^CPU=1 NPROC=1 MAX_UPDATE=300 .* RUN_NAME=debian-copyright_tnn_lm_tiny bash scripts/train\.sh '
                      r'tnn_lm_tiny data-bin/debian-copyright --weight-decay 0\.01$',
                      r'^CPU=1 DATA=data-bin/debian-copyright LENGTHS=".*" NAME=debian-copyright bash '
                      r'scripts/eval_extrapolation\.sh ',
                      r'^echo .* \| \.venv/bin/fairseq-interactive data-bin/debian-copyright ')
@pytest.mark.slow  # trains and evaluates two models through the scripts: about 70 s on 2 idle cores
def test_the_printed_next_steps_train_evaluate_and_generate(tmp_path, small_text):
    """The commands the script prints, run as printed (shorter: 8 updates, the run under tmp_path): train.sh,
    eval_extrapolation.sh and fairseq-interactive, which continues the prompt in the corpus's words. A second
    corpus's printed steps then run beside the first's (their own checkpoints and results), not refused."""
    dest, text = tmp_path / "bin", tmp_path / "text"
    out, _ = prepare(small_text, dest, text, {"VOCAB_SIZE": "600", "TOKENS_PER_SAMPLE": "64"})
    steps = printed_steps(out)
    short = {"MAX_UPDATE": "8", "VALIDATE_INTERVAL_UPDATES": "8", "SAVE_INTERVAL_UPDATES": "8"}
    for step in steps[:2]:  # train.sh, eval_extrapolation.sh
        run_printed(step, tmp_path, **short)
    ckpt = str(tmp_path / "checkpoints" / "bin_tnn_lm_tiny" / "checkpoint_best.pt")
    assert (tmp_path / "results" / "bin" / "extrapolation.md").is_file() and os.path.isfile(ckpt)

    other = write(tmp_path / "other.txt", small_text.read_bytes().replace(b"God", b"Dog"))
    out2, _ = prepare(other, tmp_path / "other", tmp_path / "other-text", {"VOCAB_SIZE": "500", "TOKENS_PER_SAMPLE": "64"})
    for step in printed_steps(out2)[:2]:
        run_printed(step, tmp_path, **{**short, "MAX_UPDATE": "2", "LENGTHS": "64", "TABLE": "0"})
    assert (tmp_path / "checkpoints" / "other_tnn_lm_tiny" / "checkpoint_best.pt").is_file()
    assert (tmp_path / "results" / "other" / "extrapolation.md").is_file()
    assert os.path.isfile(ckpt) and (tmp_path / "results" / "bin" / "extrapolation.md").is_file()

    echo, interactive = (shlex.split(part) for part in steps[2].split(" | "))
    assert echo[0] == "echo" and interactive[0] == ".venv/bin/fairseq-interactive"
    argv = [str(BIN / "fairseq-interactive")] + [str(tmp_path / a) if a.startswith("checkpoints/") else a
                                                 for a in interactive[1:]]
    rc, gen, _ = execute(argv, command_env(), 300, stdin=echo[1] + "\n", merge=True)
    assert rc == 0, gen
    texts = [line.split("\t")[2] for line in gen.splitlines() if line.startswith("D-0\t")]
    assert len(texts) == 1 and texts[0].startswith(echo[1]) and len(texts[0]) > len(echo[1]), gen


@pytest.mark.runs_doc(r'^\.venv/bin/python benchmarks/prepare_corpus\.py ')
def test_the_benchmark_reports_what_the_command_made(tmp_path, small_text):
    """benchmarks/prepare_corpus.py on a small text: its token count is the encoded files', its steps add up to
    the whole, and its prediction scales the text-linear steps by 540 MB over the text's size."""
    import sys

    out = tmp_path / "bench"
    ok([sys.executable, ROOT / "benchmarks" / "prepare_corpus.py", "--text", small_text, "--vocab-size", "600",
        "--workers", "2", "--out", out])
    r = json.loads((out / "prepare-corpus.json").read_text())
    pieces = sum(len(line.split()) for s in SPLITS for line in (out / "text" / f"{s}.bpe").read_text("utf-8").splitlines())
    assert r["tokens"] == pieces and r["lines"] == 1200 and r["vocab_size"] == 600 and r["bytes"] == small_text.stat().st_size
    steps = ("check", "split", "train", "encode", "binarise")
    assert sum(r["seconds"][s] for s in steps) == pytest.approx(r["seconds"]["total"], abs=1.0)
    assert r["predicted_wt103_seconds"]["encode"] == pytest.approx(r["seconds"]["encode"] * 540e6 / r["bytes"])
    assert "| total |" in (out / "prepare-corpus.md").read_text()


# ---------------------------------------------------------------- own text (issue 40), in this process
def prepare_here(capsys, src, dest, text, defaults=True, **knobs):
    """prepare-corpus's entry point in this process, as scripts/prepare-corpus.sh runs it: (exit status, stdout,
    stderr). defaults: a small vocabulary and block (VOCAB_SIZE=300, TOKENS_PER_SAMPLE=64) unless knobs say."""
    from fairseq_tnn.commands import prepare_corpus

    small = {"VOCAB_SIZE": "300", "TOKENS_PER_SAMPLE": "64"} if defaults else {}
    env = {**os.environ, "TEXT_DIR": str(text), **small, "WORKERS": "1", "FAIRSEQ_BIN": str(BIN), **knobs}
    rc = prepare_corpus.main([str(src), str(dest)], "prepare-corpus.sh", env)
    out, err = capsys.readouterr()
    return rc, out, err


def test_an_unreadable_file_is_one_line(tmp_path, capsys, monkeypatch, small_text):
    """open() failing as it fails for a user without read permission (the tests run as root, who may read
    anything): one line naming the file and the reason, exit status 2, nothing written."""
    import builtins

    src = write(tmp_path / "locked.txt", small_text.read_bytes())
    real_open = builtins.open

    def denying_open(file, *args, **kwargs):
        if str(file) == str(src):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", denying_open)
    rc, out, err = prepare_here(capsys, src, tmp_path / "bin", tmp_path / "text")
    assert (rc, out, err) == (2, "", f"prepare-corpus.sh: error: {src}: cannot read it: Permission denied\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["locked.txt"]


def test_a_byte_order_mark_is_dropped_and_every_inputs_sizes_are_printed(tmp_path, capsys):
    """A directory whose three files start with a UTF-8 byte-order mark (as Windows editors write them): no
    vocabulary entry and no token holds it, and fairseq's first line is the text's first line; the sizes of
    each file are printed."""
    lines = (SAMPLE / "train.txt").read_text().splitlines()
    src = tmp_path / "bom"
    for s, part in zip(SPLITS, (lines[:1000], lines[1000:1050], lines[1050:1100])):
        write(src / f"{s}.txt", b"\xef\xbb\xbf" + ("\n".join(part) + "\n").encode())
    dest, text = tmp_path / "bin", tmp_path / "text"
    rc, out, err = prepare_here(capsys, src, dest, text)
    assert rc == 0, err
    assert "\ufeff" not in (dest / "spm.vocab").read_text("utf-8") and "\ufeff" not in (dest / "dict.txt").read_text("utf-8")
    for s in SPLITS:
        assert "\ufeff" not in (text / f"{s}.bpe").read_text("utf-8")
        size = (src / f"{s}.txt").stat().st_size
        n = 1000 if s == "train" else 50
        assert f"{src / f'{s}.txt'}: {n:,} lines, " in err and f" words, {size:,} bytes\n" in err, err
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(dest / "spm.model"))
    assert sp.decode((text / "valid.bpe").read_text("utf-8").splitlines()[0].split()) == lines[1000]


def test_lines_longer_than_sentencepiece_reads_train_it_cut_at_sentence_ends(tmp_path, capsys, small_text):
    """One document per line, each over sentencepiece's limit of 8,192 bytes (its trainer skips such lines, and
    with none left stops on `[!sentences_.empty()]`): the tokenizer learns from them cut at sentence ends, the
    data keep each document as one line, and what happened is said."""
    words = small_text.read_text("utf-8").split()
    docs = [" ".join(words[i:i + 1800]) for i in range(0, 1800 * 16, 1800)]  # about 9,000 bytes each
    assert all(len(d.encode()) > 8192 for d in docs) and all(d.count(". ") > 10 for d in docs)
    src = write(tmp_path / "docs.txt", ("\n".join(docs) + "\n").encode())
    dest, text = tmp_path / "bin", tmp_path / "text"
    rc, out, err = prepare_here(capsys, src, dest, text, VALID_PERCENT="10", TEST_PERCENT="10")
    assert rc == 0, err
    assert "12 lines of the train split are longer than sentencepiece's limit of 8,192 bytes (the longest: line " in err
    assert "its training reads them cut at sentence ends; the data keep them whole" in err
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(dest / "spm.model"))
    valid = (text / "valid.bpe").read_text("utf-8").splitlines()
    assert len(valid) == 2 and [sp.decode(line.split()) for line in valid] == docs[12:14]
    assert sp.get_piece_size() == 300


def test_a_run_stopped_while_binarising_leaves_no_temporary_folder(tmp_path, small_text):
    """SIGTERM while fairseq-preprocess runs: the command removes its folder beside dest and exits 143. Killed
    (SIGKILL: nothing can clean up), the folder stays, and the next run removes it and completes."""
    import signal
    import subprocess
    import time

    fake = tmp_path / "fake-bin"
    fake.mkdir()
    (fake / "fairseq-preprocess").write_text(f'#!/bin/sh\ntouch {tmp_path}/binarising\n'
                                             '[ "$KILL" = 1 ] && kill -9 $PPID\nsleep 60\n')
    (fake / "fairseq-preprocess").chmod(0o755)
    dest, text = tmp_path / "data-bin" / "small", tmp_path / "text"
    env = {**script_env(), "TEXT_DIR": str(text), "VOCAB_SIZE": "600", "TOKENS_PER_SAMPLE": "64",
           "FAIRSEQ_BIN": str(fake)}
    proc = subprocess.Popen(["bash", PREPARE, small_text, dest], env=env, stderr=subprocess.PIPE, text=True)
    while not (tmp_path / "binarising").exists():
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.2)
    assert [p.name.startswith(".small.tmp-") for p in (tmp_path / "data-bin").iterdir()] == [True]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 143
    assert "stopped by SIGTERM" in proc.stderr.read()
    assert list((tmp_path / "data-bin").iterdir()) == []

    rc, _, err = sh(["bash", PREPARE, small_text, dest], {**env, "KILL": "1"})
    assert rc == -9, err  # the process bash became (exec) was killed
    left, = (tmp_path / "data-bin").iterdir()
    assert left.name.startswith(".small.tmp-")
    _, err = prepare(small_text, dest, text, {**env, "FAIRSEQ_BIN": str(BIN)})
    assert f"removed {left}, left by a run that was stopped" in err
    assert [p.name for p in (tmp_path / "data-bin").iterdir()] == ["small"]
