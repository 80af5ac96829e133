"""scripts/prepare-wikitext-103.sh and scripts/gpt2_bpe_encode.py, offline: failing fast with the files to
place by hand, the dry run's pipeline, GPT-2 BPE round trip, a full run from manually placed files."""
import io
import re
import shlex
import sys
import time
import zipfile

from helpers import SCRIPTS, flags, ok, sh, split_tokens, tiny_gpt2_bpe


def test_prepare_offline_fails_fast_naming_files_and_places(tmp_path):
    env = {"RAW_DIR": str(tmp_path / "raw"), "WIKITEXT_URL": "http://127.0.0.1:9/wikitext-103-raw-v1.zip",
           "GPT2_BPE_URL": "http://127.0.0.1:9/gpt2_bpe", "CONNECT_TIMEOUT": "3"}
    start = time.monotonic()
    rc, out, err = sh(["bash", SCRIPTS / "prepare-wikitext-103.sh", tmp_path / "bin"], env, timeout=60)
    assert rc == 1 and time.monotonic() - start < 20, (rc, err)
    assert "Download these files yourself" in err
    for url, dest in [("http://127.0.0.1:9/wikitext-103-raw-v1.zip", "raw/wikitext-103-raw-v1.zip"),
                      ("http://127.0.0.1:9/gpt2_bpe/encoder.json", "raw/gpt2_bpe/encoder.json"),
                      ("http://127.0.0.1:9/gpt2_bpe/vocab.bpe", "raw/gpt2_bpe/vocab.bpe"),
                      ("http://127.0.0.1:9/gpt2_bpe/dict.txt", "raw/gpt2_bpe/dict.txt")]:
        assert re.search(re.escape(url) + r"\s+-> " + re.escape(str(tmp_path / dest)), err), (url, err)
    assert str(tmp_path / "raw/wikitext-103-raw/wiki.{train,valid,test}.raw") in err
    assert not (tmp_path / "bin").exists() and not list((tmp_path / "raw").rglob("*.part"))


def test_prepare_dry_run_prints_the_pipeline(tmp_path):
    out, _ = ok(["bash", SCRIPTS / "prepare-wikitext-103.sh", tmp_path / "bin"], {"DRY_RUN": "1", "RAW_DIR": str(tmp_path)})
    assert "https://wikitext.smerity.com/wikitext-103-raw-v1.zip" in out
    for f in ("encoder.json", "vocab.bpe", "dict.txt"):
        assert f"https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe/{f}" in out
    assert "gpt2_bpe_encode.py" in out and "--keep-empty" in out
    pre = [shlex.split(line) for line in out.splitlines() if "fairseq-preprocess" in line][0]
    f = flags(pre)
    assert "--only-source" in f and f["--srcdict"] == [str(tmp_path / "gpt2_bpe/dict.txt")]
    assert f["--destdir"] == [str(tmp_path / "bin")] and f["--trainpref"] == [str(tmp_path / "wikitext-103-raw/wiki.train.bpe")]
    assert list(tmp_path.iterdir()) == []


def test_gpt2_bpe_encode_round_trip(tmp_path):
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    encoder = tiny_gpt2_bpe(tmp_path / "bpe")
    src = tmp_path / "in.txt"
    src.write_text(" = The other theme = \n\n the  weather, théâtre!\n")
    ok([sys.executable, SCRIPTS / "gpt2_bpe_encode.py", "--encoder-json", tmp_path / "bpe/encoder.json",
        "--vocab-bpe", tmp_path / "bpe/vocab.bpe", "--inputs", src, src, "--outputs", tmp_path / "keep.bpe",
        tmp_path / "drop.bpe", "--keep-empty", "--workers", "2"])
    keep = (tmp_path / "keep.bpe").read_text().split("\n")
    assert len(keep) == 4 and keep[1] == "" and keep[3] == ""  # the empty line kept, one line per input line
    dec = get_encoder(str(tmp_path / "bpe/encoder.json"), str(tmp_path / "bpe/vocab.bpe"))
    assert dec.decode([int(t) for t in keep[0].split()]) == "= The other theme ="
    assert dec.decode([int(t) for t in keep[2].split()]) == "the  weather, théâtre!"
    assert str(encoder["\u0120the"]) in keep[0].split()  # the merges applied
    ok([sys.executable, SCRIPTS / "gpt2_bpe_encode.py", "--encoder-json", tmp_path / "bpe/encoder.json",
        "--vocab-bpe", tmp_path / "bpe/vocab.bpe", "--inputs", src, "--outputs", tmp_path / "drop.bpe"])
    assert (tmp_path / "drop.bpe").read_text().count("\n") == 2


def test_prepare_runs_offline_from_manually_placed_files(tmp_path):
    raw = tmp_path / "raw"
    tiny_gpt2_bpe(raw / "gpt2_bpe")
    text = {"train": " = Valkyria = \n\n the theme of the other\n", "valid": " the other\n", "test": " there\n\n"}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for split, body in text.items():
            z.writestr(f"wikitext-103-raw/wiki.{split}.raw", body)
    (raw / "wikitext-103-raw-v1.zip").write_bytes(buf.getvalue())
    env = {"RAW_DIR": str(raw), "WIKITEXT_URL": "http://127.0.0.1:9/none.zip", "GPT2_BPE_URL": "http://127.0.0.1:9/x",
           "WORKERS": "1"}
    dest = tmp_path / "bin"
    ok(["bash", SCRIPTS / "prepare-wikitext-103.sh", dest], env)
    for split in text:
        assert (dest / f"{split}.bin").is_file() and (dest / f"{split}.idx").is_file()
        assert (raw / f"wikitext-103-raw/wiki.{split}.bpe").read_text().count("\n") == text[split].count("\n")
    assert (dest / "dict.txt").read_text() == (raw / "gpt2_bpe/dict.txt").read_text()
    assert split_tokens(dest, "train") == sum(len(line.split()) + 1 for line in
                                              (raw / "wikitext-103-raw/wiki.train.bpe").read_text().splitlines())
    # a rerun finds every output and does nothing
    stamp = (dest / "train.bin").stat().st_mtime_ns
    _, err = ok(["bash", SCRIPTS / "prepare-wikitext-103.sh", dest], env)
    assert "already binarised" in err and "BPE files present" in err and (dest / "train.bin").stat().st_mtime_ns == stamp
