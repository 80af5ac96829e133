"""Runs the fairseq CLIs and Python scripts for the tests without paying their start-up each time.

A fresh ``fairseq-train`` spends ~5 s on 2 CPU cores before it reads its first argument: starting Python, importing
torch (2 s), scikit-learn and scipy (1.3 s, which fairseq imports unconditionally), and fairseq itself, with all its
tasks, models and criterions (1.1 s); then 1.5 s importing torch._dynamo when it builds its optimizer, and 0.9 s in
the interpreter's shutdown. The suite runs a few hundred such commands. So each pytest worker starts two server
processes (this file, run as a script; ``KINDS``): one for Python scripts and modules, which imports the third-party
libraries once, and one for fairseq's console scripts, which imports fairseq as well. Each freezes what it imported
out of the garbage collector's sight (``gc.freeze``: the children's collections and their shutdown skip it), and for
every command forks a child that *is* the command: it takes the command's working directory, environment, standard
streams and ``sys.argv``, and runs the script (a console script such as ``.venv/bin/fairseq-train`` is the wrapper
file pip wrote) or module as ``__main__``, as Python would; the child exits through the interpreter's normal
shutdown. What comes back is what ``subprocess.run`` gives: the exit status (negative: killed by that signal) and
the output.

Nothing of the plugin is imported beforehand, and for Python scripts nothing of fairseq: each command imports them
itself, in its own order, with their side effects (fairseq_cli's logging set-up to stdout, the plugin's
registrations and its fixes of fairseq, --user-dir's import). Importing fairseq sets up logging, which the fairseq
server takes away after the import and gives back to each command that would have had it
(``LOGS_BEFORE_IMPORTING_FAIRSEQ``). The servers check that what they preload printed nothing (a fresh process would
print it to the command's streams), started no thread, left CUDA uninitialised and, apart from fairseq's, left
logging unconfigured, as a fresh interpreter has it (they add a few warning filters, which every fairseq command
adds too when it imports them). Commands whose environment differs from the server's in a variable that Python,
torch, OpenMP or BLAS read at start-up (``startup_env``, ``refusal``) run as fresh processes instead, and so does
everything when ``TESTS_FORKSERVER=0``. Commands that need a process of their own (torchrun and its ranks, the shell
scripts themselves, ``python -c``) do not come here.

Two kinds of clients. The pytest worker (tests/helpers.py) writes one JSON request per line on a pipe (fds given on
the command line: script or module, args, env, cwd, and the paths of files for stdin, stdout and stderr). The shell
scripts the tests run reach the servers through shims (tests/forkshim.py, FAIRSEQ_BIN and PYTHON in their
environment): a shim connects to its kind of server's unix socket (its path is the third argument; the kind is the
fourth) and sends the same request with its own fds 0-2 attached. To both the server answers ``{"exec": true}`` when
the command must be a fresh process (the client then starts it itself), or ``{"pid": ...}`` when the child is
started and ``{"status": ...}`` when it has exited. A shim that dies (SIGKILL) takes its command with it: the server
kills a child whose shim's connection closes.
"""
import gc
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time

# Variables read only after start-up (by the command itself, or by modules the server does not import),
# so a command may set them and still be forked from the server. TORCHINDUCTOR_CACHE_DIR is read again at
# each compilation (at import it only names the directory of dynamo's precompile cache, which is off).
LATE_ENV = {"TORCHINDUCTOR_CACHE_DIR", "PYTEST_CURRENT_TEST", "FAIRSEQ_BIN", "FAIRSEQ_PREPROCESS", "PYTHON"}
# Variables that Python, its locale and temporary-directory set-up, torch, OpenMP, BLAS and the other
# preloaded libraries read when they start or are imported: a command whose value of one of these (outside
# LATE_ENV) differs from the server's is not forked. Any other variable (a script's settings, SLURM's, PATH,
# PWD) is the command's own, read when it runs. tests/cli/test_forkserver.py records what the preloads read.
STARTUP_PREFIXES = ("PYTHON", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "BLIS_", "NUMEXPR_", "MALLOC_", "LD_",
                    "LC_", "TORCH", "CUDA", "NCCL", "NVIDIA", "NPY_", "NUMPY_", "SCIPY_", "SKLEARN_", "JOBLIB_",
                    "HYDRA_", "OC_", "TENSORBOARD", "TMP", "TEMP", "TMPDIR", "_PYTHON_", "PYTORCH_", "KINETO_", "FX_",
                    "LOKY_", "COMPILE_STROBELIGHT_",
                    # torch._dynamo's configs (inductor's and functorch's among them) and sympy's, at import
                    "AOTINDUCTOR_", "AOT_INDUCTOR_", "AOT_PARTITIONER_", "INDUCTOR_", "CUTEDSL_", "CUTLASS_",
                    "PARTITIONER_", "PT2_", "SYMPY_", "MPMATH_",
                    # fairseq's import: fsspec's config, tqdm's defaults, absl's flags
                    "FSSPEC_", "TQDM_", "ABSL_")
STARTUP_NAMES = {"LANG", "LANGUAGE", "HOME", "USER", "LOGNAME", "LNAME", "USERNAME", "CI", "CXX", "SAGE_ROOT",
                 "SACREBLEU", "SOURCE_DATE_EPOCH", "CRC32C_SW_MODE", "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION",
                 "ENABLE_PERSISTENT_TMA_MATMUL", "ENABLE_TEMPLATE_TMA_STORE", "ENABLE_TMA_LOAD_FOR_TEMPLATE_EPILOGUE",
                 "FAKE_ALLOW_META", "LOG_AUTOTUNE_RESULTS", "LOG_TLPARSE", "DUMP_AOTI_MINIFIER",
                 "UNSAFE_SKIP_FSDP_MODULE_GUARDS",
                 # fairseq's import: --device-id's default (fairseq/dataclass/configs.py), torch.hub's cache
                 "LOCAL_RANK", "XDG_CACHE_HOME"}
# Imported before any command: the third-party libraries that cost fairseq's start-up its time (fairseq
# imports all of these; torch._dynamo, 1.5 s, when fairseq-train builds its optimizer), none of which sets
# up logging or starts a thread.
PRELOAD = ("torch", "torch._dynamo", "numpy", "sklearn.metrics", "scipy.stats", "hydra", "omegaconf", "sacrebleu",
           "tensorboardX")
# Two kinds of server, as each client has both: "python", for Python scripts and modules, which preloads PRELOAD;
# "fairseq", for fairseq's console scripts (``fairseq-train`` ...), which preloads fairseq itself as well (1.1 s
# of each such command), as every one of them imports it before it reads its arguments.
KINDS = {"python": PRELOAD, "fairseq": PRELOAD + ("fairseq",)}
# Importing fairseq sets up logging (fairseq/models/wav2vec/wav2vec2_classification.py calls logging.basicConfig:
# DEBUG to stderr), and in a fresh process that decides where a command's log goes: fairseq-train sets up its own
# (INFO to stdout) before it imports fairseq, which then leaves it alone; fairseq's other commands import fairseq
# first, so fairseq's set-up is the one they keep. The fairseq server takes fairseq's set-up away after the import and
# gives it back to each child whose command is not one of these.
LOGS_BEFORE_IMPORTING_FAIRSEQ = {"fairseq-train"}


def kind_of(req):
    """The kind of server that runs a request: "fairseq" for a fairseq console script, else "python"."""
    script = req.get("script") or ""
    return "fairseq" if os.path.basename(script).startswith("fairseq-") and not script.endswith(".py") else "python"


def startup_env(env):
    """The part of an environment that the server's start-up has already read."""
    return {k: v for k, v in env.items()
            if k not in LATE_ENV and (k in STARTUP_NAMES or k.startswith(STARTUP_PREFIXES))}


def refusal(env, server_env, preloaded):
    """Why a command with environment ``env`` may not be forked from a server started with ``server_env``: the
    start-up variables that differ (an empty list: it may). ``preloaded``: the variables the preloaded
    libraries set for themselves when imported (scikit-learn's KMP_ ones): a command may have them so or not
    at all, as a fresh process gets them when it imports those libraries."""
    mine, theirs = startup_env(server_env), startup_env(env)
    return sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)
                  and not (k in preloaded and theirs.get(k) in (None, preloaded[k])))


def _status(wait_status):
    return -os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else os.WEXITSTATUS(wait_status)


def _read_request(conn):
    """A shim's request (one JSON line, its fds 0-2 with the first bytes), or (None, []) if it is not one."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while data and not data.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    try:
        return json.loads(data), fds
    except ValueError:
        for fd in fds:
            os.close(fd)
        return None, []


def _serve(requests, replies, listener, server_env, preloaded, kind):
    """Fork a child per request of the server's kind that may be forked (``refusal``; the others get
    ``{"exec": true}``); in the
    server, never return (until the pytest worker closes its pipe); in a child, return (its request, the
    shim's fds or None). server_env: the server's environment as it started, before the preloads added
    ``preloaded`` to it."""
    sel = selectors.DefaultSelector()
    sel.register(requests, selectors.EVENT_READ, "pipe")
    sel.register(listener, selectors.EVENT_READ, "listen")
    owners = {}  # child pid -> None (the pytest worker) or the shim's connection
    buf = b""

    def start(req, fds, owner):
        why = refusal(req["env"], server_env, preloaded)
        if kind_of(req) != kind:
            why = f"a {kind_of(req)} command sent to the {kind} server"
        elif why:
            why = f"start-up variables {why}"
        if why:  # in the server's log: why a command runs as a fresh process
            print(f"fresh process for {req.get('script') or req.get('module')}: {why}", file=sys.stderr, flush=True)
            for fd in fds or ():
                os.close(fd)
            reply(owner, {"exec": True})
            if owner is not None:
                owner.close()
            return None
        pid = os.fork()
        if pid == 0:
            for key in list(sel.get_map().values()):
                if key.fileobj is not requests:
                    key.fileobj.close()
            sel.close()
            os.close(requests)
            os.close(replies)
            if owner is not None:
                owner.close()
            return req, fds
        for fd in fds or ():
            os.close(fd)
        owners[pid] = owner
        reply(owner, {"pid": pid})
        return None

    def reply(owner, msg):
        line = (json.dumps(msg) + "\n").encode()
        try:
            if owner is None:
                os.write(replies, line)
            else:
                owner.sendall(line)
        except OSError:  # a shim that has gone: its command was killed
            pass

    while True:
        for key, _ in sel.select(timeout=0.02):
            if key.data == "pipe":
                chunk = os.read(requests, 1 << 16)
                if not chunk:
                    for pid, owner in owners.items():
                        os.kill(pid, signal.SIGKILL)
                    sys.exit(0)
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    child = start(json.loads(line), None, None)
                    if child:
                        return child
            elif key.data == "listen":
                conn, _ = listener.accept()
                try:
                    req, fds = _read_request(conn)
                except OSError:  # a shim that went away
                    conn.close()
                    continue
                if req is None or len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    reply(conn, {"exec": True})
                    conn.close()
                    continue
                child = start(req, fds, conn)
                if child:
                    return child
                if conn.fileno() != -1:  # forked, not refused
                    sel.register(conn, selectors.EVENT_READ, "shim")
            else:  # a shim's connection: readable only when the shim has gone
                conn = key.fileobj
                sel.unregister(conn)
                conn.close()
                for pid, owner in owners.items():
                    if owner is conn:
                        os.kill(pid, signal.SIGKILL)
                        owners[pid] = "gone"
        while owners:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            owner = owners.pop(pid)
            if owner == "gone":
                continue
            reply(owner, {"status": _status(wait_status)})
            if owner is not None:
                sel.unregister(owner)
                owner.close()


def _become(req, fds, preloaded, fairseq_logging):
    """Turn this child into the command: cwd, environment, fds 0-2 (the shim's, or the request's files),
    the logging set-up that importing fairseq made (``fairseq_logging``: the root logger's handlers and level,
    unless the command sets up its own first), sys.argv and sys.path[0] as Python sets them for
    `python SCRIPT ARGS` (a console script is such a script) or `python -m MODULE ARGS`; then run it as
    __main__. Its exit is the interpreter's own: SystemExit, an uncaught exception's traceback and status 1,
    atexit handlers, flushed streams."""
    import logging
    import runpy
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for k, v in preloaded.items():  # as the preloaded libraries set them on import, unless already set
        os.environ.setdefault(k, v)
    time.tzset()
    if fds is None:
        fds = [os.open(req["stdin"], os.O_RDONLY), os.open(req["stdout"], os.O_WRONLY | os.O_APPEND),
               os.open(req["stderr"], os.O_WRONLY | os.O_APPEND)]
    for fd, opened in enumerate(fds):
        os.dup2(opened, fd)
    for opened in set(fds) - {0, 1, 2}:
        os.close(opened)
    if fairseq_logging and os.path.basename(req["script"]) not in LOGS_BEFORE_IMPORTING_FAIRSEQ:
        handlers, level = fairseq_logging  # their stream is sys.stderr, now the command's
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)
    if "module" in req:
        sys.argv = [req["module"], *req["args"]]  # run_module puts the module's file in argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [req["script"], *req["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(req["script"]))
        runpy.run_path(req["script"], run_name="__main__")


def _cuda_count_spares_forks():
    """Whether torch.cuda.device_count(), which importing fairseq calls (the default of --distributed-world-size),
    leaves CUDA usable in a fork of this process: it does where torch has no CUDA or counts the devices through
    NVML (torch.cuda.device_count's note); else it initialises CUDA."""
    import torch
    count_nvml = getattr(torch.cuda, "_device_count_nvml", None)
    return not torch.cuda._is_compiled() or (count_nvml is not None and count_nvml() >= 0)


if __name__ == "__main__":
    requests, replies, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[4]
    server_env = dict(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sys.argv[3])
    listener.listen(16)
    import importlib
    import logging
    import tempfile
    with tempfile.TemporaryFile() as printed:  # what importing prints, a fresh process's command would show
        saved = os.dup(1), os.dup(2)
        os.dup2(printed.fileno(), 1)
        os.dup2(printed.fileno(), 2)
        preload = KINDS[kind]
        for name in preload:
            if name == "fairseq" and not _cuda_count_spares_forks():
                preload = PRELOAD
                break
            importlib.import_module(name)
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, kept in zip((1, 2), saved):
            os.dup2(kept, fd)
            os.close(kept)
        printed.seek(0)
        assert not printed.read(), f"importing {preload} printed something: the forked commands would not show it"
    if preload != KINDS[kind]:
        print("fairseq not preloaded: its import counts the CUDA devices, which here (no NVML) initialises CUDA, and "
              "the forks could not use it", file=sys.stderr, flush=True)
    fairseq_logging = None
    if "fairseq" in preload:
        fairseq_logging = logging.root.handlers[:], logging.root.level
        assert [type(h) for h in fairseq_logging[0]] == [logging.StreamHandler], fairseq_logging
        logging.root.handlers.clear()
        logging.root.setLevel(logging.WARNING)
    assert not logging.root.handlers and logging.root.level == logging.WARNING, \
        f"preloading {preload} set up logging: the commands' own set-up (fairseq_cli's, to stdout) would not apply"
    assert "fairseq" in preload or not any(m == "fairseq" or m.startswith("fairseq.") for m in sys.modules)
    assert not any(m.startswith(("fairseq_cli", "fairseq_tnn")) for m in sys.modules)
    assert threading.active_count() == 1, f"preloading {preload} started threads: forking would copy them half-done"
    import torch
    assert not torch.cuda.is_initialized(), f"preloading {preload} initialised CUDA, which a fork cannot use"
    preloaded = {k: v for k, v in os.environ.items() if server_env.get(k) != v}
    # The preloaded objects out of the garbage collector's sight: the children's collections, and their
    # final one at exit (0.65 s of a command's 0.9 s shutdown), no longer walk the libraries' objects.
    gc.freeze()
    os.write(replies, (json.dumps({"ready": os.getpid()}) + "\n").encode())
    _become(*_serve(requests, replies, listener, server_env, preloaded, kind), preloaded, fairseq_logging)
