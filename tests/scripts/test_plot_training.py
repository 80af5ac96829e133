"""scripts/plot_training.py: the curves of a real train.sh log (conftest's train_sh_run), fairseq's simple
log format, update times counted once."""
import json
import sys

import pytest

from helpers import SCRIPTS, ok, script_module, sh


@pytest.mark.runs_doc(r'^python scripts/plot_training\.py ')
def test_plot_training_on_the_train_log(train_sh_run, tmp_path):
    out = tmp_path / "fig" / "valid.png"
    log = train_sh_run / "train.log"
    cmd = [sys.executable, SCRIPTS / "plot_training.py", log, log, "--labels", "A", "B", "--out", out]
    ok(cmd)
    import matplotlib.image

    for png in (out, out.with_name("valid-wall.png")):
        assert matplotlib.image.imread(png).shape[:2] == (400, 640)
    rows = (out.with_suffix(".csv")).read_text().splitlines()
    assert rows[0] == "run,log,num_updates,wall_s,loss,ppl" and len(rows) == 5
    points = json.loads(out.with_suffix(".json").read_text())["runs"][0]["points"]
    assert [p["num_updates"] for p in points] == [2, 4] and all(p["wall_s"] is not None for p in points)
    assert points[1]["wall_s"] >= points[0]["wall_s"] and points[1]["ppl"] < points[0]["ppl"] * 1.5
    assert json.loads(out.with_suffix(".json").read_text())["runs"][0]["median_update_ms"] > 0
    before = out.read_bytes()
    rc, _, err = sh(cmd)
    assert rc == 2 and "refusing to overwrite" in err and out.read_bytes() == before


SIMPLE_LOG = """\
2026-11-22 09:02:20 | INFO | train_inner | epoch 001:      1 / 300 update_ms=971.6, loss=12.267, ppl=4929.69, num_updates=1, lr=0.0006, gnorm=1.189, train_wall=1, wall=3
2026-11-22 09:02:20 | INFO | train_inner | epoch 001:      2 / 300 update_ms=237.5, loss=12.106, ppl=4406.88, num_updates=2, lr=0.0012, gnorm=1.323, train_wall=0, wall=4
2026-11-22 09:02:20 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 12.091 | ppl 4361.49 | wps 3431.8 | wpb 511.2 | bsz 8 | num_updates 2
2026-11-22 09:02:21 | INFO | train_inner | epoch 001:      4 / 300 update_ms=466.6, loss=12.063, ppl=4279.81, num_updates=4, lr=0.0024, gnorm=1.317, train_wall=0, wall=5
2026-11-22 09:02:22 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 11.72 | ppl 3373.68 | wps 5543.3 | wpb 511.2 | bsz 8 | num_updates 4 | best_loss 11.72
2026-11-22 09:02:22 | INFO | train | epoch 001 | update_ms 445.4 | loss 12.176 | ppl 4627.81 | num_updates 4 | lr 0.0024 | gnorm 1.248 | train_wall 2 | wall 9
2026-11-22 09:03:00 | INFO | fairseq.trainer | Loaded checkpoint checkpoint_last.pt (epoch 1 @ 2 updates)
2026-11-22 09:03:01 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 11.5 | ppl 2896.31 | num_updates 4
"""


def test_plot_training_parses_the_simple_log_format(tmp_path):
    log = tmp_path / "simple.log"
    log.write_text(SIMPLE_LOG)
    points = script_module("plot_training").parse_log(log)
    # the validation repeated after the resume replaces the first one at update 4; wall from the last train line
    assert points == [{"num_updates": 2, "wall_s": 4.0, "loss": 12.091, "ppl": 4361.49},
                      {"num_updates": 4, "wall_s": 9.0, "loss": 11.5, "ppl": 2896.31}]


def test_plot_training_counts_each_update_time_once(tmp_path):
    """A log whose lines were written twice from epoch 2 on (fairseq 0.12 without the plugin's fix, or a resumed
    run redoing updates): the median update time is over distinct updates, not weighted to later epochs."""
    rec = '{"epoch": %d, "update_ms": "%s", "loss": "9", "num_updates": "%d", "wall": "%d"}'
    lines = [rec % (1, "10.0", u, u) for u in (1, 2, 3)]
    lines += [rec % (2, "50.0", u, u) for u in (4, 5)] * 2
    log = tmp_path / "train.log"
    log.write_text("\n".join(lines) + "\n")
    times = script_module("plot_training").step_times(log)
    assert times == [10.0, 10.0, 10.0, 50.0, 50.0]  # median 10; with the repeats it would be 50
