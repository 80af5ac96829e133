"""Shared fixtures: the sample corpus binarised once per session, and a CLI runner."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# The fairseq CLIs: beside the Python that runs pytest (scripts/test.sh's venv), or where FAIRSEQ_BIN says
# (fairseq installed elsewhere, e.g. as wheels in a --target directory on a GPU machine).
BIN = Path(os.environ["FAIRSEQ_BIN"]) if os.environ.get("FAIRSEQ_BIN") else Path(sys.executable).parent
USER_DIR = str(ROOT / "fairseq_tnn")  # absolute, as a user passes it
# Threads for torch in the tests and in the commands they run: 2, shared out among pytest-xdist's workers
# (scripts/test.sh runs one per core) so that the workers do not oversubscribe the cores.
THREADS = str(max(1, 2 // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(THREADS))


def run(cmd, expect_ok=True, timeout=900, env=None):
    """Run a command line, return its combined output; check the exit status."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", THREADS))
    full_env.update(env or {})
    proc = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, env=full_env, cwd=ROOT)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n{proc.stdout[-6000:]}")
    if not expect_ok and proc.returncode == 0:
        raise AssertionError(f"command unexpectedly succeeded: {' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}")
    return proc.stdout


def cli(name):
    return str(BIN / name)


def rel(a, b):
    """Relative error ||a - b|| / ||b||."""
    return ((a - b).norm() / b.norm()).item()


def assert_compiled_matches_eager(eager, compiled, x, tol=1e-5):
    """Forward and input gradient of the two layers on the same x agree (parameter gradients accumulate)."""
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ye, yc = eager(xe), compiled(xc)
    g = torch.randn_like(ye)
    ye.backward(g)
    yc.backward(g)
    assert rel(yc, ye) < tol and rel(xc.grad, xe.grad) < tol


@pytest.fixture(scope="session")
def data_bin(tmp_path_factory):
    dest = tmp_path_factory.mktemp("data-bin") / "sample"
    run(["bash", ROOT / "scripts/preprocess.sh", ROOT / "data/sample", dest],
        env={"FAIRSEQ_PREPROCESS": cli("fairseq-preprocess")})
    return dest


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


@pytest.fixture(scope="session")
def tiny_checkpoints(data_bin, tmp_path_factory):
    """A few updates of each tiny model: {arch: checkpoint dir with checkpoint_best.pt}, for the
    generation, scoring and fill-mask tests. The causal ones train with --sample-break-mode eos
    (fairseq's numpy-2-sensitive path, see fairseq_tnn/patches.py)."""
    root = tmp_path_factory.mktemp("tiny-checkpoints")
    common = dict(batch_size=8, max_update=20, validate_interval_updates=20, no_epoch_checkpoints=True,
                  log_interval=10, lr="0.003", max_valid_steps=2, tokens_per_sample=128)
    out = {}
    for arch in ("tnn_lm_tiny", "fd_tnn_lm_tiny"):
        out[arch] = root / arch
        run(lm_train_cmd(data_bin, arch=arch, sample_break_mode="eos", save_dir=out[arch], **common, **NO_LR_SCHEDULE))
    out["tnn_mlm_tiny"] = root / "tnn_mlm_tiny"
    run(mlm_train_cmd(data_bin, arch="tnn_mlm_tiny", save_dir=out["tnn_mlm_tiny"], **common))
    for path in out.values():
        assert (path / "checkpoint_best.pt").is_file(), path
    return out


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped where none is present, as in CI)")
    config.addinivalue_line("markers", "slow: takes more than about 20 s on 2 CPU cores (left out of "
                                       "`bash scripts/test.sh --fast`)")


# ---------------------------------------------------------------------------------------------------------
# Devices: the operator and module tests take the `device` fixture and run once per device, "cpu" and
# "cuda"; the CUDA cases carry the `gpu` marker and are skipped, with the reason "needs a CUDA GPU", where
# torch sees no GPU (the summary line counts them). A test of such a file that does not take `device` runs
# on CPU only, by design: it checks shapes, errors or pure index arithmetic that does not depend on the device.
# ---------------------------------------------------------------------------------------------------------
NEEDS_CUDA = "needs a CUDA GPU"
CUDA_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_CUDA)]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS)]


@pytest.fixture(params=DEVICES)
def device(request):
    """The device a test builds its tensors and modules on: "cpu", then "cuda" (skipped without a GPU).
    On CUDA, TF32 is off for the test (cuBLAS matmuls and cuDNN convolutions in full fp32), so fp32
    comparisons against the dense references hold the same tolerances as on CPU up to tol()'s factor;
    the previous settings come back after the test."""
    if request.param != "cuda":
        yield request.param
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield "cuda"
        torch.cuda.synchronize()  # an asynchronous CUDA error fails this test, not a later one
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


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


def pytest_terminal_summary(terminalreporter):
    """Say how many tests were skipped for want of a CUDA GPU (the device fixture's CUDA cases and tests/gpu)."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if NEEDS_CUDA in str(getattr(r, "longrepr", ""))]
    if skipped:
        terminalreporter.write_line(f"{len(skipped)} CUDA test(s) skipped: {NEEDS_CUDA} "
                                    f"(torch.cuda.is_available() is False)")
