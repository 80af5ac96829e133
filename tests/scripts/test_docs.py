"""Every command shown in README.md and docs/*.md is run by a test, and this file names no test. A command is
run in one of three ways:
- here, as written (AS_WRITTEN, below): those that run on CPU in seconds on the bundled sample, from their code
  block, in a directory laid out as after the demo; those that need a GPU, SLURM or Wikitext-103 and have a dry
  run, in their dry-run form (DRY_RUN=1 and the command as written);
- by CI itself (RUN_BY_CI: .ci/run, or a script it runs, runs the command);
- by the test that carries the command's mark, ``@pytest.mark.runs_doc(<regular expression on the command
  line>)``, in the form this machine can run: the same command on data/sample with tiny presets, under CI's
  one-node SLURM, or its dry run checked flag by flag. The marks are read from the test files' source
  (doc_marks()), so that this file runs alone.
The pages whose every block a test runs as written, in order, are RUN_AS_WRITTEN; every ```python block is run
as written by the test files PYTHON_RUN_BY names. A command added to the docs that nothing runs, a mark or row
that no documented command matches, a Python example no test runs and a link to a missing page all fail."""
import ast
import json
import re
import sys
from pathlib import Path

import pytest

from helpers import ROOT, command_env, execute

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages whose every block a test file runs as written, in order (no per-command rows needed)
RUN_AS_WRITTEN = {"docs/using-models.md": "scripts/test_docs_using_models.py"}
# The test files that run each page's ```python blocks as written
PYTHON_RUN_BY = {"README.md": ["scripts/test_docs_using_models.py", "modules/test_without_fairseq.py"],
                 **{page: [runner] for page, runner in RUN_AS_WRITTEN.items()}}
# (regex on the command line, the file that runs it): CI's own commands; the runner must name the script
RUN_BY_CI = [
    (r"^bash scripts/test\.sh( --fast)?$", ".ci/run"),  # the suite's own runner (--fast: a part of the suite)
    (r"^bash scripts/slurm/local_cluster\.sh (start|stop)$", ".ci/run"),
    (r"^bash scripts/setup\.sh$", "scripts/test.sh"),  # which .ci/run runs
]
MARK = "pytest.mark.runs_doc"


def doc_marks():
    """[(pattern, "file::test")] of every ``@pytest.mark.runs_doc(pattern, ...)`` on a test function under tests/."""
    marks = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                for decorator in node.decorator_list:
                    if isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == MARK:
                        where = f"{path.relative_to(ROOT / 'tests')}::{node.name}"
                        marks += [(ast.literal_eval(arg), where) for arg in decorator.args]
    return marks


MARKS = doc_marks()


def doc_commands(path: Path):
    """The command lines of a page's ```bash blocks (continuation lines joined, comments dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        cur = ""
        for line in block.splitlines():
            line = line.rstrip()
            if not line.strip():
                continue
            cur = f"{cur} {line.strip()}" if cur else line
            if cur.endswith("\\"):
                cur = cur[:-1].rstrip()
                continue
            out.append(re.sub(r"\s+#.*$", "", cur).strip())
            cur = ""
    return out


ALL = [(p.relative_to(ROOT), c) for p in DOCS for c in doc_commands(p)]
OUTSIDE_RUN_AS_WRITTEN = [(p, c) for p, c in ALL if str(p) not in RUN_AS_WRITTEN]


def run_by_ci(command):
    """The file of RUN_BY_CI that runs command, or None."""
    runners = [runner for pattern, runner in RUN_BY_CI if re.search(pattern, command)]
    return runners[0] if runners else None


@pytest.mark.parametrize("page,command", ALL, ids=[f"{p}:{c[:40]}" for p, c in ALL])
def test_every_command_is_run_by_a_test(page, command):
    if str(page) in RUN_AS_WRITTEN:
        runner = (ROOT / "tests" / RUN_AS_WRITTEN[str(page)]).read_text()
        assert str(page) in runner or page.name in runner, f"{RUN_AS_WRITTEN[str(page)]} no longer runs {page}"
        return
    if as_written(command):
        return  # test_doc_command_runs_as_written runs it (and a mark, if any, names a test closer to it)
    runner = run_by_ci(command)
    if runner:
        script = re.search(r"scripts/\S+", command).group(0)
        assert script in (ROOT / runner).read_text(), f"{runner} no longer runs {script}"
        return
    assert any(re.search(pattern, command) for pattern, _ in MARKS), \
        f"{page}: no test runs `{command}`; run it here as written (a row of AS_WRITTEN in tests/scripts/" \
        f"test_docs.py) or mark the test that runs it with @{MARK}(r\"<regular expression matching it>\")"


def test_every_mark_and_ci_row_matches_a_documented_command():
    commands = [c for _, c in ALL]
    stale = [f"{where}: {pattern}" for pattern, where in MARKS if not any(re.search(pattern, c) for c in commands)]
    stale += [pattern for pattern, _ in RUN_BY_CI if not any(re.search(pattern, c) for c in commands)]
    assert not stale, stale
    assert len({where for _, where in MARKS}) >= 10, MARKS  # the marks are found (a decorator renamed reads as none)


def test_every_python_example_is_run_by_a_test():
    pages = {str(p.relative_to(ROOT)) for p in DOCS if "```python\n" in p.read_text()}
    assert "README.md" in pages and pages == set(PYTHON_RUN_BY), (pages, PYTHON_RUN_BY)
    for page, runners in PYTHON_RUN_BY.items():
        for runner in runners:
            assert page in (ROOT / "tests" / runner).read_text(), f"{runner} no longer runs the Python of {page}"


def test_links_between_pages_resolve():
    for page in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            path = (page.parent / target).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)} links to missing {target}"


# ---------------------------------------------------------------------------------------------------------
# The commands run as written: (pattern, dry, check). dry: run as `DRY_RUN=1 <command>` (it needs a GPU or
# Wikitext-103). check(box, output) asserts what the command did, in the directory box laid out as after the
# demo: data/sample, data-bin/sample (made by the docs' own preprocess.sh command), demo-run/checkpoints/
# {tnn_lm_tiny,fd_tnn_lm_tiny} (the session's tiny checkpoints), the repository's code, and .venv, activated
# as the README says.
# ---------------------------------------------------------------------------------------------------------


def made_data_bin(box, out):
    assert {"dict.txt", "train.bin", "valid.bin", "test.bin"} <= {f.name for f in (box / "data-bin/sample").iterdir()}


def wt103_train_command(box, out):
    """A dry run without Wikitext-103: the command, the missing data named, nothing created."""
    assert "no binarised data in 'data-bin/wikitext-103'" in out and "a real run stops here" in out, out
    line, = [l for l in out.splitlines() if "/fairseq-train " in l or " -m fairseq_tnn.distributed.launch " in l]
    assert f"{box}/data-bin/wikitext-103 --user-dir {box}/fairseq_tnn" in line, line
    preset = re.search(r" --arch (\w+) ", line).group(1)
    assert not (box / "checkpoints" / preset).exists()
    if "--tnn-cuda-graphs" in line:  # CUDA_GRAPHS (1 by default on a GPU): the graphs of compiled layers
        assert "--tnn-compile" in line, line


def smoke_run(box, out):
    """20 updates of the recipe's 4,000-update warm-up: a model that has barely moved, its perplexity above the
    1,888 of uniform predictions (docs/evaluation.md), near the 4,620 docs/training.md shows."""
    run_dir = box / "checkpoints" / "tnn_lm_tiny"
    assert (run_dir / "checkpoint_last.pt").is_file() and (run_dir / "tensorboard").is_dir()
    valid = [json.loads(l) for l in (run_dir / "train.log").read_text().splitlines() if '"valid_ppl"' in l]
    assert valid[-1]["valid_num_updates"] == "20", valid
    assert 1888 < float(valid[-1]["valid_ppl"]) and abs(float(valid[-1]["valid_ppl"]) / 4620 - 1) < 0.05, valid


def masked_smoke_run(box, out):
    """Long lines dropped and counted: the warning's count is the dropped_blocks metric of the json log."""
    warned = re.search(r"([\d,]+) of [\d,]+ blocks of the train split .* are longer than --tokens-per-sample=64 .*; dropped",
                       out)
    assert warned, out[-3000:]
    run_dir = box / "checkpoints" / "tnn_mlm_tiny"
    train = [json.loads(l) for l in (run_dir / "train.log").read_text().splitlines() if '"train_dropped_blocks"' in l]
    assert train[-1]["train_dropped_blocks"] == warned.group(1).replace(",", "") != "0", train
    assert (run_dir / "checkpoint_last.pt").is_file()


def sbatch_dry_run(box, out):
    srun, = [l for l in out.splitlines() if l.startswith("srun --kill-on-bad-exit=1 ")]
    assert "--distributed-world-size 16 " in srun and "--arch fd_tnn_lm_wt103 " in srun, out
    assert "no binarised data" in out and not (box / "checkpoints" / "fd_tnn_lm_wt103").exists()


def hydra_sample(box, out):
    """Checkpoints in the config's save_dir, hydra's log beside them, no outputs/<date>/<time>/."""
    run_dir = box / "checkpoints" / "tnn_lm_sample"
    assert (run_dir / "checkpoint_last.pt").is_file() and (run_dir / "hydra_train.log").is_file()
    assert re.search(r"num_updates[ =]20\b", out) and not (box / "outputs").exists(), out[-3000:]


def eval_lm_sample(box, out):
    tokens = int(re.search(r"Evaluated ([0-9,]+) tokens", out).group(1).replace(",", ""))
    ppl = float(re.search(r"Perplexity: ([0-9.]+)", out).group(1))
    assert tokens == 17453 and 1 < ppl < 1888, out[-2000:]  # every test token, a trained model's perplexity


def init_study(box, out):
    names = {f.name for f in (box / "results/kernels/init").iterdir()}
    assert names == {"init-relu.png", "init-silu.png", "init-gelu.png", "init-decay.png", "init-study.json"}, names
    assert "DEBUG" not in out, out


def memory_benchmark(box, out):
    result = json.loads((box / "results/bench-memory/memory.json").read_text())
    keys = {(g["section"], g["n"]): [c["key"] for c in g["configs"]] for g in result["groups"]}
    assert keys[("causal", 512)] == ["tnn6", "tnn3", "fd3", "bound_fixed", "bound_identity"], keys
    assert "ski" in keys[("masked", 2048)], keys


def extrapolation_dry_run(box, out):
    evals = [l for l in out.splitlines() if "/fairseq-eval-lm " in l]
    # per model the six lengths on test, and valid at the training length for the table (whose test column is
    # the 512 evaluation)
    assert len(evals) == 2 * (6 + 1), out
    assert "no binarised data in 'data-bin/wikitext-103'" in out and not (box / "results").exists()


def prepare_dry_run(box, out):
    assert "fairseq-preprocess --only-source --srcdict" in out and not (box / "data-bin" / "wikitext-103").exists()


AS_WRITTEN = [
    (r"^bash scripts/preprocess\.sh data/sample data-bin/sample$", False, made_data_bin),
    (r"^(NPROC=1 |DRY_RUN=1 |PRECISION=bf16 |TNN_COMPILE=\w+ |CUDA_GRAPHS=[01] )?bash scripts/train\.sh \w+_wt103\w* "
     r"data-bin/wikitext-103$",
     True, wt103_train_command),
    (r"^OMP_NUM_THREADS=1 CPU=1 MAX_UPDATE=20 .* bash scripts/train\.sh tnn_lm_tiny data-bin/sample$", False, smoke_run),
    (r"^CPU=1 MAX_UPDATE=1 .* bash scripts/train\.sh tnn_mlm_tiny data-bin/sample$", False, masked_smoke_run),
    (r"^DRY_RUN=1 SLURM_NNODES=2 .* bash scripts/slurm/train\.sbatch fd_tnn_lm_wt103$", False, sbatch_dry_run),
    (r"^fairseq-hydra-train --config-dir configs --config-name tnn_lm_sample ", False, hydra_sample),
    (r"^fairseq-eval-lm data-bin/sample .*--path demo-run/checkpoints/", False, eval_lm_sample),
    (r"^python scripts/plot_kernels\.py --init-study ", False, init_study),
    (r"^python benchmarks/memory\.py ", False, memory_benchmark),
    (r"^DATA=data-bin/wikitext-103 bash scripts/eval_extrapolation\.sh ", True, extrapolation_dry_run),
    (r"^bash scripts/prepare-wikitext-103\.sh$", True, prepare_dry_run),
]


def as_written(command):
    """The AS_WRITTEN row of a command, or None."""
    rows = [row for row in AS_WRITTEN if re.search(row[0], command)]
    assert len(rows) <= 1, (command, rows)
    return rows[0] if rows else None


RUN_HERE = list(dict.fromkeys(c for _, c in OUTSIDE_RUN_AS_WRITTEN if as_written(c)))  # once each, in the docs' order


def test_every_as_written_row_is_used():
    unused = [pattern for pattern, _, _ in AS_WRITTEN if not any(re.search(pattern, c) for c in RUN_HERE)]
    assert not unused, unused


@pytest.fixture(scope="module")
def after_the_demo(tmp_path_factory, tiny_checkpoints):
    """A directory laid out as the repository after the demo, data-bin/sample made by the docs' command."""
    box = tmp_path_factory.mktemp("docs")
    for name in ("fairseq_tnn", "scripts", "configs", "benchmarks"):
        (box / name).symlink_to(ROOT / name)
    (box / "data").mkdir()
    (box / "data" / "sample").symlink_to(ROOT / "data" / "sample")
    (box / ".venv").symlink_to(Path(sys.executable).parent.parent)  # the suite's venv, as the one the docs name
    (box / "demo-run" / "checkpoints").mkdir(parents=True)
    for arch in ("tnn_lm_tiny", "fd_tnn_lm_tiny"):
        (box / "demo-run" / "checkpoints" / arch).symlink_to(tiny_checkpoints[arch])
    preprocess, = [c for c in RUN_HERE if c.startswith("bash scripts/preprocess.sh ")]
    run_as_written(box, preprocess)
    return box


def run_as_written(box, command, dry=False):
    """command in box, in the activated venv; its output (stdout and stderr)."""
    env = {k: v for k, v in command_env().items() if not k.startswith("SLURM_") and k != "DRY_RUN"}
    code = f"source .venv/bin/activate && set -euo pipefail\n{'DRY_RUN=1 ' if dry else ''}{command}"
    status, out, _ = execute(["bash", "-c", code], env, 600, merge=True, cwd=box)
    assert status == 0, f"`{command}` failed ({status}):\n{out[-4000:]}"
    return out


@pytest.mark.parametrize("command", RUN_HERE, ids=[c[:60] for c in RUN_HERE])
def test_doc_command_runs_as_written(after_the_demo, command):
    _, dry, check = as_written(command)
    out = run_as_written(after_the_demo, command, dry) if not command.startswith("bash scripts/preprocess.sh ") \
        else ""  # the fixture ran it
    check(after_the_demo, out)
