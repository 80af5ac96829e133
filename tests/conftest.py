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


def run(cmd, expect_ok=True, timeout=900, env=None):
    """Run a command line, return its combined output; check the exit status."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
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


LM_TRAIN = [
    "--user-dir", USER_DIR, "--cpu", "--task", "tnn_language_modeling", "--criterion", "cross_entropy",
    "--sample-break-mode", "none", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10", "--lr", "0.003",
    "--log-format", "simple", "--log-interval", "5", "--seed", "1", "--num-workers", "0",
]


def valid_ppls(log: str):
    return [float(m) for m in re.findall(r"valid on 'valid' subset \| loss [0-9.]+ \| ppl ([0-9.]+)", log)]


@pytest.fixture(scope="session")
def tiny_checkpoints(data_bin, tmp_path_factory):
    """A few updates of each tiny model: {arch: checkpoint dir with checkpoint_best.pt}, for the
    generation, scoring and fill-mask tests. The causal ones train with --sample-break-mode eos
    (fairseq's numpy-2-sensitive path, see fairseq_tnn/patches.py)."""
    root = tmp_path_factory.mktemp("tiny-checkpoints")
    common = ["--cpu", "--user-dir", USER_DIR, "--batch-size", 8, "--max-update", 20, "--validate-interval-updates", 20,
              "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", 10, "--seed", 1, "--num-workers", 0,
              "--optimizer", "adam", "--lr", "0.003", "--max-valid-steps", 2]
    out = {}
    for arch in ("tnn_lm_tiny", "fd_tnn_lm_tiny"):
        out[arch] = root / arch
        run([cli("fairseq-train"), data_bin, *common, "--task", "tnn_language_modeling", "--criterion", "cross_entropy",
             "--arch", arch, "--sample-break-mode", "eos", "--tokens-per-sample", 128, "--save-dir", out[arch]])
    out["tnn_mlm_tiny"] = root / "tnn_mlm_tiny"
    run([cli("fairseq-train"), data_bin, *common, "--task", "tnn_masked_lm", "--criterion", "masked_lm",
         "--arch", "tnn_mlm_tiny", "--sample-break-mode", "complete", "--tokens-per-sample", 128,
         "--save-dir", out["tnn_mlm_tiny"]])
    for path in out.values():
        assert (path / "checkpoint_best.pt").is_file(), path
    return out


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped where none is present, as in CI)")
