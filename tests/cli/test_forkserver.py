"""The suite's fork server (tests/forkserver.py) runs a command as a fresh process would: the same output on
stdout and stderr, exit status, argv, sys.path[0], working directory, environment, stdin and logging set-up,
for scripts, modules and the fairseq CLIs; timeouts kill the command and leave the server serving."""
import subprocess
import sys

import pytest

from helpers import ROOT, ForkServer, cli, command_env, execute

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
    assert ForkServer.request([str(c) for c in cmd], env) is not None, "the fork server would not take it"
    kw.setdefault("cwd", ROOT)
    forked = execute(cmd, env, 120, **kw)
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


def test_a_module_and_a_fairseq_cli_run_as_in_fresh_processes(tmp_path):
    forked, fresh = both([sys.executable, "-m", "fairseq_tnn.options", "tnn_lm_tiny"], command_env())
    assert forked == fresh and forked[0] == 0 and "--rpe-layers" in forked[1]
    # fairseq-train's own logging set-up (INFO to stdout) applies, and its refusal of a bad value is the same
    cmd = [cli("fairseq-train"), tmp_path, "--user-dir", "fairseq_tnn", "--arch", "tnn_lm_tiny",
           "--task", "tnn_language_modeling", "--cpu", "--tnn-compile", "eager"]
    (fcode, fout, ferr), (code, out, err) = both(cmd, command_env())
    assert fcode == code == 2 and ferr == err and "invalid choice: 'eager'" in err and fout == out


def test_a_timeout_kills_the_command_and_the_server_goes_on(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        execute([sys.executable, script], command_env(), 3)
    assert execute([sys.executable, "-m", "json.tool", "--help"], command_env(), 60)[0] == 0


def test_an_environment_read_at_start_up_gets_a_fresh_process():
    cmd = [cli("fairseq-train"), "--help"]
    assert ForkServer.request(cmd, command_env(TORCHINDUCTOR_CACHE_DIR="/tmp/x")) is not None
    assert ForkServer.request(cmd, command_env(OMP_NUM_THREADS="3")) is None
    assert ForkServer.request(cmd, command_env(PYTHONPATH="/tmp")) is None
    assert ForkServer.request(["bash", "-c", "true"], command_env()) is None
    assert ForkServer.request([sys.executable, "-c", "pass"], command_env()) is None  # -c: not a script or module
