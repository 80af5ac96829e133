"""scripts/demo.sh, README command 1, shortened: TNN and FD-TNN trained side by side, evaluated and reported."""
import json
import re
import sys

import pytest

from helpers import SCRIPTS, ok, sh


@pytest.mark.runs_doc(r'^bash scripts/demo\.sh$')
@pytest.mark.slow
def test_demo_trains_tnn_and_fd_tnn_side_by_side_and_reports(tmp_path):
    """README command 1, shortened: both models train_sh_run, the Table-1 rows, the extrapolation table and plot,
    the training curves and step times; a second run reuses the finished runs."""
    env = {"WORK": str(tmp_path / "demo"), "MAX_UPDATE": "6", "TOKENS_PER_SAMPLE": "32", "BATCH_SIZE": "4",
           "LENGTHS": "32 64", "WARMUP_UPDATES": "2", "LOG_INTERVAL": "2"}
    out, _ = ok(["bash", SCRIPTS / "demo.sh"], env, timeout=900)
    results = tmp_path / "demo" / "results" / "demo"
    report = json.loads((results / "extrapolation.json").read_text())
    assert [(r["model"], r["length"]) for r in report["results"]] == \
        [(m, L) for m in ("tnn_lm_tiny", "fd_tnn_lm_tiny") for L in (32, 64)]
    assert all(r["evaluated_tokens"] == r["expected_tokens"] for r in report["results"])
    for model in ("tnn_lm_tiny", "fd_tnn_lm_tiny"):
        assert re.search(rf"^\| {model} \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$", out, re.M), out  # table.md
        assert re.search(rf"^  {model}: 1 validations, ppl [0-9.]+ at update 6, [0-9.]+ at update 6; median update time [0-9.]+ ms$",
                         out, re.M), out
        # a sampled continuation of the fixed prompt, as text (sentencepiece-decoded, no pieces)
        assert re.search(rf"^  {model}: And God said unto Moses[^\u2581]*$", out, re.M), out
    for png in ("extrapolation.png", "training.png", "training-wall.png", "kernels/tnn_lm_tiny/layer0.png",
                "kernels/fd_tnn_lm_tiny/layer1.png"):
        assert (results / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((results / "kernels" / "fd_tnn_lm_tiny" / "kernels.json").read_text())["length"] == 32
    # a bad knob: one line, exit 2, before any work
    stamps = {m: (tmp_path / "demo" / "checkpoints" / m / "checkpoint_last.pt").stat().st_mtime_ns
              for m in ("tnn_lm_tiny", "fd_tnn_lm_tiny")}
    rc, again, err = sh(["bash", SCRIPTS / "demo.sh"], {**env, "LENGTHS": "32 0"})
    assert (rc, again) == (2, "") and err == "demo.sh: error: LENGTHS must be positive integers separated by " \
        "spaces, not '32 0'\n", (rc, again, err)
    # a second run reuses both finished runs: checked up to the evaluation, which a knob of the evaluate command
    # (passed through) stops before any work of its own (the steps after the training are the first run's,
    # already checked above)
    rc, again, err = sh(["bash", SCRIPTS / "demo.sh"], {**env, "CONTEXT_WINDOW": "-1"}, timeout=900)
    assert rc == 1 and "evaluate: error: CONTEXT_WINDOW must be a non-negative integer, not '-1'" in err, \
        (rc, again, err[-2000:])
    assert again.count("demo: reusing the finished run") == 2 and "demo: training" not in again, again
    assert stamps == {m: (tmp_path / "demo" / "checkpoints" / m / "checkpoint_last.pt").stat().st_mtime_ns
                      for m in stamps}


def test_demo_help_lists_the_smoke_recipe_from_recipe_py():
    """The demo's defaults are the smoke recipe of fairseq_tnn/recipe.py, stated there once."""
    from fairseq_tnn import recipe

    out, _ = ok([sys.executable, "-m", "fairseq_tnn", "demo", "--help"])
    for knob in ("MAX_UPDATE", "TOKENS_PER_SAMPLE", "LR", "WARMUP_UPDATES", "LOG_INTERVAL"):
        assert f"\n  {knob} [{recipe.SMOKE[knob]}] " in out, (knob, out)
    assert f"\n  BATCH_SIZE [{recipe.SMOKE['SEQS_PER_UPDATE']}] " in out, out


@pytest.mark.parametrize("knob,value,message", [
    ("MODELS", "tnn_lm_tiny tnn_mlm_tiny", "MODELS must be causal presets separated by spaces"),
    ("LR", "fast", "LR must be a positive number, not 'fast'"),
    ("BATCH_SIZE", "0", "BATCH_SIZE must be a positive integer, not '0'"),
    ("FORCE", "yes", "FORCE must be 0 or 1, not 'yes'"),
])
def test_a_bad_knob_is_refused_before_any_work(tmp_path, monkeypatch, capsys, knob, value, message):
    """In-process, as demo.sh hands over: one line naming the knob, exit 2, WORK not even made."""
    from fairseq_tnn.commands import demo

    monkeypatch.setenv("WORK", str(tmp_path / "work"))
    monkeypatch.setenv(knob, value)
    assert demo.main([], "demo.sh") == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"demo.sh: error: {message}") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []
