"""benchmarks/quality.py (training TNN, FD-TNN and SKI-TNN side by side through fairseq-train) and
benchmarks/ski_diagnostics.py (the scales behind SKI-TNN's --ski-lowrank default), at toy sizes."""
import json
import sys

import pytest

from benchmarks.ski_diagnostics import init_and_step
from helpers import ROOT, command_env, execute, run


def test_the_default_low_rank_starts_below_the_band_and_sum_above_it():
    """What the diagnostics found (docs/design.md): at n = 512 with the paper's settings and the band's N(0, 1)
    taps, 'sum' starts with a low-rank output 0.63 of the band's (4.6 times it with the U(+-m^-1/2) taps of
    before), 'mean' at 0.04 of it."""
    mean, total = init_and_step("mean", 512, 96), init_and_step("sum", 512, 96)
    assert 0.02 < mean["lowrank_rms"] / mean["band_rms"] < 0.08
    assert 0.45 < total["lowrank_rms"] / total["band_rms"] < 0.85
    # an Adam step moves the 'sum' low rank more than the band, the 'mean' one less
    assert total["step_lowrank_rms"] > 2 * total["step_band_rms"] and mean["step_lowrank_rms"] < mean["step_band_rms"]




@pytest.mark.runs_doc(r'^python benchmarks/ski_diagnostics\.py ')
def test_diagnostics_command_writes_its_tables(tmp_path):
    out = tmp_path / "diag"
    run([sys.executable, ROOT / "benchmarks/ski_diagnostics.py", "--n", "64", "--dim", "8", "--out", out])
    result = json.loads((out / "ski-diagnostics.json").read_text())
    assert [(s["mode"], s["n"]) for s in result["scales"]] == [("sum", 64), ("mean", 64)]
    assert [w["n"] for w in result["warp"]] == [64, 512, 2048, 14336]
    assert all(0 < w["reached"] <= 64 for w in result["warp"])
    assert "| mean | 64 |" in (out / "ski-diagnostics.md").read_text()
    code, _, err = execute([sys.executable, ROOT / "benchmarks/ski_diagnostics.py", "--out", out], command_env(), 300)
    assert code == 2 and "refusing to overwrite" in err


@pytest.mark.runs_doc(r'^python benchmarks/quality\.py ')
@pytest.mark.slow
def test_quality_quick_trains_every_model_through_fairseq(tmp_path):
    out = tmp_path / "q"
    run([sys.executable, ROOT / "benchmarks/quality.py", "--quick", "--out", out])
    result = json.loads((out / "quality.json").read_text())
    runs = {(r["section"], r["key"]): r for r in result["runs"]}
    assert set(runs) == {("masked", "tnn3"), ("masked", "ski"), ("masked", "ski_band"), ("causal", "fd")}
    for r in runs.values():
        assert r["returncode"] == 0 and r["seed"] == 1
        assert [u for u, _ in r["curve"]] == [4, 8] and all(p > 1 for _, p in r["curve"])
    # the SKI run's checkpoints were read back: both parts measured in its one layer at each validation
    scales = runs[("masked", "ski")]["ski_scales"]
    assert [s["update"] for s in scales] == [4, 8]
    assert all(len(s["band_rms"]) == 1 and s["band_rms"][0] > 0 and s["lowrank_rms"][0] > 0 for s in scales)
    assert {t["target"] for t in result["targets"]} == {"SKI-TNN at least as good as its band alone",
                                                        "SKI-TNN at least as good as its band alone, at 128 tokens",
                                                        "SKI-TNN within 5% of TNN (RPE 3)"}
    # the masked runs scored by fairseq-validate at 1 and 2 times their training length (64 tokens)
    for key in ("tnn3", "ski", "ski_band"):
        lengths = runs[("masked", key)]["lengths"]
        assert sorted(lengths, key=int) == ["64", "128"] and all(1 < p < 1e5 for p in lengths.values())
    assert "lengths" not in runs[("causal", "fd")]
    md = (out / "quality.md").read_text()
    assert "| SKI-TNN's band alone (m 17) |" in md and "low rank / band" in md and "| ski | " in md
    assert "Against length" in md
    assert (out / "quality.png").stat().st_size > 10000
    # again into the same --out: refused without --force; with it, every finished run is reused, not retrained
    code, _, err = execute([sys.executable, ROOT / "benchmarks/quality.py", "--quick", "--out", out], command_env(), 300)
    assert code == 2 and "refusing to overwrite" in err
    log = run([sys.executable, ROOT / "benchmarks/quality.py", "--quick", "--out", out, "--force"])
    assert log.count("(reused)") == 4
    again = json.loads((out / "quality.json").read_text())
    assert again["table"] == result["table"] and all(r["reused"] for r in again["runs"])


@pytest.mark.parametrize("argv,message", [
    (["--models", "masked/transformer"], "--models: 'masked/transformer' is not a model of this benchmark"),
    (["--updates", "0"], "--updates=0 is invalid"),
    (["--seeds", "1", "1"], "--seeds=[1, 1] is invalid"),
    (["--length-factors", "0", "2"], "--length-factors=[0, 2] is invalid"),
    (["--data", "/nonexistent"], "--data=/nonexistent is invalid: it has no train.bpe, valid.bpe"),
])
def test_quality_refuses_bad_options_before_any_work(tmp_path, argv, message):
    out = tmp_path / "q"
    code, _, err = execute([sys.executable, ROOT / "benchmarks/quality.py", *argv, "--out", out], command_env(), 300)
    assert code == 2 and message in err, err
    assert not out.exists()
