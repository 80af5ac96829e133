"""fairseq_tnn/recipe.py, the one module of the training recipes: its presets are fairseq's registered archs, the
paper's recipe has the published values and refuses bad knobs with scripts/train.sh's errors, the shell scripts
read it (train.sh's command is paper()'s), it runs without torch, fairseq or the plugin installed, and
configs/tnn_lm_sample.yaml says what its SAMPLE recipe says."""
import shlex
import subprocess
import sys

import pytest
import yaml

from fairseq_tnn import recipe
from helpers import ROOT, SCRIPTS, arch_presets, ok, sh

RECIPE_PY = ROOT / "fairseq_tnn" / "recipe.py"


def options(args):
    """'--a 1 --b --c x' -> {'--a': '1', '--b': True, '--c': 'x'} (each option once)."""
    out = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            assert a not in out, f"{a} twice in {args}"
            nxt = args[i + 1] if i + 1 < len(args) else "--"
            out[a] = True if nxt.startswith("--") else nxt
    return out


def plain(value):
    """A config value comparable across yaml and fairseq's config: lists as lists, numbers (1e-07 is text to yaml)
    as floats."""
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        try:
            return float(value)
        except (TypeError, ValueError):
            return value
    return [plain(v) for v in value]


def test_presets_are_the_registered_archs():
    assert list(recipe.CAUSAL_PRESETS) == arch_presets("tnn_lm")
    assert list(recipe.MASKED_PRESETS) == arch_presets("tnn_mlm")
    assert [recipe.kind(p) for p in recipe.PRESETS] == ["causal"] * 5 + ["masked"] * 7
    with pytest.raises(recipe.RecipeError, match="unknown preset 'tnn_lm'; choose one of: tnn_lm_wt103 "):
        recipe.kind("tnn_lm")


@pytest.mark.parametrize("preset,world,update_freq", [("tnn_lm_wt103", 8, 2), ("fd_tnn_lm_wt103", 1, 16),
                                                      ("tnn_mlm_wt103", 8, 4), ("fd_tnn_mlm_wt103", 2, 16)])
def test_paper_recipe_has_the_published_values(preset, world, update_freq):
    """Qin et al.'s recipe (docs/references.md#published-configurations), FD-TNN's rate from Moreno et al."""
    p = recipe.paper(preset, "/data", "/runs/x", world, env={})
    causal = p.kind == "causal"
    assert p.update_freq == update_freq and p.args[0] == "/data"
    o = options(p.args[1:])
    expect = {"--arch": preset, "--optimizer": "adam", "--adam-betas": "(0.9, 0.98)", "--weight-decay": "0.2",
              "--clip-norm": "1.0", "--lr": "1e-3" if preset.startswith("fd_") else "5e-4",
              "--tokens-per-sample": "512", "--batch-size": "8" if causal else "16", "--update-freq": str(update_freq),
              "--max-update": "50000", "--fp16": True, "--tnn-compile": True, "--seed": "1",
              "--save-dir": "/runs/x", "--log-file": "/runs/x/train.log", "--user-dir": recipe.USER_DIR}
    if causal:
        expect.update({"--task": "tnn_language_modeling", "--sample-break-mode": "none", "--lr-scheduler": "inverse_sqrt",
                       "--warmup-updates": "4000", "--warmup-init-lr": "1e-07"})
    else:
        expect.update({"--task": "tnn_masked_lm", "--sample-break-mode": "complete", "--adam-eps": "1e-06",
                       "--lr-scheduler": "polynomial_decay", "--warmup-updates": "3000", "--total-num-update": "50000",
                       "--oversized-blocks": "drop", "--skip-invalid-size-inputs-valid-test": True})
    assert {k: o.get(k) for k in expect} == expect
    assert int(o["--batch-size"]) * update_freq * world == (128 if causal else 512)  # sequences per update
    assert "--cpu" not in o


def test_paper_recipe_knobs():
    env = {"CPU": "1", "PRECISION": "bf16", "TNN_COMPILE": "strict", "MAX_UPDATE": "7", "LR": "", "SEED": "3",
           "SEQS_PER_UPDATE": "8", "BATCH_PER_GPU": "2", "OVERSIZED": "error"}
    p = recipe.paper("ski_tnn_mlm_tiny", "/d", "/s", 2, env=env)
    o = options(p.args[1:])
    assert p.update_freq == 2 and o["--max-update"] == o["--total-num-update"] == "7" and o["--seed"] == "3"
    assert o["--lr"] == "5e-4"  # an empty knob is its default
    assert o["--bf16-autocast"] is True and o["--tnn-compile"] == "strict" and o["--cpu"] is True
    assert o["--oversized-blocks"] == "error" and "--fp16" not in o
    assert "--tnn-compile" not in options(recipe.paper("tnn_lm_tiny", "/d", "/s", env={"CPU": "1"}).args)


@pytest.mark.parametrize("env,world,message", [
    ({}, 3, "SEQS_PER_UPDATE=128 is not divisible by BATCH_PER_GPU=8 x 3 processes = 24; change BATCH_PER_GPU"),
    ({"BATCH_PER_GPU": "0"}, 1, "SEQS_PER_UPDATE (128), BATCH_PER_GPU (0) and the number of processes (1) must be"),
    ({}, "x", "the number of processes (x) must be positive integers"),
    ({"PRECISION": "fp8"}, 1, "PRECISION must be fp16, bf16 or fp32, not 'fp8'"),
    ({"TNN_COMPILE": "yes"}, 1, "TNN_COMPILE must be 0 or 1 (--tnn-compile), or strict (--tnn-compile strict), not 'yes'"),
    ({"CPU": "1", "PRECISION": "fp16"}, 1, "CPU=1 trains in fp32 or bf16 (PRECISION=fp32 or bf16), not fp16"),
    ({"CPU": "yes"}, 1, "CPU must be 0 (train on GPUs) or 1 (train on the CPU), not 'yes'"),
    ({"OVERSIZED": "maybe", "BATCH_PER_GPU": "0"}, 1, "OVERSIZED must be drop or error, not 'maybe'"),  # first
])
def test_paper_recipe_refuses_bad_knobs(env, world, message):
    with pytest.raises(recipe.RecipeError) as e:
        recipe.paper("tnn_lm_wt103", "/d", "/s", world, env=env)
    assert message in str(e.value)


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


@pytest.mark.parametrize("preset,env", [("fd_tnn_lm_wt103", {"NPROC": "1"}),
                                        ("ski_tnn_mlm_tiny", {"NPROC": "1", "CPU": "1", "MAX_UPDATE": "9", "LR": "0.01"})])
def test_train_sh_runs_the_module_recipe(tmp_path, preset, env):
    """scripts/recipe.sh reads the recipe from the module: train.sh's dry run is fairseq-train and paper()'s args."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "dict.txt").touch()
    out, _ = ok(["bash", SCRIPTS / "train.sh", preset, data], {"DRY_RUN": "1", "SAVE_ROOT": str(tmp_path), **env})
    argv = shlex.split(out)
    p = recipe.paper(preset, str(data), str(tmp_path / preset), 1, env=env, user_dir=str(ROOT / "fairseq_tnn"))
    assert argv[1:] == [*p.args, "--distributed-world-size", "1"]


def test_gpu_check_flags_are_shorthands_for_its_environment_knobs(tmp_path):
    """The same refusals from LIMITS / ONLY / OUT as from --limit / --only / --out, before any work."""
    for env, message in (({"LIMITS": "tests=soon"}, "LIMITS / --limit 'tests=soon' is invalid: must be PART=SECONDS"),
                         ({"ONLY": "tests,bench"}, "ONLY / --only 'tests,bench': unknown part 'bench'"),
                         ({"QUICK": "yes"}, "QUICK must be 0 or 1 (--quick sets 1), not 'yes'")):
        rc, out, err = sh(["bash", SCRIPTS / "gpu_check.sh", "--cpu"], {"OUT": str(tmp_path / "new"), **env})
        assert rc == 2 and message in err and out == "", (env, err)
    (tmp_path / "old").mkdir()
    rc, _, err = sh(["bash", SCRIPTS / "gpu_check.sh"], {"OUT": str(tmp_path / "old"), "CPU": "1"})
    assert rc == 2 and f"--out {tmp_path / 'old'} already exists" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]


def test_benchmark_and_test_recipes():
    bench = recipe.benchmark("masked", "fd_tnn_mlm_wt103", 2048)
    assert bench["task"] == "tnn_masked_lm" and bench["criterion"] == "masked_lm" and bench["tokens_per_sample"] == "2048"
    for key, value in {**recipe.ADAM, **recipe.PAPER_REGULARISATION, "lr": "5e-4", "warmup_updates": "4000"}.items():
        assert bench[key] == value, key  # the paper's optimizer
    assert recipe.fairseq_options({"a_b": 1, "c": True, "d": None, "e": False}, {"a_b": 2, "f": "x"}) == \
        ["--a-b", 2, "--c", "--f", "x"]
    causal = dict(recipe.TEST_CAUSAL, **recipe.NO_LR_SCHEDULE)
    assert "--lr-scheduler" not in recipe.fairseq_options(causal) and "--adam-betas" not in recipe.fairseq_options(causal)


def test_sample_yaml_is_the_sample_recipe():
    """configs/tnn_lm_sample.yaml (fairseq-hydra-train, which cannot import the module) and recipe.SAMPLE agree both
    ways: every field the yaml sets is what fairseq's parser makes of SAMPLE, and every option of SAMPLE is in the yaml."""
    from fairseq import options as fairseq_cli_options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    import fairseq_tnn
    fairseq_tnn.register()  # this process imported the package (recipe) before fairseq reads --user-dir
    argv = ["data", "--user-dir", recipe.USER_DIR, *recipe.fairseq_options(recipe.SAMPLE)]
    cfg = convert_namespace_to_omegaconf(
        fairseq_cli_options.parse_args_and_arch(fairseq_cli_options.get_training_parser(), input_args=argv))
    sample = yaml.safe_load((ROOT / "configs" / "tnn_lm_sample.yaml").read_text())
    in_yaml = set()
    for section, fields in sample.items():
        if section == "hydra":  # where hydra runs (the checkpoint directory), not a fairseq option
            continue
        for key, value in fields.items():
            if value == "???":  # task.data, common.user_dir: the command line's
                continue
            assert plain(cfg[section][key]) == plain(value), (section, key, cfg[section][key], value)
            in_yaml.add("arch" if (section, key) == ("model", "_name") else
                        section if key == "_name" else key)
    assert set(recipe.SAMPLE) - in_yaml == set(), "options of recipe.SAMPLE missing from configs/tnn_lm_sample.yaml"
