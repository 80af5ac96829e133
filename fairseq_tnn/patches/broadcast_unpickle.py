"""Resuming a multi-process run with torch >= 2.6: fairseq's broadcast of Python objects between the ranks of one
job unpickles what its own job sent (the ``broadcast-unpickle`` row of the table in ``__init__``)."""
import io

import torch
from fairseq.distributed import utils as distributed_utils


def broadcast_object_slow(obj, src_rank, group, dist_device):
    """Broadcast a picklable object from ``src_rank``; every rank returns it.

    Replaces fairseq's ``distributed_utils._broadcast_object_slow`` (same arguments, same messages on the
    wire: a length, then the ``torch.save`` bytes), except that the receivers unpickle with
    ``weights_only=False``. With torch >= 2.6 fairseq's ``torch.load`` there refuses what resuming a
    multi-process run sends: rank 0 reads the checkpoint and ``Trainer.load_checkpoint`` broadcasts it
    after the loader has turned ``state["cfg"]`` into an OmegaConf ``DictConfig`` ("Unsupported global:
    GLOBAL omegaconf.dictconfig.DictConfig"); the same function carries fairseq's other broadcasts
    (sharded optimizer state, FSDP). Its contract is to carry any Python object between the processes of
    one job, and its sender is rank ``src_rank`` of this same job running this same code, not a file from
    elsewhere; torch's own ``broadcast_object_list`` unpickles without restriction for the same reason.
    An allowlist instead would tie the fix to what a config happens to contain (OmegaConf's node and
    metadata classes, ``typing.Any``, fairseq's private placeholder, every typed node of a converted old
    checkpoint). ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` would turn the protection off for every file the
    process loads; this module never does that.
    """
    if distributed_utils.get_rank(group) == src_rank:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(dist_device)
        length = torch.tensor([payload.numel()], dtype=torch.long, device=dist_device)
        distributed_utils.broadcast(length, src=src_rank, group=group)
        distributed_utils.broadcast(payload, src=src_rank, group=group)
        return obj
    length = torch.zeros(1, dtype=torch.long, device=dist_device)
    distributed_utils.broadcast(length, src=src_rank, group=group)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=dist_device)
    distributed_utils.broadcast(payload, src=src_rank, group=group)
    # trusted: the bytes were written by torch.save on rank src_rank of this job (see the docstring)
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location="cpu", weights_only=False)
