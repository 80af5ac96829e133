"""How often a gloo rank that ends with its process group alive aborts at exit, against one that destroys it but
still holds it, and one that releases it.

    python benchmarks/gloo_exit.py --runs 40        # ~10 minutes on 2 cores (--in-flight --runs 12: ~3)

Each run starts ``--ranks`` processes (spawned, one thread each) that join one gloo group, run one all-gather and wait
for it (or, with ``--in-flight``, leave it in flight), and return, in one of three ways:

- ``alive``: the group left as it is (fairseq's ``distributed_main`` leaves it so);
- ``held``: destroyed (``torch.distributed.destroy_process_group()``) but still referenced, as fairseq-train held it
  before commit d2d0967: ``torch.distributed.nn`` imported after the group exists, which keeps it in its functions'
  default arguments (torch._dynamo imports it when fairseq builds the optimizer);
- ``released``: ``torch.distributed.nn`` imported before the group exists, and the group destroyed: its threads stop
  before the rank returns (what ``fairseq_tnn/patches/destroy_group_at_end.py`` does).

A rank whose gloo worker thread still holds the collective's tensors when the interpreter finalizes aborts with
"terminate called without an active exception" (exit code -6, SIGABRT). The ways alternate run by run; the counts
of runs with an aborted rank, and of aborted ranks, are printed and written to ``--out`` as JSON, with the gloo
threads each way's ranks had left as they returned.
"""
import argparse
import importlib
import json
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist

from fairseq_tnn.distributed.threads import gloo_threads


WAYS = ("alive", "held", "released")


def rank_main(rank: int, ranks: int, port: int, way: str, threads_out: str, in_flight: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if way == "released":  # before the group exists: torch.distributed.nn's defaults stay None
        importlib.import_module("torch.distributed.nn")
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    if way == "held":  # after: its functions' defaults hold the group
        importlib.import_module("torch.distributed.nn")
    gathered = [torch.empty(1) for _ in range(ranks)]
    if in_flight:  # not waited for, and still referenced as the rank returns
        work = dist.all_gather(gathered, torch.tensor([float(rank)]), async_op=True)  # noqa: F841
    else:
        dist.all_gather(gathered, torch.tensor([float(rank)]))
    if way != "alive":
        dist.destroy_process_group()
    if rank == 0:
        with open(threads_out, "w") as f:
            f.write(" ".join(gloo_threads()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(ranks: int, way: str, tmp: str, in_flight: bool = False):
    """(the number of ranks of one run that did not exit with 0, the gloo threads rank 0 had left as it returned)."""
    context = torch.multiprocessing.get_context("spawn")
    port, threads_out = free_port(), os.path.join(tmp, f"threads-{way}")
    processes = [context.Process(target=rank_main, args=(r, ranks, port, way, threads_out, in_flight))
                 for r in range(ranks)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(120)
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()
    left = open(threads_out).read().split() if os.path.exists(threads_out) else None
    return sum(p.exitcode != 0 for p in processes), left


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="runs of each way (default 40)")
    parser.add_argument("--ranks", type=int, default=5, help="gloo ranks per run (default 5)")
    parser.add_argument("--in-flight", action="store_true",
                        help="return with the all-gather not waited for (a collective still in flight at exit)")
    parser.add_argument("--out", help="a JSON file for the counts (optional)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.ranks < 2:
        parser.error(f"--runs {args.runs} --ranks {args.ranks}: at least 1 run and 2 ranks")
    counts = {way: {"runs": 0, "runs_with_an_abort": 0, "ranks_aborted": 0, "gloo_threads_left": None}
              for way in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.runs):
            for way in WAYS:
                failed, left = one_run(args.ranks, way, tmp, args.in_flight)
                counts[way]["runs"] += 1
                counts[way]["runs_with_an_abort"] += failed > 0
                counts[way]["ranks_aborted"] += failed
                if left is not None:
                    counts[way]["gloo_threads_left"] = left
    result = {"torch": torch.__version__, "ranks": args.ranks, "in_flight": args.in_flight, "counts": counts}
    for way, c in counts.items():
        print(f"process group {way} at exit: {c['runs_with_an_abort']} of {c['runs']} runs lost a rank "
              f"({c['ranks_aborted']} of {c['runs'] * args.ranks} ranks); gloo threads left as rank 0 returned: "
              f"{len(c['gloo_threads_left'] or [])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
