"""Start multi-process fairseq training on one machine, on CPUs or GPUs.

    python -m fairseq_tnn.distributed.launch --nproc N [--cpu | --gpu] [--port P] [--hydra] [--dry-run] \\
        -- <fairseq-train arguments...>

GPUs: fairseq starts one process per GPU itself, so this runs one ``fairseq-train ...
--distributed-world-size N --distributed-init-method tcp://127.0.0.1:P``. (An explicit init
method, because fairseq silently trains on one GPU when given ``--distributed-port`` outside
SLURM.)

CPUs (``--cpu``, ``--cpu`` among the fairseq arguments, or no CUDA device): stock fairseq cannot
start the processes itself there (``--cpu --distributed-world-size N`` asserts that N CUDA devices
exist), so this starts N processes of ``fairseq-train``, one per rank, each with::

    --cpu --distributed-world-size N --distributed-rank R --distributed-init-method tcp://127.0.0.1:P
    --distributed-no-spawn --distributed-backend gloo --ddp-backend legacy_ddp

(``pytorch_ddp``, fairseq's default, passes CUDA ``device_ids`` to DDP and fails on CPU.) Rank 0's
output is passed through; the other ranks log only warnings and errors, which are shown with a
``[rank R]`` prefix. If a rank fails, the others are stopped and the launcher exits with that
rank's status; SIGINT and SIGTERM are passed on to every rank. Unless OMP_NUM_THREADS is set,
each rank gets an equal share of the CPUs.

P is a free port unless ``--port`` gives one. ``--hydra`` runs ``fairseq-hydra-train`` instead
and passes the same settings as ``distributed_training.*=`` overrides. ``--dry-run`` prints the
command lines (one per process) and exits.
"""
import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

USAGE = ("python -m fairseq_tnn.distributed.launch --nproc N [--cpu | --gpu] [--port P] [--hydra] [--dry-run] "
         "-- <fairseq-train arguments...>")

# Settings the launcher owns: passing them among the fairseq arguments is an error.
OWNED = ("distributed_world_size", "distributed_rank", "distributed_init_method", "distributed_no_spawn",
         "distributed_port", "distributed_num_procs", "device_id")
# Settings with only some values usable on CPU: the user may pass one of those, or none.
CPU_CHOICES = {"distributed_backend": ("gloo",), "ddp_backend": ("legacy_ddp", "no_c10d")}
STOP_GRACE_S = 10.0  # after asking the ranks to stop, how long before killing them


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m fairseq_tnn.distributed.launch", usage=USAGE,
        description="Run fairseq-train (or fairseq-hydra-train) as N data-parallel processes.")
    parser.add_argument("--nproc", type=int, required=True, help="number of processes (ranks), >= 1")
    device = parser.add_mutually_exclusive_group()
    device.add_argument("--cpu", action="store_true", help="train on CPUs (default where no CUDA device is visible)")
    device.add_argument("--gpu", action="store_true",
                        help="take the GPU path even where no CUDA device is visible (for --dry-run)")
    parser.add_argument("--port", type=int, help="TCP port for the rendezvous on 127.0.0.1 (default: a free one)")
    parser.add_argument("--hydra", action="store_true",
                        help="the arguments after -- are for fairseq-hydra-train (key=value overrides)")
    parser.add_argument("--dry-run", action="store_true", help="print the command line of each process and exit")
    if "--" not in argv:
        parser.error("missing '--' before the fairseq-train arguments")
    split = argv.index("--")
    opts = parser.parse_args(argv[:split])
    opts.train_args = argv[split + 1:]
    if not opts.train_args:
        parser.error("no fairseq-train arguments after '--'")
    if opts.nproc < 1:
        parser.error(f"--nproc must be at least 1 (got {opts.nproc})")
    if opts.port is not None and not 0 < opts.port < 65536:
        parser.error(f"--port must be in 1..65535 (got {opts.port})")
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


def build(opts, parser):
    """The command line of each process and the environment variables to set for them."""
    args, hydra, n = opts.train_args, opts.hydra, opts.nproc
    for name in OWNED:
        if find_setting(args, "distributed_training", name, hydra) is not None:
            parser.error(f"{spelling('distributed_training', name, hydra)} is set by the launcher (from --nproc "
                         "and --port); remove it from the fairseq arguments")
    cpu = use_cpu(opts)
    if opts.gpu and cpu:
        parser.error("--gpu contradicts --cpu among the fairseq arguments")
    program = [sys.executable, "-m", "fairseq_cli.hydra_train" if hydra else "fairseq_cli.train"]
    if not cpu:
        if n > 1 and not opts.dry_run:
            import torch
            if n > torch.cuda.device_count():
                parser.error(f"--nproc {n}, but only {torch.cuda.device_count()} CUDA devices are visible "
                             "(--cpu runs CPU processes)")
        settings = [] if n == 1 else [
            ("distributed_training", "distributed_world_size", n),
            ("distributed_training", "distributed_init_method", f"tcp://127.0.0.1:{opts.port or free_port()}")]
        return [program + args + render(settings, hydra)], {}

    if cpu_flag(args, hydra) is False:
        parser.error("common.cpu=false among the fairseq arguments, but the launcher is to train on CPU")
    settings = [] if cpu_flag(args, hydra) else [("common", "cpu", True)]
    if n == 1:
        return [program + args + render(settings, hydra)], {}
    backends = []
    for name, choices in CPU_CHOICES.items():
        given = find_setting(args, "distributed_training", name, hydra)
        if given is not None and given not in choices:
            parser.error(f"{spelling('distributed_training', name, hydra)} {given} does not work on CPU; "
                         f"use {' or '.join(choices)} or leave it out")
        if given is None:
            backends.append(("distributed_training", name, choices[0]))
    init_method = f"tcp://127.0.0.1:{opts.port or free_port()}"
    commands = [program + args + render(settings + [("distributed_training", "distributed_world_size", n),
                                                    ("distributed_training", "distributed_rank", rank),
                                                    ("distributed_training", "distributed_init_method", init_method),
                                                    ("distributed_training", "distributed_no_spawn", True)] + backends,
                                        hydra)
                for rank in range(n)]
    env = {}
    if "OMP_NUM_THREADS" not in os.environ:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(max(1, cpus // n))
    return commands, env


def _forward(stream, prefix):
    """Copy a rank's output to ours, line by line, with a prefix."""
    for line in iter(stream.readline, ""):
        sys.stdout.write(prefix + line)
        sys.stdout.flush()
    stream.close()


def _exit_status(returncode):
    return returncode if returncode >= 0 else 128 - returncode  # killed by signal s: 128 + s, as a shell says


def run(commands, env):
    """Start one process per command and wait for all of them.

    Returns 0, or the exit status of the first process seen to fail (the others are then stopped),
    or 128 + the signal number after a SIGINT or SIGTERM (passed on to every process).
    """
    full_env = dict(os.environ, **env)
    procs, threads, signals = [], [], []

    def on_signal(signum, _frame):
        signals.append(signum)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank, cmd in enumerate(commands):
            if signals:
                break
            if rank == 0:
                procs.append(subprocess.Popen(cmd, env=full_env))
                continue
            proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace")
            procs.append(proc)
            threads.append(threading.Thread(target=_forward, args=(proc.stdout, f"[rank {rank}] "), daemon=True))
            threads[-1].start()
        failed, deadline = None, None
        while True:
            codes = [proc.poll() for proc in procs]
            if failed is None and not signals:
                failed = next(((rank, c) for rank, c in enumerate(codes) if c not in (None, 0)), None)
                if failed is not None and len(procs) > 1:
                    print(f"fairseq_tnn.distributed.launch: rank {failed[0]} exited with status {_exit_status(failed[1])}; "
                          "stopping the other ranks", file=sys.stderr, flush=True)
                    for proc in procs:
                        if proc.poll() is None:
                            proc.terminate()
            if deadline is None and (failed is not None or signals):
                deadline = time.monotonic() + STOP_GRACE_S
            if all(c is not None for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
            time.sleep(0.1)
    finally:
        for proc in procs:  # only left running if starting a later rank raised
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for thread in threads:
            thread.join(timeout=5)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if signals:
        return 128 + signals[0]
    return _exit_status(failed[1]) if failed is not None else 0


def main(argv=None):
    parser, opts = parse_args(sys.argv[1:] if argv is None else argv)
    commands, env = build(opts, parser)
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())
    if opts.dry_run:
        for cmd in commands:
            print(prefix + shlex.join(cmd))
        return 0
    if len(commands) > 1:
        print(f"fairseq_tnn.distributed.launch: {len(commands)} CPU processes ({prefix.strip() or 'OMP_NUM_THREADS as set'}); "
              "rank 0's output follows, other ranks' lines start with [rank R]", file=sys.stderr, flush=True)
    return run(commands, env)


if __name__ == "__main__":
    sys.exit(main())
