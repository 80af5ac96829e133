"""Every command of docs/using-models.md, and the Python example of README.md, run as written, in a directory
laid out as after the demo (data-bin/sample, demo-run/checkpoints/<model>/checkpoint_best.pt,
data/sample/spm.model, .venv, fairseq_tnn, benchmarks), with the session's tiny checkpoints."""
import json
import re
import sys
from pathlib import Path

import pytest

from helpers import ROOT, command_env, doc_blocks, execute

DOC = ROOT / "docs" / "using-models.md"
README = ROOT / "README.md"
VENV = Path(sys.executable).parent.parent


def blocks():
    return re.findall(r"```(bash|python)\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, data_bin, tiny_checkpoints):
    box = tmp_path_factory.mktemp("using-models")
    (box / "data-bin").mkdir()
    (box / "data-bin" / "sample").symlink_to(data_bin)
    (box / "data" / "sample").mkdir(parents=True)
    for name in ("spm.model", "test.txt", "valid.txt"):
        (box / "data" / "sample" / name).symlink_to(ROOT / "data" / "sample" / name)
    (box / "demo-run" / "checkpoints").mkdir(parents=True)
    for arch in ("tnn_lm_tiny", "fd_tnn_lm_tiny"):
        (box / "demo-run" / "checkpoints" / arch).symlink_to(tiny_checkpoints[arch])
    for name, target in (("fairseq_tnn", ROOT / "fairseq_tnn"), ("benchmarks", ROOT / "benchmarks")):
        (box / name).symlink_to(target)
    venv_like(box / ".venv")
    return box


def venv_like(path):
    """The venv the docs' commands name (.venv/bin/fairseq-train ...): the suite's."""
    path.symlink_to(VENV)


def run_block(kind, code, cwd, scripts):
    if kind == "bash":  # in the environment the README says to activate
        cmd = ["bash", "-c", f"source .venv/bin/activate && set -euo pipefail\n{code}"]
    else:  # from a file elsewhere, so that `import fairseq_tnn` finds the installed package, as from the repo root
        script = scripts / f"block{len(list(scripts.iterdir()))}.py"
        script.write_text(code)
        cmd = [sys.executable, str(script)]
    status, out, err = execute(cmd, command_env(), 600, cwd=cwd)
    assert status == 0, f"{kind} block failed:\n{code}\n---\n{out[-3000:]}\n{err[-3000:]}"
    return out  # fairseq logs to stderr


def test_every_example_runs(sandbox, tmp_path):
    found = blocks()
    assert [k for k, _ in found] == ["bash", "bash", "python", "bash", "python", "bash",
                                     "bash", "python", "python", "python"], found
    outs = [run_block(kind, code, sandbox, tmp_path) for kind, code in found]
    interactive, generate, hub, _, fill, bench, export, pretrained, pretrained_fill, finetune = outs
    for out in (interactive, generate):
        texts = dict(re.findall(r"^D-(\d+)\t\S+\t(.*)$", out, re.M))
        assert texts["0"].startswith("And God said") and texts["1"].startswith("In the beginning God created"), out
    lines = hub.splitlines()
    assert lines[0].startswith("And God said") and lines[1].startswith("['And God said")
    assert lines[2].startswith("And God said unto Moses tensor([")
    assert len(re.findall(r"^-?[0-9.]+ The LORD", hub, re.M)) == 3, hub
    assert len(re.findall(r"^0\.\d{3} '.+': The.* of Egypt$", fill, re.M)) == 5, fill
    result = json.loads((sandbox / "results" / "generate-quick" / "generate.json").read_text())
    assert [r["arch"] for r in result["results"]] == ["tnn_lm_tiny", "fd_tnn_lm_tiny"]
    for r in result["results"]:
        assert r["same_tokens"] and not r["uncached_estimated"] and r["speedup"] > 0  # timings: not asserted
        assert r["cache_v_kib_per_token_layer"] == 3 * 64 * 4 / 1024  # d1 = 3 x 64 fp32 values
    for per in result["per_position"].values():
        assert per["cached_positions"] == list(range(16, 64)) and len(per["cached_step_ms"]) == 48
    assert "| tnn_lm_tiny |" in (sandbox / "results" / "generate-quick" / "generate.md").read_text()
    assert (sandbox / "results" / "generate-quick" / "generate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "generate: " in bench
    # Without fairseq: the exports, and the torch-only classes on them (tests/cli/test_export.py checks the figures
    # against fairseq's)
    assert export.split() == ["config.json", "model.safetensors", "spm.model", "vocab.json"], export
    lines = pretrained.splitlines()
    assert re.fullmatch(r"test perplexity [0-9.]+", lines[0]) and 1 < float(lines[0].split()[-1]) < 1888, pretrained
    assert lines[1].startswith("And God said ") and lines[2].startswith("And God said "), pretrained
    assert lines[4].startswith("[") and len(lines[4].split("] [")[1].split(",")) == 5, pretrained
    assert len(re.findall(r"^0\.\d{3} '.+': The.* of Egypt$", pretrained_fill, re.M)) == 5, pretrained_fill
    steps = re.findall(r"^step (\d) loss ([0-9.]+)$", finetune, re.M)
    assert [int(s) for s, _ in steps] == list(range(8)), finetune
    before, after = map(float, re.search(r"lines trained on: ([0-9.]+) before, ([0-9.]+) after", finetune).groups())
    assert after < before, finetune  # 8 steps on the lines scored lower their perplexity


def test_the_readme_example_runs(sandbox, tmp_path):
    found = doc_blocks(README, "python", "## From Python")
    assert len(found) == 1 and len(found[0].strip().splitlines()) == 5, found  # the README shows five lines
    sample, ppl = run_block("python", found[0], sandbox, tmp_path).splitlines()
    # the prompt, continued (the continuation may start with punctuation: "And God said, and ...")
    assert sample.startswith("And God said") and len(sample) > len("And God said") + 2, sample
    assert 1 < float(ppl) < 1888, ppl  # a perplexity, below the uniform one of the sample's 1,888 symbols


def test_benchmark_refuses_to_overwrite(tmp_path):
    (tmp_path / "generate.json").write_text("{}")
    code, log, _ = execute([sys.executable, ROOT / "benchmarks/generate.py", "--quick", "--out", tmp_path],
                           command_env(), 120, merge=True)
    assert code == 2 and "pass --force" in log
