"""scripts/preprocess.sh (data/sample binarised as conftest's data_bin is) and scripts/make_sample_data.sh:
an existing output is kept unless FORCE=1; fairseq is found through FAIRSEQ_BIN alone."""
import shutil

import pytest

from helpers import BIN, ROOT, SCRIPTS, ok, sh


def test_make_sample_data_refuses_to_overwrite_the_corpus():
    before = {p.name: p.read_bytes() for p in (ROOT / "data" / "sample").iterdir()}
    rc, _, err = sh(["bash", SCRIPTS / "make_sample_data.sh"])
    assert rc == 2 and "refusing to overwrite" in err and "FORCE=1" in err, err
    assert {p.name: p.read_bytes() for p in (ROOT / "data" / "sample").iterdir()} == before


def test_preprocess_skips_a_binarised_dir_and_redoes_it_with_force(data_bin, tmp_path):
    """data_bin is `bash scripts/preprocess.sh data/sample <dest>` (conftest): a copy of it is an existing output."""
    dest = tmp_path / "bin"
    shutil.copytree(data_bin, dest)
    env = {"FAIRSEQ_BIN": str(BIN)}
    before = (dest / "train.bin").read_bytes()
    (dest / "train.bin").write_bytes(b"damaged")
    _, err = ok(["bash", SCRIPTS / "preprocess.sh", ROOT / "data" / "sample", dest], env)
    assert "already binarised (FORCE=1 to redo)" in err and (dest / "train.bin").read_bytes() == b"damaged"
    ok(["bash", SCRIPTS / "preprocess.sh", ROOT / "data" / "sample", dest], {**env, "FORCE": "1"})
    assert (dest / "train.bin").read_bytes() == before


@pytest.mark.parametrize("script,args", [("preprocess.sh", ["data/sample", "out"]), ("train.sh", ["tnn_lm_tiny", "x"]),
                                         ("demo.sh", []), ("eval_extrapolation.sh", ["x.pt"])])
def test_the_retired_fairseq_preprocess_is_refused_before_any_work(tmp_path, script, args):
    """FAIRSEQ_PREPROCESS named a binary; every script now finds fairseq-preprocess in FAIRSEQ_BIN, and one set in
    the environment is an error that says so (not a setting silently ignored)."""
    rc, out, err = sh(["bash", SCRIPTS / script, *[str(tmp_path / a) if a == "out" else a for a in args]],
                      {"FAIRSEQ_PREPROCESS": str(tmp_path / "fairseq-preprocess"), "DRY_RUN": "1"})
    assert rc == 2 and out == "", (rc, out, err)
    assert f"{script}: error: FAIRSEQ_PREPROCESS is set" in err and "set FAIRSEQ_BIN" in err, err
    assert list(tmp_path.iterdir()) == []
