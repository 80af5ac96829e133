"""Multi-process CPU training through fairseq_tnn.distributed.launch (torchrun underneath): one real data-parallel
run, rank 0 alone writes checkpoints, per-update losses equal one process with --update-freq 2, and resuming works
on torch >= 2.6 (rank 0 broadcasts the checkpoint); two "machines" (two launches with --nnodes 2 on this one, 1
and 2 processes each) train as one process at the same tokens per update; plain torchrun, on one machine or two,
and --distributed-world-size on CPU are refused with the launcher command that works. Then the launcher's command
lines, errors, and what it makes of torchrun's handling of a failing rank and of a signal."""
import fractions
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import cli, lm_args, mlm_args, rank0_updates, run, wait_all
from fairseq_tnn.patches.broadcast_unpickle import broadcast_object_slow
from fairseq_tnn.distributed import launch

# 2 ranks x 4 sequences x 64 tokens per update, or 1 rank x 4 x 64 x --update-freq 2. fairseq shuffles
# the list of batches with the same seed on every rank; rank r takes batches r, r + 2, r + 4, ...
# (ShardedIterator) and --update-freq 2 takes them in consecutive pairs (GroupedIterator), so update
# k sees batches 2k and 2k + 1 in both runs.
TRAIN = lm_args(tokens_per_sample=64, batch_size=4, log_interval=1, no_epoch_checkpoints=True, disable_validation=True)
FIRST, RESUMED = 6, 8  # updates in the first 2-process run, and after resuming it

# Installed as sitecustomize in the launched processes: records every write under TNN_WATCH_DIR
# with the rank (torchrun's RANK) of the process that made it; and a process about to write a
# file whose path contains TNN_HOLD_WRITES waits there until it is killed (the SIGKILL test's checkpoint
# that must not be written: without the hold, the run could reach it between the kill's cue and the kill).
SITECUSTOMIZE = """
import os, sys, time

def _record(event, args):
    if event == "open":
        path, mode, flags = args
        writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & (os.O_WRONLY | os.O_RDWR))
    elif event in ("os.rename", "os.replace", "shutil.copyfile"):
        path, writing = args[1], True
    elif event == "os.mkdir":
        path, writing = args[0], True
    else:
        return
    if writing and str(path).startswith(os.environ["TNN_WATCH_DIR"]):
        rank = os.environ.get("RANK", "?")  # torchrun's, which fairseq joins under (--distributed-rank may say -1)
        with open(os.environ["TNN_WRITES_LOG"], "a") as log:
            log.write(f"{rank} {event} {path}\\n")

def _hold(event, args):
    if event == "open" and os.environ["TNN_HOLD_WRITES"] in str(args[0]) and args[1] and "w" in str(args[1]):
        while True:
            time.sleep(60)

def _record_exit():  # registered first, so it runs last of the atexit handlers
    import torch.distributed
    # imported here: imported at start-up, fairseq would take the plugin for imported and not register it
    from fairseq_tnn.distributed.threads import gloo_threads
    with open(os.environ["TNN_EXIT_LOG"], "a") as log:
        log.write(f"{os.environ.get('RANK', '?')} {torch.distributed.is_initialized()} {len(gloo_threads())}\\n")

if "TNN_WATCH_DIR" in os.environ:
    sys.addaudithook(_record)
if "TNN_EXIT_LOG" in os.environ:
    import atexit
    atexit.register(_record_exit)
if "TNN_HOLD_WRITES" in os.environ:
    sys.addaudithook(_hold)
"""


def with_hooks(hook_dir):
    """PYTHONPATH with hook_dir first: the launched processes import its sitecustomize (SITECUSTOMIZE)."""
    return os.pathsep.join(p for p in [str(hook_dir), os.environ.get("PYTHONPATH", "")] if p)


def launch_2_procs(data_bin, save_dir, max_update, hook_dir):
    writes = hook_dir / f"writes_{max_update}.txt"
    env = {"OMP_NUM_THREADS": "1", "TNN_WATCH_DIR": str(save_dir), "TNN_WRITES_LOG": str(writes),
           "TNN_EXIT_LOG": str(hook_dir / f"exits_{max_update}.txt"), "PYTHONPATH": with_hooks(hook_dir)}
    log = run([cli("python"), "-m", "fairseq_tnn.distributed.launch", "--nproc", 2, "--cpu",
               "--log-dir", hook_dir / f"ranks_{max_update}", "--",
               data_bin, *TRAIN, "--max-update", max_update, "--save-dir", save_dir], env=env)
    return log, writes.read_text().splitlines() if writes.exists() else []


@pytest.fixture(scope="module")
def hook_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hook")
    (path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return path


@pytest.fixture(scope="module")
def two_procs(data_bin, hook_dir, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("dist") / "checkpoints"
    log, writes = launch_2_procs(data_bin, save_dir, FIRST, hook_dir)
    first = save_dir / f"checkpoint_after_{FIRST}.pt"
    first.write_bytes((save_dir / "checkpoint_last.pt").read_bytes())  # the resume test overwrites _last
    return save_dir, log, writes, first


@pytest.fixture(scope="module")
def one_proc(data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("single") / "checkpoints"
    log = run([cli("fairseq-train"), data_bin, *TRAIN, "--update-freq", 2, "--max-update", RESUMED,
               "--save-dir", save_dir, "--save-interval-updates", FIRST])
    return save_dir, log


def assert_only_rank_0_wrote(writes, save_dir):
    assert writes, "the write recorder saw nothing: is it installed?"
    assert {w.split()[0] for w in writes} == {"0"}, writes
    assert any(w.endswith(str(save_dir / "checkpoint_last.pt")) for w in writes), writes


@pytest.mark.runs_doc(r'^python -m fairseq_tnn\.distributed\.launch --nproc 2 --cpu -- ')
@pytest.mark.slow
def test_two_processes_train_as_one_with_update_freq_2(two_procs, one_proc, hook_dir):
    save_dir, log, writes, first = two_procs
    assert "training on 2 devices" in log, log[-3000:]
    assert "[rank 1]" in log and "distributed init (rank 1)" in log  # rank 1 ran, its lines are prefixed
    (rank_1,) = (hook_dir / f"ranks_{FIRST}").glob("*/attempt_0/1/stdout.log")  # and torchrun kept them
    assert "distributed init (rank 1)" in rank_1.read_text()
    assert_only_rank_0_wrote(writes, save_dir)
    assert sorted(p.name for p in save_dir.iterdir()) == ["checkpoint_after_6.pt", "checkpoint_last.pt"]
    # each rank destroyed its process groups, and their gloo threads had stopped, before the interpreter finalized
    # (fairseq_tnn/patches/destroy_group_at_end.py: left alive, a gloo worker thread could abort the finished rank);
    # the launcher's own process (no RANK) never had one
    exits = sorted((hook_dir / f"exits_{FIRST}.txt").read_text().splitlines())
    assert exits == ["0 False 0", "1 False 0", "? False 0"], exits

    dist, single = rank0_updates(log), rank0_updates(one_proc[1])
    assert sorted(dist) == list(range(1, FIRST + 1)), log[-3000:]
    for update, (loss, bsz) in dist.items():
        # fairseq logs losses rounded to 3 decimals: one rounding step is ~1e-4 of a loss of ~12
        assert bsz == single[update][1] == 8
        assert loss == pytest.approx(single[update][0], abs=1.1e-3), (update, dist, single)
    # the parameters after 6 updates agree to round-off (all-reduce vs. accumulation order)
    a = torch.load(first, map_location="cpu")["model"]
    b = torch.load(one_proc[0] / f"checkpoint_1_{FIRST}.pt", map_location="cpu")["model"]
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_resume_two_processes_from_checkpoint_last(two_procs, one_proc, data_bin, hook_dir):
    save_dir = two_procs[0]
    log, writes = launch_2_procs(data_bin, save_dir, RESUMED, hook_dir)
    assert re.search(rf"Loaded checkpoint .*checkpoint_last\.pt \(epoch 1 @ {FIRST} updates\)", log), log[-3000:]
    assert "Unsupported global" not in log and "Traceback" not in log
    resumed, single = rank0_updates(log), rank0_updates(one_proc[1])
    assert sorted(resumed) == list(range(FIRST + 1, RESUMED + 1)), log[-3000:]
    for update, (loss, _) in resumed.items():  # it continues exactly where the uninterrupted run goes
        assert loss == pytest.approx(single[update][0], abs=1.1e-3), (update, resumed, single)
    assert_only_rank_0_wrote(writes, save_dir)


def launch_nodes(nnodes, nproc, train, run_dir, hook_dir):
    """The launcher run as `nnodes` machines would run it, here as that many launches on this machine (node
    ranks 0 to nnodes - 1, the master at 127.0.0.1 on a free port), on CPU, `nproc` processes each: each
    node's output (node 0 first) and the writes under the --save-dir in `train` (rank, event, path)."""
    save_dir = Path(train[train.index("--save-dir") + 1])
    writes = run_dir / "writes.txt"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TNN_WATCH_DIR=str(save_dir),
               TNN_WRITES_LOG=str(writes), PYTHONPATH=with_hooks(hook_dir))
    port, procs, logs = launch.free_port(), [], [run_dir / f"node{r}.log" for r in range(nnodes)]
    for rank in range(nnodes):
        cmd = [cli("python"), "-m", "fairseq_tnn.distributed.launch", "--nproc", str(nproc), "--cpu",
               "--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port",
               str(port), "--log-dir", str(run_dir / f"ranks{rank}"), "--", *map(str, train)]
        with open(logs[rank], "w") as log:  # files, not pipes: a node blocked on a full pipe would stall the others
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env))
    codes, out = wait_all(procs, logs)
    assert codes == [0] * nnodes, "\n".join(o[-3000:] for o in out)
    return out, writes.read_text().splitlines() if writes.exists() else []


def assert_same_parameters(a_path, b_path):
    a, b = (torch.load(p, map_location="cpu")["model"] for p in (a_path, b_path))
    assert a.keys() == b.keys()
    for name in a:  # all-reduce vs. accumulation: the same sums, to round-off
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_two_machines_train_as_one_process_with_update_freq_2(data_bin, tmp_path, hook_dir, one_proc):
    """Two "machines" (two launches with --nnodes 2, node ranks 0 and 1), one CPU process each: one run of 2
    ranks ("training on 2 devices"), whose losses and parameters equal one process's at the same tokens per
    update (--update-freq 2), and whose checkpoints only rank 0, on node 0, writes."""
    save_dir = tmp_path / "checkpoints"
    (node0, node1), writes = launch_nodes(2, 1, [data_bin, *TRAIN, "--max-update", FIRST, "--save-dir", save_dir],
                                          tmp_path, hook_dir)
    assert "torchrun starts 1 CPU processes on node 0 of 2" in node0 and "on node 1 of 2" in node1
    assert "training on 2 devices" in node0 and "initialized host" in node1, node1[-3000:]
    assert "train_inner" not in node1  # rank 1 logs warnings only
    assert_only_rank_0_wrote(writes, save_dir)
    dist, single = rank0_updates(node0), rank0_updates(one_proc[1])
    assert sorted(dist) == list(range(1, FIRST + 1)), node0[-3000:]
    for update, (loss, bsz) in dist.items():
        assert (loss, bsz) == (single[update][0], 8), (update, dist, single)
    assert_same_parameters(save_dir / "checkpoint_last.pt", one_proc[0] / f"checkpoint_1_{FIRST}.pt")


@pytest.mark.slow
@pytest.mark.runs_doc(r"^python -m fairseq_tnn\.distributed\.launch --nproc \d+ (--cpu )?--nnodes 2 --node-rank [01] ")
def test_two_machines_of_two_processes_train_as_one_process_with_update_freq_4(data_bin, tmp_path, hook_dir):
    """2 machines x 2 CPU processes (world 4), 2 sequences per process: equal to one process with 2 sequences
    per batch and --update-freq 4."""
    train = lm_args(tokens_per_sample=64, batch_size=2, log_interval=1, no_epoch_checkpoints=True,
                    disable_validation=True) + ["--max-update", 4]
    single = run([cli("fairseq-train"), data_bin, *train, "--update-freq", 4, "--save-dir", tmp_path / "single"])
    save_dir = tmp_path / "checkpoints"
    (node0, node1), writes = launch_nodes(2, 2, [data_bin, *train, "--save-dir", save_dir], tmp_path, hook_dir)
    assert "training on 4 devices" in node0 and "[rank 3]" in node1, node1[-3000:]
    assert_only_rank_0_wrote(writes, save_dir)
    dist, single = rank0_updates(node0), rank0_updates(single)
    assert sorted(dist) == sorted(single) == [1, 2, 3, 4], node0[-3000:]
    for update, (loss, bsz) in dist.items():
        assert (loss, bsz) == (single[update][0], 8), (update, dist, single)
    assert_same_parameters(save_dir / "checkpoint_last.pt", tmp_path / "single" / "checkpoint_last.pt")


MASKED_TRAIN = mlm_args(batch_size=4, disable_validation=True)


def children(pid):
    """The processes whose parent is `pid`, by the parent field of each process's /proc/<pid>/stat. (Not
    /proc/<pid>/task/*/children: a thread that ends while it is read takes its file with it, and the
    children it started pass to a sibling thread, so that scan can fail or miss a rank.)"""
    return [int(entry.name) for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and (stat_fields(int(entry.name)) or [None, None])[1] == str(pid)]


def stat_fields(pid):
    """The fields of /proc/<pid>/stat after the command's name (state, parent, ...); None once it has ended."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def wait_gone(pids, timeout=30):
    """Until each of `pids` has exited (gone, or a zombie nobody reaped)."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            fields = stat_fields(pid)
            if fields is None or fields[0] == "Z":
                break
            time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["causal", "masked"])
def test_sigkill_of_a_two_process_run_then_the_same_command_resumes_exactly(data_bin, tmp_path, hook_dir, request,
                                                                           kind):
    """Every process of a 2-rank run is SIGKILLed (as when a node dies or the job is cancelled) between the
    interval checkpoints at 3 and 6; the same command started again resumes from checkpoint_last, and its
    losses equal those of an uninterrupted one-process run with --update-freq 2 (for the causal recipe the
    module's ``one_proc``; test_two_processes_train_as_one_with_update_freq_2 shows the two equal for an
    uninterrupted run). The masked recipe's masks are drawn per sample (seed, epoch, index), so that equality
    holds for it too."""
    train = TRAIN if kind == "causal" else MASKED_TRAIN

    def command(save_dir):
        return [cli("python"), "-m", "fairseq_tnn.distributed.launch", "--nproc", "2", "--cpu",
                "--log-dir", str(tmp_path / f"{save_dir.name}-ranks"), "--", str(data_bin),
                *map(str, train), "--max-update", str(RESUMED), "--save-interval-updates", "3",
                "--save-dir", str(save_dir)]

    if kind == "causal":
        reference = rank0_updates(request.getfixturevalue("one_proc")[1])
    else:
        reference = rank0_updates(run([cli("fairseq-train"), data_bin, *train, "--update-freq", 2, "--max-update", RESUMED,
                                     "--save-dir", tmp_path / "reference"]))
    assert sorted(reference) == list(range(1, RESUMED + 1))
    cmd = command(tmp_path / "checkpoints")
    # rank 0 holds before it writes the checkpoint at 6 (a cue at 5 alone races an update of ~0.1 s)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TNN_HOLD_WRITES="checkpoint_1_6.pt",
               PYTHONPATH=with_hooks(hook_dir))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)

    def kill_all():  # the launcher (torchrun runs in it) and each rank, which torchrun starts in a session of its own
        ranks = children(proc.pid)
        for group in [proc.pid, *ranks]:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:  # a rank that had exited already
                pass
        wait_gone(ranks)

    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "| train_inner |" in line and not line.startswith("[rank") and "num_updates=5," in line:
                kill_all()
                break
    finally:
        if proc.poll() is None:
            kill_all()
        proc.wait(timeout=60)
    first = "".join(seen)
    assert proc.returncode == -signal.SIGKILL and "num_updates=5," in first, first[-3000:]
    assert "checkpoint_1_3.pt" in first and "checkpoint_1_6.pt" not in first

    log = run(cmd, env={"OMP_NUM_THREADS": "1"})
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch 1 @ 3 updates\)", log), log[-3000:]
    resumed = rank0_updates(log)
    assert sorted(resumed) == list(range(4, RESUMED + 1)), log[-3000:]
    for update, (loss, _) in resumed.items():
        assert loss == pytest.approx(reference[update][0], abs=1.1e-3), (update, resumed, reference)


def launcher_line(log):
    """The launcher command that a refusal names, split into words."""
    marker = "run this on this machine instead: "
    (command,) = {l.split(marker, 1)[1] for l in log.splitlines() if marker in l}  # the same for each rank
    return shlex.split(command)


@pytest.mark.slow
def test_plain_torchrun_on_cpu_is_refused_instead_of_training_twice(data_bin, tmp_path):
    """Stock fairseq ignores torchrun's environment on CPU: both processes would train alone and write the
    same checkpoint files. The plugin's tasks refuse that while fairseq parses the command line, naming the
    launcher command that runs the same arguments."""
    save_dir = tmp_path / "checkpoints"
    train = [data_bin, *TRAIN, "--max-update", 2, "--save-dir", save_dir]
    log = run([cli("torchrun"), "--nproc-per-node", 2, cli("fairseq-train"), *train], expect_ok=False)
    # whichever rank gets there first; torchrun then stops the other
    assert re.search(r"fairseq-train: error: this process is rank [01] of the 2 that torchrun started", log), log[-3000:]
    words = launcher_line(log)
    assert words[1:] == ["-m", "fairseq_tnn.distributed.launch", "--nproc", "2", "--cpu", "--", *map(str, train)]
    assert Path(words[0]).name.startswith("python") and "training on 1 devices" not in log
    assert not save_dir.exists()


@pytest.mark.slow
def test_plain_torchrun_on_two_machines_is_refused_naming_each_machines_launcher_command(data_bin, tmp_path):
    """torchrun --nnodes 2 --node-rank R --master-addr ... fairseq-train ..., as users type it on each of two
    machines (here two torchruns on this one), with --distributed-world-size 2 (on CPU fairseq would divide by
    the number of CUDA devices): each node's ranks are refused, naming the launcher command for that node, with
    its node rank and the master torchrun was given (test_two_machines_train_as_one_process_with_update_freq_2
    runs such commands)."""
    save_dir = tmp_path / "checkpoints"
    train = [data_bin, *TRAIN, "--max-update", 2, "--save-dir", save_dir]
    port, procs = launch.free_port(), []
    for rank in range(2):
        cmd = [cli("torchrun"), "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
               "--master-port", str(port), "--nproc-per-node", "1", cli("fairseq-train"), *map(str, train),
               "--distributed-world-size", "2"]
        with open(tmp_path / f"node{rank}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1")))
    assert [p.wait(timeout=300) for p in procs] == [1, 1]  # torchrun's status when a rank fails
    for rank in range(2):
        log = (tmp_path / f"node{rank}.log").read_text()
        assert f"fairseq-train: error: this process is rank {rank} of the 2 that torchrun started" in log, log[-3000:]
        assert launcher_line(log)[1:] == [
            "-m", "fairseq_tnn.distributed.launch", "--nproc", "1", "--cpu", "--nnodes", "2", "--node-rank", str(rank),
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--", *map(str, train)]
    assert not save_dir.exists()


def test_distributed_world_size_on_cpu_without_a_launcher_is_refused(data_bin, tmp_path):
    """fairseq-train --distributed-world-size 2 on CPU would stop on an assertion that 2 GPUs exist: refused
    before any work, with the launcher's command for the same arguments."""
    train = [data_bin, *TRAIN, "--max-update", 2, "--save-dir", tmp_path / "checkpoints"]
    log = run([cli("fairseq-train"), *train, "--distributed-world-size", 2], expect_ok=False)
    assert log.splitlines()[-1].startswith("fairseq-train: error: --distributed-world-size 2 on CPU"), log[-3000:]
    assert launcher_line(log)[1:] == ["-m", "fairseq_tnn.distributed.launch", "--nproc", "2", "--cpu", "--",
                                      *map(str, train)]
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_old_style_checkpoint_loads_and_weights_only_stays_on(two_procs, data_bin, tmp_path):
    from fairseq import checkpoint_utils, options
    from fairseq.distributed import utils as distributed_utils
    from fairseq_tnn import register

    register()  # as fairseq loading the plugin does (this module imports fairseq_tnn before fairseq)
    assert distributed_utils._broadcast_object_slow is broadcast_object_slow
    # a pre-hydra checkpoint: the configuration as an argparse.Namespace under "args"
    state = torch.load(two_procs[3], map_location="cpu")
    state["args"] = options.parse_args_and_arch(options.get_training_parser(), input_args=[
        str(data_bin), "--task", "tnn_language_modeling", "--arch", "tnn_lm_tiny", "--criterion", "cross_entropy",
        "--tokens-per-sample", "64", "--optimizer", "adam", "--lr-scheduler", "inverse_sqrt"])
    state["cfg"] = None
    torch.save(state, tmp_path / "old.pt")
    loaded = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "old.pt"))
    assert loaded["cfg"].model._name == "tnn_lm_tiny"
    # other classes are still refused by torch.load's weights_only default
    torch.save({"x": fractions.Fraction(1, 3)}, tmp_path / "other.pt")
    with pytest.raises(Exception, match="Unsupported global"):
        torch.load(tmp_path / "other.pt")


# The launcher, in process: command lines, refused input, failures and signals.

def dry_run(capsys, *argv):
    assert launch.main([str(a) for a in argv]) == 0
    return [line.split() for line in capsys.readouterr().out.splitlines()]


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PREFIX = ["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank", "${rank}]", "'"]  # '[rank ${rank}] ', split at spaces


def expected_rank_flags(n):
    return ["--cpu", "--distributed-world-size", str(n), "--distributed-rank", "'${local_rank}'",
            "--distributed-init-method", "env://", "--distributed-no-spawn",
            "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"]


@pytest.mark.runs_doc(r'^python -m fairseq_tnn\.distributed\.launch --nproc 2 --cpu --dry-run -- ')
def test_dry_run_cpu_prints_one_torchrun_command(capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(6)))
    (words,) = dry_run(capsys, "--nproc", 3, "--cpu", "--port", 23456, "--dry-run", "--", "data-bin/x", "--arch", "tnn_lm_tiny")
    assert words[:4] == ["OMP_NUM_THREADS=2", *PREFIX]
    assert words[4:] == [*TORCHRUN, "--nproc-per-node", "3", "--master-addr", "127.0.0.1", "--master-port", "23456",
                         "--tee", "1:3,2:3", "-m", "fairseq_cli.train", "data-bin/x", "--arch", "tnn_lm_tiny",
                         *expected_rank_flags(3)]


@pytest.mark.runs_doc(r'^python -m fairseq_tnn\.distributed\.launch --nproc 8 -- ')
def test_dry_run_variants(capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # set by the user: left alone
    # --cpu among fairseq's arguments means CPU; a CPU-capable --ddp-backend is kept; a free port from torchrun
    # (--standalone); --log-dir goes to torchrun
    (cpu,) = dry_run(capsys, "--nproc", 2, "--log-dir", "logs", "--dry-run", "--", "d", "--cpu", "--ddp-backend", "no_c10d")
    assert cpu[:len(PREFIX)] == PREFIX and cpu[len(PREFIX):][:3] == TORCHRUN
    assert cpu[len(PREFIX) + 3:] == ["--nproc-per-node", "2", "--standalone", "--tee", "1:3", "--log-dir", "logs",
                                     "-m", "fairseq_cli.train", "d", "--cpu", "--ddp-backend", "no_c10d",
                                     "--distributed-world-size", "2", "--distributed-rank", "'${local_rank}'",
                                     "--distributed-init-method", "env://", "--distributed-no-spawn",
                                     "--distributed-backend", "gloo"]
    assert dry_run(capsys, "--nproc", 2, "--dry-run", "--", "--cpu", "d")[0][-13:-11] == ["--cpu", "d"]  # --cpu is a flag
    # GPUs: one fairseq-train that spawns the ranks itself
    (gpu,) = dry_run(capsys, "--nproc", 4, "--gpu", "--port", 1234, "--dry-run", "--", "d")
    assert gpu == [sys.executable, "-m", "fairseq_cli.train", "d", "--distributed-world-size", "4",
                   "--distributed-init-method", "tcp://127.0.0.1:1234"]
    # one process: fairseq-train unchanged (plus --cpu on CPU)
    assert dry_run(capsys, "--nproc", 1, "--cpu", "--dry-run", "--", "d")[0][3:] == ["d", "--cpu"]
    assert dry_run(capsys, "--nproc", 1, "--gpu", "--dry-run", "--", "d")[0][3:] == ["d"]
    # fairseq-hydra-train: the same settings as overrides
    (hydra,) = dry_run(capsys, "--nproc", 2, "--cpu", "--hydra", "--dry-run", "--", "--config-name", "c")
    module = hydra.index("-m", len(PREFIX) + 3)
    assert hydra[module:] == ["-m", "fairseq_cli.hydra_train", "--config-name", "c", "common.cpu=true",
                              "distributed_training.distributed_world_size=2",
                              "'distributed_training.distributed_rank=${local_rank}'",
                              "distributed_training.distributed_init_method=env://",
                              "distributed_training.distributed_no_spawn=true",
                              "distributed_training.distributed_backend=gloo",
                              "distributed_training.ddp_backend=legacy_ddp"]


def node_flags(nnodes, rank, addr="10.1.2.3", port=29500):
    return ["--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", addr, "--master-port", str(port)]


@pytest.mark.runs_doc(r"^python -m fairseq_tnn\.distributed\.launch --nproc \d+ (--cpu )?--nnodes 2 --node-rank [01] ")
def test_dry_run_on_two_machines_prints_each_nodes_command(capsys, monkeypatch):
    """Each node runs the launcher with its own --node-rank. On CPU: torchrun with the same node options, the
    world (2 x 3) and the rank left to torchrun (-1: env:// reads its RANK). On GPUs: fairseq-train with
    the world, node 0's address and this node's first rank (node rank x 3); fairseq spawns ranks from it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for rank in range(2):
        (cpu,) = dry_run(capsys, "--nproc", 3, "--cpu", *node_flags(2, rank), "--dry-run", "--", "d")
        assert cpu[len(PREFIX) + 3:] == [
            "--nproc-per-node", "3", "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "10.1.2.3",
            "--master-port", "29500", "--tee", "1:3,2:3", "-m", "fairseq_cli.train", "d", "--cpu",
            "--distributed-world-size", "6", "--distributed-rank", "-1", "--distributed-init-method", "env://",
            "--distributed-no-spawn", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"]
        (gpu,) = dry_run(capsys, "--nproc", 3, "--gpu", *node_flags(2, rank), "--dry-run", "--", "d")
        assert gpu == [sys.executable, "-m", "fairseq_cli.train", "d", "--distributed-world-size", "6",
                       "--distributed-init-method", "tcp://10.1.2.3:29500", "--distributed-rank", str(3 * rank)]
    # one process per machine: torchrun still joins the two (CPU), fairseq still spawns one (GPU)
    (cpu,) = dry_run(capsys, "--nproc", 1, "--cpu", "--hydra", *node_flags(2, 1), "--dry-run", "--", "--config-name", "c")
    assert cpu[len(PREFIX) + 3:][:11] == ["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1",
                                          "--master-addr", "10.1.2.3", "--master-port", "29500", "-m"]
    assert "distributed_training.distributed_rank=-1" in cpu and "distributed_training.distributed_world_size=2" in cpu
    # a machine with more GPUs than --nproc: fairseq spawns one process per visible GPU, so the launcher hides the rest
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    (gpu,) = dry_run(capsys, "--nproc", 2, "--gpu", *node_flags(2, 1), "--dry-run", "--", "d")
    assert gpu[0] == "CUDA_VISIBLE_DEVICES=4,5" and gpu[-2:] == ["--distributed-rank", "2"], gpu


def test_an_unresolvable_master_address_is_refused_before_any_work(capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--nproc", "1", "--cpu", *node_flags(2, 1, addr="no-such-host.invalid"), "--", "d"])
    assert exit_info.value.code == 2
    assert "error: --master-addr no-such-host.invalid: cannot resolve it on this machine" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--nproc", "0", "--", "d"], "--nproc must be at least 1"),
    (["--nproc", "-2", "--", "d"], "--nproc must be at least 1"),
    (["--nproc", "two", "--", "d"], "argument --nproc: invalid int value"),
    (["--cpu", "--", "d"], "required: --nproc"),
    (["--nproc", "2", "d"], "missing '--'"),
    (["--nproc", "2", "--"], "no fairseq-train arguments after '--'"),
    (["--nproc", "2", "--port", "70000", "--", "d"], "--master-port must be in 1..65535 (got 70000)"),
    (["--nproc", "2", "--master-port", "0", "--", "d"], "--master-port must be in 1..65535 (got 0)"),
    (["--nproc", "2", "--nnodes", "0", "--", "d"], "--nnodes must be at least 1 (got 0)"),
    (["--nproc", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "a", "--master-port", "9", "--", "d"],
     "--node-rank must be in 0..1 for --nnodes 2 (got 2)"),
    (["--nproc", "2", "--node-rank", "-1", "--", "d"], "--node-rank must be in 0..0 for --nnodes 1 (got -1)"),
    (["--nproc", "2", "--node-rank", "1", "--", "d"], "--node-rank must be in 0..0 for --nnodes 1 (got 1)"),
    (["--nproc", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", "9", "--", "d"],
     "--nnodes 2 needs --master-addr and --master-port: node 0's address and a free port there, the same on every node"),
    (["--nproc", "2", "--nnodes", "2", "--master-addr", "10.0.0.1", "--", "d"], "--nnodes 2 needs --master-addr and"),
    (["--nproc", "2", "--master-addr", "127.0.0.1", "--", "d"], "--master-addr 127.0.0.1 needs --master-port"),
    (["--nproc", "2", "--master-addr", "", "--", "d"], "--master-addr must be a host name or an IP address (got '')"),
    (["--nproc", "2", "--master-addr", "tcp://h", "--", "d"], "--master-addr must be a host name or an IP address"),
    (["--nproc", "2", "--nnodes", "two", "--", "d"], "argument --nnodes: invalid int value: 'two'"),
    (["--nproc", "2", "--cpu", "--gpu", "--", "d"], "not allowed with argument"),
    (["--nproc", "2", "--cpu", "--", "d", "--distributed-world-size", "2"], "--distributed-world-size is set by the launcher"),
    (["--nproc", "2", "--cpu", "--", "d", "--distributed-rank=1"], "--distributed-rank is set by the launcher"),
    (["--nproc", "2", "--cpu", "--hydra", "--", "distributed_training.distributed_port=9"],
     "distributed_training.distributed_port is set by the launcher"),
    (["--nproc", "2", "--cpu", "--", "d", "--ddp-backend", "pytorch_ddp"], "--ddp-backend pytorch_ddp does not work on CPU"),
    (["--nproc", "2", "--cpu", "--", "d", "--distributed-backend", "nccl"], "--distributed-backend nccl does not work on CPU"),
    (["--nproc", "2", "--gpu", "--", "d", "--cpu"], "--gpu contradicts --cpu"),
    (["--nproc", "2", "--cpu", "--hydra", "--", "common.cpu=false"], "common.cpu=false among the fairseq arguments"),
    (["--nproc", "2", "--gpu", "--log-dir", "l", "--", "d"], "--log-dir is for torchrun, which starts CPU ranks"),
    (["--nproc", "1", "--cpu", "--log-dir", "l", "--", "d"], "--log-dir is for torchrun, which starts CPU ranks"),
])
def test_bad_launcher_input_is_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--dry-run", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m fairseq_tnn.distributed.launch --nproc N") and message in err, err


@pytest.fixture
def torchrun_env(monkeypatch):
    """The environment the launcher gives torchrun; the signal handlers torchrun installs are undone after."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for key, value in launch.RANK_PREFIX.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "torchrun sets it")  # and monkeypatch removes it after
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    yield
    for s, handler in handlers.items():
        signal.signal(s, handler)


def python_ranks(log_dir, code, *args):
    """torchrun's options, as the launcher gives them, for 2 ranks of `python -c code args`."""
    return [*launch.torchrun_options(2, log_dir=str(log_dir)), "--no-python", sys.executable, "-c", code, *args]


def test_a_failing_rank_stops_the_others_and_sets_the_exit_status(capsys, torchrun_env, tmp_path):
    code = "import os, sys, time\nif os.environ['RANK'] == '1':\n    print('rank one fails'); sys.exit(3)\ntime.sleep(60)"
    start = time.monotonic()
    status = launch.run_torchrun(python_ranks(tmp_path, code))
    assert status == 3 and time.monotonic() - start < 30  # rank 0 was stopped, not waited for
    out, err = capsys.readouterr()
    assert "[rank 1] rank one fails" in out and re.search(r"exitcode\s*:\s*3\b", err), (out, err)


def test_sigterm_is_passed_on_to_every_rank(tmp_path, torchrun_env):
    wait_for_signal = ("import os, signal, sys, time, pathlib\n"
                       "out = pathlib.Path(sys.argv[1]) / os.environ['RANK']\n"
                       "def stop(signum, frame):\n"
                       "    out.write_text(str(signum)); sys.exit(0)\n"
                       "signal.signal(signal.SIGTERM, stop)\n"
                       "out.with_suffix('.ready').touch()\n"
                       "time.sleep(60)\n")
    got = [tmp_path / str(r) for r in range(2)]

    def terminate_launcher_when_ready():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(p.with_suffix(".ready").exists() for p in got):  # torchrun is running, its handlers installed
                os.kill(os.getpid(), signal.SIGTERM)  # caught by torchrun, passed on to the ranks
                return
            time.sleep(0.05)

    threading.Thread(target=terminate_launcher_when_ready, daemon=True).start()
    start = time.monotonic()
    status = launch.run_torchrun(python_ranks(tmp_path / "logs", wait_for_signal, str(tmp_path)))
    assert status == 128 + signal.SIGTERM and time.monotonic() - start < 60
    assert [p.read_text() for p in got] == [str(int(signal.SIGTERM))] * 2


def test_launcher_module_runs_without_import_warnings():
    log = run([cli("python"), "-m", "fairseq_tnn.distributed.launch", "--nproc", 2, "--cpu", "--dry-run", "--", "data"])
    assert "Warning" not in log and log.count("-m fairseq_cli.train data --cpu") == 1, log
