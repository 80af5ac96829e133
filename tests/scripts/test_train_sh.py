"""scripts/train.sh and what it hands over to (python -m fairseq_tnn train, fairseq_tnn/recipe.py): dry runs
checked flag by flag against the paper's recipe for every preset, the environment knobs (several machines
among them), refusals of bad settings, of distributed options and of existing runs, a resume against another
dictionary, and a real run on CPU (conftest's train_sh_run)."""
import json
import os
import shlex
import shutil
import subprocess

import pytest

from helpers import (ROOT, SCRIPTS, USER_DIR, cli, dry_train, flags, ok, script_env, sh, wait_all,
                     wt103_presets)

CAUSAL = wt103_presets("tnn_lm")


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
        assert argv[:6] == [script_env()["PYTHON"], "-m", "fairseq_tnn.distributed.launch", "--nproc", str(nproc), "--"], argv
        args = argv[6:]
        assert "--distributed-world-size" not in args  # the launcher sets it
    assert args[0] == str(data_bin)
    f = flags(args)
    save_dir = str(tmp_path / "ck" / preset)
    expect = {
        "--user-dir": [USER_DIR], "--arch": [preset],  # every preset is a registered arch
        "--task": ["tnn_language_modeling" if causal else "tnn_masked_lm"],
        "--criterion": ["tnn_cross_entropy" if causal else "tnn_masked_lm"],
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
                  {"--adam-eps": ["1e-06"], "--total-num-update": ["50000"], "--skip-invalid-size-inputs-valid-test": [],
                   "--oversized-blocks": ["drop"]})
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
    assert argv[:7] == [script_env()["PYTHON"], "-m", "fairseq_tnn.distributed.launch", "--nproc", "2", "--cpu", "--"], argv
    f = flags(argv[7:])
    assert f["--update-freq"] == ["2"] and f["--batch-size"] == ["4"] and f["--max-update"] == ["7"]
    assert f["--tokens-per-sample"] == ["64"] and f["--lr"] == ["0.003"] and f["--warmup-updates"] == ["3"]
    assert "--cpu" in f and "--fp16" not in f and f["--save-dir"] == [str(tmp_path / "smoke")]
    assert "--tnn-compile" not in f and "--bf16-autocast" not in f  # CPU: eager fp32 unless asked
    assert argv[-2:] == ["--max-epoch", "1"]
    assert not (tmp_path / "smoke").exists()  # a dry run creates nothing


def test_train_dry_run_masked_knobs(data_bin, tmp_path):
    """MAX_UPDATE is also the masked schedule's length, an empty knob is its default, OVERSIZED=error refuses
    long lines (--oversized-blocks error)."""
    env = {"CPU": "1", "NPROC": "1", "MAX_UPDATE": "7", "LR": "", "SEED": "3", "SEQS_PER_UPDATE": "8",
           "BATCH_PER_GPU": "2", "OVERSIZED": "error", "SAVE_ROOT": str(tmp_path)}
    f = flags(dry_train("ski_tnn_mlm_tiny", data_bin, **env))
    assert f["--max-update"] == f["--total-num-update"] == ["7"] and f["--lr"] == ["5e-4"] and f["--seed"] == ["3"]
    assert f["--update-freq"] == ["4"] and f["--oversized-blocks"] == ["error"]


@pytest.mark.parametrize("env,present,absent", [
    ({}, ["--fp16", "--tnn-compile", "--tnn-cuda-graphs"], ["--bf16-autocast", "--bf16", "--cpu"]),
    ({"PRECISION": "bf16"}, ["--bf16", "--tnn-compile", "--tnn-cuda-graphs"], ["--fp16", "--bf16-autocast"]),
    ({"PRECISION": "bf16-autocast"}, ["--bf16-autocast", "--tnn-compile", "--tnn-cuda-graphs"], ["--fp16", "--bf16"]),
    ({"PRECISION": "fp32", "TNN_COMPILE": "0"}, [], ["--fp16", "--bf16-autocast", "--tnn-compile", "--tnn-cuda-graphs"]),
    ({"CUDA_GRAPHS": "0"}, ["--fp16", "--tnn-compile"], ["--tnn-cuda-graphs"]),
    ({"TNN_COMPILE": "strict"}, ["--fp16", "--tnn-compile", "--tnn-cuda-graphs"], []),
    ({"CPU": "1", "PRECISION": "bf16", "TNN_COMPILE": "1"}, ["--bf16", "--tnn-compile", "--cpu"],
     ["--fp16", "--tnn-cuda-graphs", "--bf16-autocast"]),
    ({"CPU": "1", "PRECISION": "bf16-autocast"}, ["--bf16-autocast", "--cpu"], ["--fp16", "--bf16", "--tnn-compile"]),
])
def test_train_dry_run_precision_and_compile(data_bin, tmp_path, env, present, absent):
    """GPU recipe: fp16 and compiled layers trained as CUDA graphs by default; PRECISION=bf16 is fairseq's --bf16
    (bf16 weights, an fp32 master copy), bf16-autocast the plugin's --bf16-autocast; TNN_COMPILE switches compilation either way, and the graphs with it unless
    CUDA_GRAPHS says otherwise (CUDA_GRAPHS=1 is refused on the CPU and without compilation, below)."""
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


def test_cuda_graphs_are_the_default_on_one_gpu_and_on_several(data_bin, tmp_path):
    """CUDA_GRAPHS' default: 1 for one GPU process and for several (DistributedDataParallel with the graphs, tested
    on a GPU in the ninth run), on one node or two; CUDA_GRAPHS=0 turns them off."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nfor i in 0 1; do echo \"GPU $i: NVIDIA H100 (UUID: GPU-$i)\"; done\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "SAVE_ROOT": str(tmp_path)}
    assert "--tnn-cuda-graphs" in dry_train("tnn_lm_wt103", data_bin, NPROC="1", **env)
    assert "--tnn-cuda-graphs" in dry_train("tnn_lm_wt103", data_bin, **env)  # NPROC: the 2 GPUs
    assert "--tnn-cuda-graphs" in dry_train("tnn_lm_wt103", data_bin, NPROC="1", NNODES="2", NODE_RANK="0",
                                             MASTER_ADDR="10.0.0.1", MASTER_PORT="29500", **env)
    assert "--tnn-cuda-graphs" not in dry_train("tnn_lm_wt103", data_bin, CUDA_GRAPHS="0", **env)


def test_train_multiprocess_command_is_accepted_by_the_launcher(data_bin, tmp_path):
    """The NPROC > 1 command line, run through fairseq_tnn.distributed.launch --dry-run: one torchrun command
    that starts 2 ranks, each told its rank by torchrun (${local_rank})."""
    pytest.importorskip("fairseq_tnn.distributed.launch")
    argv = dry_train("tnn_lm_tiny", data_bin, CPU="1", NPROC="2", SEQS_PER_UPDATE="8", BATCH_PER_GPU="4",
                     SAVE_ROOT=str(tmp_path))
    out, _ = ok([*argv[:5], "--dry-run", *argv[5:]])
    (line,) = out.splitlines()
    f = flags(shlex.split(line))
    assert "-m torch.distributed.run --nproc-per-node 2 " in line and " -m fairseq_cli.train " in line, line
    assert f["--distributed-world-size"] == ["2"] and f["--distributed-rank"] == ["${local_rank}"]
    assert f["--batch-size"] == ["4"] and f["--update-freq"] == ["1"] and f["--user-dir"] == [USER_DIR]


@pytest.mark.parametrize("env,message", [
    ({"NPROC": "3"}, "SEQS_PER_UPDATE=128 is not divisible by BATCH_PER_GPU=8 x 3 processes = 24; change BATCH_PER_GPU"),
    ({"NPROC": "1", "BATCH_PER_GPU": "0"}, "SEQS_PER_UPDATE (128), BATCH_PER_GPU (0) and the number of processes (1) "
                                           "must be positive integers"),
    ({"NPROC": "x"}, "NPROC must be a positive integer"),
    ({"NPROC": "1", "PRECISION": "fp8"}, "PRECISION must be fp16, bf16, bf16-autocast or fp32, not 'fp8'"),
    ({"NPROC": "1", "TNN_COMPILE": "yes"}, "TNN_COMPILE must be 0 or 1 (--tnn-compile), or strict (--tnn-compile "
                                           "strict), not 'yes'"),
    ({"CPU": "1", "PRECISION": "fp16"}, "CPU=1 trains in fp32 or bf16 (PRECISION=fp32, bf16 or bf16-autocast), not fp16"),
    ({"CPU": "1", "CUDA_GRAPHS": "1"}, "CUDA_GRAPHS=1 runs the compiled layers as CUDA graphs on a GPU: it needs "
                                       "TNN_COMPILE=1 or strict and a GPU (here TNN_COMPILE=0, CPU=1); set CUDA_GRAPHS=0"),
    ({"NPROC": "1", "CUDA_GRAPHS": "yes"}, "CUDA_GRAPHS must be 0 or 1 (--tnn-cuda-graphs), not 'yes'"),
    ({"NPROC": "1", "TNN_COMPILE": "0", "CUDA_GRAPHS": "1"}, "CUDA_GRAPHS=1 runs the compiled layers as CUDA graphs on "
                                                             "a GPU: it needs TNN_COMPILE=1 or strict and a GPU (here "
                                                             "TNN_COMPILE=0, CPU=0); set CUDA_GRAPHS=0"),
    ({"CPU": "yes", "NPROC": "1"}, "CPU must be 0 (train on GPUs) or 1 (train on the CPU), not 'yes'"),
    ({"NPROC": "1", "OVERSIZED": "maybe", "BATCH_PER_GPU": "0"}, "OVERSIZED must be drop or error, not 'maybe'"),  # first
    ({"NPROC": "1", "OVERSIZED": "drop"}, "OVERSIZED=drop applies to the masked presets only"),  # not ignored
])
def test_train_rejects_bad_settings(data_bin, env, message):
    rc, out, err = sh(["bash", SCRIPTS / "train.sh", "tnn_lm_wt103", data_bin], {"DRY_RUN": "1", **env})
    assert rc == 2 and message in err and out == "", (rc, out, err)


def test_train_dry_run_without_data_prints_the_command_and_says_what_is_missing(tmp_path):
    rc, out, err = sh(["bash", SCRIPTS / "train.sh", "tnn_lm_wt103", "data-bin/nowhere"],
                      {"SAVE_ROOT": str(tmp_path), "NPROC": "1"})
    assert rc == 2 and "no binarised data in 'data-bin/nowhere'" in err and out == ""
    out, err = ok(["bash", SCRIPTS / "train.sh", "tnn_lm_wt103", "data-bin/nowhere"],
                  {"SAVE_ROOT": str(tmp_path), "NPROC": "1", "DRY_RUN": "1"})
    assert "no binarised data in 'data-bin/nowhere'" in err and "a real run stops here" in err
    argv = shlex.split(out)
    assert argv[1] == str(ROOT / "data-bin" / "nowhere") and flags(argv[2:])["--arch"] == ["tnn_lm_wt103"]
    assert not list(tmp_path.iterdir())  # a dry run creates nothing


def test_train_refuses_an_existing_run_without_force(data_bin, tmp_path):
    run_dir = tmp_path / "tnn_lm_tiny"
    run_dir.mkdir()
    ckpt = run_dir / "checkpoint_last.pt"
    ckpt.write_bytes(b"precious")
    before = ckpt.stat().st_mtime_ns
    rc, out, err = sh(["bash", SCRIPTS / "train.sh", "tnn_lm_tiny", data_bin], {"CPU": "1", "SAVE_ROOT": str(tmp_path)})
    assert rc == 2 and "refusing to overwrite" in err and "FORCE=1" in err, (rc, out, err)
    assert ckpt.read_bytes() == b"precious" and ckpt.stat().st_mtime_ns == before
    # the dry run prints the command whatever is on disk, saying what a real run would refuse
    out, err = ok(["bash", SCRIPTS / "train.sh", "tnn_lm_tiny", data_bin],
                  {"CPU": "1", "SAVE_ROOT": str(tmp_path), "DRY_RUN": "1"})
    assert "refusing to overwrite" in err and "a real run stops here" in err and "fairseq-train" in out
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
    assert rc == 2 and "refusing to overwrite" in err


def test_train_sh_trains_on_cpu_with_json_log_and_tensorboard(train_sh_run):
    for name in ("checkpoint_best.pt", "checkpoint_last.pt", "checkpoint_1_2.pt", "checkpoint_1_4.pt"):
        assert (train_sh_run / name).is_file(), name
    records = []
    for line in (train_sh_run / "train.log").read_text().splitlines():
        if line.startswith('{"'):  # json log lines (the config dump starts with "{'")
            records.append(json.loads(line))
    valid = [r for r in records if "valid_ppl" in r]
    inner = [r for r in records if "update_ms" in r and "num_updates" in r]
    assert [r["valid_num_updates"] for r in valid] == ["2", "4"]
    assert [r["num_updates"] for r in inner] == ["1", "2", "3", "4"] and all("max_rss_mb" in r for r in inner)
    assert any((train_sh_run / "tensorboard").rglob("events.out.tfevents.*"))
    assert shlex.split((train_sh_run / "command.txt").read_text())[0] == cli("fairseq-train")


@pytest.mark.parametrize("arg", ["--distributed-world-size", "--ddp-backend=pytorch_ddp", "--distributed-rank"])
def test_train_refuses_distributed_options_among_the_extra_arguments(data_bin, tmp_path, arg):
    """They are train.sh's (from NPROC, NNODES and CPU): one would change the tokens per update."""
    rc, out, err = sh(["bash", SCRIPTS / "train.sh", "tnn_lm_tiny", data_bin, arg, "2"],
                      {"CPU": "1", "SAVE_ROOT": str(tmp_path)})
    assert (rc, out) == (2, "") and err == (f"train.sh: error: {arg} is set by this script from NPROC, NNODES and "
                                           "CPU; remove it from the fairseq-train arguments\n"), err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("env,head,update_freq", [
    ({"CPU": "1", "NPROC": "1", "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"},
     ["--nproc", "1", "--cpu", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port",
      "29500"], "8"),  # 128 / (8 x 2)
    ({"NPROC": "8", "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "node1", "MASTER_PORT": "1234"},
     ["--nproc", "8", "--nnodes", "2", "--node-rank", "0", "--master-addr", "node1", "--master-port", "1234"], "1"),
    ({"CPU": "1", "NPROC": "2", "MASTER_PORT": "1234"}, ["--nproc", "2", "--cpu", "--port", "1234"], "8"),
])
def test_train_several_machines_run_the_launcher_at_the_papers_tokens_per_update(data_bin, tmp_path, env, head,
                                                                                  update_freq):
    """NNODES x NPROC is the world: update-freq keeps 128 sequences per update (issue 41: the launcher's flags
    in torchrun's terms, one launch per machine)."""
    argv = dry_train("tnn_lm_wt103" if "CPU" not in env else "tnn_lm_tiny", data_bin, SAVE_ROOT=str(tmp_path), **env)
    assert argv[:3] == [script_env()["PYTHON"], "-m", "fairseq_tnn.distributed.launch"]
    assert argv[3:argv.index("--")] == head and flags(argv)["--update-freq"] == [update_freq]
    split = argv.index("--")  # and the launcher takes it (its dry run: the command it would run on this machine)
    out, _ = ok([*argv[:split], *([] if "--cpu" in head else ["--gpu"]), "--dry-run", *argv[split:]])
    assert f"--distributed-world-size {int(env.get('NNODES', 1)) * int(env['NPROC'])} " in out, out


@pytest.mark.parametrize("env,message", [
    ({"NNODES": "0"}, "NNODES must be a positive integer, not '0'"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, "NODE_RANK must be 0 to NNODES - 1 = 1, not '2'"),
    ({"NNODES": "2", "NODE_RANK": "-1", "MASTER_ADDR": "h"}, "NODE_RANK must be 0 to NNODES - 1, not '-1'"),
    ({"NNODES": "2"}, "MASTER_ADDR must be the NODE_RANK 0 machine's address when NNODES > 1, not ''"),
    ({"NNODES": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT must be a port, 1 to 65535, not '70000'"),
    ({"MASTER_ADDR": "10.0.0.1"}, "MASTER_ADDR=10.0.0.1 is for several machines (NNODES > 1)"),
    ({"MASTER_PORT": "1234"}, "MASTER_PORT=1234 is for several processes (NPROC > 1 or NNODES > 1); one process"),
    ({"FORCE": "yes"}, "FORCE must be 0 or 1, not 'yes'"),
    ({"MAX_UPDATE": "1e4"}, "MAX_UPDATE must be a positive integer, not '1e4'"),
    ({"LR": "fast"}, "LR must be a positive number, not 'fast'"),
])
def test_train_knobs_refused_in_process(data_bin, tmp_path, monkeypatch, capsys, env, message):
    """The entry point, called as train.sh calls it: one line naming the knob, exit 2, nothing written."""
    from fairseq_tnn.commands import main
    for name, value in {"CPU": "1", "NPROC": "1", "SAVE_ROOT": str(tmp_path), **env}.items():
        monkeypatch.setenv(name, value)
    assert main(["--prog", "train.sh", "train", "tnn_lm_tiny", str(data_bin)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"train.sh: error: {message}") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())


def test_train_only_node_rank_0_claims_the_run_directory(data_bin, tmp_path, monkeypatch, capsys):
    """A failed attempt's files (no checkpoint) in a shared run directory: NODE_RANK 1 leaves them and writes no
    command.txt, NODE_RANK 0 moves them to previous-attempt/ and appends its command (the command run in this
    process, os.execvp recorded instead)."""
    from fairseq_tnn.commands import main, train
    run_dir = tmp_path / "tnn_lm_tiny"
    run_dir.mkdir()
    (run_dir / "command.txt").write_text("the failed attempt\n")
    ran = []
    monkeypatch.setattr(train.os, "execvp", lambda prog, argv: ran.append(argv))
    env = {"CPU": "1", "NPROC": "1", "NNODES": "2", "MASTER_ADDR": "10.0.0.1", "SAVE_ROOT": str(tmp_path)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NODE_RANK", "1")
    main(["--prog", "train.sh", "train", "tnn_lm_tiny", str(data_bin)])
    assert sorted(p.name for p in run_dir.iterdir()) == ["command.txt"]
    assert (run_dir / "command.txt").read_text() == "the failed attempt\n" and "--node-rank 1" in " ".join(ran[0])
    monkeypatch.setenv("NODE_RANK", "0")
    main(["--prog", "train.sh", "train", "tnn_lm_tiny", str(data_bin)])
    assert (run_dir / "previous-attempt" / "command.txt").read_text() == "the failed attempt\n"
    assert shlex.split((run_dir / "command.txt").read_text()) == ran[1] and "--node-rank" in ran[1]
    assert "holds no checkpoint" in capsys.readouterr().err


def test_train_resume_with_another_dictionary_stops_naming_both(data_bin, tmp_path, train_sh_run):
    """issue 40: a second corpus resumed into the first's run directory stopped in fairseq's state_dict size
    mismatch traceback; now one line names the checkpoint's data and dictionary size and the new ones."""
    run_dir = tmp_path / "tnn_lm_tiny"
    run_dir.mkdir()
    shutil.copy(train_sh_run / "checkpoint_last.pt", run_dir / "checkpoint_last.pt")
    other = tmp_path / "other-bin"
    shutil.copytree(data_bin, other)
    words = (other / "dict.txt").read_text().splitlines()
    (other / "dict.txt").write_text("\n".join(words + [f"extra{i} 1" for i in range(8)]) + "\n")
    symbols = 4 + len(words)
    env = {"CPU": "1", "SAVE_ROOT": str(tmp_path), "RESUME": "1", "MAX_UPDATE": "6", "TOKENS_PER_SAMPLE": "64",
           "SEQS_PER_UPDATE": "8", "NUM_WORKERS": "0"}
    rc, out, err = sh(["bash", SCRIPTS / "train.sh", "tnn_lm_tiny", other], env)
    assert (rc, out) == (2, ""), (rc, out[-2000:], err[-3000:])
    assert err.splitlines()[-1] == (
        f"train.sh: error: {run_dir}/checkpoint_last.pt was trained with the dictionary of {data_bin} ({symbols} "
        f"symbols), not with {other}/dict.txt ({symbols + 8} symbols); resume it on its own data, or train this data "
        "beside it (RUN_NAME=<another name>) or over it (FORCE=1)"), err
    assert "Traceback" not in err and sorted(p.name for p in run_dir.iterdir()) == ["checkpoint_last.pt"]
    # its own data resumes (the dry run: the command, no refusal)
    out, err = ok(["bash", SCRIPTS / "train.sh", "tnn_lm_tiny", data_bin], {**env, "DRY_RUN": "1"})
    assert "RESUME=1: continuing the run" in err and "error" not in err and "fairseq-train" in out
    # a requeued SLURM job (RESUME=1 by itself) against the other data stops the same way, before srun
    slurm = {"CPU": "1", "DATA": str(other), "SAVE_ROOT": str(tmp_path), "SLURM_NNODES": "1",
             "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}
    rc, out, err = sh(["bash", SCRIPTS / "slurm" / "train.sbatch", "tnn_lm_tiny"], slurm)
    assert (rc, out) == (2, "") and err.splitlines()[-1].startswith(
        f"train.sbatch: error: {run_dir}/checkpoint_last.pt was trained with the dictionary of {data_bin} "), err


def test_train_sh_on_two_machines_trains_one_run(data_bin, tmp_path):
    """Two "machines" as two train.sh commands on this machine (NNODES=2, NODE_RANK 0 and 1, the master on
    127.0.0.1), one CPU process each: one run of world 2 at update-freq 1 (8 sequences per update as 2 x 4), its
    run directory claimed and its command written by NODE_RANK 0 alone."""
    from fairseq_tnn.distributed.launch import free_port
    env = script_env({"CPU": "1", "NPROC": "1", "NNODES": "2", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": str(free_port()), "MAX_UPDATE": "4", "TOKENS_PER_SAMPLE": "64",
                      "SEQS_PER_UPDATE": "8", "BATCH_PER_GPU": "4", "LR": "0.003", "WARMUP_UPDATES": "2",
                      "VALIDATE_INTERVAL_UPDATES": "4", "SAVE_INTERVAL_UPDATES": "4", "LOG_INTERVAL": "1",
                      "NUM_WORKERS": "0", "SAVE_ROOT": str(tmp_path / "ck")})
    procs, logs = [], [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    for rank in (0, 1):
        with open(logs[rank], "w") as log:  # files, not pipes: a node blocked on a full pipe would stall the other
            procs.append(subprocess.Popen(["bash", SCRIPTS / "train.sh", "tnn_lm_tiny", data_bin, "--max-valid-steps",
                                           "2"], stdout=log, stderr=subprocess.STDOUT, env={**env, "NODE_RANK": str(rank)},
                                          cwd=ROOT))
    codes, out = wait_all(procs, logs)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in out)
    assert "train.sh: tnn_lm_tiny, 1 process(es) on each of 2 machines (this one NODE_RANK 0), update-freq 1" in out[0]
    assert "training on 2 devices" in out[0] and "'distributed_world_size': 2" in out[0], out[0][-3000:]
    run_dir = tmp_path / "ck" / "tnn_lm_tiny"
    assert (run_dir / "checkpoint_last.pt").is_file() and not (run_dir / "previous-attempt").exists()
    (command,) = (run_dir / "command.txt").read_text().splitlines()  # NODE_RANK 0's only
    assert "--nnodes 2 --node-rank 0 --master-addr 127.0.0.1 " in command
    records = [json.loads(line) for line in (run_dir / "train.log").read_text().splitlines() if line.startswith('{"')]
    assert [r["num_updates"] for r in records if "update_ms" in r and "num_updates" in r] == ["1", "2", "3", "4"]
