"""fairseq_tnn/recipe.py, the one module of the training recipes: its presets are fairseq's registered archs, it
runs without torch, fairseq or the plugin installed, and the benchmarks' recipe is the paper's optimizer. The
paper's recipe itself, its knobs and refusals are checked through scripts/train.sh (tests/scripts/test_train_sh.py)."""
import shlex
import subprocess
import sys

import pytest

from fairseq_tnn import recipe
from helpers import ROOT, arch_presets

RECIPE_PY = ROOT / "fairseq_tnn" / "recipe.py"


def test_presets_are_the_registered_archs():
    assert list(recipe.CAUSAL_PRESETS) == arch_presets("tnn_lm")
    assert list(recipe.MASKED_PRESETS) == arch_presets("tnn_mlm")
    assert [recipe.kind(p) for p in recipe.PRESETS] == ["causal"] * 5 + ["masked"] * 7
    with pytest.raises(recipe.RecipeError, match="unknown preset 'tnn_lm'; choose one of: tnn_lm_wt103 "):
        recipe.kind("tnn_lm")


def test_the_command_line_prints_bash_and_errors_exit_2_without_torch():
    """Run as the scripts run it, with -S -I: no site-packages (no torch, no fairseq, no plugin installed)."""
    python = [sys.executable, "-S", "-I", str(RECIPE_PY)]
    out = subprocess.run([*python, "presets"], capture_output=True, text=True, check=True).stdout
    assert out == ("TNN_CAUSAL_PRESETS=" + shlex.quote(" ".join(recipe.CAUSAL_PRESETS)) + "\n"
                   "TNN_MASKED_PRESETS=" + shlex.quote(" ".join(recipe.MASKED_PRESETS)) + "\n")
    proc = subprocess.run([*python, "--prog", "train.sh", "paper", "tnn_lm_wt103", "/d", "/s", "3", "/u"],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == ("train.sh: error: SEQS_PER_UPDATE=128 is not divisible by BATCH_PER_GPU=8 x 3 processes = "
                           "24; change BATCH_PER_GPU or the number of processes\n")


def test_benchmark_recipe_is_the_papers_optimizer():
    """benchmarks/trainer.py's recipe: Qin et al.'s causal optimizer and schedule
    (docs/references.md#published-configurations), the warm-up's initial rate left at fairseq's default."""
    bench = recipe.benchmark("masked", "fd_tnn_mlm_wt103", 2048)
    assert {k: bench.get(k) for k in ("task", "criterion", "arch", "tokens_per_sample", "optimizer", "adam_betas",
                                       "weight_decay", "clip_norm", "lr", "lr_scheduler", "warmup_updates",
                                       "warmup_init_lr")} == {
        "task": "tnn_masked_lm", "criterion": "masked_lm", "arch": "fd_tnn_mlm_wt103", "tokens_per_sample": "2048",
        "optimizer": "adam", "adam_betas": "(0.9, 0.98)", "weight_decay": "0.2", "clip_norm": "1.0", "lr": "5e-4",
        "lr_scheduler": "inverse_sqrt", "warmup_updates": "4000", "warmup_init_lr": None}
    assert recipe.fairseq_options({"a_b": 1, "c": True, "d": None, "e": False}, {"a_b": 2, "f": "x"}) == \
        ["--a-b", 2, "--c", "--f", "x"]
