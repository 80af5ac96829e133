"""The threads of a gloo process group that are still running in this process (Linux: ``/proc/self/task``), for
the check that a rank's groups are gone before its interpreter finalizes
(``fairseq_tnn/patches/destroy_group_at_end.py``, its tests and ``benchmarks/gloo_exit.py``). Standard library
only, so that an atexit handler can import it while the interpreter exits."""
import os
from typing import List

# the names torch gives a gloo group's threads (/proc/<pid>/task/*/comm): its device's event loop, its workers
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


def gloo_threads() -> List[str]:
    """The sorted names of this process's running threads that belong to a gloo process group; [] where
    ``/proc/self/task`` cannot be read (not Linux)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                name = comm.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(GLOO_THREADS):
            names.append(name)
    return sorted(names)
