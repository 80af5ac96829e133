"""scripts/eval_extrapolation.sh (the evaluate command, fairseq_tnn/commands/evaluate.py) and its report
(fairseq_tnn/commands/extrapolation_report.py) on the checkpoints of a real train.sh run (conftest's
train_sh_run): every test token scored at every length, the report and Table-1 layout, refusals, the dry run's
commands, the training length read from the checkpoints, the knobs' checks and --help."""
import json
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from fairseq_tnn.commands import evaluate, extrapolation_report
from helpers import SCRIPTS, USER_DIR, cli, flags, ok, sh, split_tokens


@pytest.fixture(scope="module")
def extrapolation(train_sh_run, data_bin, tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    # TRAIN_TOKENS and TABLE_TOKENS unset: both are the training length, read from the checkpoint (64)
    env = {"DATA": str(data_bin), "LENGTHS": "64 128 512", "CPU": "1",
           "NUM_WORKERS": "0", "RESULTS_ROOT": str(results), "NAME": "tiny"}
    out, err = ok(["bash", SCRIPTS / "eval_extrapolation.sh", train_sh_run / "checkpoint_last.pt"], env)
    return results / "tiny", env, out, err


def test_eval_extrapolation_scores_every_token_at_every_length(extrapolation, train_sh_run, data_bin):
    out_dir, _, out, err = extrapolation
    assert "trained at 64 tokens (the checkpoints' tokens_per_sample): TRAIN_TOKENS=64 TABLE_TOKENS=64" in err
    report = json.loads((out_dir / "extrapolation.json").read_text())
    assert report["train_length"] == 64 and "trained at 64." in (out_dir / "extrapolation.md").read_text()
    rows = report["results"]
    assert [(r["model"], r["length"]) for r in rows] == [("tnn_lm_tiny", L) for L in (64, 128, 512)]
    tokens = split_tokens(data_bin, "test")
    for r in rows:
        assert set(r) >= {"model", "checkpoint", "length", "loss", "ppl", "evaluated_tokens", "expected_tokens"}
        assert r["evaluated_tokens"] == r["expected_tokens"] == tokens
        assert r["checkpoint"] == str(train_sh_run / "checkpoint_last.pt")
        assert 1 < r["ppl"] < 5000 and abs(2 ** r["loss"] - r["ppl"]) < 0.01 * r["ppl"]
        assert f"Evaluated {tokens:,} tokens" in Path(r["log"]).read_text()
    md = (out_dir / "extrapolation.md").read_text()
    table_rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    assert len(table_rows) == 1 and table_rows[0].startswith("| tnn_lm_tiny |")
    assert "| model | 64 | 128 | 512 |" in md and md.strip() in out
    # the Table-1 layout: val ppl, test ppl, params (M); the test cell is the evaluation at the training length
    t1 = report["table"][0]
    assert t1["model"] == "tnn_lm_tiny" and t1["params"] > 0 and t1["test_ppl"] == rows[0]["ppl"]
    assert f"| tnn_lm_tiny | {t1['valid_ppl']:.2f} | {t1['test_ppl']:.2f} | {t1['params'] / 1e6:.2f} |" in \
        (out_dir / "table.md").read_text()
    import matplotlib.image

    png = matplotlib.image.imread(out_dir / "extrapolation.png")
    assert png.shape[:2] == (400, 640) and png.std() > 0.01


def test_eval_extrapolation_refuses_existing_results(extrapolation, train_sh_run):
    out_dir, env, _, _ = extrapolation
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out_dir.iterdir() if p.is_file()}
    rc, out, err = sh(["bash", SCRIPTS / "eval_extrapolation.sh", train_sh_run / "checkpoint_last.pt"], env)
    assert rc == 2 and "refusing to overwrite" in err and "FORCE=1" in err, (rc, out, err)
    assert "fairseq-eval-lm" not in err
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out_dir.iterdir() if p.is_file()}
    assert after == before


def test_eval_extrapolation_dry_run_commands(train_sh_run, data_bin, tmp_path):
    env = {"DRY_RUN": "1", "DATA": str(data_bin), "RESULTS_ROOT": str(tmp_path)}
    out, _ = ok(["bash", SCRIPTS / "eval_extrapolation.sh", f"TNN={train_sh_run / 'checkpoint_best.pt'}"], env)
    evals = [shlex.split(line) for line in out.splitlines() if line.startswith(cli("fairseq-eval-lm"))]
    # 6 lengths on test, plus the table at the training length read from the checkpoint (64): valid and test
    assert [(flags(e)["--gen-subset"][0], int(flags(e)["--tokens-per-sample"][0])) for e in evals] == \
        [("test", L) for L in (512, 1024, 2048, 4096, 8192, 14336)] + [("valid", 64), ("test", 64)]
    assert "--train-length 64" in out.splitlines()[-1]
    for e in evals:
        f = flags(e[1:])
        assert e[1] == str(data_bin) and f["--user-dir"] == [USER_DIR] and f["--task"] == ["tnn_language_modeling"]
        assert f["--sample-break-mode"] == ["none"] and f["--context-window"] == ["0"] and f["--batch-size"] == ["1"]
        assert f["--max-tokens"] == f["--tokens-per-sample"] and f["--path"] == [str(train_sh_run / "checkpoint_best.pt")]
    assert " -m fairseq_tnn.commands.extrapolation_report " in out.splitlines()[-1]
    assert not (tmp_path / "extrapolation").exists()


def test_eval_extrapolation_training_length_from_checkpoints(train_sh_run, data_bin, tmp_path):
    """Checkpoints trained at different lengths: an error listing them unless both lengths are set; set
    ones win over the checkpoint."""
    import torch

    other = tmp_path / "other.pt"
    state = torch.load(train_sh_run / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    state["cfg"]["task"]["tokens_per_sample"] = 128
    torch.save(state, other)
    env = {"DRY_RUN": "1", "DATA": str(data_bin), "RESULTS_ROOT": str(tmp_path)}
    args = ["bash", SCRIPTS / "eval_extrapolation.sh", f"A={train_sh_run / 'checkpoint_last.pt'}", f"B={other}"]
    rc, out, err = sh(args, env)
    assert rc == 2 and "trained at different lengths" in err and "tokens_per_sample 64" in err \
        and "tokens_per_sample 128" in err and "TRAIN_TOKENS" in err and out == "", (rc, out, err)
    rc, out, err = sh(args, {**env, "TRAIN_TOKENS": "128"})  # TABLE_TOKENS still unknown
    assert rc == 2 and "trained at different lengths" in err
    out, _ = ok(args, {**env, "TRAIN_TOKENS": "100", "TABLE_TOKENS": "96"})
    assert "--train-length 100" in out and "--table-tokens 96" in out


def test_report_one_row_per_model_and_refuses_incomplete(extrapolation, data_bin, tmp_path, capsys):
    src, *_ = extrapolation
    report = extrapolation_report
    out_dir = tmp_path / "two"
    for label in ("TNN", "FD-TNN"):
        shutil.copytree(src / "raw" / "tnn_lm_tiny", out_dir / "raw" / label)
    args = ["--data", str(data_bin), "--lengths", "64", "128", "512", "--table-tokens", "64"]
    assert report.main(["--out-dir", str(out_dir), *args, "--models", "TNN=a.pt", "FD-TNN=b.pt"]) == 0
    md = (out_dir / "extrapolation.md").read_text()
    assert [line.split(" |")[0] for line in md.splitlines() if line.startswith("| ") and "---" not in line] == \
        ["| model", "| TNN", "| FD-TNN"]
    assert len([line for line in (out_dir / "table.md").read_text().splitlines() if line.startswith("| ")]) == 3
    # a short token count (an evaluation that skipped blocks) or a missing log is an error, and nothing is written
    bad = tmp_path / "bad"
    shutil.copytree(src / "raw" / "tnn_lm_tiny", bad / "raw" / "TNN")
    log = bad / "raw" / "TNN" / "test.L128.cw0.log"
    log.write_text(re.sub(r"Evaluated [0-9,]+ tokens", "Evaluated 1,000 tokens", log.read_text()))
    (bad / "raw" / "TNN" / "test.L64.cw0.log").unlink()
    capsys.readouterr()
    assert report.main(["--out-dir", str(bad), *args, "--models", "TNN=a.pt"]) == 1
    err = capsys.readouterr().err
    assert "extrapolation_report: error: incomplete evaluations, nothing written" in err, err
    assert "scored 1000 of" in err and "no complete fairseq-eval-lm log for test at L=64" in err, err
    assert not (bad / "extrapolation.json").exists()


@pytest.mark.parametrize("knob,value,message", [
    ("LENGTHS", "64 0", "LENGTHS must be positive integers separated by spaces, not '64 0'"),
    ("TABLE", "yes", "TABLE must be 0 or 1, not 'yes'"),
    ("TABLE_TOKENS", "-5", "TABLE_TOKENS must be a positive integer, not '-5'"),
    ("CONTEXT_WINDOW", "-1", "CONTEXT_WINDOW must be a non-negative integer, not '-1'"),
    ("NAME", "a/b", "NAME must be letters, digits, '.', '_' or '-', not 'a/b'"),
    ("EXTRA_ARGS", "--x 'y", "EXTRA_ARGS must be words a shell can split (balanced quotes), not '--x 'y'"),
    ("FORCE", "2", "FORCE must be 0 or 1, not '2'"),
])
def test_a_bad_knob_is_one_line_before_any_work(train_sh_run, data_bin, tmp_path, monkeypatch, capsys, knob, value,
                                                message):
    """In-process, as the script hands over: one line naming the knob, its value and what is allowed; exit 2."""
    for name, v in {"DATA": str(data_bin), "RESULTS_ROOT": str(tmp_path), knob: value}.items():
        monkeypatch.setenv(name, v)
    assert evaluate.main([str(train_sh_run / "checkpoint_last.pt")], "eval_extrapolation.sh") == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"eval_extrapolation.sh: error: {message}\n")
    assert list(tmp_path.iterdir()) == []


def test_help_lists_every_knob_with_its_default():
    out, _ = ok([sys.executable, "-m", "fairseq_tnn", "evaluate", "--help"])
    assert out.startswith("usage: python -m fairseq_tnn evaluate [label=]<checkpoint.pt>...\n"), out
    for knob in evaluate.KNOBS:
        assert re.search(rf"^  {knob.name} \[{re.escape(knob.default)}\]", out, re.M), (knob.name, out)
    out, _ = ok(["bash", SCRIPTS / "slurm" / "extrapolation.sbatch", "--help"])
    assert out.startswith("usage: sbatch scripts/slurm/extrapolation.sbatch ") and "SLURM_ARRAY_TASK_ID" in out
