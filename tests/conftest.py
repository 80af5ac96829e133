"""pytest's fixtures and hooks for the suite: the sample corpus binarised, the tiny checkpoints and a
train.sh run, each made once per test run (shared by pytest-xdist's workers), the `device` parameter, the
markers and the CUDA-skip summary.
The shared utilities live in helpers.py (``from helpers import run, cli, ...``); test modules import from
there, never from this file."""
import os
import shutil

import pytest
import torch
from filelock import FileLock  # a dependency of torch

from helpers import BIN, NO_LR_SCHEDULE, ROOT, SCRIPTS, THREADS, lm_train_cmd, mlm_train_cmd, ok, run

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(THREADS))
# Without a CUDA device, Triton's kernels (fairseq_tnn/ops/toeplitz_direct.py) run on the CPU in its interpreter, which
# Triton chooses when it is imported: set before any test imports it (tests/ops/test_toeplitz_direct.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def made_once(tmp_path_factory, name, make):
    """A directory that make(path) fills once per test run. pytest-xdist's workers each run the session
    fixtures; they share this directory instead of each making its own: the first to come makes it, holding
    a lock, the others wait for it and reuse it (so a fixture's fairseq runs happen once, not once per
    worker). The users only read it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.mktemp(name)
        make(path)
        return path
    shared = tmp_path_factory.getbasetemp().parent  # this run's directory, above the workers' own
    path, done = shared / name, shared / f"{name}.done"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)  # left by a worker whose attempt failed
            path.mkdir()
            make(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def data_bin(tmp_path_factory):
    """data/sample binarised by scripts/preprocess.sh."""
    def make(path):
        run(["bash", ROOT / "scripts/preprocess.sh", ROOT / "data/sample", path / "sample"],
            env={"FAIRSEQ_BIN": str(BIN)})
    return made_once(tmp_path_factory, "data-bin", make) / "sample"


@pytest.fixture(scope="session")
def tiny_checkpoints(data_bin, tmp_path_factory):
    """A few updates of each tiny model: {arch: checkpoint dir with checkpoint_best.pt}, for the
    generation, scoring and fill-mask tests. The causal ones train with --sample-break-mode eos
    (fairseq's numpy-2-sensitive path, see fairseq_tnn/patches/numpy2_compat_long.py)."""
    archs = ("tnn_lm_tiny", "fd_tnn_lm_tiny", "tnn_mlm_tiny")

    def make(root):
        common = dict(batch_size=8, max_update=20, validate_interval_updates=20, no_epoch_checkpoints=True,
                      log_interval=10, lr="0.003", max_valid_steps=2, tokens_per_sample=128)
        for arch in archs[:2]:
            run(lm_train_cmd(data_bin, arch=arch, sample_break_mode="eos", save_dir=root / arch, **common,
                             **NO_LR_SCHEDULE))
        run(mlm_train_cmd(data_bin, arch="tnn_mlm_tiny", save_dir=root / "tnn_mlm_tiny", **common))

    root = made_once(tmp_path_factory, "tiny-checkpoints", make)
    out = {arch: root / arch for arch in archs}
    for path in out.values():
        assert (path / "checkpoint_best.pt").is_file(), path
    return out


@pytest.fixture(scope="session")
def train_sh_run(data_bin, tmp_path_factory):
    """The run directory of scripts/train.sh on CPU with the tiny causal preset: 4 updates of 8 x 64 tokens,
    validation and a checkpoint every 2 updates, json log, tensorboard (tests/scripts: train.sh,
    eval_extrapolation.sh, plot_training.py)."""
    def make(save_root):
        env = {"CPU": "1", "MAX_UPDATE": "4", "TOKENS_PER_SAMPLE": "64", "SEQS_PER_UPDATE": "8", "BATCH_PER_GPU": "8",
               "LR": "0.003", "WARMUP_UPDATES": "2", "VALIDATE_INTERVAL_UPDATES": "2", "SAVE_INTERVAL_UPDATES": "2",
               "LOG_INTERVAL": "1", "NUM_WORKERS": "0", "SAVE_ROOT": str(save_root)}
        ok(["bash", SCRIPTS / "train.sh", "tnn_lm_tiny", data_bin, "--max-valid-steps", "4"], env)
    return made_once(tmp_path_factory, "train-sh", make) / "tnn_lm_tiny"


# The files that take longest on 2 CPU cores (worker-seconds in a fresh clone's CI run, 2026-12-04, from pytest's
# --junitxml: fairseq processes, CPU compilation and SLURM jobs), run first. scripts/test.sh hands whole files to
# its pytest-xdist workers in collection order (--dist loadfile --no-loadscope-reorder; xdist's own reordering
# puts the files with the fewest tests, which here are the longest ones, last), so that the last files to start
# are short and the workers end together instead of one waiting on a long file. The SLURM files come first: most of
# their time is waiting for their jobs, which then run beside the CPU-bound files.
LONGEST_FIRST = [
    "tests/scripts/test_slurm_real.py",           # ~160 s, mostly waiting for its SLURM jobs (skipped without SLURM)
    "tests/scripts/test_slurm_nodes.py",          # ~155 s, waiting for its SLURM jobs (skipped without SLURM)
    "tests/scripts/test_benchmarks.py",           # ~640 s: the benchmarks' quick runs, several compiled on the CPU
    "tests/modules/test_compile.py",              # ~630 s with inductor's cache cold, as in CI
    "tests/scripts/test_gpu_check.py",            # ~140 s
    "tests/modules/test_compile_ddp.py",          # ~130 s
    "tests/scripts/test_quality.py",              # ~130 s
    "tests/reliability/test_distributed.py",      # ~110 s
    "tests/scripts/test_prepare_corpus.py",       # ~95 s
    "tests/reliability/test_reliability.py",      # ~80 s
    "tests/scripts/test_demo.py",                 # ~70 s
    "tests/reliability/test_resume.py",           # ~65 s
    "tests/cli/test_export.py",                   # ~55 s: two masked models and two wt103 presets trained, a pip install
    "tests/scripts/test_docs_using_models.py",    # ~50 s
    "tests/cli/test_cli.py",                      # ~40 s
    "tests/scripts/test_docs.py",                 # ~40 s: the docs' commands run as written
    "tests/scripts/test_train_sh.py",             # ~40 s
    "tests/scripts/test_eval_extrapolation.py",   # ~40 s
    "tests/ops/test_toeplitz_direct.py",          # ~30 s
    "tests/scripts/test_experiment_configs.py",   # ~20 s
]


def pytest_collection_modifyitems(config, items):
    """The files of LONGEST_FIRST first, in that order; the others after them, as collected."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped where none is present, as in CI)")
    config.addinivalue_line("markers", "slow: takes more than about 20 s on 2 CPU cores (left out of "
                                       "`bash scripts/test.sh --fast`)")
    config.addinivalue_line("markers", "runs_doc(*patterns): runs the commands of README.md and docs/*.md that these "
                                       "regular expressions match (tests/scripts/test_docs.py reads the marks)")


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


def pytest_terminal_summary(terminalreporter):
    """Say how many tests were skipped for want of a CUDA GPU (the device fixture's CUDA cases and tests/gpu)."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if NEEDS_CUDA in str(getattr(r, "longrepr", ""))]
    if skipped:
        terminalreporter.write_line(f"{len(skipped)} CUDA test(s) skipped: {NEEDS_CUDA} "
                                    f"(torch.cuda.is_available() is False)")
