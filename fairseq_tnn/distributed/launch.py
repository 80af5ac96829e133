"""Start multi-process fairseq training on one machine or several, on CPUs or GPUs.

    python -m fairseq_tnn.distributed.launch --nproc N [--cpu | --gpu] \\
        [--nnodes K --node-rank R --master-addr ADDR] [--master-port P] [--log-dir D] [--hydra] \\
        [--dry-run] -- <fairseq-train arguments...>

This writes fairseq's arguments; others start and watch the processes. With ``--nnodes K`` each of K
machines runs this with the same arguments but its own ``--node-rank`` (0 to K - 1); node 0 is the master,
at ``--master-addr`` (an address every node reaches) and ``--master-port`` (a free port there; torchrun's
names). The run has W = K x N ranks; node R's are R x N to R x N + N - 1. One machine: the master is
127.0.0.1 on a free port (``--master-port``, or its old name ``--port``, picks it).

CPUs (``--cpu``, ``--cpu`` among the fairseq arguments, or no CUDA device): torchrun
(``torch.distributed.run``, called in this process, given the same node options) starts N ranks of
``python -m fairseq_cli.train``, each with::

    --cpu --distributed-world-size W --distributed-rank ${local_rank} --distributed-init-method env://
    --distributed-no-spawn --distributed-backend gloo --ddp-backend legacy_ddp

Stock fairseq needs them all on CPU. Its world size defaults to the number of CUDA devices (none:
1, and each rank would train alone); given W, it reads torchrun's RANK but takes the device as
RANK % torch.cuda.device_count(), a division by zero. So the rank comes as a flag: on one machine
torchrun replaces ``${local_rank}`` in each rank's arguments with its number, which is its rank. On
several, a rank is R x N + its local rank, which torchrun writes into no argument: the flag says
``--distributed-rank -1``, and torch.distributed's ``env://`` rendezvous, given no rank, takes torchrun's
RANK (fairseq then logs "distributed init (rank -1)"). ``env://`` reads the rendezvous address torchrun
gives the ranks. fairseq's default backends, nccl and ``pytorch_ddp`` (which passes CUDA ``device_ids`` to
DDP), fail on CPU.

torchrun stops the other ranks if one fails, passes SIGINT and SIGTERM on to every rank, and keeps each
rank's output under its log directory (``--log-dir``, default a new ``torchelastic_*`` directory in the
temporary directory). Local rank 0's output goes to the console as it is; torchrun tees the others'
(which fairseq limits to warnings and errors) to the console with a ``[rank R]`` prefix. Left to this
launcher: the flags above; an equal share of the CPUs per rank in OMP_NUM_THREADS unless it is set
(torchrun sets 1, with a warning); and the exit status, that of the first rank to fail or 128 + the
signal, as a shell gives (torchrun raises, exiting with 1 and a traceback of its own). ``--dry-run``
prints the torchrun command, which runs as it is in a shell.

GPUs: fairseq starts one process per GPU itself, so this runs one ``fairseq-train ...
--distributed-world-size W --distributed-init-method tcp://ADDR:P`` (an explicit init method, because
fairseq silently trains on one GPU when given ``--distributed-port`` outside SLURM), with
``--distributed-rank R x N`` on several machines: fairseq spawns its processes on GPUs 0, 1, ... with
ranks R x N + 0, 1, ... . It spawns min(visible GPUs, W) of them (fairseq 0.12 does not read
``--distributed-num-procs``), so where this machine has more GPUs than N, the launcher sets
CUDA_VISIBLE_DEVICES to the first N. One process in all (``--nproc 1`` on one machine):
``fairseq-train`` unchanged, with ``--cpu`` on CPU.

``--hydra`` runs ``fairseq-hydra-train`` instead and passes the same settings as
``distributed_training.*=`` overrides. Bad values (a node rank out of range, several machines without the
master's address and port, and in a real run an address that does not resolve here) stop the launcher
with one line.
"""
import argparse
import os
import shlex
import socket
import sys

from fairseq_tnn.commands.common import cpus
from fairseq_tnn.recipe import CPU_BACKENDS, cpu_ranks

USAGE = ("python -m fairseq_tnn.distributed.launch --nproc N [--cpu | --gpu] [--nnodes K --node-rank R "
         "--master-addr ADDR] [--master-port P] [--log-dir D] [--hydra] [--dry-run] -- <fairseq-train arguments...>")

# Settings the launcher owns: passing them among the fairseq arguments is an error.
OWNED = ("distributed_world_size", "distributed_rank", "distributed_init_method", "distributed_no_spawn",
         "distributed_port", "distributed_num_procs", "device_id")
# Settings with only some values usable on CPU: the user may pass one of those, or none (fairseq_tnn/recipe.py,
# which also gives a CPU rank's settings to scripts/slurm/train.sbatch).
CPU_CHOICES = CPU_BACKENDS
# torchrun's prefix for the lines of the ranks whose output it tees to the console (all but rank 0).
RANK_PREFIX = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank ${rank}] "}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m fairseq_tnn.distributed.launch", usage=USAGE,
        description="Run fairseq-train (or fairseq-hydra-train) as N data-parallel processes on each of K machines.")
    parser.add_argument("--nproc", type=int, required=True, help="processes (ranks) on this machine, >= 1")
    device = parser.add_mutually_exclusive_group()
    device.add_argument("--cpu", action="store_true", help="train on CPUs (default where no CUDA device is visible)")
    device.add_argument("--gpu", action="store_true",
                        help="take the GPU path even where no CUDA device is visible (for --dry-run)")
    parser.add_argument("--nnodes", type=int, default=1,
                        help="machines (nodes) in the run, each running this launcher with the same arguments "
                             "but its own --node-rank (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this machine's rank, 0 to NNODES - 1 (default 0)")
    parser.add_argument("--master-addr",
                        help="address of node 0, reachable from every node, with --master-port (default 127.0.0.1; "
                             "required with --nnodes > 1)")
    parser.add_argument("--master-port", "--port", dest="port", type=int,
                        help="TCP port for the rendezvous on node 0 (default: a free one; required with --nnodes > 1)")
    parser.add_argument("--log-dir", help="CPU ranks: where torchrun keeps each rank's output "
                                          "(default: a new torchelastic_* directory in the temporary directory)")
    parser.add_argument("--hydra", action="store_true",
                        help="the arguments after -- are for fairseq-hydra-train (key=value overrides)")
    parser.add_argument("--dry-run", action="store_true", help="print the command line and exit")
    if "--" not in argv:
        parser.error("missing '--' before the fairseq-train arguments")
    split = argv.index("--")
    opts = parser.parse_args(argv[:split])
    opts.train_args = argv[split + 1:]
    if not opts.train_args:
        parser.error("no fairseq-train arguments after '--'")
    if opts.nproc < 1:
        parser.error(f"--nproc must be at least 1 (got {opts.nproc})")
    if opts.nnodes < 1:
        parser.error(f"--nnodes must be at least 1 (got {opts.nnodes})")
    if not 0 <= opts.node_rank < opts.nnodes:
        parser.error(f"--node-rank must be in 0..{opts.nnodes - 1} for --nnodes {opts.nnodes} (got {opts.node_rank})")
    if opts.port is not None and not 0 < opts.port < 65536:
        parser.error(f"--master-port must be in 1..65535 (got {opts.port})")
    if opts.master_addr is not None and (not opts.master_addr or any(c.isspace() or c == "/" for c in opts.master_addr)):
        parser.error(f"--master-addr must be a host name or an IP address (got {opts.master_addr!r})")
    if opts.nnodes > 1 and (opts.master_addr is None or opts.port is None):
        parser.error(f"--nnodes {opts.nnodes} needs --master-addr and --master-port: node 0's address and a free "
                     "port there, the same on every node")
    if opts.master_addr is not None and opts.port is None:
        parser.error(f"--master-addr {opts.master_addr} needs --master-port (a free port there)")
    return parser, opts


def spelling(group, name, hydra):
    """How a fairseq setting is named on the command line: a flag, or a hydra override key."""
    return f"{group}.{name}" if hydra else "--" + name.replace("_", "-")


def find_setting(args, group, name, hydra):
    """The value given for a fairseq setting among `args` (True for a bare flag), or None."""
    key = spelling(group, name, hydra)
    for i, arg in enumerate(args):
        if hydra:
            arg = arg.lstrip("+")  # hydra's +key=value and ++key=value
        elif arg == key:
            following = args[i + 1] if i + 1 < len(args) else None
            return True if following is None or following.startswith("--") else following
        if arg.startswith(key + "="):
            return arg[len(key) + 1:]
    return None


def without_settings(args, hydra):
    """`args` without the settings the launcher owns (and torch.distributed.launch's --local_rank) and without
    backends that fail on CPU: the fairseq arguments of a command that ran without the launcher, for it."""
    drop = [spelling("distributed_training", name, hydra) for name in OWNED] + ["--local_rank", "--local-rank"]
    drop += [spelling("distributed_training", name, hydra) for name, choices in CPU_CHOICES.items()
             if find_setting(args, "distributed_training", name, hydra) not in (None, *choices)]
    bare = spelling("distributed_training", "distributed_no_spawn", hydra)  # the one flag without a value
    kept, i = [], 0
    while i < len(args):
        key = args[i].lstrip("+") if hydra else args[i]
        if any(key.startswith(name + "=") for name in drop):
            i += 1
        elif not hydra and key in drop:
            i += 1 if key == bare or i + 1 == len(args) or args[i + 1].startswith("--") else 2
        else:
            kept.append(args[i])
            i += 1
    return kept


def render(settings, hydra):
    """(group, name, value) triples as fairseq-train flags or as hydra overrides."""
    out = []
    for group, name, value in settings:
        key = spelling(group, name, hydra)
        if hydra:
            out.append(f"{key}={'true' if value is True else value}")
        else:
            out += [key] if value is True else [key, str(value)]
    return out


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_flag(args, hydra):
    """Whether the fairseq arguments ask for CPU training: True, False (hydra's common.cpu=false) or None."""
    given = find_setting(args, "common", "cpu", hydra)
    if given is None:
        return None
    return given in ("true", "True") if hydra else True  # --cpu is a flag: what follows it is not its value


def use_cpu(opts):
    if opts.cpu or cpu_flag(opts.train_args, opts.hydra):
        return True
    if opts.gpu:
        return False
    import torch
    return not torch.cuda.is_available()


def torchrun_options(nproc, port=None, log_dir=None, nnodes=1, node_rank=0, master_addr=None):
    """torchrun's options for N processes on this machine, node `node_rank` of `nnodes`: each node's local
    rank 0 prints to the console, the others' output is teed (to their log files and, prefixed, to the console)."""
    options = ["--nproc-per-node", str(nproc)]
    if nnodes > 1:
        options += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
    if port:
        options += ["--master-addr", master_addr or "127.0.0.1", "--master-port", str(port)]
    else:
        options += ["--standalone"]
    if nproc > 1:
        options += ["--tee", ",".join(f"{rank}:3" for rank in range(1, nproc))]  # local ranks; 3: stdout and stderr
    return options + (["--log-dir", log_dir] if log_dir else [])


def cpu_threads_env(nproc):
    """OMP_NUM_THREADS for each of N ranks, an equal share of the CPUs, unless it is set."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, cpus() // nproc))}


def check_reachable(parser, host):
    """Refuse a master address that does not resolve here (before torchrun or fairseq wait on it)."""
    try:
        socket.getaddrinfo(host, None)
    except OSError as error:
        parser.error(f"--master-addr {host}: cannot resolve it on this machine ({error.strerror or error})")


def visible_gpus(n):
    """CUDA_VISIBLE_DEVICES naming the first N of the GPUs this process sees."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    return ",".join(given.split(",")[:n] if given else map(str, range(n)))


def build(opts, parser):
    """The command line to run and the environment variables to set for it."""
    args, hydra, n = opts.train_args, opts.hydra, opts.nproc
    world, first_rank = opts.nnodes * n, opts.node_rank * n
    for name in OWNED:
        if find_setting(args, "distributed_training", name, hydra) is not None:
            parser.error(f"{spelling('distributed_training', name, hydra)} is set by the launcher (from --nproc, "
                         "--nnodes, --node-rank, --master-addr and --master-port); remove it from the fairseq arguments")
    cpu = use_cpu(opts)
    if opts.gpu and cpu:
        parser.error("--gpu contradicts --cpu among the fairseq arguments")
    if opts.log_dir and (world == 1 or not cpu):
        parser.error(f"--log-dir is for torchrun, which starts CPU ranks (--nproc or --nnodes > 1); "
                     f"{'one process' if world == 1 else 'on GPUs fairseq'} writes to the console only")
    if opts.master_addr and not opts.dry_run:
        check_reachable(parser, opts.master_addr)
    module = "fairseq_cli.hydra_train" if hydra else "fairseq_cli.train"
    program = [sys.executable, "-m", module]
    if not cpu:
        import torch
        gpus = torch.cuda.device_count()
        if world > 1 and not opts.dry_run and n > gpus:
            parser.error(f"--nproc {n}, but only {gpus} CUDA devices are visible (--cpu runs CPU processes)")
        if world == 1:
            return program + args, {}
        address = f"tcp://{opts.master_addr or '127.0.0.1'}:{opts.port or free_port()}"
        settings = [("distributed_training", "distributed_world_size", world),
                    ("distributed_training", "distributed_init_method", address)]
        if opts.nnodes == 1:
            return program + args + render(settings, hydra), {}
        # fairseq spawns min(visible GPUs, world size) processes, ranks first_rank + 0, 1, ... on GPUs 0, 1, ...
        settings.append(("distributed_training", "distributed_rank", first_rank))
        env = {"CUDA_VISIBLE_DEVICES": visible_gpus(n)} if gpus > n else {}  # else fairseq would spawn more
        return program + args + render(settings, hydra), env

    if cpu_flag(args, hydra) is False:
        parser.error("common.cpu=false among the fairseq arguments, but the launcher is to train on CPU")
    settings = [] if cpu_flag(args, hydra) else [("common", "cpu", True)]
    if world == 1:
        return program + args + render(settings, hydra), {}
    given = {}
    for name, choices in CPU_CHOICES.items():
        given[name] = find_setting(args, "distributed_training", name, hydra)
        if given[name] is not None and given[name] not in choices:
            parser.error(f"{spelling('distributed_training', name, hydra)} {given[name]} does not work on CPU; "
                         f"use {' or '.join(choices)} or leave it out")
    # One machine: torchrun writes each rank's number for ${local_rank}. Several: the rank is node rank x
    # nproc + local rank, which torchrun writes into no argument; given -1, env:// takes torchrun's RANK.
    rank = "${local_rank}" if opts.nnodes == 1 else -1
    cpu = cpu_ranks(world, "env://", rank, given={k: v for k, v in given.items() if v is not None})
    settings += [("distributed_training", name, value) for name, value in cpu.items()]
    command = [*TORCHRUN, *torchrun_options(n, opts.port, opts.log_dir, opts.nnodes, opts.node_rank, opts.master_addr),
               "-m", module, *args, *render(settings, hydra)]
    return command, {**cpu_threads_env(n), **RANK_PREFIX}


def _exit_status(returncode):
    return returncode if returncode >= 0 else 128 - returncode  # killed by signal s: 128 + s, as a shell says


def run_torchrun(options):
    """torchrun (``python -m torch.distributed.run <options>``) in this process. Returns 0, the exit status
    of the first rank to fail (torchrun has stopped the others), or 128 + the signal that stopped torchrun
    (it passed the signal on to every rank)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.main(options)
    except ChildFailedError as error:
        print(error, file=sys.stderr, flush=True)  # torchrun's report: each failed rank, its status and error
        return _exit_status(error.get_first_failure()[1].exitcode)
    except SignalException as error:
        return 128 + int(error.sigval)
    return 0


def main(argv=None):
    parser, opts = parse_args(sys.argv[1:] if argv is None else argv)
    command, env = build(opts, parser)
    if opts.dry_run:
        print("".join(f"{k}={shlex.quote(v)} " for k, v in env.items()) + shlex.join(command))
        return 0
    os.environ.update(env)
    if command[:3] != TORCHRUN:  # one fairseq process (which spawns the GPU ranks): it becomes this one
        os.execv(command[0], command)
    node = f" on node {opts.node_rank} of {opts.nnodes}" if opts.nnodes > 1 else ""
    print(f"fairseq_tnn.distributed.launch: torchrun starts {opts.nproc} CPU processes{node} "
          f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}); rank "
          f"{opts.node_rank * opts.nproc}'s output follows, other ranks' lines start with [rank R]", file=sys.stderr,
          flush=True)
    return run_torchrun(command[len(TORCHRUN):])


if __name__ == "__main__":
    sys.exit(main())
