"""How often a gloo rank that ends with its process group alive aborts at exit, against one that destroys it first.

    python benchmarks/gloo_exit.py --runs 40        # ~4 minutes on 2 cores

Each run starts ``--ranks`` processes (spawned, one thread each) that join one gloo group, run one all-gather and wait
for it, and return: left alive (fairseq's ``distributed_main`` leaves it so) or destroyed first
(``torch.distributed.destroy_process_group()``, what ``fairseq_tnn/patches/destroy_group_at_end.py`` adds). A rank
whose gloo worker thread still holds the collective's tensors when the interpreter finalizes aborts with "terminate
called without an active exception" (exit code -6, SIGABRT). The two ways alternate run by run; the counts of runs
with an aborted rank, and of aborted ranks, are printed and written to ``--out`` as JSON.
"""
import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist


def rank_main(rank: int, ranks: int, port: int, destroy: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    gathered = [torch.empty(1) for _ in range(ranks)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    if destroy:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(ranks: int, destroy: bool) -> int:
    """The number of ranks of one run that did not exit with 0."""
    context = torch.multiprocessing.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=rank_main, args=(r, ranks, port, destroy)) for r in range(ranks)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(120)
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()
    return sum(p.exitcode != 0 for p in processes)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="runs of each way (default 40)")
    parser.add_argument("--ranks", type=int, default=5, help="gloo ranks per run (default 5)")
    parser.add_argument("--out", help="a JSON file for the counts (optional)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.ranks < 2:
        parser.error(f"--runs {args.runs} --ranks {args.ranks}: at least 1 run and 2 ranks")
    counts = {way: {"runs": 0, "runs_with_an_abort": 0, "ranks_aborted": 0} for way in ("alive", "destroyed")}
    for _ in range(args.runs):
        for way in ("alive", "destroyed"):
            failed = one_run(args.ranks, destroy=way == "destroyed")
            counts[way]["runs"] += 1
            counts[way]["runs_with_an_abort"] += failed > 0
            counts[way]["ranks_aborted"] += failed
    result = {"torch": torch.__version__, "ranks": args.ranks, "counts": counts}
    for way, c in counts.items():
        print(f"process group {way} at exit: {c['runs_with_an_abort']} of {c['runs']} runs lost a rank "
              f"({c['ranks_aborted']} of {c['runs'] * args.ranks} ranks)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
