"""The suite's shared utilities, one importable module (tests import it as ``helpers``; conftest.py keeps
only pytest's fixtures and hooks): running commands and the fairseq CLIs, the tiny causal and masked
recipes' fairseq-train options, the architecture presets from fairseq's registry, and the tolerance,
relative-error and device helpers of the numeric tests."""
import atexit
import itertools
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from forkserver import KINDS, kind_of
from forkshim import make_shims

ROOT = Path(__file__).resolve().parents[1]
# The fairseq CLIs: beside the Python that runs pytest (scripts/test.sh's venv), or where FAIRSEQ_BIN says
# (fairseq installed elsewhere, e.g. as wheels in a --target directory on a GPU machine).
BIN = Path(os.environ["FAIRSEQ_BIN"]) if os.environ.get("FAIRSEQ_BIN") else Path(sys.executable).parent
USER_DIR = str(ROOT / "fairseq_tnn")  # absolute, as a user passes it
# Threads for torch in the tests and in the commands they run: 2, shared out among pytest-xdist's workers
# (scripts/test.sh runs one per core) so that the workers do not oversubscribe the cores.
THREADS = str(max(1, 2 // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


SCRIPTS = ROOT / "scripts"
SLURM = SCRIPTS / "slurm"


def command_env(**extra):
    """run()'s environment for a command: this process's, unbuffered, with the suite's THREADS for torch."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", THREADS),
            **extra}


# The fork server's environment: command_env() as this worker started, whenever the server starts (a test may
# have changed os.environ by then: torchrun run in-process sets TORCHELASTIC_ variables).
SERVER_ENV = command_env()


def run(cmd, expect_ok=True, timeout=900, env=None, stdin=None):
    """Run a command line (stdin: text fed to it), return its combined output; check the exit status."""
    code, out, _ = execute(cmd, command_env(**(env or {})), timeout, stdin=stdin, merge=True)
    if expect_ok and code != 0:
        raise AssertionError(f"command failed ({code}): {' '.join(map(str, cmd))}\n{out[-6000:]}")
    if not expect_ok and code == 0:
        raise AssertionError(f"command unexpectedly succeeded: {' '.join(map(str, cmd))}\n{out[-3000:]}")
    return out


def execute(cmd, env, timeout, stdin=None, merge=False, cwd=ROOT):
    """subprocess.run of cmd from cwd: (exit status, stdout, stderr; with merge, stderr is in stdout and
    None). The fairseq CLIs (a fairseq-* script in BIN) and `sys.executable SCRIPT.py | -m MODULE` are forked
    from this worker's fork servers (tests/forkserver.py: the same command without the ~3.3 s of importing
    torch, scikit-learn, scipy and fairseq's other libraries, and for the fairseq CLIs the 1.1 s of importing
    fairseq) unless their environment needs a fresh
    process; everything else (and every command with TESTS_FORKSERVER=0) starts as a process of its own."""
    cmd = [str(c) for c in cmd]
    request = ForkServer.request(cmd)
    if request is not None:
        forked = ForkServer.get().execute(request, env, timeout, stdin, merge, cwd)
        if forked is not None:
            return forked
    proc = subprocess.run(cmd, input=stdin, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True, timeout=timeout,
                          env=env, cwd=cwd)
    return proc.returncode, proc.stdout, proc.stderr


class ForkServer:
    """The client of tests/forkserver.py: per pytest worker, a server of each kind (forkserver.KINDS: "python"
    for Python scripts and modules, "fairseq" for fairseq's console scripts, fairseq preloaded), started on
    first use with run()'s environment, stopped when the worker exits. TESTS_FORKSERVER=0 runs every command
    as a fresh process."""
    _instance = None
    _count = itertools.count()
    ENABLED = os.environ.get("TESTS_FORKSERVER", "1") != "0"

    @classmethod
    def request(cls, cmd):
        """What a server would run for cmd ({"script" or "module", "args"}: it may still refuse, for an
        environment that changes a start-up variable), or None if cmd needs a process of its own."""
        if not cls.ENABLED:
            return None
        if Path(cmd[0]).parent == BIN and Path(cmd[0]).name.startswith("fairseq-"):
            return {"script": cmd[0], "args": cmd[1:]}
        if cmd[0] == sys.executable and len(cmd) > 2 and cmd[1] == "-m":
            return {"module": cmd[2], "args": cmd[3:]}
        if cmd[0] == sys.executable and len(cmd) > 1 and cmd[1].endswith(".py"):
            return {"script": cmd[1], "args": cmd[2:]}
        return None

    @classmethod
    def get(cls):
        if cls._instance is None or any(s.proc.poll() is not None for s in cls._instance.servers.values()):
            cls._instance = cls()
        return cls._instance

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="forkserver-")
        sockets = {kind: os.path.join(self.dir, f"{kind}.socket") for kind in KINDS}
        # the scripts' FAIRSEQ_BIN and PYTHON (script_env): shims that hand their commands to these servers
        self.shims = Path(self.dir) / "bin"
        make_shims(self.shims, BIN, sys.executable, sockets)
        self.servers = {kind: _Server(self.dir, kind, sockets[kind]) for kind in KINDS}  # importing together
        for server in self.servers.values():
            server.wait_ready()
        self.forked = 0  # commands run as forks (the others were refused)
        atexit.register(self.stop)

    def stop(self):
        for server in self.servers.values():
            server.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def execute(self, request, env, timeout, stdin, merge, cwd):
        n = next(self._count)
        files = {k: os.path.join(self.dir, f"{n}.{k}") for k in ("stdin", "stdout", "stderr")}
        for k, path in files.items():
            with open(path, "w") as f:
                f.write((stdin or "") if k == "stdin" else "")
        if merge:
            files["stderr"] = files["stdout"]
        server = self.servers[kind_of(request)]
        os.write(server.req_w, (json.dumps({**request, "env": env, "cwd": str(cwd), **files}) + "\n").encode())
        started = server.reply(60)
        if started is None:
            raise RuntimeError(f"the fork server did not start {request}; its log: {server.log}")
        if started.get("exec"):  # refused: the caller runs it as a process
            for path in set(files.values()):
                os.remove(path)
            return None
        pid = started["pid"]
        self.forked += 1
        status = server.reply(timeout)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            server.reply(60)
        out, err = (open(files[k]).read() for k in ("stdout", "stderr"))
        for path in set(files.values()):
            os.remove(path)
        if status is None:
            raise subprocess.TimeoutExpired(request.get("script") or request["module"], timeout, output=out)
        return status["status"], out, None if merge else err


class _Server:
    """One server process of ForkServer: its pipes (JSON lines: requests in, replies out) and its log."""

    def __init__(self, directory, kind, server_socket):
        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        self.log = os.path.join(directory, f"{kind}.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forkserver.py")), str(req_r),
                                          str(rep_w), server_socket, kind], pass_fds=(req_r, rep_w), env=SERVER_ENV,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=ROOT)
        os.close(req_r)
        os.close(rep_w)
        self.buf = b""

    def wait_ready(self):
        if self.reply(120) is None:  # {"ready": pid}: the libraries are imported
            raise RuntimeError(f"the fork server did not start in 120 s; its log: {self.log}")

    def stop(self):
        os.close(self.req_w)  # the server exits at the end of its requests
        os.close(self.rep_r)
        self.proc.wait(timeout=30)

    def reply(self, timeout):
        """The server's next reply (a dict), or None if none came within timeout seconds."""
        while b"\n" not in self.buf:
            if not select.select([self.rep_r], [], [], timeout)[0]:
                return None
            chunk = os.read(self.rep_r, 4096)
            if not chunk:
                raise RuntimeError(f"the fork server exited; its log: {self.log}")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


def cli(name):
    return str(BIN / name)


def rel(a, b):
    """Relative error ||a - b|| / ||b||, computed in at least float32 (half-precision tensors are widened
    first; float64 and complex stay as they are)."""
    a, b = (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in (a, b))
    return ((a - b).norm() / b.norm()).item()


def assert_compiled_matches_eager(eager, compiled, x, tol=1e-5):
    """Forward and input gradient of the two layers on the same x agree (parameter gradients accumulate)."""
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ye, yc = eager(xe), compiled(xc)
    g = torch.randn_like(ye)
    ye.backward(g)
    yc.backward(g)
    assert rel(yc, ye) < tol and rel(xc.grad, xe.grad) < tol


def split_tokens(data_bin: Path, split: str) -> int:
    """Number of tokens (eos included) in a binarised split."""
    from fairseq.data import data_utils
    ds = data_utils.load_indexed_dataset(str(data_bin / split), None)
    return int(ds.sizes.sum())


def fairseq_options(defaults: dict, overrides: dict) -> list:
    """fairseq command-line options from {name: value}, names with underscores for dashes (save_dir is
    --save-dir). A keyword override replaces an option's value in place or adds it at the end; True makes a
    bare flag (cpu=True is --cpu), None or False leaves the option out."""
    merged = {**defaults, **overrides}
    args = []
    for name, value in merged.items():
        if value is None or value is False:
            continue
        args.append("--" + name.replace("_", "-"))
        if value is not True:
            args.append(value)
    return args


# The causal recipe of the CLI tests: tnn_language_modeling, Adam with an inverse-sqrt schedule, on CPU.
LM_OPTIONS = {
    "user_dir": USER_DIR, "cpu": True, "task": "tnn_language_modeling", "criterion": "cross_entropy",
    "arch": "tnn_lm_tiny", "sample_break_mode": "none", "tokens_per_sample": 64, "batch_size": 8,
    "optimizer": "adam", "adam_betas": "(0.9, 0.98)", "lr_scheduler": "inverse_sqrt", "warmup_updates": 10,
    "lr": "0.003", "log_format": "simple", "log_interval": 5, "seed": 1, "num_workers": 0,
}
# The masked recipe: tnn_masked_lm with whole lines per block ("complete"; the longest sample line, 112
# pieces + eos + bos, fits 128 tokens), Adam at a constant rate, on CPU.
MLM_OPTIONS = {
    "user_dir": USER_DIR, "cpu": True, "task": "tnn_masked_lm", "criterion": "masked_lm",
    "arch": "tnn_mlm_tiny", "sample_break_mode": "complete", "tokens_per_sample": 128, "batch_size": 8,
    "optimizer": "adam", "lr": "0.001", "log_format": "simple", "log_interval": 1, "seed": 1, "num_workers": 0,
    "no_epoch_checkpoints": True,
}
# Overrides that take the schedule out of the causal recipe: a constant learning rate, Adam's default betas.
NO_LR_SCHEDULE = dict(lr_scheduler=None, warmup_updates=None, adam_betas=None)


def lm_args(**overrides) -> list:
    """The causal recipe's fairseq-train options (after the data directory), with keyword overrides."""
    return fairseq_options(LM_OPTIONS, overrides)


def mlm_args(**overrides) -> list:
    """The masked recipe's fairseq-train options (after the data directory), with keyword overrides."""
    return fairseq_options(MLM_OPTIONS, overrides)


def lm_train_cmd(data_bin, *extra, **overrides) -> list:
    """fairseq-train of the causal recipe on data_bin; extra arguments go last."""
    return [cli("fairseq-train"), data_bin, *lm_args(**overrides), *extra]


def mlm_train_cmd(data_bin, *extra, **overrides) -> list:
    """fairseq-train of the masked recipe on data_bin; extra arguments go last."""
    return [cli("fairseq-train"), data_bin, *mlm_args(**overrides), *extra]


# The causal recipe without a model or batch shape, for commands that name their own.
LM_TRAIN = lm_args(arch=None, tokens_per_sample=None, batch_size=None)


def valid_ppls(log: str):
    return [float(m) for m in re.findall(r"valid on 'valid' subset \| loss [0-9.]+ \| ppl ([0-9.]+)", log)]




def arch_presets(model: str) -> list:
    """The architecture presets registered for one of our models ("tnn_lm" or "tnn_mlm") in fairseq's
    registry, in registration order: the names a user passes to --arch (and to scripts/train.sh). The
    model's own name, which fairseq also registers as an arch (the model's defaults), is not a preset."""
    import fairseq_tnn.models  # noqa: F401  (registers the models and their presets)
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY
    if model not in ("tnn_lm", "tnn_mlm"):
        raise ValueError(f"arch_presets: model={model!r} is not one of ours; choose tnn_lm or tnn_mlm")
    return [arch for arch, name in ARCH_MODEL_NAME_REGISTRY.items() if name == model and arch != model]


def wt103_presets(model: str) -> list:
    """The Wikitext-103 presets (the paper's sizes) of one of our models, from fairseq's registry."""
    return [arch for arch in arch_presets(model) if "_wt103" in arch]


# The factor by which a comparison's CPU tolerance grows on CUDA, by dtype. With TF32 off, cuBLAS and cuFFT
# round fp32 and fp64 as MKL/pocketfft do, to the same order, but in other orders of summation (and cuFFT
# with other radices), so fp32 gets 4x headroom; fp64 tolerances are already orders above its rounding, and
# half-precision ones are set by rounding the inputs and output to 8 or 11 bits, the same on either device.
CUDA_TOL_FACTOR = {torch.float32: 4.0, torch.complex64: 4.0}


def tol(table, dtype, device):
    """The tolerance table[dtype] for a comparison run on device: as given (the CPU one) on CPU, times
    CUDA_TOL_FACTOR[dtype] (1 for dtypes not named there) on CUDA. table[dtype] is a number or a dict of
    numbers (e.g. torch.testing.assert_close's rtol and atol), each scaled."""
    value = table[dtype]
    factor = CUDA_TOL_FACTOR.get(dtype, 1.0) if torch.device(device).type == "cuda" else 1.0
    return {k: v * factor for k, v in value.items()} if isinstance(value, dict) else value * factor


def on(device, *tensors):
    """Each tensor moved to device (made on CPU first, from a seeded CPU generator, so that every device gets
    the same values); a leaf that required grad is a leaf on device that requires grad."""
    out = [None if t is None else t.detach().to(device).requires_grad_(t.requires_grad) for t in tensors]
    return out[0] if len(out) == 1 else out


def assert_on(device, *tensors):
    """Every tensor is on device: a test that means CUDA did not compute on CPU (or the other way round)."""
    want = torch.device(device).type
    for i, t in enumerate(tensors):
        if t is not None:
            assert t.device.type == want, f"tensor {i} is on {t.device}, the test runs on {want}"


def assert_close_rel(actual, expected, tol, what=""):
    """max |actual - expected| <= tol * max |expected|: the op tests' comparison of a fast path with its dense
    reference (an error relative to the largest value, so entries near zero do not set it)."""
    scale = expected.abs().max().clamp_min(1e-30)
    err = (actual - expected).abs().max()
    assert err <= tol * scale, f"{what + ': ' if what else ''}max abs err {err.item():.3e} > {tol:.1e} * {scale.item():.3e}"


# ---------------------------------------------------------------------------------------------------------
# The user-facing scripts (tests/scripts): run as a user runs them, from the repository root, with the fairseq
# CLIs of the venv that runs pytest and without the SLURM variables of a real job.
# ---------------------------------------------------------------------------------------------------------
SCRIPT_ENV = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
SCRIPT_ENV.update(FAIRSEQ_BIN=str(BIN), PYTHON=sys.executable, PYTHONUNBUFFERED="1",
                  OMP_NUM_THREADS="1")  # tiny models: one thread is 10-30x faster than two on a busy 2-core machine


def script_env(env=None):
    """A script's environment: SCRIPT_ENV, then env. With the fork server, FAIRSEQ_BIN and PYTHON are its
    shims (tests/forkshim.py), through which the script's fairseq commands and Python scripts are forked
    from it (unless env sets them)."""
    out = dict(SCRIPT_ENV)
    if ForkServer.ENABLED:
        shims = ForkServer.get().shims
        out.update(FAIRSEQ_BIN=str(shims), PYTHON=str(shims / "python"))
    return {**out, **(env or {})}


def script_cli(name):
    """The path of a fairseq CLI as a script run by sh() sees it ($FAIRSEQ_BIN/name)."""
    return str(Path(script_env()["FAIRSEQ_BIN"]) / name)


def sh(cmd, env=None, timeout=600):
    """Run a command from the repository root; return (exit status, stdout, stderr)."""
    return execute(cmd, script_env(env), timeout)


def ok(cmd, env=None, timeout=600):
    """sh() of a command that must succeed; return (stdout, stderr)."""
    rc, out, err = sh(cmd, env, timeout)
    assert rc == 0, f"{cmd} failed ({rc}):\n{out[-3000:]}\n{err[-5000:]}"
    return out, err


def flags(argv):
    """'--a 1 --b --c x y' -> {'--a': ['1'], '--b': [], '--c': ['x', 'y']} (last occurrence wins)."""
    out, key = {}, None
    for a in argv:
        if a.startswith("--"):
            key = a
            out[key] = []
        elif key is not None:
            out[key].append(a)
    return out


def dry_train(preset, data, **env):
    """The command scripts/train.sh would run for preset on data (DRY_RUN=1), split into arguments."""
    out, _ = ok(["bash", SCRIPTS / "train.sh", preset, data], {"DRY_RUN": "1", **env})
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    return shlex.split(lines[0])


def script_module(name):
    """Import scripts/<name>.py (to call its main() in this process, where fairseq is already imported)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(SCRIPTS))


def ski_inputs(n, r, m, dtype, layout="bnd", d=3, b=2, seed=0, device="cpu"):
    """Random SKI operands: x (b, n, d), or channel-major (d, b, n) with ``layout="dbn"``; conv_weight (d, m);
    knots (2r, d). Drawn in float64, then cast to ``dtype``, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    shape = (b, n, d) if layout == "bnd" else (d, b, n)
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    conv_weight = torch.randn(d, m, generator=g, dtype=torch.float64).to(dtype)
    knots = torch.randn(2 * r, d, generator=g, dtype=torch.float64).to(dtype)
    return on(device, x, conv_weight, knots)
