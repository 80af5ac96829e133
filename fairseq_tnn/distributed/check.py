"""A guard the plugin's tasks run at start-up, after fairseq has (or has not) set up torch.distributed.

(Beside the launcher, fairseq_tnn/distributed/launch.py, but a module of its own: the tasks import this,
and ``python -m fairseq_tnn.distributed.launch`` must not find its own module imported already.)
"""
import os


def check_joined():
    """Refuse a process that a launcher (torchrun, torch.distributed.launch) started as one of N ranks but
    that fairseq did not join into a distributed run. On CPU, stock fairseq ignores torchrun's environment
    unless given the flags the plugin's launcher adds (``--distributed-world-size N --distributed-rank
    ${local_rank} --distributed-init-method env:// ...``), so each process would train alone and all would
    write the same checkpoint files. Called by the plugin's tasks, after fairseq has (or has not)
    initialised torch.distributed."""
    import torch.distributed as dist

    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit() or int(world) <= 1 or (dist.is_available() and dist.is_initialized()):
        return
    raise RuntimeError(
        f"this process was started as rank {os.environ.get('RANK', '?')} of WORLD_SIZE={world} (torchrun or "
        "torch.distributed.launch), but fairseq did not join the processes into one distributed run: each would "
        "train alone and all would write the same checkpoints. On CPU, launch with "
        "'python -m fairseq_tnn.distributed.launch --nproc N --cpu -- <fairseq-train arguments>' (it runs torchrun "
        "with the flags fairseq needs; --dry-run prints that command); on GPUs, use "
        "'fairseq-train ... --distributed-world-size N' or torchrun with one process per visible GPU.")
