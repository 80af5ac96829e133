"""Guards the plugin's tasks run against CPU processes that stock fairseq would not join into one run: one while
fairseq parses fairseq-train's command line (``refuse_unjoinable``), one after it has (or has not) set up
torch.distributed (``check_joined``). Both name the launcher command that works on this machine
(``launcher_command``).

(Beside the launcher, fairseq_tnn/distributed/launch.py, but a module of its own: the tasks import this,
and ``python -m fairseq_tnn.distributed.launch`` must not find its own module imported already.)
"""
import argparse
import os
import shlex
import sys
from pathlib import Path


def _env_int(name, default):
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else default


def launcher_command(argv, nproc=None):
    """The launcher's command that runs fairseq-train's arguments `argv` (or fairseq-hydra-train's, when
    ``sys.argv[0]`` is that program) on this machine, on CPU: under torchrun (or torch.distributed.launch), as
    this node of the run it started (processes per node, node count, this node's rank, the master's address and
    port from torchrun's environment); otherwise as `nproc` processes on this machine. The settings the
    launcher owns, and backends that fail on CPU, are left out of `argv`."""
    from . import launch

    hydra = "hydra" in Path(sys.argv[0]).name
    world = _env_int("WORLD_SIZE", 1)
    nproc = _env_int("LOCAL_WORLD_SIZE", world) if world > 1 else nproc
    nnodes = _env_int("GROUP_WORLD_SIZE", max(1, world // nproc))
    options = ["--nproc", str(nproc), "--cpu"]
    if nnodes > 1:
        options += ["--nnodes", str(nnodes), "--node-rank", str(_env_int("GROUP_RANK", 0)),
                    "--master-addr", os.environ.get("MASTER_ADDR", "127.0.0.1"),
                    "--master-port", os.environ.get("MASTER_PORT", "29500")]
    if hydra:
        options.append("--hydra")
    args = launch.without_settings(argv, hydra)
    return shlex.join([sys.executable, "-m", "fairseq_tnn.distributed.launch", *options, "--", *args])


def refuse_unjoinable(parser, argv=None):
    """Called while fairseq parses a training command line (the plugin's tasks' ``add_args``), before fairseq
    sets up distributed training: on CPU, without ``--distributed-init-method``, stock fairseq cannot join
    processes into one run. Under torchrun it would train each rank alone (no --distributed-world-size) or
    divide by the number of CUDA devices (``--distributed-world-size N``: ZeroDivisionError); alone,
    ``--distributed-world-size N`` stops on an assertion that N GPUs exist. Such a command is refused with
    one line on stderr, ``<prog>: error: ...`` naming the launcher command that works here, exit status 2."""
    if not isinstance(parser, argparse.ArgumentParser):
        return  # fairseq's import of the task, which builds a parser of its options for the documentation
    argv = sys.argv[1:] if argv is None else argv
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1 and not any(a.startswith("--distributed-world-size") for a in argv):
        return  # neither started by torchrun nor asking for several processes
    args, _ = parser.parse_known_args(argv)
    if not hasattr(args, "update_freq") or getattr(args, "distributed_init_method", None) is not None:
        return  # not fairseq-train, or fairseq is told how to join the processes
    import torch

    if not (args.cpu or not torch.cuda.is_available()):
        return  # on GPUs fairseq joins torchrun's processes (and spawns its own) itself
    if world > 1:
        problem = (f"this process is rank {os.environ.get('RANK', '?')} of the {world} that torchrun started, but on "
                   "CPU fairseq-train does not join them into one run (it would train each alone or, given "
                   "--distributed-world-size, divide by the number of CUDA devices)")
    elif (args.distributed_world_size or 1) > 1 and "SLURM_JOB_ID" not in os.environ:
        problem = (f"--distributed-world-size {args.distributed_world_size} on CPU: fairseq-train starts one "
                   "process per CUDA device")
        world = args.distributed_world_size
    else:
        return
    print(f"{parser.prog}: error: {problem}; run this on this machine instead: "
          f"{launcher_command(argv, nproc=world)}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def check_joined():
    """Refuse a process that a launcher (torchrun, torch.distributed.launch) started as one of N ranks but
    that fairseq did not join into a distributed run (where ``refuse_unjoinable`` did not see it first, e.g.
    under fairseq-hydra-train): each process would train alone and all would write the same checkpoint
    files. Called by the plugin's tasks, after fairseq has (or has not) initialised torch.distributed."""
    import torch.distributed as dist

    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit() or int(world) <= 1 or (dist.is_available() and dist.is_initialized()):
        return
    raise RuntimeError(
        f"this process was started as rank {os.environ.get('RANK', '?')} of WORLD_SIZE={world} (torchrun or "
        "torch.distributed.launch), but fairseq did not join the processes into one distributed run: each would "
        "train alone and all would write the same checkpoints. On CPU, run this on this machine instead (it runs "
        f"torchrun with the flags fairseq needs; --dry-run prints that command): {launcher_command(sys.argv[1:])}; "
        "on GPUs, use 'fairseq-train ... --distributed-world-size N' or torchrun with one process per visible GPU.")
