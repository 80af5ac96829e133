"""Runs the fairseq CLIs and Python scripts for the tests without paying their start-up each time.

A fresh ``fairseq-train`` spends ~5 s on 2 CPU cores before it reads its first argument: starting Python,
importing torch (2 s), scikit-learn and scipy (1.3 s, which fairseq imports unconditionally), and fairseq
itself, with all its tasks, models and criterions (1 s). The suite runs a few hundred such commands. So each
pytest worker starts one server process (this file, run as a script) that imports the third-party libraries
once, and for every command forks a child that *is* the command: it takes the command's working directory,
environment, standard streams and ``sys.argv``, and runs the script (a console script such as
``.venv/bin/fairseq-train`` is the wrapper file pip wrote) or module as ``__main__``, as Python would; the
child exits through the interpreter's normal shutdown. What comes back is what ``subprocess.run`` gives:
the exit status (negative: killed by that signal) and the output.

Nothing of fairseq or of the plugin is imported beforehand: each command imports them itself, in its own
order, with their side effects (fairseq_cli's logging set-up to stdout, the plugin's registrations and its
fixes of fairseq, --user-dir's import). The server checks that the libraries it preloads left logging
unconfigured, as a fresh interpreter has it (they add a few warning filters, which every fairseq command adds
too when it imports them). Commands whose environment differs from the server's in a
variable that Python, torch, OpenMP or BLAS read at start-up (anything outside ``LATE_ENV``) run as fresh
processes instead, and so does everything when ``TESTS_FORKSERVER=0``. Commands that need a process of
their own (torchrun, the SIGKILL tests, the shell scripts) do not come here: they run as processes.

Protocol, over two pipes (fds given on the command line): the client writes one JSON request per line
(script or module, args, env, cwd, stdin, stdout, stderr: paths of files); the server answers
``{"pid": ...}`` when the child is started and ``{"status": ...}`` when it has exited.
"""
import json
import os
import sys

# Variables read only after start-up (by the command itself, or by modules the server does not import),
# so a command may set them and still be forked from the server.
LATE_ENV = {"CXX", "TORCHINDUCTOR_CACHE_DIR", "PYTEST_CURRENT_TEST", "FAIRSEQ_BIN", "FAIRSEQ_PREPROCESS", "PYTHON"}
# Imported before any command: the third-party libraries that cost fairseq's start-up its time (fairseq
# imports all of these), none of which sets up logging.
PRELOAD = ("torch", "numpy", "sklearn.metrics", "scipy.stats", "hydra", "omegaconf", "sacrebleu", "tensorboardX")


def _serve(requests, replies):
    """Fork a child per request; in the server, never return (until the client closes the pipe); in a
    child, return its request."""
    while True:
        line = requests.readline()
        if not line:
            sys.exit(0)
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            return req
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        replies.write(json.dumps({"status": code}) + "\n")
        replies.flush()


def _become(req):
    """Turn this child into the command: cwd, environment, fds 0-2, sys.argv and sys.path[0] as Python sets
    them for `python SCRIPT ARGS` (a console script is such a script) or `python -m MODULE ARGS`; then run
    it as __main__. Its exit is the interpreter's own: SystemExit, an uncaught exception's traceback and
    status 1, atexit handlers, flushed streams."""
    import runpy
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path, flags in ((0, req["stdin"], os.O_RDONLY),
                            (1, req["stdout"], os.O_WRONLY | os.O_APPEND),
                            (2, req["stderr"], os.O_WRONLY | os.O_APPEND)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    if "module" in req:
        sys.argv = [req["module"], *req["args"]]  # run_module puts the module's file in argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [req["script"], *req["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(req["script"]))
        runpy.run_path(req["script"], run_name="__main__")


if __name__ == "__main__":
    requests = os.fdopen(int(sys.argv[1]), "r")
    replies = os.fdopen(int(sys.argv[2]), "w")
    import importlib
    import logging
    for name in PRELOAD:
        importlib.import_module(name)
    assert not logging.root.handlers and logging.root.level == logging.WARNING, \
        f"preloading {PRELOAD} set up logging: the commands' own set-up (fairseq_cli's, to stdout) would not apply"
    assert not any(m == "fairseq" or m.startswith(("fairseq.", "fairseq_cli", "fairseq_tnn")) for m in sys.modules)
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    replies.flush()
    _become(_serve(requests, replies))
