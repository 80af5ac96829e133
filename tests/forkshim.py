"""The shims that the shell scripts run in the tests find as ``$FAIRSEQ_BIN/fairseq-*`` and ``$PYTHON``: each
hands its command to the pytest worker's fork server (tests/forkserver.py) with its own standard streams, so
that a script's fairseq commands and Python scripts start without re-importing torch and fairseq's other
libraries, and are otherwise what the script ran: the same arguments, environment, working directory and
streams, the exit status (a signal's included) passed back as the shim's own, the signals the shim receives
passed on to the command.

A shim runs the real program instead (``exec``, the same process a script without shims starts) when the
server is not there or refuses (an environment that changes a start-up variable), and for a ``python``
command that is not ``python SCRIPT.py ...`` or ``python -m MODULE ...``. ``make_shims`` writes them: each is
a small executable that runs this file with the interpreter's ``-S -E`` (no site-packages: a few ms).
"""
import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def make_shims(shim_dir, real_bin, python, server_sockets):
    """Fill shim_dir: a shim for each fairseq console script of real_bin (served by the socket
    server_sockets["fairseq"]) and for `python` (server_sockets["python"]); the other programs of real_bin
    (torchrun, pip, ...) as links to the real ones."""
    os.makedirs(shim_dir)
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(real_bin)):
        path = os.path.join(shim_dir, name)
        if name.startswith("fairseq-") or name in ("python", "python3"):
            real = python if name.startswith("python") else os.path.join(real_bin, name)
            server_socket = server_sockets["python" if name.startswith("python") else "fairseq"]
            with open(path, "w") as f:
                f.write(f"#!{python} -SE\nimport sys\nsys.path.insert(0, {here!r})\nimport forkshim\n"
                        f"forkshim.main({real!r}, {server_socket!r})\n")
            os.chmod(path, 0o755)
        else:
            os.symlink(os.path.join(real_bin, name), path)


def request(real, argv):
    """What the server runs for `real argv...` ({"script" or "module", "args"}), or None (run the real one)."""
    if os.path.basename(real).startswith("python"):
        if len(argv) >= 2 and argv[0] == "-m":
            return {"module": argv[1], "args": argv[2:]}
        if argv and argv[0].endswith(".py") and not argv[0].startswith("-"):
            return {"script": argv[0], "args": argv[1:]}
        return None
    return {"script": real, "args": argv}


def main(real, server_socket):
    argv = sys.argv[1:]
    req = request(real, argv)
    reply, sock = None, None
    if req is not None:
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(server_socket)
            msg = json.dumps({**req, "env": dict(os.environ), "cwd": os.getcwd()}).encode() + b"\n"
            socket.send_fds(sock, [msg], [0, 1, 2])
            replies = sock.makefile("rb")
            reply = json.loads(replies.readline() or b"{}")
        except (OSError, ValueError):
            reply = None
    if not reply or "pid" not in reply:
        if sock is not None:
            sock.close()
        os.execv(real, [real, *argv])
    pid = reply["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    line = replies.readline()
    if not line:
        sys.stderr.write(f"{os.path.basename(real)} (the tests' fork-server shim): the server went away\n")
        os._exit(1)
    status = json.loads(line)["status"]
    if status < 0:  # killed by a signal: so is the shim, as the script expects of its command
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status & 0xFF)
