"""fairseq_tnn/recipe.py, the one module of the training recipes: its presets are fairseq's registered archs, it
and the train command run without torch, fairseq or the plugin installed, the knobs' help comes from their
declarations, and the benchmarks' recipe is the paper's optimizer. The paper's recipe itself, its knobs and
refusals are checked through scripts/train.sh (tests/scripts/test_train_sh.py)."""
import subprocess
import sys

import pytest

from fairseq_tnn import recipe
from helpers import ROOT, arch_presets

def test_presets_are_the_registered_archs():
    assert list(recipe.CAUSAL_PRESETS) == arch_presets("tnn_lm")
    assert list(recipe.MASKED_PRESETS) == arch_presets("tnn_mlm")
    assert [recipe.kind(p) for p in recipe.PRESETS] == ["causal"] * 5 + ["masked"] * 7
    with pytest.raises(recipe.RecipeError, match="unknown preset 'tnn_lm'; choose one of: tnn_lm_wt103 "):
        recipe.kind("tnn_lm")


def test_the_entry_point_needs_no_torch_and_errors_exit_2(data_bin):
    """The train command as the scripts run it, but with -S -I: no site-packages (no torch, no fairseq, no plugin
    installed); a knob's error is one line, exit status 2."""
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from fairseq_tnn.commands import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-S", "-I", "-c", code, "--prog", "train.sh", "train", "tnn_lm_wt103",
                           str(data_bin)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "NPROC": "3", "DRY_RUN": "1"})
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == ("train.sh: error: SEQS_PER_UPDATE=128 is not divisible by BATCH_PER_GPU=8 x 3 processes = "
                           "24; change BATCH_PER_GPU or the number of processes\n")


def test_help_lists_every_knob_from_its_declaration(capsys):
    """`python -m fairseq_tnn train --help` (the scripts' headers point there): every knob, in the order read,
    with the default it is declared with."""
    from fairseq_tnn.commands import main, train
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m fairseq_tnn train <preset> <data-bin> ")
    knobs = [*recipe.KNOBS, *train.TRAIN_KNOBS, *train.RUN_KNOBS]
    lines = [line for line in out.splitlines() if line.startswith("  ")]
    assert [line.split()[0] for line in lines[:len(knobs)]] == [k.name for k in knobs]
    for line in ("  MAX_UPDATE [50000] ", "  SEQS_PER_UPDATE [128 causal, 512 masked] ", "  CPU [0] ",
                 "  NNODES [1] ", "  MASTER_ADDR [127.0.0.1 when NNODES=1, required otherwise] "):
        assert line in out, line
    assert main(["slurm-train", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m fairseq_tnn slurm-train <preset> ") and "  PORT [10000 + job id" in out
    assert "NPROC" not in out  # the allocation decides


def test_benchmark_recipe_is_the_papers_optimizer():
    """benchmarks/trainer.py's recipe: Qin et al.'s causal optimizer and schedule
    (docs/references.md#published-configurations), the warm-up's initial rate left at fairseq's default."""
    bench = recipe.benchmark("masked", "fd_tnn_mlm_wt103", 2048)
    assert {k: bench.get(k) for k in ("task", "criterion", "arch", "tokens_per_sample", "optimizer", "adam_betas",
                                       "weight_decay", "clip_norm", "lr", "lr_scheduler", "warmup_updates",
                                       "warmup_init_lr")} == {
        "task": "tnn_masked_lm", "criterion": "tnn_masked_lm", "arch": "fd_tnn_mlm_wt103", "tokens_per_sample": "2048",
        "optimizer": "adam", "adam_betas": "(0.9, 0.98)", "weight_decay": "0.2", "clip_norm": "1.0", "lr": "5e-4",
        "lr_scheduler": "inverse_sqrt", "warmup_updates": "4000", "warmup_init_lr": None}
    assert recipe.fairseq_options({"a_b": 1, "c": True, "d": None, "e": False}, {"a_b": 2, "f": "x"}) == \
        ["--a-b", 2, "--c", "--f", "x"]
