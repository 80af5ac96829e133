"""scripts/slurm/train.sbatch and extrapolation.sbatch run with bash and DRY_RUN=1, SLURM's variables set by
hand: the layouts that cannot run here (nodes of 8 GPUs) at the paper's tokens per update, the command next to
train.sh's, and the refusals made before any work. tests/scripts/test_slurm_real.py runs them under a real SLURM."""
import re
import shlex
import shutil

import pytest

from helpers import ROOT, SLURM, USER_DIR, cli, dry_train, flags, ok, sh, wt103_presets

CAUSAL = wt103_presets("tnn_lm")
EXPERIMENTS = CAUSAL + wt103_presets("tnn_mlm")
TRAIN_SBATCH = SLURM / "train.sbatch"
# docs/references.md#published-configurations: sequences x tokens per update, causal and masked
PAPER_TOKENS_PER_UPDATE = {"fd_tnn_lm_wt103": 128 * 512, "ski_tnn_mlm_wt103": 512 * 512}


def sbatch_header(path):
    return dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)", path.read_text(), re.M))


def slurm_env(nodes, tasks, gpus, **env):
    """The variables SLURM sets in a job of `nodes` nodes x `tasks` tasks, with `gpus` GPUs per node."""
    return {"DRY_RUN": "1", "SLURM_NNODES": str(nodes), "SLURM_NTASKS_PER_NODE": str(tasks), "SLURM_JOB_ID": "4242",
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus))), **env}


EIGHT_GPUS = dict(gpus=8)


def header_layout():
    head = sbatch_header(TRAIN_SBATCH)
    return int(head["nodes"]), int(head["ntasks-per-node"]), int(head["gpus-per-node"])


# (nodes, tasks per node, GPUs per node): the header's, two nodes, fewer tasks than GPUs, fewer GPUs, and one task
# per node, where fairseq itself spawns a process per GPU and sets the world size to nodes x GPUs
# (fairseq/distributed/utils.py, _infer_slurm_init), whatever --distributed-world-size says.
LAYOUTS = [header_layout(), (2, 8, 8), (1, 4, 8), (1, 4, 4), (1, 2, 2), (1, 1, 8), (2, 1, 8), (1, 1, 1)]


@pytest.mark.runs_doc(r'^sbatch --gpus-per-node=4 --ntasks-per-node=4 scripts/slurm/train\.sbatch fd_tnn_lm_wt103$')
@pytest.mark.parametrize("preset", sorted(PAPER_TOKENS_PER_UPDATE))
@pytest.mark.parametrize("nodes,tasks,gpus", LAYOUTS)
def test_every_layout_trains_at_the_papers_tokens_per_update(data_bin, tmp_path, preset, nodes, tasks, gpus):
    env = slurm_env(nodes, tasks, gpus, DATA=str(data_bin), SAVE_ROOT=str(tmp_path))
    out, err = ok(["bash", TRAIN_SBATCH, preset], env)
    f = flags(shlex.split(out)[3:])
    processes = nodes * gpus if tasks == 1 else nodes * tasks
    tokens = int(f["--batch-size"][0]) * int(f["--update-freq"][0]) * processes * int(f["--tokens-per-sample"][0])
    assert tokens == PAPER_TOKENS_PER_UPDATE[preset], (out, err)
    assert f["--distributed-world-size"] == [str(processes)] and "--cpu" not in f


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


@pytest.mark.runs_doc(r'^sbatch (--nodes=2 |--job-name=\w+ )?scripts/slurm/train\.sbatch \w+_wt103(_rpe3)?$')
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_sbatch_dry_run_is_train_sh_recipe_under_srun(data_bin, tmp_path, experiment):
    env = slurm_env(2, 8, **EIGHT_GPUS, DATA=str(data_bin), SAVE_ROOT=str(tmp_path))
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
           "SLURM_NTASKS": "8", "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(ROOT), "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    out, _ = ok(["bash", spool / "slurm_script", "fd_tnn_lm_wt103"], env)
    f = flags(shlex.split(out)[3:])
    assert f["--user-dir"] == [USER_DIR] and f["--distributed-world-size"] == ["8"] and f["--update-freq"] == ["2"]
    rc, _, err = sh(["bash", spool / "slurm_script", "fd_tnn_lm_wt103"], {**env, "SLURM_SUBMIT_DIR": str(tmp_path)})
    assert rc == 2 and "cannot find the repository" in err


def test_sbatch_requeued_job_continues_its_run_and_a_new_job_refuses_it(data_bin, tmp_path):
    run_dir = tmp_path / "tnn_lm_wt103"
    run_dir.mkdir()
    (run_dir / "checkpoint_last.pt").write_bytes(b"precious")
    env = slurm_env(1, 8, **EIGHT_GPUS, DATA=str(data_bin), SAVE_ROOT=str(tmp_path))
    rc, out, err = sh(["bash", TRAIN_SBATCH, "tnn_lm_wt103"], {**env, "DRY_RUN": "0"})
    assert rc == 2 and "already exists; refusing to overwrite it" in err and out == ""
    out, err = ok(["bash", TRAIN_SBATCH, "tnn_lm_wt103"], env)  # the dry run prints the command and says so
    assert "already exists; refusing to overwrite it" in err and "a real run stops here" in err
    assert out.startswith("srun ")
    out, err = ok(["bash", TRAIN_SBATCH, "tnn_lm_wt103"], {**env, "SLURM_RESTART_COUNT": "1", "FORCE": "1"})
    assert "RESUME=1: continuing the run" in err and "deleting" not in err and out.startswith("srun ")
    assert (run_dir / "checkpoint_last.pt").read_bytes() == b"precious"


def test_sbatch_outside_slurm_refuses(data_bin):
    rc, out, err = sh(["bash", TRAIN_SBATCH, "tnn_lm_wt103"], {"DATA": str(data_bin)})
    assert rc == 2 and "not inside a SLURM job" in err and out == ""


@pytest.mark.parametrize("args,env,message", [
    (["tnn_lm_wt103", "data-bin/sample"], {}, "'data-bin/sample' is not a fairseq-train option: extra arguments go "
                                              "to fairseq-train and the data comes from DATA (DATA=data-bin/sample"),
    (["tnn_lm_wt103", "--distributed-world-size", "4"], {}, "--distributed-world-size is set by this script"),
    (["tnn_lm_wt103", "--ddp-backend=pytorch_ddp"], {}, "--ddp-backend=pytorch_ddp is set by this script"),
    (["tnn_lm_wt103"], {"SLURM_NTASKS_PER_NODE": "16"}, "--ntasks-per-node=16 but 8 GPU(s) visible"),
    (["tnn_lm_wt103"], {"CUDA_VISIBLE_DEVICES": ""}, "no GPU visible on this node"),
    (["tnn_lm_wt103"], {"CPU": "yes"}, "CPU must be 0 (train on GPUs) or 1 (train on the CPU), not 'yes'"),
    (["tnn_lm_wt103"], {"SLURM_NTASKS_PER_NODE": "", "SLURM_NNODES": "2", "SLURM_NTASKS": "7"},
     "7 tasks on 2 nodes: give every node the same number"),
])
def test_sbatch_refuses_a_bad_submission_before_any_work(data_bin, tmp_path, args, env, message):
    env = {**slurm_env(1, 8, **EIGHT_GPUS, DATA=str(data_bin), SAVE_ROOT=str(tmp_path / "ck")), "DRY_RUN": "0", **env}
    rc, out, err = sh(["bash", TRAIN_SBATCH, *args], env)
    assert rc == 2 and message in err and out == "", (rc, out, err)
    assert list(tmp_path.iterdir()) == []


def test_extrapolation_array_refusals():
    script = SLURM / "extrapolation.sbatch"
    rc, _, err = sh(["bash", script, "A=a.pt"], {"DRY_RUN": "1", "SLURM_ARRAY_TASK_ID": "6"})
    assert rc == 2 and "array task 6 but only 6 LENGTHS" in err and "use --array=0-5" in err
    rc, _, err = sh(["bash", script, "A=a.pt"], {"DRY_RUN": "1"})
    assert rc == 2 and "not an array task" in err
    rc, _, err = sh(["bash", script], {"DRY_RUN": "1", "SLURM_ARRAY_TASK_ID": "0"})
    assert rc == 2 and "usage:" in err
