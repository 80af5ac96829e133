"""The user-facing scripts (scripts/*.sh, scripts/slurm/*.sbatch, scripts/*.py) and configs/, run as a user runs
them: tiny presets and short lengths on data/sample, dry runs checked flag by flag, offline behaviour."""
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from helpers import BIN, ROOT, USER_DIR, cli, run, split_tokens

SCRIPTS = ROOT / "scripts"
SLURM = SCRIPTS / "slurm"
CAUSAL = ["tnn_lm_wt103", "tnn_lm_wt103_rpe3", "fd_tnn_lm_wt103"]
MASKED = ["tnn_mlm_wt103", "tnn_mlm_wt103_rpe3", "fd_tnn_mlm_wt103", "ski_tnn_mlm_wt103"]
EXPERIMENTS = CAUSAL + MASKED
LIBRARIES = [SCRIPTS / "lib.sh", SCRIPTS / "recipe.sh"]  # sourced, not run
BASH_SCRIPTS = [SCRIPTS / "train.sh", SCRIPTS / "prepare-wikitext-103.sh", SCRIPTS / "eval_extrapolation.sh",
                *LIBRARIES, *sorted(SLURM.glob("*.sbatch")), SCRIPTS / "demo.sh",
                SCRIPTS / "preprocess.sh", SCRIPTS / "setup.sh", SCRIPTS / "test.sh", SCRIPTS / "make_sample_data.sh",
                SCRIPTS / "gpu_check.sh"]
PY_SCRIPTS = [SCRIPTS / "extrapolation_report.py", SCRIPTS / "plot_training.py", SCRIPTS / "gpt2_bpe_encode.py",
              SCRIPTS / "plot_kernels.py", SCRIPTS / "make_experiment_configs.py"]
# the venv that runs pytest has the fairseq CLIs; keep SLURM variables of a real job out of the dry runs
BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
BASE_ENV.update(FAIRSEQ_BIN=str(BIN), PYTHON=sys.executable, PYTHONUNBUFFERED="1",
                OMP_NUM_THREADS="1")  # tiny models: one thread is 10-30x faster than two on a busy 2-core machine


def sh(cmd, env=None, timeout=600):
    """Run a command from the repository root; return (exit status, stdout, stderr)."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**BASE_ENV, **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr


def ok(cmd, env=None, timeout=600):
    rc, out, err = sh(cmd, env, timeout)
    assert rc == 0, f"{cmd} failed ({rc}):\n{out[-3000:]}\n{err[-5000:]}"
    return out, err


def flags(argv):
    """'--a 1 --b --c x y' -> {'--a': ['1'], '--b': [], '--c': ['x', 'y']} (last occurrence wins)."""
    out, key = {}, None
    for a in argv:
        if a.startswith("--"):
            key = a
            out[key] = []
        elif key is not None:
            out[key].append(a)
    return out


def dry_train(preset, data, **env):
    out, _ = ok(["bash", SCRIPTS / "train.sh", preset, data], {"DRY_RUN": "1", **env})
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    return shlex.split(lines[0])


# ---------------------------------------------------------------- syntax and usage

@pytest.mark.parametrize("script", BASH_SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax_and_strict_mode(script):
    ok(["bash", "-n", script])
    text = script.read_text()
    if script not in LIBRARIES:
        assert "set -euo pipefail" in text


def test_every_script_uses_the_shared_helpers():
    """scripts/lib.sh holds die, say, usage_error, quote_cmd and is_pos_int; every script that uses one sources it
    (directly or through recipe.sh) and none defines its own copy."""
    scripts = sorted({*SCRIPTS.glob("*.sh"), *SLURM.glob("*.sbatch")})
    assert set(scripts) == set(BASH_SCRIPTS)  # a new script is checked here too
    users = []
    for script in scripts:
        if script.name == "lib.sh":
            continue
        text = script.read_text()
        if re.search(r"\b(die|say|usage_error|quote_cmd|is_pos_int)\b", text):
            users.append(script.name)
            assert re.search(r'^\s*source "\$ROOT/scripts/(lib|recipe)\.sh"', text, re.M), f"{script.name} does not source lib.sh"
        own = re.findall(r"^\s*(\w*die|say|quote_cmd|usage_error|is_pos_int)\s*\(\)", text, re.M)
        assert not own, f"{script.name} defines {own}; use scripts/lib.sh's"
    assert set(users) == {s.name for s in scripts} - {"lib.sh", "test.sh"}, users  # test.sh: two lines, no errors


def test_die_names_the_calling_script_and_takes_an_exit_code(tmp_path):
    script = tmp_path / "caller.sh"
    script.write_text(f'set -euo pipefail\nROOT={shlex.quote(str(ROOT))}\nsource "$ROOT/scripts/lib.sh"\n'
                      'quote_cmd a "b c" "it\'s"\n[[ "${1:-}" == 3 ]] && die "three" 3\ndie "plain"\n')
    rc, out, err = sh(["bash", script])
    assert (rc, out, err) == (1, "a 'b c' 'it'\\''s'\n", "caller.sh: error: plain\n")
    assert shlex.split(out) == ["a", "b c", "it's"]
    rc, _, err = sh(["bash", script, "3"], {"PROG": "named"})
    assert (rc, err) == (3, "named: error: three\n")


@pytest.mark.parametrize("script", PY_SCRIPTS, ids=lambda p: p.name)
def test_python_scripts_compile_and_have_help(script):
    out, _ = ok([sys.executable, script, "--help"])
    assert "usage:" in out


@pytest.mark.parametrize("cmd", [
    ["train.sh"], ["train.sh", "tnn_lm_tiny"], ["train.sh", "no_such_preset", "data-bin"],
    ["eval_extrapolation.sh"], ["prepare-wikitext-103.sh", "a", "b"], ["prepare-wikitext-103.sh", "--help"],
    ["preprocess.sh"], ["preprocess.sh", "data/sample"], ["preprocess.sh", "/no/such/dir", "/tmp/x"],
    ["demo.sh", "--fast"], ["setup.sh", "x"], ["make_sample_data.sh", "x"],
], ids=lambda c: " ".join(c) or "none")
def test_wrong_arguments_print_usage_and_fail(cmd):
    rc, out, err = sh(["bash", SCRIPTS / cmd[0], *cmd[1:]])
    assert rc == 2, (rc, out, err)
    assert "usage: bash scripts/" + cmd[0] in err
    assert out == ""


# ---------------------------------------------------------------- train.sh dry runs

@pytest.mark.parametrize("preset,nproc,batch,update_freq", [
    ("tnn_lm_wt103", 8, 8, 2), ("tnn_lm_wt103", 1, 8, 16), ("fd_tnn_lm_wt103", 2, 8, 8), ("tnn_lm_wt103_rpe3", 4, 4, 8),
    ("tnn_mlm_wt103", 8, 16, 4), ("ski_tnn_mlm_wt103", 1, 16, 32), ("fd_tnn_mlm_wt103", 16, 16, 2),
])
def test_train_dry_run_recipe_flag_by_flag(data_bin, tmp_path, preset, nproc, batch, update_freq):
    argv = dry_train(preset, data_bin, NPROC=str(nproc), BATCH_PER_GPU=str(batch), SAVE_ROOT=str(tmp_path / "ck"))
    causal = preset in CAUSAL
    if nproc == 1:
        assert argv[0] == cli("fairseq-train")
        args = argv[1:]
        assert flags(args)["--distributed-world-size"] == ["1"]
    else:
        assert argv[:6] == [sys.executable, "-m", "fairseq_tnn.distributed.launch", "--nproc", str(nproc), "--"], argv
        args = argv[6:]
        assert "--distributed-world-size" not in args  # the launcher sets it
    assert args[0] == str(data_bin)
    f = flags(args)
    save_dir = str(tmp_path / "ck" / preset)
    expect = {
        "--user-dir": [USER_DIR], "--arch": [preset],  # every preset is a registered arch
        "--task": ["tnn_language_modeling" if causal else "tnn_masked_lm"],
        "--criterion": ["cross_entropy" if causal else "masked_lm"],
        "--sample-break-mode": ["none" if causal else "complete"],
        "--optimizer": ["adam"], "--adam-betas": ["(0.9, 0.98)"], "--weight-decay": ["0.2"], "--clip-norm": ["1.0"],
        "--lr": ["1e-3" if preset.startswith("fd_") else "5e-4"],
        "--lr-scheduler": ["inverse_sqrt" if causal else "polynomial_decay"],
        "--warmup-updates": ["4000" if causal else "3000"],
        "--tokens-per-sample": ["512"], "--batch-size": [str(batch)], "--update-freq": [str(update_freq)],
        "--max-update": ["50000"], "--fp16": [], "--tnn-compile": [], "--log-format": ["json"], "--save-dir": [save_dir],
        "--log-file": [save_dir + "/train.log"], "--tensorboard-logdir": [save_dir + "/tensorboard"],
        "--no-epoch-checkpoints": [], "--seed": ["1"],
    }
    expect.update({"--warmup-init-lr": ["1e-07"]} if causal else
                  {"--adam-eps": ["1e-06"], "--total-num-update": ["50000"], "--skip-invalid-size-inputs-valid-test": []})
    for key, value in expect.items():
        assert f.get(key) == value, (key, f.get(key), value)
    assert "--cpu" not in f
    assert "--rpe-layers" not in f  # the arch says it (tnn_*_wt103_rpe3), no flag on top
    # the paper's tokens per update, whatever the number of processes
    assert batch * update_freq * nproc == (128 if causal else 512)


def test_train_dry_run_cpu_env_overrides_and_extra_args_last(data_bin, tmp_path):
    env = {"CPU": "1", "NPROC": "2", "MAX_UPDATE": "7", "TOKENS_PER_SAMPLE": "64", "SEQS_PER_UPDATE": "16",
           "BATCH_PER_GPU": "4", "LR": "0.003", "WARMUP_UPDATES": "3", "SAVE_ROOT": str(tmp_path), "RUN_NAME": "smoke"}
    out, _ = ok(["bash", SCRIPTS / "train.sh", "fd_tnn_lm_tiny", data_bin, "--max-epoch", "1"], {"DRY_RUN": "1", **env})
    argv = shlex.split(out)
    assert argv[:7] == [sys.executable, "-m", "fairseq_tnn.distributed.launch", "--nproc", "2", "--cpu", "--"], argv
    f = flags(argv[7:])
    assert f["--update-freq"] == ["2"] and f["--batch-size"] == ["4"] and f["--max-update"] == ["7"]
    assert f["--tokens-per-sample"] == ["64"] and f["--lr"] == ["0.003"] and f["--warmup-updates"] == ["3"]
    assert "--cpu" in f and "--fp16" not in f and f["--save-dir"] == [str(tmp_path / "smoke")]
    assert "--tnn-compile" not in f and "--bf16-autocast" not in f  # CPU: eager fp32 unless asked
    assert argv[-2:] == ["--max-epoch", "1"]
    assert not (tmp_path / "smoke").exists()  # a dry run creates nothing


@pytest.mark.parametrize("env,present,absent", [
    ({}, ["--fp16", "--tnn-compile"], ["--bf16-autocast", "--bf16", "--cpu"]),
    ({"PRECISION": "bf16"}, ["--bf16-autocast", "--tnn-compile"], ["--fp16", "--bf16"]),
    ({"PRECISION": "fp32", "TNN_COMPILE": "0"}, [], ["--fp16", "--bf16-autocast", "--tnn-compile"]),
    ({"CPU": "1", "PRECISION": "bf16", "TNN_COMPILE": "1"}, ["--bf16-autocast", "--tnn-compile", "--cpu"], ["--fp16"]),
])
def test_train_dry_run_precision_and_compile(data_bin, tmp_path, env, present, absent):
    """GPU recipe: fp16 and compiled layers by default; PRECISION=bf16 is the plugin's bf16 autocast (fairseq's
    --bf16 means TPU); TNN_COMPILE switches compilation either way."""
    f = flags(dry_train("tnn_lm_wt103", data_bin, NPROC="1", SAVE_ROOT=str(tmp_path), **env))
    for flag in present:
        assert flag in f, (flag, env)
    for flag in absent:
        assert flag not in f, (flag, env)


@pytest.mark.parametrize("value,expected", [("1", []), ("strict", ["strict"])])
def test_train_dry_run_compile_mode(data_bin, tmp_path, value, expected):
    """TNN_COMPILE=1: --tnn-compile (a layer that fails to compile runs eagerly); strict: --tnn-compile strict."""
    f = flags(dry_train("tnn_lm_wt103", data_bin, NPROC="1", SAVE_ROOT=str(tmp_path), TNN_COMPILE=value))
    assert f["--tnn-compile"] == expected


def test_train_nproc_defaults_to_the_visible_gpus(data_bin, tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nfor i in 0 1 2 3; do echo \"GPU $i: NVIDIA H100 (UUID: GPU-$i)\"; done\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "SAVE_ROOT": str(tmp_path)}
    argv = dry_train("tnn_lm_wt103", data_bin, **env)
    assert argv[3:5] == ["--nproc", "4"] and flags(argv)["--update-freq"] == ["4"]  # 128 / (8 x 4)
    argv = dry_train("tnn_lm_wt103", data_bin, CUDA_VISIBLE_DEVICES="0,1", **env)
    assert argv[3:5] == ["--nproc", "2"] and flags(argv)["--update-freq"] == ["8"]
    argv = dry_train("tnn_lm_wt103", data_bin, CPU="1", **env)
    assert argv[0] == cli("fairseq-train") and flags(argv)["--update-freq"] == ["16"]


def test_train_multiprocess_command_is_accepted_by_the_launcher(data_bin, tmp_path):
    """The NPROC > 1 command line, run through fairseq_tnn.distributed.launch --dry-run: one rank command per process."""
    pytest.importorskip("fairseq_tnn.distributed.launch")
    argv = dry_train("tnn_lm_tiny", data_bin, CPU="1", NPROC="2", SEQS_PER_UPDATE="8", BATCH_PER_GPU="4",
                     SAVE_ROOT=str(tmp_path))
    out, _ = ok([*argv[:5], "--dry-run", *argv[5:]])
    ranks = [shlex.split(line) for line in out.splitlines() if "fairseq_cli.train" in line or "fairseq-train" in line]
    assert len(ranks) == 2, out
    for rank, cmd in enumerate(ranks):
        f = flags(cmd)
        assert f["--distributed-world-size"] == ["2"] and f["--distributed-rank"] == [str(rank)]
        assert f["--batch-size"] == ["4"] and f["--update-freq"] == ["1"] and f["--user-dir"] == [USER_DIR]


@pytest.mark.parametrize("env,message", [
    ({"NPROC": "3"}, "SEQS_PER_UPDATE=128 is not divisible by BATCH_PER_GPU=8 x 3 processes"),
    ({"NPROC": "1", "BATCH_PER_GPU": "0"}, "must be positive integers"),
    ({"NPROC": "x"}, "NPROC must be a positive integer"),
    ({"NPROC": "1", "PRECISION": "fp8"}, "PRECISION must be"),
    ({"NPROC": "1", "TNN_COMPILE": "yes"}, "TNN_COMPILE must be 0 or 1"),
    ({"CPU": "1", "PRECISION": "fp16"}, "CPU=1 trains in fp32 or bf16"),
])
def test_train_rejects_bad_settings(data_bin, env, message):
    rc, out, err = sh(["bash", SCRIPTS / "train.sh", "tnn_lm_wt103", data_bin], {"DRY_RUN": "1", **env})
    assert rc == 2 and message in err and out == "", (rc, out, err)


def test_train_refuses_an_existing_run_without_force(data_bin, tmp_path):
    run_dir = tmp_path / "tnn_lm_tiny"
    run_dir.mkdir()
    ckpt = run_dir / "checkpoint_last.pt"
    ckpt.write_bytes(b"precious")
    before = ckpt.stat().st_mtime_ns
    rc, out, err = sh(["bash", SCRIPTS / "train.sh", "tnn_lm_tiny", data_bin], {"CPU": "1", "SAVE_ROOT": str(tmp_path)})
    assert rc == 1 and "refusing to overwrite" in err and "FORCE=1" in err, (rc, out, err)
    assert ckpt.read_bytes() == b"precious" and ckpt.stat().st_mtime_ns == before
    # RESUME=1 would continue the run, FORCE=1 would delete it: the dry run says so and touches nothing
    _, err = ok(["bash", SCRIPTS / "train.sh", "tnn_lm_tiny", data_bin],
                {"CPU": "1", "SAVE_ROOT": str(tmp_path), "FORCE": "1", "DRY_RUN": "1"})
    assert "FORCE=1: deleting" in err and ckpt.read_bytes() == b"precious"


def test_train_retries_a_run_that_saved_no_checkpoint(data_bin, tmp_path):
    """A first attempt that failed before saving a checkpoint (here: the masked recipe refusing long lines
    with OVERSIZED=error) does not block the same command; its files move to previous-attempt/."""
    env = {"CPU": "1", "SAVE_ROOT": str(tmp_path), "MAX_UPDATE": "1", "TOKENS_PER_SAMPLE": "64", "SEQS_PER_UPDATE": "4",
           "BATCH_PER_GPU": "4", "NUM_WORKERS": "0", "WARMUP_UPDATES": "1", "LOG_INTERVAL": "1"}
    cmd = ["bash", SCRIPTS / "train.sh", "tnn_mlm_tiny", data_bin, "--max-valid-steps", "1"]
    rc, out, err = sh(cmd, {**env, "OVERSIZED": "error"})
    assert rc != 0 and "is too small for --sample-break-mode complete" in out + err, (rc, out[-2000:], err[-2000:])
    run_dir = tmp_path / "tnn_mlm_tiny"
    assert (run_dir / "command.txt").is_file() and not list(run_dir.glob("checkpoint*.pt"))
    _, err = ok(cmd, env)  # the retry, same command, no FORCE=1
    assert "holds no checkpoint" in err and (run_dir / "checkpoint_last.pt").is_file()
    assert "--oversized-blocks error" in (run_dir / "previous-attempt" / "command.txt").read_text()
    assert "--oversized-blocks drop" in (run_dir / "command.txt").read_text()
    # now the run has a checkpoint: the same command is refused again
    rc, _, err = sh(cmd, env)
    assert rc == 1 and "refusing to overwrite" in err


# ---------------------------------------------------------------- SLURM dry runs

def sbatch_header(path):
    return dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)", path.read_text(), re.M))


TRAIN_SBATCH = SLURM / "train.sbatch"


def test_one_sbatch_script_for_every_preset():
    assert sorted(p.name for p in SLURM.iterdir()) == ["extrapolation.sbatch", "train.sbatch"]
    head = sbatch_header(TRAIN_SBATCH)
    assert head == {"job-name": "fairseq-tnn", "nodes": "1", "ntasks-per-node": "8", "gpus-per-node": "8",
                    "cpus-per-task": "8", "time": "2-00:00:00", "output": "slurm-%x-%j.out"}
    assert re.search(r"^#SBATCH --requeue$", TRAIN_SBATCH.read_text(), re.M)


@pytest.mark.parametrize("args,message", [
    ([], "usage: sbatch scripts/slurm/train.sbatch <preset>"),
    (["--max-epoch", "3"], "usage: sbatch scripts/slurm/train.sbatch <preset>"),
    (["tnn_lm_wt104"], "train.sbatch: error: unknown preset 'tnn_lm_wt104'; choose one of: "),
])
def test_sbatch_refuses_a_missing_or_unknown_preset_before_any_work(tmp_path, args, message):
    """Checked first: outside SLURM and without data, the error is still about the preset, and lists them all."""
    rc, out, err = sh(["bash", TRAIN_SBATCH, *args], {"DATA": str(tmp_path / "none"), "SAVE_ROOT": str(tmp_path / "ck")})
    assert rc == 2 and message in err and out == "", (rc, out, err)
    assert all(p in err for p in EXPERIMENTS + ["tnn_lm_tiny"]), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_sbatch_dry_run_is_train_sh_recipe_under_srun(data_bin, tmp_path, experiment):
    env = {"DRY_RUN": "1", "DATA": str(data_bin), "SAVE_ROOT": str(tmp_path), "SLURM_NNODES": "2",
           "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_ID": "4242"}
    out, _ = ok(["bash", TRAIN_SBATCH, experiment, "--max-epoch", "3"], env)
    argv = shlex.split(out)
    assert argv[:3] == ["srun", "--kill-on-bad-exit=1", cli("fairseq-train")], argv
    f = flags(argv[3:])
    assert f["--distributed-world-size"] == ["16"] and f["--distributed-port"] == [str(10000 + 4242)]
    assert f["--update-freq"] == (["1"] if experiment in CAUSAL else ["2"])  # 128 / (8 x 16), 512 / (16 x 16)
    assert argv[-2:] == ["--max-epoch", "3"]
    # the same recipe as train.sh with as many processes
    train = dry_train(experiment, data_bin, NPROC="16", SAVE_ROOT=str(tmp_path))
    assert argv[3:-6] == train[6:], (argv, train)


def test_sbatch_root_from_submit_dir_when_slurm_runs_a_spool_copy(data_bin, tmp_path):
    spool = tmp_path / "slurmd" / "job4242"
    spool.mkdir(parents=True)
    shutil.copy(TRAIN_SBATCH, spool / "slurm_script")
    env = {"DRY_RUN": "1", "DATA": str(data_bin), "SAVE_ROOT": str(tmp_path / "ck"), "SLURM_NNODES": "1",
           "SLURM_NTASKS": "8", "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(ROOT)}
    out, _ = ok(["bash", spool / "slurm_script", "fd_tnn_lm_wt103"], env)
    f = flags(shlex.split(out)[3:])
    assert f["--user-dir"] == [USER_DIR] and f["--distributed-world-size"] == ["8"] and f["--update-freq"] == ["2"]
    rc, _, err = sh(["bash", spool / "slurm_script", "fd_tnn_lm_wt103"], {**env, "SLURM_SUBMIT_DIR": str(tmp_path)})
    assert rc == 2 and "cannot find the repository" in err


def test_sbatch_requeued_job_continues_its_run_and_a_new_job_refuses_it(data_bin, tmp_path):
    run_dir = tmp_path / "tnn_lm_wt103"
    run_dir.mkdir()
    (run_dir / "checkpoint_last.pt").write_bytes(b"precious")
    env = {"DRY_RUN": "1", "DATA": str(data_bin), "SAVE_ROOT": str(tmp_path), "SLURM_NNODES": "1",
           "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_ID": "5"}
    rc, out, err = sh(["bash", TRAIN_SBATCH, "tnn_lm_wt103"], env)
    assert rc == 1 and "already exists; refusing to overwrite it" in err and out == ""
    out, err = ok(["bash", TRAIN_SBATCH, "tnn_lm_wt103"], {**env, "SLURM_RESTART_COUNT": "1"})
    assert "RESUME=1: continuing the run" in err and out.startswith("srun ")
    assert (run_dir / "checkpoint_last.pt").read_bytes() == b"precious"


def test_sbatch_outside_slurm_refuses(data_bin):
    rc, out, err = sh(["bash", TRAIN_SBATCH, "tnn_lm_wt103"], {"DATA": str(data_bin)})
    assert rc == 2 and "not inside a SLURM job" in err and out == ""


def test_extrapolation_array_dry_run():
    script = SLURM / "extrapolation.sbatch"
    assert sbatch_header(script)["array"] == "0-5"
    prog = str(SCRIPTS / "eval_extrapolation.sh")
    out, _ = ok(["bash", script, "A=a.pt", "B=b.pt"], {"DRY_RUN": "1", "SLURM_ARRAY_TASK_ID": "3"})
    assert shlex.split(out) == ["srun", "--ntasks=1", "--kill-on-bad-exit=1", "env", "LENGTHS=4096", "TABLE=0", "REPORT=0",
                                "bash", prog, "A=a.pt", "B=b.pt"]
    out, _ = ok(["bash", script, "A=a.pt"], {"DRY_RUN": "1", "SLURM_ARRAY_TASK_ID": "0"})
    assert "LENGTHS=512" in shlex.split(out) and "TABLE=1" in shlex.split(out)
    out, _ = ok(["bash", script, "A=a.pt"], {"DRY_RUN": "1", "REPORT_ONLY": "1"})
    assert shlex.split(out) == ["env", "LENGTHS=512 1024 2048 4096 8192 14336", "REPORT_ONLY=1", "bash", prog, "A=a.pt"]
    rc, _, err = sh(["bash", script, "A=a.pt"], {"DRY_RUN": "1", "SLURM_ARRAY_TASK_ID": "6"})
    assert rc == 2 and "only 6 LENGTHS" in err
    rc, _, err = sh(["bash", script], {"DRY_RUN": "1", "SLURM_ARRAY_TASK_ID": "0"})
    assert rc == 2 and "usage:" in err


# ---------------------------------------------------------------- train -> evaluate -> plot, for real

@pytest.fixture(scope="module")
def trained(data_bin, tmp_path_factory):
    """train.sh on CPU with a tiny preset: 4 updates of 8 x 64 tokens, validation every 2 updates."""
    save_root = tmp_path_factory.mktemp("train")
    env = {"CPU": "1", "MAX_UPDATE": "4", "TOKENS_PER_SAMPLE": "64", "SEQS_PER_UPDATE": "8", "BATCH_PER_GPU": "8",
           "LR": "0.003", "WARMUP_UPDATES": "2", "VALIDATE_INTERVAL_UPDATES": "2", "SAVE_INTERVAL_UPDATES": "2",
           "LOG_INTERVAL": "1", "NUM_WORKERS": "0", "SAVE_ROOT": str(save_root)}
    ok(["bash", SCRIPTS / "train.sh", "tnn_lm_tiny", data_bin, "--max-valid-steps", "4"], env)
    return save_root / "tnn_lm_tiny"


def test_train_sh_trains_on_cpu_with_json_log_and_tensorboard(trained):
    for name in ("checkpoint_best.pt", "checkpoint_last.pt", "checkpoint_1_2.pt", "checkpoint_1_4.pt"):
        assert (trained / name).is_file(), name
    records = []
    for line in (trained / "train.log").read_text().splitlines():
        if line.startswith('{"'):  # json log lines (the config dump starts with "{'")
            records.append(json.loads(line))
    valid = [r for r in records if "valid_ppl" in r]
    inner = [r for r in records if "update_ms" in r and "num_updates" in r]
    assert [r["valid_num_updates"] for r in valid] == ["2", "4"]
    assert [r["num_updates"] for r in inner] == ["1", "2", "3", "4"] and all("max_rss_mb" in r for r in inner)
    assert any((trained / "tensorboard").rglob("events.out.tfevents.*"))
    assert (trained / "command.txt").read_text().startswith(cli("fairseq-train"))


@pytest.fixture(scope="module")
def extrapolation(trained, data_bin, tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    # TRAIN_TOKENS and TABLE_TOKENS unset: both are the training length, read from the checkpoint (64)
    env = {"DATA": str(data_bin), "LENGTHS": "64 128 512", "CPU": "1",
           "NUM_WORKERS": "0", "RESULTS_ROOT": str(results), "NAME": "tiny"}
    out, err = ok(["bash", SCRIPTS / "eval_extrapolation.sh", trained / "checkpoint_last.pt"], env)
    return results / "tiny", env, out, err


def test_eval_extrapolation_scores_every_token_at_every_length(extrapolation, trained, data_bin):
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
        assert r["checkpoint"] == str(trained / "checkpoint_last.pt")
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


def test_eval_extrapolation_refuses_existing_results(extrapolation, trained):
    out_dir, env, _, _ = extrapolation
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out_dir.iterdir() if p.is_file()}
    rc, out, err = sh(["bash", SCRIPTS / "eval_extrapolation.sh", trained / "checkpoint_last.pt"], env)
    assert rc == 1 and "refusing to overwrite" in err and "FORCE=1" in err, (rc, out, err)
    assert "fairseq-eval-lm" not in err
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out_dir.iterdir() if p.is_file()}
    assert after == before


def test_eval_extrapolation_dry_run_commands(trained, data_bin, tmp_path):
    env = {"DRY_RUN": "1", "DATA": str(data_bin), "RESULTS_ROOT": str(tmp_path)}
    out, _ = ok(["bash", SCRIPTS / "eval_extrapolation.sh", f"TNN={trained / 'checkpoint_best.pt'}"], env)
    evals = [shlex.split(line) for line in out.splitlines() if line.startswith(cli("fairseq-eval-lm"))]
    # 6 lengths on test, plus the table at the training length read from the checkpoint (64): valid and test
    assert [(flags(e)["--gen-subset"][0], int(flags(e)["--tokens-per-sample"][0])) for e in evals] == \
        [("test", L) for L in (512, 1024, 2048, 4096, 8192, 14336)] + [("valid", 64), ("test", 64)]
    assert "--train-length 64" in out.splitlines()[-1]
    for e in evals:
        f = flags(e[1:])
        assert e[1] == str(data_bin) and f["--user-dir"] == [USER_DIR] and f["--task"] == ["tnn_language_modeling"]
        assert f["--sample-break-mode"] == ["none"] and f["--context-window"] == ["0"] and f["--batch-size"] == ["1"]
        assert f["--max-tokens"] == f["--tokens-per-sample"] and f["--path"] == [str(trained / "checkpoint_best.pt")]
    assert "extrapolation_report.py" in out.splitlines()[-1] and not (tmp_path / "extrapolation").exists()


def test_eval_extrapolation_training_length_from_checkpoints(trained, data_bin, tmp_path):
    """Checkpoints trained at different lengths: an error listing them unless both lengths are set; set
    ones win over the checkpoint."""
    import torch

    other = tmp_path / "other.pt"
    state = torch.load(trained / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    state["cfg"]["task"]["tokens_per_sample"] = 128
    torch.save(state, other)
    env = {"DRY_RUN": "1", "DATA": str(data_bin), "RESULTS_ROOT": str(tmp_path)}
    args = ["bash", SCRIPTS / "eval_extrapolation.sh", f"A={trained / 'checkpoint_last.pt'}", f"B={other}"]
    rc, out, err = sh(args, env)
    assert rc == 2 and "trained at different lengths" in err and "tokens_per_sample 64" in err \
        and "tokens_per_sample 128" in err and "TRAIN_TOKENS" in err and out == "", (rc, out, err)
    rc, out, err = sh(args, {**env, "TRAIN_TOKENS": "128"})  # TABLE_TOKENS still unknown
    assert rc == 2 and "trained at different lengths" in err
    out, _ = ok(args, {**env, "TRAIN_TOKENS": "100", "TABLE_TOKENS": "96"})
    assert "--train-length 100" in out and "--table-tokens 96" in out


def script_module(name):
    """Import scripts/<name>.py (to call its main() in this process, where fairseq is already imported)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(SCRIPTS))


def test_report_one_row_per_model_and_refuses_incomplete(extrapolation, data_bin, tmp_path, capsys):
    src, *_ = extrapolation
    report = script_module("extrapolation_report")
    out_dir = tmp_path / "two"
    for label in ("TNN", "FD-TNN"):
        shutil.copytree(src / "raw" / "tnn_lm_tiny", out_dir / "raw" / label)
    args = ["--data", str(data_bin), "--lengths", "64", "128", "512", "--table-tokens", "64"]
    report.main(["--out-dir", str(out_dir), *args, "--models", "TNN=a.pt", "FD-TNN=b.pt"])
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
    with pytest.raises(SystemExit) as exc:
        report.main(["--out-dir", str(bad), *args, "--models", "TNN=a.pt"])
    assert "scored 1000 of" in str(exc.value) and "no complete fairseq-eval-lm log for test at L=64" in str(exc.value)
    assert not (bad / "extrapolation.json").exists()


def test_plot_training_on_the_train_log(trained, tmp_path):
    out = tmp_path / "fig" / "valid.png"
    cmd = [sys.executable, SCRIPTS / "plot_training.py", trained / "train.log", trained / "train.log", "--labels", "A", "B",
           "--out", out]
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
    assert rc == 1 and "refusing to overwrite" in err and out.read_bytes() == before


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


# ---------------------------------------------------------------- hydra configs

def compose_experiment(name, overrides=()):
    from fairseq.dataclass.initialize import add_defaults, hydra_init
    from hydra import compose, initialize_config_dir

    import fairseq_tnn

    fairseq_tnn.register()  # registers the models whose dataclasses add_defaults merges

    hydra_init(name)  # as fairseq-hydra-train does: the yaml is validated against FairseqConfig
    with initialize_config_dir(config_dir=str(ROOT / "configs" / "experiments"), version_base="1.1"):
        cfg = compose(config_name=name, overrides=["task.data=/data", f"common.user_dir={USER_DIR}", *overrides])
    add_defaults(cfg)
    return cfg


GENERATOR = SCRIPTS / "make_experiment_configs.py"


def test_experiment_yamls_are_what_the_generator_writes():
    """configs/experiments/*.yaml are generated from train.sh's recipe and the registered archs, never edited by
    hand: a recipe or arch change without regenerating fails here, naming the command that regenerates them."""
    assert sorted(p.stem for p in (ROOT / "configs/experiments").glob("*.yaml")) == sorted(EXPERIMENTS)
    rc, out, err = sh([sys.executable, GENERATOR, "--check"], {"MAX_UPDATE": "7", "NPROC": "3", "LR": "1"})  # knobs ignored
    assert rc == 0, f"configs/experiments/ is stale:\n{err[-3000:]}"
    assert out == ""


def test_generator_check_names_a_stale_config_and_the_command(tmp_path):
    for experiment in ("tnn_lm_wt103", "ski_tnn_mlm_wt103"):
        shutil.copy(ROOT / "configs/experiments" / f"{experiment}.yaml", tmp_path)
    stale = tmp_path / "ski_tnn_mlm_wt103.yaml"
    stale.write_text(stale.read_text().replace("ski_rank: 32", "ski_rank: 16"))
    rc, out, err = sh([sys.executable, GENERATOR, "--check", "--out-dir", tmp_path, "tnn_lm_wt103", "ski_tnn_mlm_wt103"])
    assert rc == 1 and f"{stale}: differs" in err and "tnn_lm_wt103.yaml" not in err, err
    assert "regenerate with: .venv/bin/python scripts/make_experiment_configs.py" in err
    assert "ski_rank: 16" in stale.read_text()  # --check writes nothing
    out, _ = ok([sys.executable, GENERATOR, "--out-dir", tmp_path, "ski_tnn_mlm_wt103"])
    assert stale.read_text() == (ROOT / "configs/experiments/ski_tnn_mlm_wt103.yaml").read_text()
    rc, _, err = sh([sys.executable, GENERATOR, "--check", "tnn_lm_tiny"])
    assert rc == 2 and "unknown preset 'tnn_lm_tiny'" in err and "ski_tnn_mlm_wt103" in err


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_yaml_equals_train_sh_recipe(data_bin, tmp_path, experiment):
    """Every field fairseq would train with, from the yaml (model written out) vs from train.sh (arch preset):
    the generator's output means what train.sh's command means."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    def plain(node):
        return OmegaConf.to_container(node, resolve=True, enum_to_str=True)

    yml = compose_experiment(experiment)
    argv = dry_train(experiment, data_bin, NPROC="8", SAVE_ROOT=str(tmp_path))[6:]
    cli_cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), input_args=argv))
    ignore = {"task": {"data"}, "model": {"_name"}, "checkpoint": {"save_dir"},
              "common": {"log_file", "tensorboard_logdir"}}
    for section in ("task", "model", "criterion", "optimizer", "lr_scheduler", "optimization", "dataset", "checkpoint",
                    "common"):
        a, b = plain(yml[section]), plain(cli_cfg[section])
        diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if k not in ignore.get(section, ()) and a.get(k) != b.get(k)}
        assert not diff, (section, diff)
    assert plain(yml.model)["_name"] == ("tnn_lm" if experiment in CAUSAL else "tnn_mlm")
    assert yml.checkpoint.save_dir == f"checkpoints/{experiment}"
    assert yml.model.get("tno_type") == cli_cfg.model.tno_type


def test_hydra_experiment_trains_two_updates_with_the_local_launcher(data_bin, tmp_path):
    log = run([cli("fairseq-hydra-train"), "--config-dir", ROOT / "configs" / "experiments", "--config-name",
               "ski_tnn_mlm_wt103", f"task.data={data_bin}", f"common.user_dir={USER_DIR}",
               f"hydra.searchpath=[file://{ROOT / 'configs'}]", "hydra/launcher=local", f"hydra.run.dir={tmp_path / 'run'}",
               "common.cpu=true", "common.fp16=false", "model.tnn_compile=false",  # the GPU recipe's, off on CPU
               "model.encoder_embed_dim=32", "model.encoder_layers=1",
               "model.ski_rank=8", "model.ski_taps=5", "task.tokens_per_sample=128", "dataset.batch_size=4",
               "optimization.update_freq=[1]", "optimization.max_update=2", "dataset.disable_validation=true",
               "dataset.num_workers=0", "common.log_interval=1", f"checkpoint.save_dir={tmp_path / 'ck'}",
               f"common.tensorboard_logdir={tmp_path / 'tb'}"])
    assert re.search(r'"num_updates": "2"', log), log[-3000:]
    assert (tmp_path / "ck" / "checkpoint_last.pt").exists()
    assert "'tno_type': ski" in log and "'ski_rank': 8" in log and "'encoder_layers': 1" in log


def test_launcher_configs():
    local = yaml.safe_load((ROOT / "configs/hydra/launcher/local.yaml").read_text())
    assert local == {"defaults": ["basic"]}
    slurm = yaml.safe_load((ROOT / "configs/hydra/launcher/slurm.yaml").read_text())
    assert slurm["defaults"] == ["submitit_slurm"]
    for key in ("nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task", "timeout_min", "mem_gb", "partition",
                "submitit_folder", "name"):
        assert key in slurm, key
    assert slurm["tasks_per_node"] == slurm["gpus_per_node"] == 8  # one task per GPU, as fairseq expects on SLURM
    for experiment in EXPERIMENTS:
        text = (ROOT / "configs/experiments" / f"{experiment}.yaml").read_text()
        cfg = yaml.safe_load(text)
        assert cfg["common"]["user_dir"] == "???" and cfg["task"]["data"] == "???"
        assert "hydra/launcher=slurm" in text and "hydra.searchpath" in text


# ---------------------------------------------------------------- data preparation, offline

def test_prepare_offline_fails_fast_naming_files_and_places(tmp_path):
    env = {"RAW_DIR": str(tmp_path / "raw"), "WIKITEXT_URL": "http://127.0.0.1:9/wikitext-103-raw-v1.zip",
           "GPT2_BPE_URL": "http://127.0.0.1:9/gpt2_bpe", "CONNECT_TIMEOUT": "3"}
    start = time.monotonic()
    rc, out, err = sh(["bash", SCRIPTS / "prepare-wikitext-103.sh", tmp_path / "bin"], env, timeout=60)
    assert rc == 1 and time.monotonic() - start < 20, (rc, err)
    assert "Download these files yourself" in err
    for url, dest in [("http://127.0.0.1:9/wikitext-103-raw-v1.zip", "raw/wikitext-103-raw-v1.zip"),
                      ("http://127.0.0.1:9/gpt2_bpe/encoder.json", "raw/gpt2_bpe/encoder.json"),
                      ("http://127.0.0.1:9/gpt2_bpe/vocab.bpe", "raw/gpt2_bpe/vocab.bpe"),
                      ("http://127.0.0.1:9/gpt2_bpe/dict.txt", "raw/gpt2_bpe/dict.txt")]:
        assert re.search(re.escape(url) + r"\s+-> " + re.escape(str(tmp_path / dest)), err), (url, err)
    assert str(tmp_path / "raw/wikitext-103-raw/wiki.{train,valid,test}.raw") in err
    assert not (tmp_path / "bin").exists() and not list((tmp_path / "raw").rglob("*.part"))


def test_prepare_dry_run_prints_the_pipeline(tmp_path):
    out, _ = ok(["bash", SCRIPTS / "prepare-wikitext-103.sh", tmp_path / "bin"], {"DRY_RUN": "1", "RAW_DIR": str(tmp_path)})
    assert "https://wikitext.smerity.com/wikitext-103-raw-v1.zip" in out
    for f in ("encoder.json", "vocab.bpe", "dict.txt"):
        assert f"https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe/{f}" in out
    assert "gpt2_bpe_encode.py" in out and "--keep-empty" in out
    pre = [shlex.split(line) for line in out.splitlines() if "fairseq-preprocess" in line][0]
    f = flags(pre)
    assert "--only-source" in f and f["--srcdict"] == [str(tmp_path / "gpt2_bpe/dict.txt")]
    assert f["--destdir"] == [str(tmp_path / "bin")] and f["--trainpref"] == [str(tmp_path / "wikitext-103-raw/wiki.train.bpe")]
    assert list(tmp_path.iterdir()) == []


def tiny_gpt2_bpe(dest: Path):
    """A GPT-2-format encoder.json / vocab.bpe: the 256 byte symbols plus a few merges; and a dict.txt."""
    from fairseq.data.encoders.gpt2_bpe_utils import bytes_to_unicode

    byte_sym = bytes_to_unicode()
    encoder = {byte_sym[b]: b for b in range(256)}
    merges = [("t", "h"), ("\u0120", "th"), ("\u0120th", "e"), ("th", "e"), ("e", "r")]
    for a, b in merges:
        encoder[a + b] = len(encoder)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "encoder.json").write_text(json.dumps(encoder))
    (dest / "vocab.bpe").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    (dest / "dict.txt").write_text("".join(f"{i} {1000 - i}\n" for i in range(len(encoder))))
    return encoder


def test_gpt2_bpe_encode_round_trip(tmp_path):
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    encoder = tiny_gpt2_bpe(tmp_path / "bpe")
    src = tmp_path / "in.txt"
    src.write_text(" = The other theme = \n\n the  weather, théâtre!\n")
    ok([sys.executable, SCRIPTS / "gpt2_bpe_encode.py", "--encoder-json", tmp_path / "bpe/encoder.json",
        "--vocab-bpe", tmp_path / "bpe/vocab.bpe", "--inputs", src, src, "--outputs", tmp_path / "keep.bpe",
        tmp_path / "drop.bpe", "--keep-empty", "--workers", "2"])
    keep = (tmp_path / "keep.bpe").read_text().split("\n")
    assert len(keep) == 4 and keep[1] == "" and keep[3] == ""  # the empty line kept, one line per input line
    dec = get_encoder(str(tmp_path / "bpe/encoder.json"), str(tmp_path / "bpe/vocab.bpe"))
    assert dec.decode([int(t) for t in keep[0].split()]) == "= The other theme ="
    assert dec.decode([int(t) for t in keep[2].split()]) == "the  weather, théâtre!"
    assert str(encoder["\u0120the"]) in keep[0].split()  # the merges applied
    ok([sys.executable, SCRIPTS / "gpt2_bpe_encode.py", "--encoder-json", tmp_path / "bpe/encoder.json",
        "--vocab-bpe", tmp_path / "bpe/vocab.bpe", "--inputs", src, "--outputs", tmp_path / "drop.bpe"])
    assert (tmp_path / "drop.bpe").read_text().count("\n") == 2


def test_prepare_runs_offline_from_manually_placed_files(tmp_path):
    raw = tmp_path / "raw"
    tiny_gpt2_bpe(raw / "gpt2_bpe")
    text = {"train": " = Valkyria = \n\n the theme of the other\n", "valid": " the other\n", "test": " there\n\n"}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for split, body in text.items():
            z.writestr(f"wikitext-103-raw/wiki.{split}.raw", body)
    (raw / "wikitext-103-raw-v1.zip").write_bytes(buf.getvalue())
    env = {"RAW_DIR": str(raw), "WIKITEXT_URL": "http://127.0.0.1:9/none.zip", "GPT2_BPE_URL": "http://127.0.0.1:9/x",
           "WORKERS": "1"}
    dest = tmp_path / "bin"
    ok(["bash", SCRIPTS / "prepare-wikitext-103.sh", dest], env)
    for split in text:
        assert (dest / f"{split}.bin").is_file() and (dest / f"{split}.idx").is_file()
        assert (raw / f"wikitext-103-raw/wiki.{split}.bpe").read_text().count("\n") == text[split].count("\n")
    assert (dest / "dict.txt").read_text() == (raw / "gpt2_bpe/dict.txt").read_text()
    assert split_tokens(dest, "train") == sum(len(line.split()) + 1 for line in
                                              (raw / "wikitext-103-raw/wiki.train.bpe").read_text().splitlines())
    # a rerun finds every output and does nothing
    stamp = (dest / "train.bin").stat().st_mtime_ns
    _, err = ok(["bash", SCRIPTS / "prepare-wikitext-103.sh", dest], env)
    assert "already binarised" in err and "BPE files present" in err and (dest / "train.bin").stat().st_mtime_ns == stamp


def test_make_sample_data_refuses_to_overwrite_the_corpus():
    before = {p.name: p.read_bytes() for p in (ROOT / "data" / "sample").iterdir()}
    rc, _, err = sh(["bash", SCRIPTS / "make_sample_data.sh"])
    assert rc == 1 and "refusing to overwrite" in err and "FORCE=1" in err, err
    assert {p.name: p.read_bytes() for p in (ROOT / "data" / "sample").iterdir()} == before


@pytest.mark.slow
def test_demo_trains_tnn_and_fd_tnn_side_by_side_and_reports(tmp_path):
    """README command 1, shortened: both models trained, the Table-1 rows, the extrapolation table and plot,
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
    again, _ = ok(["bash", SCRIPTS / "demo.sh"], env, timeout=900)
    assert again.count("demo: reusing the finished run") == 2


def test_preprocess_skips_a_binarised_dir_and_redoes_it_with_force(tmp_path):
    dest = tmp_path / "bin"
    env = {"FAIRSEQ_PREPROCESS": cli("fairseq-preprocess")}
    ok(["bash", SCRIPTS / "preprocess.sh", ROOT / "data" / "sample", dest], env)
    before = (dest / "train.bin").read_bytes()
    (dest / "train.bin").write_bytes(b"damaged")
    out, _ = ok(["bash", SCRIPTS / "preprocess.sh", ROOT / "data" / "sample", dest], env)
    assert "already binarised (FORCE=1 to redo)" in out and (dest / "train.bin").read_bytes() == b"damaged"
    ok(["bash", SCRIPTS / "preprocess.sh", ROOT / "data" / "sample", dest], {**env, "FORCE": "1"})
    assert (dest / "train.bin").read_bytes() == before
