"""The benchmark's smoke run: ``benchmarks/run.py --quick`` on tiny sizes writes complete JSON, Markdown and plots."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SECTIONS = {"causal", "bidirectional", "rpe", "layer"}


def test_quick_benchmark_writes_json_markdown_and_plots(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/run.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]

    result = json.loads((out / "results.json").read_text())
    meta = result["meta"]
    assert meta["malloc"] == "MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736"  # set by the re-exec
    assert {g["section"] for g in result["groups"]} == SECTIONS
    for g in result["groups"]:
        configs = g["configs"]
        assert configs[0]["is_baseline"]
        assert len({c["label"] for c in configs}) == len(configs)
        for c in configs:
            for field in ("wall_ms", "user_ms", "sys_ms", "paired_speedup"):
                st = c[field]
                assert st["min"] <= st["q1"] <= st["median"] <= st["q3"] <= st["max"]
                assert len(st["all"]) == meta["sizes"]["rounds"]
            assert c["wall_ms"]["median"] > 0
            if g["section"] != "rpe":  # every other configuration got a fresh process for its memory
                mem = c["memory"]
                assert mem["tensor_peak_mib"] >= mem["step_peak_mib"] > 0
                assert mem["tensor_peak_mib"] >= mem["resting_mib"] > 0
    keys = {(g["section"], c["key"]) for g in result["groups"] for c in g["configs"]}
    assert {("causal", "transformer"), ("causal", "fd3"), ("bidirectional", "ski"), ("causal", "bound_fixed"),
            ("layer", "floor"), ("layer", "ski_causal_cumsum"), ("layer", "ski_causal_local")} <= keys
    rpe = next(g for g in result["groups"] if g["section"] == "rpe")
    assert sorted(c["rpe_layers"] for c in rpe["configs"]) == sorted(2 * list(range(1, 7)))
    # the tiny sizes cover none of the target lengths, so no target is evaluated
    assert result["targets"] == []

    md = (out / "results.md").read_text()
    for title in ("## Causal LM, whole training step", "## Masked LM, whole training step",
                  "## RPE depth sweep", "## One TNO layer alone"):
        assert title in md
    assert "| n | batch | configuration |" in md and "transformer_lm" in md and "SKI-TNN" in md
    assert md.count("\n| ") > 40  # table rows
    for name in ("causal.png", "bidirectional.png", "rpe.png", "layer.png"):
        png = out / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert str(png) in result["plots"]

    # a second run into the same directory refuses before any work, leaving the results as they were
    before = (out / "results.json").read_bytes()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/run.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 2 and "refusing to overwrite" in proc.stdout, proc.stdout[-2000:]
    assert (out / "results.json").read_bytes() == before


def test_trainer_benchmark_through_fairseqs_trainer_eager_and_compiled(tmp_path):
    """``run.py --device cpu --quick``: whole updates through fairseq's Trainer, every configuration eager and
    compiled, with kernel (here: operator) time and counts, ratios against TNN, JSON, Markdown and a plot."""
    out = tmp_path / "trainer"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/run.py"), "--device", "cpu", "--quick", "--out", str(out)],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    result = json.loads((out / "trainer.json").read_text())
    assert result["meta"]["device"] == "cpu" and result["meta"]["precision"] == "fp32"
    assert [(g["section"], g["batch"], g["n"]) for g in result["groups"]] == [("causal", 2, 32), ("masked", 2, 32)]
    for g in result["groups"]:
        keys = {(c["key"], c["compiled"]) for c in g["configs"]}
        assert {(k, m) for k, _ in keys for m in (False, True)} == keys  # every configuration in both modes
        for c in g["configs"]:
            assert len(c["ms"]) == result["meta"]["rounds"] * result["meta"]["per_round"]
            assert c["median_ms"] > 0 and c["kernel_ms"] > 0 and c["kernels"] > 0
            assert c["wall_over_kernel"] == c["median_ms"] / c["kernel_ms"]
    assert {("causal", "fd3", "tnn6"), ("masked", "ski", "tnn6"), ("masked", "bound_identity", "tnn6")} <= \
        {(r["section"], r["key"], r["base"]) for r in result["ratios"]}
    md = (out / "trainer.md").read_text()
    assert "| causal | 2 x 32 | FD-TNN (RPE 3) compiled |" in md and "## Ratios against TNN" in md
    assert (out / "trainer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/run.py"), "--device", "cpu", "--quick", "--out", str(out)],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 2 and "refusing to overwrite" in proc.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present: --device cuda would run")
def test_trainer_benchmark_refuses_cuda_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/run.py"), "--device", "cuda", "--out", str(tmp_path)],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 2 and "--device cuda: no CUDA device" in proc.stdout
