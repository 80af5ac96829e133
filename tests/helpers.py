"""The suite's shared utilities, one importable module (tests import it as ``helpers``; conftest.py keeps
only pytest's fixtures and hooks): running commands and the fairseq CLIs, the tiny causal and masked
recipes' fairseq-train options, the architecture presets from fairseq's registry, and the tolerance,
relative-error and device helpers of the numeric tests."""
import contextlib
import io
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import traceback
import warnings
from importlib.metadata import entry_points
from pathlib import Path

import torch

from fairseq_tnn import recipe
from fairseq_tnn.recipe import NO_LR_SCHEDULE  # noqa: F401  (the tests import it from here)

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


def run(cmd, expect_ok=True, timeout=900, env=None, stdin=None, process=False):
    """Run a command line (stdin: text fed to it), return its combined output; check the exit status.
    A fairseq CLI runs in this process unless process=True or env is given (see execute())."""
    code, out, _ = execute(cmd, command_env(**(env or {})), timeout, stdin=stdin, merge=True,
                           process=process or bool(env))
    if expect_ok and code != 0:
        raise AssertionError(f"command failed ({code}): {' '.join(map(str, cmd))}\n{out[-6000:]}")
    if not expect_ok and code == 0:
        raise AssertionError(f"command unexpectedly succeeded: {' '.join(map(str, cmd))}\n{out[-3000:]}")
    return out


# The fairseq CLIs that execute() runs in this process, as fairseq's own tests run training and evaluation
# (their utilities call the CLI's main in the test's process). fairseq-hydra-train is not among them: hydra
# keeps a process-wide singleton and may change the working directory.
IN_PROCESS = {"fairseq-train", "fairseq-eval-lm", "fairseq-validate", "fairseq-generate", "fairseq-interactive",
              "fairseq-preprocess"}


def execute(cmd, env, timeout, stdin=None, merge=False, cwd=ROOT, process=False):
    """Run cmd from cwd: (exit status, stdout, stderr; with merge, stderr is in stdout and None).
    A fairseq CLI of IN_PROCESS (a fairseq-* script in BIN) runs in this process through its console entry
    point (in_process()), unless process=True; everything else is a process of its own (subprocess.run,
    killed after timeout seconds)."""
    cmd = [str(c) for c in cmd]
    if not process and Path(cmd[0]).parent == BIN and Path(cmd[0]).name in IN_PROCESS:
        return in_process(cmd, env, stdin, merge, cwd)
    proc = subprocess.run(cmd, input=stdin, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True, timeout=timeout,
                          env=env, cwd=cwd)
    return proc.returncode, proc.stdout, proc.stderr


# A fresh interpreter's warning filters (the documented defaults of a release build of Python)
PYTHON_WARNING_FILTERS = [("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, None),
                          ("ignore", PendingDeprecationWarning, None), ("ignore", ImportWarning, None),
                          ("ignore", ResourceWarning, None)]


# The state fairseq keeps in function attributes between the trainings of one process: the best validation loss
# so far (which decides whether checkpoint_best.pt is written) and early stopping's count.
RUN_STATE = {("fairseq.checkpoint_utils", "save_checkpoint"): ("best",),
             ("fairseq_cli.train", "should_stop_early"): ("best", "num_runs")}


def forget_runs():
    """Clear RUN_STATE, so that a run in this process starts as in a new one."""
    for (module, function), names in RUN_STATE.items():
        if module in sys.modules:
            for name in names:
                vars(getattr(sys.modules[module], function)).pop(name, None)


def show_warning(message, category, filename, lineno, file=None, line=None):
    """A process's showwarning (pytest records warnings instead): the warning on stderr."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def start_logging(name, out, err):
    """(the root logger's handler, its level) as a process of the fairseq CLI `name` has them once it imported the
    CLI's module. fairseq-train sets up logging before it imports fairseq: stdout, fairseq's format, LOGLEVEL
    (default INFO). The other CLIs import fairseq first, and importing fairseq sets it up (its wav2vec2_classification
    model calls logging.basicConfig(level=DEBUG)): stderr, Python's default format, DEBUG."""
    if name == "fairseq-train":
        handler = logging.StreamHandler(out)
        handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                                               "%Y-%m-%d %H:%M:%S"))
        return handler, os.environ.get("LOGLEVEL", "INFO").upper()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    return handler, logging.DEBUG


def loggers():
    """The root logger and every logger made so far."""
    return [logging.getLogger()] + [l for l in logging.Logger.manager.loggerDict.values() if isinstance(l, logging.Logger)]


def in_process(cmd, env, stdin, merge, cwd):
    """A fairseq console script run in this process as its process would run it: the function its entry point
    names is called with the command's sys.argv, sys.stdin/stdout/stderr, os.environ and working directory,
    logging set up as in the CLI's process (start_logging()), a fresh interpreter's warning filters, and none
    of fairseq's state of earlier runs (RUN_STATE). An exception ends it as it ends a process: its traceback on
    stderr, status 1; sys.exit(code) gives code. Afterwards everything it changed is put back: the logging
    handlers it added (--log-file's) are closed, fairseq's tensorboard writers flushed and closed, and
    torch.compile's caches emptied (a process's compiled code would end with it)."""
    name = Path(cmd[0]).name
    entry, = [ep for ep in entry_points(group="console_scripts") if ep.name == name]
    main = entry.load()
    if "fairseq_tnn" in sys.modules:  # fairseq skips --user-dir when the package is imported: register as it would
        sys.modules["fairseq_tnn"].register()
    forget_runs()
    out = io.StringIO()
    err = out if merge else io.StringIO()
    saved_env, saved_cwd, saved_argv, saved_stdin = dict(os.environ), os.getcwd(), sys.argv, sys.stdin
    saved_loggers = {l: (list(l.handlers), l.level) for l in loggers()}
    root = logging.getLogger()
    handler, level = start_logging(name, out, err)
    code = 0
    try:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv, sys.stdin = [cmd[0], *cmd[1:]], io.StringIO(stdin or "")
        root.handlers = [handler]
        root.setLevel(level)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.resetwarnings()
            warnings.showwarning = show_warning
            for action, category, module in reversed(PYTHON_WARNING_FILTERS):
                warnings.filterwarnings(action, category=category, module=module or "")
            try:
                main()
            except SystemExit as e:
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:  # noqa: BLE001  (a process prints the traceback and exits with 1)
                traceback.print_exc(file=sys.stderr)
                code = 1
    finally:
        for l in loggers():  # each logger's handlers and level as before (none for one made by the run)
            handlers, l_level = saved_loggers.get(l, ([], l.level))
            for h in l.handlers:
                if h not in handlers:
                    h.close()
            l.handlers[:] = handlers
            l.setLevel(l_level)
        from fairseq.logging import progress_bar
        progress_bar._close_writers()
        progress_bar._tensorboard_writers.clear()
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv, sys.stdin = saved_argv, saved_stdin
    return code, out.getvalue(), None if merge else err.getvalue()


def cli(name):
    return str(BIN / name)


def rel(a, b):
    """Relative error ||a - b|| / ||b||, computed in at least float32 (half-precision tensors are widened
    first; float64 and complex stay as they are)."""
    a, b = (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in (a, b))
    return ((a - b).norm() / b.norm()).item()


def assert_compiled_matches_eager(eager, compiled, x, tol=1e-5, param_tol=1e-4):
    """Forward, input gradient and every parameter's gradient of the two layers on the same x agree (parameter
    gradients accumulate over calls, alike in both). Parameter gradients sum over every position and the batch, in
    another order compiled than eagerly: ``param_tol`` (a gradient lost in the compiled graph is off by 1)."""
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ye, yc = eager(xe), compiled(xc)
    g = torch.randn_like(ye)
    ye.backward(g)
    yc.backward(g)
    assert rel(yc, ye) < tol and rel(xc.grad, xe.grad) < tol
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert pe.grad is not None and pc.grad is not None, name
        assert rel(pc.grad, pe.grad) < param_tol, (name, float(rel(pc.grad, pe.grad)))


class DropoutLayer(torch.nn.Module):
    """A layer with a layer's signature (``x, pad_mask, kernel_length, spectrum``) that only applies dropout."""

    def forward(self, x, pad_mask=None, kernel_length=None, spectrum=None):
        return torch.nn.functional.dropout(x, 0.5, self.training)


def region_dropout_masks(device: str, **compile_options):
    """The dropout masks of two calls of one compiled stack region (``models.compile._layer_region``, as the stack's
    CUDA graphs call each layer) on a layer that only applies dropout, in two compiled calls: four masks of (4, 4096),
    which must all differ (a region stamped out with its random state would give each layer, or each update, the same
    mask)."""
    from fairseq_tnn.models import compile as compiling
    layer = DropoutLayer().train()

    def two_layers(x):
        y = compiling._layer_region(layer, x, None, None, None)
        return y, compiling._layer_region(layer, x + 0, None, None, None)

    torch._dynamo.reset()
    f = torch.compile(two_layers, **compile_options)
    x = torch.ones(4, 4096, device=device, requires_grad=True)
    masks = []
    for _ in range(2):
        if compile_options.get("mode") == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        y1, y2 = f(x)
        (y1.sum() + y2.sum()).backward()
        masks += [y1.detach().ne(0), y2.detach().ne(0)]
    return masks


def assert_masks_differ(masks):
    for i, a in enumerate(masks):
        assert 0.45 < float(a.float().mean()) < 0.55, (i, float(a.float().mean()))
        for j in range(i):
            assert not torch.equal(a, masks[j]), (i, j)


def split_tokens(data_bin: Path, split: str) -> int:
    """Number of tokens (eos included) in a binarised split."""
    from fairseq.data import data_utils
    ds = data_utils.load_indexed_dataset(str(data_bin / split), None)
    return int(ds.sizes.sum())


# The tiny causal and masked recipes of the CLI tests live with the other recipes in fairseq_tnn/recipe.py.
LM_OPTIONS, MLM_OPTIONS = recipe.TEST_CAUSAL, recipe.TEST_MASKED


def lm_args(**overrides) -> list:
    """The causal recipe's fairseq-train options (after the data directory), with keyword overrides."""
    return recipe.fairseq_options(LM_OPTIONS, overrides)


def mlm_args(**overrides) -> list:
    """The masked recipe's fairseq-train options (after the data directory), with keyword overrides."""
    return recipe.fairseq_options(MLM_OPTIONS, overrides)


def lm_train_cmd(data_bin, *extra, **overrides) -> list:
    """fairseq-train of the causal recipe on data_bin; extra arguments go last."""
    return [cli("fairseq-train"), data_bin, *lm_args(**overrides), *extra]


def mlm_train_cmd(data_bin, *extra, **overrides) -> list:
    """fairseq-train of the masked recipe on data_bin; extra arguments go last."""
    return [cli("fairseq-train"), data_bin, *mlm_args(**overrides), *extra]


# The causal recipe without a model or batch shape, for commands that name their own.
LM_TRAIN = lm_args(arch=None, tokens_per_sample=None, batch_size=None)


def rank0_updates(log: str) -> dict:
    """{update: (loss, bsz)} from rank 0's per-update lines of a fairseq-train log (simple format, under fairseq's
    logging set-up or Python's default one; the other ranks' lines, which torchrun prefixes with ``[rank N]``, left
    out)."""
    out = {}
    for line in log.splitlines():
        if "train_inner" in line and "num_updates=" in line and not line.startswith("[rank"):
            fields = dict(re.findall(r"(\w+)=([0-9.]+)", line))
            out[int(fields["num_updates"])] = (float(fields["loss"]), int(fields["bsz"]))
    return out


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
    """A script's environment: SCRIPT_ENV, then env."""
    return {**SCRIPT_ENV, **(env or {})}


def sh(cmd, env=None, timeout=600):
    """Run a command from the repository root; return (exit status, stdout, stderr). A fairseq CLI runs in
    this process unless env is given (execute())."""
    return execute(cmd, script_env(env), timeout, process=bool(env))


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


def tiny_gpt2_bpe(dest):
    """A GPT-2-format encoder.json / vocab.bpe: the 256 byte symbols plus a few merges; and a dict.txt."""
    from fairseq.data.encoders.gpt2_bpe_utils import bytes_to_unicode

    byte_sym = bytes_to_unicode()
    encoder = {byte_sym[b]: b for b in range(256)}
    merges = [("t", "h"), ("\u0120", "th"), ("\u0120th", "e"), ("th", "e"), ("e", "r")]
    for a, b in merges:
        encoder[a + b] = len(encoder)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "encoder.json").write_text(json.dumps(encoder))
    (dest / "vocab.bpe").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    (dest / "dict.txt").write_text("".join(f"{i} {1000 - i}\n" for i in range(len(encoder))))
    return encoder


def doc_blocks(page: Path, lang: str, section: str = "") -> list:
    """The ```lang code blocks of a markdown page, or of its section whose heading is `section` (up to the next
    heading of that level or above): the docs' code as written, for the tests that run it."""
    text = page.read_text()
    if section:
        level = section.split(" ")[0]
        start = text.index(f"\n{section}\n")
        ends = [m.start() for m in re.finditer(rf"\n#{{1,{len(level)}}} ", text) if m.start() > start]
        text = text[start:ends[0] if ends else len(text)]
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def install_core(tmp_path: Path):
    """`pip install .` of a copy of the package (no dependencies fetched: torch is this venv's), into a folder of
    its own (``tmp_path/site``); returns that folder and the installed distribution's metadata."""
    import shutil
    from email.parser import Parser
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "fairseq_tnn", src / "fairseq_tnn", ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp_path / "site"
    code, out, _ = execute([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                            "--no-index", "--target", site, src], command_env(), 300, merge=True, cwd=tmp_path)
    assert code == 0, out[-3000:]
    meta, = site.glob("fairseq_tnn-*.dist-info/METADATA")
    return site, Parser().parsestr(meta.read_text())


def wait_all(procs, logs, timeout: int = 600):
    """Wait for processes started together (one per node or rank, each writing its log file), kill any still running
    once one wait fails; return their exit codes and logs' texts."""
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return codes, [log.read_text() for log in logs]


def require_triton(request, device_less_on_cpu: bool) -> None:
    """For the tests of Triton kernels (the direct Toeplitz product, the fused loss, the direct band): skip without
    Triton, which a CPU-only torch lacks (scripts/setup.sh installs it there; CI fails instead), and a test on the CPU
    where Triton's interpreter is off (tests/conftest.py turns it on, by ``TRITON_INTERPRET=1``, where no CUDA device
    is): one whose ``device`` fixture is the CPU, and with ``device_less_on_cpu`` one without that fixture."""
    import pytest

    from fairseq_tnn.ops import toeplitz_direct
    if not toeplitz_direct.AVAILABLE:
        if os.environ.get("CI") == "true":
            pytest.fail("Triton is not installed: scripts/setup.sh installs it beside a CPU-only torch")
        pytest.skip("needs Triton (scripts/setup.sh installs it beside a CPU-only torch)")
    if "device" in request.fixturenames:
        on_cpu = request.getfixturevalue("device") == "cpu"
    else:
        on_cpu = device_less_on_cpu
    if on_cpu and not toeplitz_direct.INTERPRETED:
        pytest.skip("the CPU runs Triton's kernels only in its interpreter, chosen as Triton is imported: "
                    "TRITON_INTERPRET=1, which tests/conftest.py sets where no CUDA device is (here one is)")


# The start of a script for ``compile_for_hopper``: ``compile(kernel, signature, constants)`` compiles a Triton kernel
# for sm_90 (an H100's or H200's) and appends its cubin's size to ``built``.
_HOPPER_PRELUDE = r'''
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
target, built = GPUTarget("cuda", 90, 32), []

def compile(kernel, signature, constants, aligned=()):
    # aligned: the arguments specialized as Triton's launcher specializes a 16-byte aligned pointer or an integer
    # divisible by 16 (vectorized and asynchronous loads: the code a GPU runs at the recipes' shapes)
    signature = {**signature, **{k: "constexpr" for k in constants}}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    built.append(len(triton.compile(ASTSource(kernel, signature, constants, attrs), target=target).asm["cubin"]))
'''


def compile_for_hopper(script: str, tmp_path) -> list:
    """Run ``script`` after ``_HOPPER_PRELUDE`` in a process where Triton is not in its interpreter (so that its
    kernels are ``JITFunction``s, compiled by Triton's compiler and ptxas, and the plugin's custom operators exist), on
    a machine without a GPU (one with a GPU compiles and runs the kernels in the other tests: the test is skipped there,
    its device time saved). Returns the JSON of each line the script prints."""
    import pytest
    import torch
    if torch.cuda.is_available():
        pytest.skip("a check for machines without a GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", _HOPPER_PRELUDE + script], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.strip().splitlines()]
