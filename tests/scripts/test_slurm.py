"""scripts/slurm/train.sbatch and extrapolation.sbatch, run as SLURM would run them (DRY_RUN=1, SLURM_*
variables set): train.sh's recipe under srun for every preset, requeued jobs, refusals outside SLURM."""
import re
import shlex
import shutil

import pytest

from helpers import ROOT, SCRIPTS, SLURM, USER_DIR, cli, dry_train, flags, ok, sh, wt103_presets

CAUSAL = wt103_presets("tnn_lm")
EXPERIMENTS = CAUSAL + wt103_presets("tnn_mlm")


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
    rc, out, err = sh(["bash", TRAIN_SBATCH, "tnn_lm_wt103"], {**env, "DRY_RUN": "0"})
    assert rc == 2 and "already exists; refusing to overwrite it" in err and out == ""
    out, err = ok(["bash", TRAIN_SBATCH, "tnn_lm_wt103"], env)  # the dry run prints the command and says so
    assert "already exists; refusing to overwrite it" in err and "a real run stops here" in err
    assert out.startswith("srun ")
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
