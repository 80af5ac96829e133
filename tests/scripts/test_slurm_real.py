"""scripts/slurm/*.sbatch under a real SLURM, submitted with sbatch as docs/training.md#slurm and
docs/evaluation.md tell a user to, on CPU with the tiny causal preset and data/sample: one task; two tasks on one
node (gloo ranks) with the losses and parameters of the one-task run at the same tokens per update; a job
requeued after its first checkpoint that resumes from checkpoint_last.pt, ends as the uninterrupted run, and
keeps both attempts in its log; the extrapolation array and its report job (--dependency=afterok).

They need a cluster that answers `sinfo` (CI starts one of two nodes: .ci/run runs scripts/slurm/local_cluster.sh),
with at least 2 CPUs on a node; without one they are skipped, except under CI=true, where they fail. The jobs on
two nodes are in test_slurm_nodes.py."""
import json
import os
import re
import subprocess
import time

import pytest
import torch

from helpers import ROOT, SLURM, script_env, split_tokens

pytestmark = pytest.mark.slow

# The tiny causal recipe through train.sbatch's knobs: 6 updates of 8 sequences x 64 tokens, a checkpoint and a
# validation every 3. One task: --batch-size 4 --update-freq 2; two tasks: --batch-size 4 each, --update-freq 1.
# PYTHONFAULTHANDLER: as in test_slurm_nodes.py, a rank that aborts prints its Python threads' stacks
TRAIN = {"CPU": "1", "MAX_UPDATE": "6", "TOKENS_PER_SAMPLE": "64", "SEQS_PER_UPDATE": "8", "BATCH_PER_GPU": "4",
         "LR": "0.003", "WARMUP_UPDATES": "2", "LOG_INTERVAL": "1", "NUM_WORKERS": "0",
         "VALIDATE_INTERVAL_UPDATES": "3", "SAVE_INTERVAL_UPDATES": "3", "PYTHONFAULTHANDLER": "1"}
UPDATES = list(range(1, 7))
# The header's GPUs and tasks overridden for a CPU partition, as docs/training.md#slurm says
CPU_TASKS = ["--gpus-per-node=0", "--cpus-per-task=1"]
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
        "PREEMPTED"}
# Installed as sitecustomize in the jobs' processes. A job given TNN_HOLD_WRITES stops (sleeps) in its first attempt
# before it writes that file, so that the test requeues it after a checkpoint and before the run ends. A job given
# TNN_EXIT_LOG has each fairseq-train rank write, when its interpreter exits (atexit, after fairseq's
# distributed_main has returned), its rank, its node and how many gloo process-group threads still run there
# (fairseq_tnn/patches/destroy_group_at_end.py stops them, so that none can abort the finished rank).
HOOK = """
import os, sys, time

def _hold(event, args):
    if (event == "open" and os.environ["TNN_HOLD_WRITES"] in str(args[0]) and "w" in str(args[1])
            and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"):
        while True:
            time.sleep(60)

def _record_exit():  # registered first, so it runs last of the atexit handlers
    if "fairseq_cli.train" in sys.modules:  # a rank, not the job's other Python processes
        # imported here: imported at start-up, fairseq would take the plugin for imported and not register it
        from fairseq_tnn.distributed.threads import gloo_threads
        with open(os.environ["TNN_EXIT_LOG"], "a") as log:
            log.write(f"{os.environ.get('SLURM_PROCID', '?')} {os.uname().nodename} {len(gloo_threads())}\\n")

if "TNN_HOLD_WRITES" in os.environ:
    sys.addaudithook(_hold)
if "TNN_EXIT_LOG" in os.environ:
    import atexit
    atexit.register(_record_exit)
"""


def with_hook(hook_dir, env):
    """env with hook_dir (holding HOOK as its sitecustomize.py) first on the jobs' PYTHONPATH."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(hook_dir), os.environ.get("PYTHONPATH")]))}


def exits_of(path):
    """The ranks' records of TNN_EXIT_LOG: sorted [(rank, node, gloo threads still running)]."""
    return sorted((int(rank), node, int(threads)) for rank, node, threads in
                  (line.split() for line in path.read_text().splitlines()))


def failure_report(record, log):
    """A job's state and what its log says of a failure, for an assertion's message: scontrol's main fields; every
    line that reports an error, with the 60 lines after a fatal error (faulthandler's stacks of the Python threads of
    a rank that aborted); and the log's last 40 lines."""
    fields = ("JobId", "JobState", "Reason", "ExitCode", "Restarts", "NodeList", "BatchHost")
    lines = log.splitlines()
    marks = [i for i, line in enumerate(lines)
             if re.search(r"Fatal Python error|terminate called|Traceback|srun: error|slurmstepd: error|Error", line)]
    shown = sorted({j for i in marks for j in range(i, min(len(lines), i + (61 if "Fatal" in lines[i] else 1)))})
    errors = "\n".join(lines[i] for i in shown[:400])
    return (f"job {' '.join(f'{k}={record.get(k)}' for k in fields)}\n--- its log's error lines ---\n{errors}\n"
            f"--- its log's end ---\n" + "\n".join(lines[-40:]))


def no_cluster(nodes=1):
    """Why no SLURM cluster with `nodes` nodes answers here, or None when `sinfo` shows one."""
    try:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"sinfo: {error}"
    if proc.returncode != 0:
        return f"sinfo failed: {proc.stderr.strip()}"
    found = set(proc.stdout.split())
    return None if len(found) >= nodes else f"{len(found)} node(s), {nodes} needed"


def require_cluster(nodes=1):
    """Skip the caller unless a SLURM cluster with `nodes` nodes answers; under CI=true, fail instead."""
    why = no_cluster(nodes)
    if why:
        message = (f"no SLURM cluster answers ({why}); `bash scripts/slurm/local_cluster.sh start` (as root) starts "
                   "one of two nodes on this machine")
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {message}")
        pytest.skip(message)


def sbatch(script, args, options, env, out_dir):
    """sbatch <options> <script> <args> from the repository root, as a user submits; the job's id. The job's
    log goes to out_dir; a job that an interrupted test run leaves behind ends within 15 minutes."""
    cmd = ["sbatch", "--parsable", f"--output={out_dir}/slurm-%x-%j.out", "--time=15", *options, str(script),
           *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=script_env(env), timeout=60)
    assert proc.returncode == 0, (cmd, proc.stderr)
    return proc.stdout.strip().split(";")[0]


def jobs(job):
    """scontrol's record of a job (of each task of an array job): [{field: value}]."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, check=True).stdout
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]


def wait(job, timeout=300):
    """Until the job (every task of an array) has ended; its records."""
    deadline = time.monotonic() + timeout
    while True:
        records = jobs(job)
        if records and all(r["JobState"] in DONE for r in records):
            return records
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], check=False)
            pytest.fail(f"job {job} did not end within {timeout} s: {records}")
        time.sleep(1)


def log_of(out_dir, job):
    return (out_dir / f"slurm-fairseq-tnn-{job}.out").read_text()


def train_inner(log):
    """[(update, loss, bsz)] of the training lines of a log, in order (rank 0's: the others log warnings only)."""
    out = []
    for line in log.splitlines():
        if "| train_inner |" in line:
            stats = json.loads(line.split("| train_inner |", 1)[1])
            out.append((int(stats["num_updates"]), float(stats["loss"]), int(stats["bsz"])))
    return out


def assert_same_losses(got, want, what, seqs=8):
    """The losses of `got` (train_inner's) equal those of `want` at the same updates, at `seqs` sequences each."""
    want = {update: loss for update, loss, _ in want}
    for update, loss, bsz in got:
        # fairseq logs losses rounded to 3 decimals: one rounding step is ~1e-4 of a loss of ~12
        assert bsz == seqs and loss == pytest.approx(want[update], abs=1.1e-3), (what, update, got, want)


def assert_same_parameters(a, b, rtol):
    a, b = (torch.load(path, map_location="cpu")["model"] for path in (a, b))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def submitted(data_bin, tmp_path_factory):
    """The training jobs, submitted together (they share the node's CPUs): the two-task one first, then the one-
    task run and the run to requeue (held before its checkpoint at update 6 until test_requeue requeues it;
    submitted with FORCE=1, which a requeued job must not take as "delete the run and start over")."""
    require_cluster()
    root = tmp_path_factory.mktemp("slurm")
    hook = root / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    train = SLURM / "train.sbatch"

    def submit(name, tasks, **env):
        env = with_hook(hook, {**TRAIN, "DATA": str(data_bin), "SAVE_ROOT": str(root), "RUN_NAME": name,
                               "TNN_EXIT_LOG": str(root / f"exits-{name}.txt"), **env})
        return name, sbatch(train, ["tnn_lm_tiny"], [*CPU_TASKS, f"--ntasks-per-node={tasks}"], env, root)

    held = str(root / "requeued" / "checkpoint_1_6.pt")
    ids = dict([submit("two", 2), submit("one", 1), submit("requeued", 1, FORCE="1", TNN_HOLD_WRITES=held)])
    yield root, ids
    subprocess.run(["scancel", *ids.values()], check=False)  # whatever a failed test left


@pytest.fixture(scope="module")
def one_task(submitted):
    root, ids = submitted
    (record,) = wait(ids["one"])
    log = log_of(root, ids["one"])
    assert record["JobState"] == "COMPLETED", failure_report(record, log)
    return root / "one", log


@pytest.mark.runs_doc(r'^CPU=1 DATA=data-bin/sample sbatch --gpus-per-node=0 --ntasks-per-node=1 --cpus-per-task=1 scripts/slurm/train\.sbatch tnn_lm_tiny$')
def test_one_task_on_cpu_trains_and_saves(one_task):
    run_dir, log = one_task
    assert "train.sbatch: tnn_lm_tiny: 1 node(s) x 1 CPU task(s), update-freq 2" in log
    assert "training on 1 devices" in log and "Traceback" not in log
    assert [u for u, _, _ in train_inner(log)] == UPDATES
    assert {"checkpoint_best.pt", "checkpoint_last.pt", "checkpoint_1_3.pt", "checkpoint_1_6.pt", "train.log",
            "command.txt"} <= {p.name for p in run_dir.iterdir()}
    assert (run_dir / "command.txt").read_text().startswith("srun --kill-on-bad-exit=1 ")


def test_requeue_resumes_from_checkpoint_last_and_keeps_both_attempts_in_the_log(submitted, one_task):
    root, ids = submitted
    job, out = ids["requeued"], root / f"slurm-fairseq-tnn-{ids['requeued']}.out"
    deadline = time.monotonic() + 300
    while f"Saving checkpoint to {root / 'requeued' / 'checkpoint_1_6.pt'}" not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline and jobs(job)[0]["JobState"] not in DONE, out.read_text()[-3000:]
        time.sleep(0.5)
    subprocess.run(["scontrol", "requeue", job], check=True)
    while jobs(job)[0]["Restarts"] == "0":  # until the controller has taken the requeue (at once, in practice)
        assert time.monotonic() < deadline
        time.sleep(0.2)
    (record,) = wait(job)
    log = out.read_text()
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", failure_report(record, log)

    first, marker, second = log.partition(f"*** JOB {job} ON ")
    assert marker and "CANCELLED AT" in second.splitlines()[0] and "DUE TO JOB REQUEUE" in second.splitlines()[0]
    # the first attempt, kept: its updates 1 to 6 (held before it wrote the checkpoint at 6)
    assert "update-freq 2; logs in" in first and [u for u, _, _ in train_inner(first)] == UPDATES
    # the second: the script resumes (RESUME=1), fairseq loads checkpoint_last.pt (update 3) and goes on
    assert "RESUME=1: continuing the run" in second and "update-freq 2, restart 1; logs in" in second
    assert re.search(r"Loaded checkpoint \S*/requeued/checkpoint_last\.pt \(epoch 1 @ 3 updates\)", second), second
    assert len((root / "requeued" / "command.txt").read_text().splitlines()) == 2  # a line per attempt
    resumed = train_inner(second)
    assert [u for u, _, _ in resumed] == UPDATES[3:]
    assert_same_losses(resumed, train_inner(one_task[1]), "requeued")
    assert_same_parameters(root / "requeued" / "checkpoint_last.pt", one_task[0] / "checkpoint_last.pt", rtol=1e-6)


@pytest.mark.runs_doc(r'^CPU=1 DATA=data-bin/sample sbatch --gpus-per-node=0 --ntasks-per-node=2 --cpus-per-task=1 scripts/slurm/train\.sbatch tnn_lm_tiny$')
def test_two_tasks_on_one_node_train_as_one_task_at_the_same_tokens_per_update(submitted, one_task):
    root, ids = submitted
    (record,) = wait(ids["two"])
    log = log_of(root, ids["two"])
    assert record["JobState"] == "COMPLETED", failure_report(record, log)
    # both ranks ended with their process groups' threads stopped (destroy_group_at_end.py)
    exits = exits_of(root / "exits-two.txt")
    assert [(rank, threads) for rank, _, threads in exits] == [(0, 0), (1, 0)], exits
    assert "train.sbatch: tnn_lm_tiny: 1 node(s) x 2 CPU task(s), update-freq 1" in log
    assert "distributed init (rank 0)" in log and "distributed init (rank 1)" in log
    assert "training on 2 devices" in log and "Traceback" not in log
    two = train_inner(log)
    assert [u for u, _, _ in two] == UPDATES
    assert_same_losses(two, train_inner(one_task[1]), "two tasks")
    # the parameters after 6 updates agree to round-off (all-reduce vs. accumulation order)
    assert_same_parameters(root / "two" / "checkpoint_last.pt", one_task[0] / "checkpoint_last.pt", rtol=1e-4)


@pytest.mark.runs_doc(r'^(jid=\$\(sbatch --parsable|REPORT_ONLY=1 sbatch) .*scripts/slurm/extrapolation\.sbatch ')
def test_extrapolation_array_and_its_report_job(one_task, data_bin, tmp_path):
    """docs/evaluation.md's two sbatch lines, with a CPU partition's header overrides and two lengths."""
    script = SLURM / "extrapolation.sbatch"
    model = f"tiny={one_task[0] / 'checkpoint_best.pt'}"
    env = {"CPU": "1", "DATA": str(data_bin), "LENGTHS": "64 128", "RESULTS_ROOT": str(tmp_path), "NUM_WORKERS": "0"}
    array = sbatch(script, [model], ["--array=0-1", *CPU_TASKS], env, tmp_path)
    report = sbatch(script, [model], [f"--dependency=afterok:{array}", "--array=0", *CPU_TASKS],
                    {**env, "REPORT_ONLY": "1"}, tmp_path)
    tasks, (reported,) = wait(array), wait(report)
    assert sorted(r["JobState"] for r in tasks) == ["COMPLETED", "COMPLETED"], tasks
    assert reported["JobState"] == "COMPLETED", reported
    out = tmp_path / "extrapolation"
    assert sorted(p.name for p in (out / "raw" / "tiny").iterdir()) == ["test.L128.cw0.log", "test.L64.cw0.log",
                                                                        "valid.L64.cw0.log"]
    results = json.loads((out / "extrapolation.json").read_text())["results"]
    tokens = split_tokens(data_bin, "test")
    assert [(r["length"], r["evaluated_tokens"]) for r in results] == [(64, tokens), (128, tokens)]
    assert {"extrapolation.md", "extrapolation.png", "table.md"} <= {p.name for p in out.iterdir()}
