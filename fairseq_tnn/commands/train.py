"""``train`` and ``slurm-train``: the paper's recipe (fairseq_tnn/recipe.py) for one preset, as one process, one
machine's processes, several machines, or a SLURM job's tasks, with its run directory.

    python -m fairseq_tnn train <preset> <data-bin> [extra fairseq-train args...]    (scripts/train.sh)
    python -m fairseq_tnn slurm-train <preset> [extra fairseq-train args...]        (scripts/slurm/train.sbatch)

Knobs are environment variables; ``--help`` lists each with its default. What these commands decide:
- the fairseq-train arguments: the recipe, with update-freq = SEQS_PER_UPDATE / (BATCH_PER_GPU x world), so that
  the tokens per update are the paper's on any number of processes (world: NNODES x NPROC for ``train``, the
  job's processes for ``slurm-train``);
- the command: fairseq-train alone (world 1), fairseq_tnn.distributed.launch (several processes, or several
  machines, each running ``train`` with its NODE_RANK), or srun (slurm_layout: one task per GPU, one task
  per node in which fairseq spawns a process per GPU, or CPU ranks);
- the run directory SAVE_ROOT/RUN_NAME (claim_run_dir): refused when it holds a run, unless FORCE=1 (deleted)
  or RESUME=1 (continued; refused when its checkpoint_last.pt was trained with another dictionary than the
  data's); without any checkpoint (an attempt that saved none) its files are moved to previous-attempt/. Only
  NODE_RANK 0 claims it and appends the command to its command.txt; the other machines check it.
The distributed options are these commands' own: passing one among the extra arguments is refused. A dry run
(DRY_RUN=1) prints the command whatever is on disk, saying what a real run would stop at; a real run replaces
this process with the command (os.execvp), so signals and the exit status are the command's.
"""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import List, Mapping

from fairseq_tnn import recipe
from fairseq_tnn.commands.common import (ROOT, CommandError, Knob, abs_path, count_gpus, fairseq_bin, invocation,
                                         is_pos_int, knobs_help, quote_cmd, read_knobs, refuse_unless_dry, run_main, say)

LAUNCH = ["-m", "fairseq_tnn.distributed.launch"]  # run by PYTHON


def _flag(value: str) -> bool:
    return value in ("0", "1")


def _port(value: str) -> bool:
    return value.isdigit() and 0 < int(value) < 65536


def _default_nproc(known) -> str:
    return "1" if known["CPU"] == "1" else str(max(count_gpus(), 1))


# The run directory's knobs, shared by both commands (after the recipe's, recipe.KNOBS)
RUN_KNOBS = (
    Knob("SAVE_ROOT", str(ROOT / "checkpoints"), "where run directories go"),
    Knob("RUN_NAME", lambda known: known["PRESET"], "[<preset>] the run directory, SAVE_ROOT/RUN_NAME: checkpoints, "
         "train.log (json lines), tensorboard/, command.txt (the commands that ran)"),
    Knob("FORCE", "0", "1 deletes an existing run directory first and starts over", check=_flag, allowed="0 or 1"),
    Knob("RESUME", "0", "1 continues the run in the run directory from its checkpoint_last.pt (a directory "
         "without any checkpoint needs neither FORCE nor RESUME: its files go to previous-attempt/)",
         check=_flag, allowed="0 or 1"),
    Knob("DRY_RUN", "0", "1 prints the command instead of running it, whatever is on disk (what a real run "
         "would refuse is said, not fatal)", check=_flag, allowed="0 or 1"),
)
# train's own: the processes on this machine and the machines
TRAIN_KNOBS = (
    Knob("NPROC", _default_nproc, "[the GPUs seen (CUDA_VISIBLE_DEVICES, else nvidia-smi), 1 with CPU=1] "
         "processes on this machine: 1 runs fairseq-train alone, more run python -m fairseq_tnn.distributed.launch "
         "(on GPUs one fairseq-train that spawns a process per GPU, on CPU torchrun)",
         check=is_pos_int, allowed="a positive integer"),
    Knob("NNODES", "1", "machines, each running this command with its NODE_RANK (world = NNODES x NPROC)",
         check=is_pos_int, allowed="a positive integer"),
    Knob("NODE_RANK", "0", "this machine's rank, 0 to NNODES - 1; only 0 claims the run directory",
         check=lambda v: v.isdigit(), allowed="0 to NNODES - 1"),
    Knob("MASTER_ADDR", lambda known: "127.0.0.1" if known["NNODES"] == "1" else "",
         "[127.0.0.1 when NNODES=1, required otherwise] the address of the NODE_RANK 0 machine, which every "
         "machine reaches", check=bool, allowed="the NODE_RANK 0 machine's address when NNODES > 1"),
    Knob("MASTER_PORT", lambda known: "29500" if known["NNODES"] != "1" else "",
         "[a free one when NNODES=1, 29500 otherwise] the rendezvous port on MASTER_ADDR",
         check=lambda v: v == "" or _port(v), allowed="a port, 1 to 65535"),
)
SLURM_KNOBS = (
    Knob("DATA", str(ROOT / "data-bin" / "wikitext-103"), "the binarised data (fairseq-preprocess's output)"),
    Knob("PORT", lambda known: str(10000 + int(known["SLURM_JOB_ID"]) % 20000),
         "[10000 + job id mod 20000] the master's port (GPU tasks: --distributed-port; CPU ranks: the tcp:// "
         "rendezvous)", check=_port, allowed="a port, 1 to 65535"),
)
# Besides the knobs, read by common.fairseq_bin and scripts/lib.sh's hand_over (which runs these commands)
ENVIRONMENT = ("  FAIRSEQ_BIN [<repo>/.venv/bin] where fairseq-train is\n"
               "  PYTHON [$FAIRSEQ_BIN/python] the python that runs the launcher and this command")

# fairseq's distributed options: these commands set them (from NPROC, NNODES and CPU, or the SLURM allocation)
DISTRIBUTED_OPTIONS = ("--distributed-world-size", "--distributed-rank", "--distributed-port",
                       "--distributed-init-method", "--distributed-no-spawn", "--distributed-num-procs",
                       "--device-id", "--local_rank", "--distributed-backend", "--ddp-backend")

USAGE = {"train": "<preset> <data-bin> [extra fairseq-train args...]",
         "slurm-train": "<preset> [extra fairseq-train args...]"}
def usage(command: str, prog: str) -> str:
    return f"usage: {invocation(prog)} {USAGE[command]}"


def help_text(command: str, prog: str) -> str:
    knobs = [*recipe.KNOBS, *(TRAIN_KNOBS if command == "train" else SLURM_KNOBS), *RUN_KNOBS]
    what = ("Train a preset with the paper's recipe: fairseq-train, or the launcher for several processes or "
            "machines. Extra arguments go last to fairseq-train, so they win over the recipe."
            if command == "train" else
            "Inside a SLURM job (scripts/slurm/train.sbatch): the paper's recipe under srun, the world from the "
            "allocation; on a requeue (SLURM_RESTART_COUNT > 0) RESUME=1 and FORCE=0.")
    return (f"{usage(command, prog)}\n{what}\ncausal presets: {' '.join(recipe.CAUSAL_PRESETS)}\n"
            f"masked presets: {' '.join(recipe.MASKED_PRESETS)}\n"
            f"{knobs_help(knobs)}\n{ENVIRONMENT}\n")


def refuse_distributed_options(extra: List[str], source: str) -> None:
    for arg in extra:
        if arg.split("=", 1)[0] in DISTRIBUTED_OPTIONS:
            raise CommandError(f"{arg} is set by this script from {source}; remove it from the fairseq-train arguments")


def python(env: Mapping[str, str]) -> str:
    return env.get("PYTHON") or str(fairseq_bin(env) / "python")


def data_dir(prog: str, data: str, dry: bool) -> str:
    """The data directory made absolute; without dict.txt refused (said, in a dry run)."""
    if not (Path(data) / "dict.txt").is_file():
        refuse_unless_dry(prog, dry, f"no binarised data in '{data}' (dict.txt missing); run "
                                     "scripts/prepare-wikitext-103.sh first, or scripts/prepare-corpus.sh for your "
                                     "own text")
    return os.path.normpath(abs_path(data))


def save_dir_of(knobs: Mapping[str, str]) -> Path:
    return abs_path(knobs["SAVE_ROOT"]) / knobs["RUN_NAME"]


def has_checkpoint(run_dir: Path) -> bool:
    return any(run_dir.glob("checkpoint*.pt"))


def claim_run_dir(prog: str, run_dir: Path, knobs: Mapping[str, str], claim: bool = True) -> None:
    """Refuse an existing run unless FORCE=1 (start over) or RESUME=1 (continue). A run directory without any
    checkpoint (an attempt that failed before saving one) is not a run to protect: its files are moved to
    previous-attempt/ (replacing an older one) and training starts there again. claim False (a machine
    other than NODE_RANK 0's): the same checks, nothing moved or deleted. A dry run changes nothing."""
    dry, force, resume = knobs["DRY_RUN"] == "1", knobs["FORCE"] == "1", knobs["RESUME"] == "1"
    act = claim and not dry
    if run_dir.is_dir() and any(run_dir.iterdir()):
        if not has_checkpoint(run_dir) and not force and not resume:
            if claim:
                say(prog, f"{run_dir} holds no checkpoint (an earlier attempt that saved nothing): moving its files "
                          f"to {run_dir}/previous-attempt/ and starting again")
            if act:
                prev, new = run_dir / "previous-attempt", run_dir / "previous-attempt.new"
                shutil.rmtree(new, ignore_errors=True)
                new.mkdir()
                for entry in list(run_dir.iterdir()):
                    if entry not in (prev, new):
                        entry.rename(new / entry.name)
                shutil.rmtree(prev, ignore_errors=True)
                new.rename(prev)
        elif force:
            if claim:
                say(prog, f"FORCE=1: deleting {run_dir}")
            if act:
                shutil.rmtree(run_dir)
        elif resume:
            say(prog, f"RESUME=1: continuing the run in {run_dir}")
        else:
            refuse_unless_dry(prog, dry, f"{run_dir} already exists; refusing to overwrite it (FORCE=1 deletes it "
                                         "and starts over, RESUME=1 continues from its checkpoint_last.pt)")
    if not dry:
        run_dir.mkdir(parents=True, exist_ok=True)  # every machine: fairseq opens train.log there


def dictionary_symbols(dict_txt: Path, kind: str) -> int:
    """The symbols of the model fairseq builds for dict_txt: fairseq's 4 specials (<s>, <pad>, </s>, <unk>),
    one per line of dict.txt, and the masked task's <mask>."""
    with open(dict_txt, encoding="utf-8") as f:
        lines = sum(1 for line in f if line.strip())
    return 4 + lines + (1 if kind == "masked" else 0)


def check_resumed_dictionary(prog: str, run_dir: Path, data: str, kind: str, knobs: Mapping[str, str]) -> None:
    """On a resume, refuse (before fairseq starts, which would stop with a state_dict size mismatch) a
    checkpoint_last.pt trained with another dictionary than data's."""
    last = run_dir / "checkpoint_last.pt"
    new_dict = Path(data) / "dict.txt"
    if knobs["RESUME"] != "1" or knobs["FORCE"] == "1" or not new_dict.is_file() or not zipfile.is_zipfile(last):
        return  # (not a zip file: no checkpoint torch wrote, whose reading fairseq reports)
    import fairseq_tnn  # only here: a resume reads the checkpoint's dictionary size and data directory
    fairseq_tnn.register()  # the plugin's checkpoint loader (weights_only, as fairseq-train will load it)
    from fairseq import checkpoint_utils
    try:
        state = checkpoint_utils.load_checkpoint_to_cpu(str(last))
        rows = [w.shape[0] for name, w in state["model"].items() if name.endswith("embed_tokens.weight")]
        old_data = str(state["cfg"]["task"]["data"])
    except Exception:  # unreadable or not fairseq's: fairseq's own load says what is wrong with it
        return
    if not rows:
        return
    symbols = dictionary_symbols(new_dict, kind)
    old_dict = Path(old_data) / "dict.txt"
    same_words = (not old_dict.is_file() or os.path.samefile(old_dict, new_dict)
                  or old_dict.read_bytes() == new_dict.read_bytes())
    if rows[0] != symbols or not same_words:
        refuse_unless_dry(prog, knobs["DRY_RUN"] == "1",
                          f"{last} was trained with the dictionary of {old_data} ({rows[0]} symbols), not with "
                          f"{new_dict} ({symbols} symbols); resume it on its own data, or train this data beside it "
                          "(RUN_NAME=<another name>) or over it (FORCE=1)")


def parse(command: str, argv: List[str], prog: str):
    """(preset, the arguments after it) from the command line, or the exit status of --help (0, the help on
    stdout) or of a usage error (2, the usage and the presets on stderr)."""
    positional = 2 if command == "train" else 1
    if argv[:1] in (["-h"], ["--help"]):
        print(help_text(command, prog), end="")
        return 0
    if len(argv) < positional or any(a.startswith("-") for a in argv[:positional]):
        print(f"{usage(command, prog)}\npresets: {' '.join(recipe.PRESETS)}\n"
              f"knobs: python -m fairseq_tnn {command} --help", file=sys.stderr)
        return 2
    try:
        recipe.kind(argv[0])
    except CommandError:
        if command == "train":
            print(usage(command, prog), file=sys.stderr)
        raise
    return argv[0], argv[1:]


def execute(prog: str, cmd: List[str], run_dir: Path, claim: bool, message: str) -> int:
    if claim:
        with open(run_dir / "command.txt", "a") as f:
            f.write(quote_cmd(cmd) + "\n")
    say(prog, message)
    sys.stdout.flush()
    os.execvp(cmd[0], cmd)
    return 1  # not reached


def train(argv: List[str], prog: str, env: Mapping[str, str]) -> int:
    parsed = parse("train", argv, prog)
    if isinstance(parsed, int):
        return parsed
    preset, (data, *extra) = parsed
    refuse_distributed_options(extra, "NPROC, NNODES and CPU")
    knobs = read_knobs([*recipe.KNOBS, *TRAIN_KNOBS, *RUN_KNOBS], env,
                       known={"PRESET": preset, "KIND": recipe.kind(preset)})
    nproc, nnodes, node_rank = int(knobs["NPROC"]), int(knobs["NNODES"]), int(knobs["NODE_RANK"])
    if node_rank >= nnodes:
        raise CommandError(f"NODE_RANK must be 0 to NNODES - 1 = {nnodes - 1}, not '{node_rank}'")
    addr, port = knobs["MASTER_ADDR"], knobs["MASTER_PORT"]
    if nnodes == 1 and addr not in ("127.0.0.1", "localhost"):
        raise CommandError(f"MASTER_ADDR={addr} is for several machines (NNODES > 1); one machine's processes "
                           "meet on 127.0.0.1")
    if nnodes == 1 and nproc == 1 and port:
        raise CommandError(f"MASTER_PORT={port} is for several processes (NPROC > 1 or NNODES > 1); one process "
                           "needs no port")
    dry, cpu = knobs["DRY_RUN"] == "1", knobs["CPU"] == "1"
    data = data_dir(prog, data, dry)
    run_dir = save_dir_of(knobs)
    paper = recipe.paper(preset, data, str(run_dir), nnodes * nproc, env, str(ROOT / "fairseq_tnn"))

    if nnodes == 1 and nproc == 1:
        cmd = [str(fairseq_bin(env) / "fairseq-train"), *paper.args, "--distributed-world-size", "1", *extra]
    else:
        cmd = [python(env), *LAUNCH, "--nproc", str(nproc), *(["--cpu"] if cpu else [])]
        if nnodes > 1:
            cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", addr,
                    "--master-port", port]
        elif port:
            cmd += ["--port", port]
        cmd += ["--", *paper.args, *extra]

    claim = node_rank == 0
    claim_run_dir(prog, run_dir, knobs, claim)
    check_resumed_dictionary(prog, run_dir, data, paper.kind, knobs)
    if dry:
        print(quote_cmd(cmd))
        return 0
    where = "" if nnodes == 1 else f" on each of {nnodes} machines (this one NODE_RANK {node_rank})"
    return execute(prog, cmd, run_dir, claim, f"{preset}, {nproc} process(es){where}, update-freq "
                                              f"{paper.update_freq}; logs and checkpoints in {run_dir}")


def slurm_layout(env: Mapping[str, str], preset: str, cpu: bool):
    """(nodes, tasks per node, world, words) of this SLURM job."""
    nnodes = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or ""
    per_node = env.get("SLURM_NTASKS_PER_NODE") or ""
    ntasks = env.get("SLURM_NTASKS") or ""
    if not per_node and ntasks and nnodes:
        if is_pos_int(ntasks) and is_pos_int(nnodes) and int(ntasks) % int(nnodes):
            raise CommandError(f"{ntasks} tasks on {nnodes} nodes: give every node the same number (--ntasks-per-node)")
        per_node = str(int(ntasks) // int(nnodes)) if is_pos_int(ntasks) and is_pos_int(nnodes) else ntasks
    if not nnodes or not per_node:
        raise CommandError(f"not inside a SLURM job: submit with 'sbatch scripts/slurm/train.sbatch {preset}' from "
                           "the repository root (or set SLURM_NNODES and SLURM_NTASKS_PER_NODE with DRY_RUN=1 to "
                           "see the command)")
    if not (is_pos_int(nnodes) and is_pos_int(per_node)):
        raise CommandError(f"SLURM_NNODES={nnodes} and SLURM_NTASKS_PER_NODE={per_node}: expected a positive number "
                           "of nodes and of tasks per node")
    nodes, tasks = int(nnodes), int(per_node)
    if cpu:
        return nodes, tasks, nodes * tasks, f"{nodes} node(s) x {tasks} CPU task(s)"
    gpus = count_gpus(env)
    if gpus < 1:
        raise CommandError("no GPU visible on this node (CUDA_VISIBLE_DEVICES, nvidia-smi): ask for GPUs "
                           "(--gpus-per-node), or train on CPU with CPU=1 and --gpus-per-node=0 "
                           "(docs/training.md#slurm); a dry run off the GPU node: set CUDA_VISIBLE_DEVICES to the "
                           "node's GPUs")
    if tasks == 1:  # fairseq spawns one process per visible GPU and sets world = nodes x GPUs itself
        return nodes, tasks, nodes * gpus, f"{nodes} node(s) x {gpus} GPU(s), one process per GPU spawned by fairseq"
    if tasks <= gpus:
        return nodes, tasks, nodes * tasks, f"{nodes} node(s) x {tasks} task(s), one GPU each"
    raise CommandError(f"--ntasks-per-node={tasks} but {gpus} GPU(s) visible: one task per GPU (--ntasks-per-node at "
                       "most --gpus-per-node), or one task per node (--ntasks-per-node=1)")


def master_host(env: Mapping[str, str]) -> str:
    """The job's first node (scontrol show hostnames), else this host."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", env.get("SLURM_JOB_NODELIST", "")],
                             capture_output=True, text=True).stdout.split()
    except OSError:
        out = []
    return out[0] if out else os.uname().nodename


def slurm_train(argv: List[str], prog: str, env: Mapping[str, str]) -> int:
    parsed = parse("slurm-train", argv, prog)
    if isinstance(parsed, int):
        return parsed
    preset, extra = parsed
    if extra and not extra[0].startswith("-"):
        raise CommandError(f"'{extra[0]}' is not a fairseq-train option: extra arguments go to fairseq-train and the "
                           f"data comes from DATA (DATA={extra[0]} sbatch ... scripts/slurm/train.sbatch {preset})")
    refuse_distributed_options(extra, "the SLURM allocation (and CPU)")
    env = dict(env)
    restarts = env.get("SLURM_RESTART_COUNT") or "0"
    requeued = restarts.isdigit() and int(restarts) > 0
    if requeued:  # continue this job's run, even if it was submitted with FORCE=1
        env.update(RESUME="1", FORCE="0")
    job = env.get("SLURM_JOB_ID") or ""
    known = {"PRESET": preset, "KIND": recipe.kind(preset), "SLURM_JOB_ID": job if job.isdigit() else "0"}
    cpu_knob = read_knobs([k for k in recipe.KNOBS if k.name == "CPU"], env)  # the layout depends on it
    nodes, tasks, world, layout = slurm_layout(env, preset, cpu_knob["CPU"] == "1")
    knobs = read_knobs([*recipe.KNOBS, *SLURM_KNOBS, *RUN_KNOBS], env, known=known)
    dry, cpu = knobs["DRY_RUN"] == "1", knobs["CPU"] == "1"
    data = data_dir(prog, knobs["DATA"], dry)
    run_dir = save_dir_of(knobs)
    paper = recipe.paper(preset, data, str(run_dir), world, env, str(ROOT / "fairseq_tnn"))
    port = knobs["PORT"]
    train_cmd = [str(fairseq_bin(env) / "fairseq-train")]
    if cpu and world > 1:
        # each task's rank from SLURM_PROCID, appended in the task (srun gives every task the same arguments)
        train_cmd = ["bash", "-c", 'exec "$@" --distributed-rank "$SLURM_PROCID"', "fairseq-train", *train_cmd]
        dist = recipe.fairseq_options(recipe.cpu_ranks(str(world), f"tcp://{master_host(env)}:{port}"))
    else:
        dist = ["--distributed-world-size", str(world), *(["--distributed-port", port] if world > 1 else [])]
    cmd = ["srun", "--kill-on-bad-exit=1", *train_cmd, *paper.args, *dist, *extra]

    claim_run_dir(prog, run_dir, knobs)
    check_resumed_dictionary(prog, run_dir, data, paper.kind, knobs)
    if dry:
        print(quote_cmd(cmd))
        return 0
    if cpu:
        os.environ.setdefault("OMP_NUM_THREADS", env.get("SLURM_CPUS_PER_TASK") or "1")
    attempt = f", restart {restarts}" if requeued else ""
    return execute(prog, cmd, run_dir, True, f"{preset}: {layout}, update-freq {paper.update_freq}{attempt}; "
                                             f"logs in {run_dir}")


def main(argv: List[str], prog: str) -> int:
    return run_main(prog, lambda: train(argv, prog, os.environ))


def main_slurm(argv: List[str], prog: str) -> int:
    return run_main(prog, lambda: slurm_train(argv, prog, os.environ))
