"""The suite's fork server (tests/forkserver.py) runs a command as a fresh process would: the same output on
stdout and stderr, exit status, argv, sys.path[0], working directory, environment, stdin and logging set-up,
for scripts, modules and the fairseq CLIs; timeouts kill the command and leave the server serving. The same
through the shims that shell scripts run as $PYTHON and $FAIRSEQ_BIN/fairseq-* (tests/forkshim.py), with
signals passed on and a killed shim's command killed."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from helpers import BIN, ROOT, ForkServer, cli, command_env, execute, script_env

pytestmark = pytest.mark.skipif(not ForkServer.ENABLED, reason="TESTS_FORKSERVER=0: every command runs fresh")

PROBE = r'''
import json, logging, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "env": os.environ.get("FAIRSEQ_PREPROCESS"),
                  "stdin": sys.stdin.read(), "fairseq": "fairseq" in sys.modules,
                  "logging": [type(h).__name__ for h in logging.root.handlers], "level": logging.root.level}))
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "raise":
    raise ValueError("boom")
if how == "signal":
    import signal
    os.kill(os.getpid(), signal.SIGTERM)
if how == "fairseq":
    import fairseq  # configures logging (fairseq's text_to_speech task calls logging.basicConfig)
    logging.getLogger("probe").warning("after fairseq: %s", [type(h).__name__ for h in logging.root.handlers])
sys.exit(3 if how == "exit" else None)
'''


def both(cmd, env, **kw):
    """(fork server's result, a fresh process's result) of the same command."""
    assert ForkServer.request([str(c) for c in cmd]) is not None, "not a command for the fork server"
    kw.setdefault("cwd", ROOT)
    before = ForkServer.get().forked
    forked = execute(cmd, env, 120, **kw)
    assert ForkServer.get().forked == before + 1, "the fork server refused it (its server.log says why)"
    proc = subprocess.run([str(c) for c in cmd], input=kw.get("stdin"), capture_output=True, text=True, env=env,
                          cwd=kw["cwd"], timeout=120)
    return forked, (proc.returncode, proc.stdout, proc.stderr)


@pytest.mark.parametrize("how,status", [("exit", 3), ("ok", 0), ("raise", 1), ("signal", -15), ("fairseq", 0)])
def test_a_script_runs_as_in_a_fresh_process(tmp_path, how, status):
    script = tmp_path / "sub" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    forked, fresh = both([sys.executable, script, how], command_env(FAIRSEQ_PREPROCESS="x y"), stdin="line 1\nline 2\n",
                         cwd=tmp_path)
    assert forked[0] == fresh[0] == status
    assert forked[1] == fresh[1] and f'"cwd": "{tmp_path}"' in fresh[1] and '"env": "x y"' in fresh[1]
    assert forked[2] == fresh[2] if how != "raise" else forked[2].endswith(fresh[2].splitlines()[-1] + "\n")


def test_a_module_runs_as_in_a_fresh_process():
    forked, fresh = both([sys.executable, "-m", "fairseq_tnn.options", "tnn_lm_tiny"], command_env())
    assert forked == fresh and forked[0] == 0 and "--rpe-layers" in forked[1]


# A --user-dir that every fairseq CLI imports while it reads its arguments, after it has imported fairseq and
# set up logging: the root logger's handlers and level as the command has them, and one line logged at INFO.
LOG_PROBE = r'''
import json, logging, sys
root = logging.getLogger()
print(json.dumps([[type(h).__name__, h.stream.name, h.level, h.formatter and h.formatter._fmt] for h in root.handlers]
                 + [root.level]), flush=True)
logging.getLogger("probe").info("a line at INFO")
sys.exit(0)
'''


@pytest.mark.parametrize("name", ["fairseq-train", "fairseq-eval-lm", "fairseq-generate"])
def test_a_fairseq_cli_logs_where_a_fresh_one_does(name, tmp_path):
    """The fairseq server preloads fairseq, whose import sets up logging (to stderr); fairseq-train sets up its
    own first (to stdout), the others keep fairseq's: forked, each has the fresh process's handlers and level.
    One CLI of each kind: fairseq-train; fairseq-eval-lm, which calls logging.basicConfig after importing
    fairseq, as fairseq-preprocess, -interactive and -validate do; fairseq-generate, which calls it when it runs."""
    (tmp_path / "logprobe").mkdir()
    (tmp_path / "logprobe" / "__init__.py").write_text(LOG_PROBE)
    forked, fresh = both([cli(name), "--user-dir", tmp_path / "logprobe"], command_env())
    stamp = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")  # fairseq-train's lines begin with the time
    assert [stamp.sub("T", str(x)) for x in forked] == [stamp.sub("T", str(x)) for x in fresh]
    assert forked[0] == 0 and "a line at INFO" in (forked[1] if name == "fairseq-train" else forked[2]), forked


def test_a_timeout_kills_the_command_and_the_server_goes_on(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        execute([sys.executable, script], command_env(), 3)
    assert execute([sys.executable, "-m", "json.tool", "--help"], command_env(), 60)[0] == 0


def test_an_environment_read_at_start_up_gets_a_fresh_process(tmp_path):
    """The server refuses a command that changes a start-up variable (execute() then starts it itself); a
    script's own settings, and scikit-learn's KMP_ variables as its import sets them, are no reason."""
    script = tmp_path / "preloaded.py"
    script.write_text("import os, sys\nprint('torch' in sys.modules, os.environ.get('KMP_INIT_AT_FORK'))\n")
    for env, forked in (({}, True), ({"TORCHINDUCTOR_CACHE_DIR": "/tmp/x", "MAX_UPDATE": "7", "SLURM_JOB_ID": "1",
                                      "LOG_INTERVAL": "2", "ENABLE_X": "1"}, True),
                        ({"KMP_INIT_AT_FORK": "FALSE"}, True), ({"OMP_NUM_THREADS": "3"}, False),
                        ({"PYTHONPATH": "/tmp"}, False), ({"KMP_INIT_AT_FORK": "TRUE"}, False),
                        ({"CXX": "/nonexistent/c++"}, False), ({"CI": "" if os.environ.get("CI") else "1"}, False)):
        code, out, _ = execute([sys.executable, script], {**command_env(), **env}, 60)
        assert code == 0 and out.split()[0] == str(forked), (env, out)
        if forked:  # as scikit-learn's import sets it (a fresh process gets it there too)
            assert out.split()[1] == env.get("KMP_INIT_AT_FORK", "FALSE")
    cmd = [cli("fairseq-train"), "--help"]
    assert ForkServer.request(cmd) == {"script": cli("fairseq-train"), "args": ["--help"]}
    assert ForkServer.request(["bash", "-c", "true"]) is None
    assert ForkServer.request([sys.executable, "-c", "pass"]) is None  # -c: not a script or module


ENV_READS = r'''
import json, os, sys
sys.path.insert(0, sys.argv[1])
import forkserver
read = {}  # the code that read, -> the variables it read
environ = type(os.environ)
get, getitem, contains = environ.get, environ.__getitem__, environ.__contains__

def named(k):  # a variable read by name, not a copy of the whole environment (os.environ.copy(), items())
    code = sys._getframe(2).f_code
    if code.co_name not in ("copy", "__iter__"):
        read.setdefault(code, set()).add(k)

environ.get = lambda self, k, d=None: (named(k), get(self, k, d))[1]
environ.__getitem__ = lambda self, k: (named(k), getitem(self, k))[1]
environ.__contains__ = lambda self, k: (named(k), contains(self, k))[1]
for name in forkserver.KINDS["fairseq"]:  # the fairseq server's, PRELOAD and fairseq
    __import__(name)
# code that read every variable copied the environment (dict(os.environ), as fsspec's config does)
print(json.dumps(sorted(set().union(*(ks for ks in read.values() if not set(os.environ) <= ks)))))
'''


def test_every_variable_the_preloads_read_is_a_start_up_one(tmp_path):
    """The environment variables that importing the servers' preloads (PRELOAD, and fairseq) reads, recorded in a fresh
    interpreter, are all start-up variables (a command that changes one gets a fresh process) or LATE_ENV's
    (read again when used): a torch that reads a new variable at import fails here, naming it. (What C code
    reads with getenv, OpenMP's and BLAS's OMP_, MKL_ ... variables, is not recorded: those are listed by hand.)"""
    import forkserver
    script = tmp_path / "reads.py"
    script.write_text(ENV_READS)
    proc = subprocess.run([sys.executable, str(script), str(ROOT / "tests")], capture_output=True, text=True,
                          env=command_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    read = json.loads(proc.stdout.splitlines()[-1])
    assert "CXX" in read and "PYTORCH_JIT" in read, read  # the recorder works (inductor's and torch.jit's)
    env = {k: "x" for k in read}
    assert sorted(k for k in read if k not in forkserver.startup_env(env) and k not in forkserver.LATE_ENV) == []


# --- the shims: a shell script's $FAIRSEQ_BIN/fairseq-* and $PYTHON (helpers.script_env) ---

SHIM_PROBE = r'''
import json, os, signal, sys, time
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("KNOB"), "stdin": sys.stdin.read(),
                  "forked": "torch" in sys.modules}), flush=True)  # the server preloads torch; python does not
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "pid":
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(60)
if how == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
sys.exit(3 if how == "exit" else None)
'''


def through_script(line, tmp_path, shims=True, **env):
    """(status, stdout, stderr) of a bash script `line` run from tmp_path with script_env()'s shims, or with the
    real FAIRSEQ_BIN and PYTHON."""
    (tmp_path / "probe.py").write_text(SHIM_PROBE)
    real = {} if shims else {"FAIRSEQ_BIN": str(BIN), "PYTHON": sys.executable}
    env.setdefault("OMP_NUM_THREADS", command_env()["OMP_NUM_THREADS"])  # the server's, whatever THREADS is
    proc = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=script_env({**real, **env}), capture_output=True,
                          text=True, timeout=120)
    return proc.returncode, proc.stdout, re.sub(r"line 1: \d+ ", "line 1: PID ", proc.stderr)  # bash's "Terminated"


@pytest.mark.parametrize("how", ["exit", "ok", "signal"])
def test_a_scripts_python_runs_through_the_shim_as_the_real_one(tmp_path, how):
    line = f'echo in | "$PYTHON" probe.py {how} "a b" > out.txt 2> err.txt; echo "status $?"; cat out.txt err.txt'
    shim, real = through_script(line, tmp_path, KNOB="k"), through_script(line, tmp_path, shims=False, KNOB="k")
    assert '"forked": true' in shim[1] and '"forked": false' in real[1]
    assert shim == (real[0], real[1].replace('"forked": false', '"forked": true'), real[2])
    assert f"status {dict(exit=3, ok=0, signal=143)[how]}" in shim[1] and '"stdin": "in\\n"' in shim[1]
    assert f'"argv": ["{how}", "a b"]' in shim[1] and '"env": "k"' in shim[1] and "to stderr" in shim[1]


def test_the_shim_runs_the_real_program_when_the_server_cannot(tmp_path):
    """A start-up variable changed, `python -c`, a fairseq CLI's refusal of its arguments."""
    code, out, _ = through_script('OMP_NUM_THREADS=3 "$PYTHON" probe.py ok; "$PYTHON" -c "import sys; '
                                  'print(\\"torch\\" in sys.modules)"', tmp_path)
    assert code == 0 and '"forked": false' in out and out.endswith("False\n"), out
    cmd = '"$FAIRSEQ_BIN/fairseq-train" --user-dir fairseq_tnn --arch tnn_lm_tiny --tnn-compile eager .'
    shim, real = (through_script(f"cd {ROOT} && {cmd}", tmp_path, shims=s) for s in (True, False))
    assert shim == real and shim[0] == 2 and "invalid choice: 'eager'" in shim[2]


def test_signals_reach_the_command_and_a_killed_shim_takes_it_along(tmp_path):
    """timeout's SIGINT and SIGTERM (to the shim) stop the command; so does a SIGKILL of the shim alone, which
    the command cannot see: the server kills it."""
    code, out, err = through_script('timeout -s INT 5 "$PYTHON" probe.py pid p1; echo "status $?"; '
                                    'timeout -s TERM 5 "$PYTHON" probe.py pid p2; echo "status $?"; '
                                    '"$PYTHON" probe.py pid p3 & shim=$!; while [[ ! -s p3 ]]; do sleep 0.1; done; '
                                    'kill -KILL $shim; wait $shim; echo "status $?"', tmp_path)
    assert out.count('"forked": true') == 3 and out.count("status 124") == 2 and "status 137" in out, out + err
    assert "KeyboardInterrupt" in err
    pids = [int((tmp_path / f"p{i}").read_text()) for i in (1, 2, 3)]
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
