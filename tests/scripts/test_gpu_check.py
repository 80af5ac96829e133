"""scripts/gpu_check.sh: the one command a GPU machine runs. Here on CPU: `--cpu --quick` runs every part at
toy sizes and writes a complete report; a part that fails (a failing test, a part past its time limit) makes
the exit status 1 and the report's failure section name it, the check going on past it; without a GPU and
without --cpu, and with an existing --out, it refuses at once. The report's own checks (a compiled run fallen
back to eager, compiled and eager runs that disagree) on hand-made part outputs."""
import json
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, script_env

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
REPORTER = ROOT / "scripts" / "gpu_check_report.py"


def gpu_check(*args, timeout=3000, env=None):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], cwd=ROOT,
                          env=script_env({"TEST_WORKERS": "0", **(env or {})}), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the check would run")
def test_refuses_without_a_gpu_unless_cpu(tmp_path):
    proc = gpu_check("--out", tmp_path / "report", timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "gpu_check.sh: error: no CUDA GPU is visible to torch" in proc.stderr and "--cpu" in proc.stderr
    assert not (tmp_path / "report").exists()


def test_refuses_an_existing_out_and_bad_options(tmp_path):
    out = tmp_path / "earlier"
    out.mkdir()
    (out / "report.md").write_text("an earlier report")
    proc = gpu_check("--cpu", "--quick", "--out", out, timeout=300)
    assert proc.returncode == 2 and f"--out {out} already exists; refusing to overwrite it (--force" in proc.stderr
    assert (out / "report.md").read_text() == "an earlier report"
    for args, message in ((["--limit", "tests=soon"], "--limit 'tests=soon' is invalid: must be PART=SECONDS"),
                          (["--limit", "lunch=5"], "unknown part 'lunch'"),
                          (["--only", "tests,bench"], "--only 'tests,bench': unknown part 'bench'"),
                          (["--fast"], "unknown argument '--fast'")):
        proc = gpu_check("--cpu", "--quick", "--out", tmp_path / "new", *args, timeout=300)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
        assert not (tmp_path / "new").exists()


@pytest.mark.runs_doc(r'^(PYTHONPATH=\S+ FAIRSEQ_BIN=\S+ PYTHON=python3 )?bash scripts/gpu_check\.sh( --cpu --quick)?$')
@pytest.mark.slow
def test_quick_cpu_check_writes_a_complete_report(tmp_path):
    """What CI runs: every part at toy sizes on the CPU, all passing, and a report with every section."""
    out = tmp_path / "check"
    proc = gpu_check("--cpu", "--quick", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:] + (out / "report.md").read_text()[-5000:]
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and report["failed"] == 0 and report["device"] == "cpu" and report["quick"]
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["fairseq"] and env["python"] == sys.version.split()[0]
    names = [p["name"] for p in report["parts"]]
    assert names == ["environment", "profile (where an update's time goes)", "tests", "benchmark fp32 (eager and compiled)",
                     "benchmark bf16 (compiled)",
                     "data (data/sample binarised)",
                     "train ski_tnn_mlm_tiny compiled", "train ski_tnn_mlm_tiny eager"]
    for p in report["parts"]:
        assert p["status"] == "passed" and p["exit_code"] == 0 and 0 < p["seconds"] <= p["limit_s"], p
        assert (out / p["log"]).exists()
    tests = report["parts"][2]["tests"]
    assert tests["passed"] > 0 and tests["failures"] == tests["errors"] == 0 and tests["failing"] == []
    fp32, bf16 = report["parts"][3]["benchmark"], report["parts"][4]["benchmark"]
    assert fp32["meta"]["precision"] == "fp32" and bf16["meta"]["precision"] == "bf16"
    rows = {(g["section"], c["key"], c["compiled"]) for g in fp32["groups"] for c in g["configs"]}
    assert rows == {("causal", "transformer", False), ("causal", "fd3", False), ("causal", "fd3", True)}  # --quick
    assert ("causal", "transformer", True) not in rows  # nothing of ours to compile in fairseq's transformer
    assert {(g["section"], c["key"], c["compiled"]) for g in bf16["groups"] for c in g["configs"]} == {("masked", "fd3", True)}
    assert [(r["key"], r["compiled"]) for r in fp32["against_transformer"]] == [("fd3", False), ("fd3", True)]
    runs = {p["name"]: p["training"] for p in report["parts"] if "training" in p}
    for name, t in runs.items():
        assert t["num_updates"] == 8 and t["update_ms"] > 0 and t["valid_loss"] > 0 and t["eager_fallback"] == [], name
        assert t["compiled"] == name.endswith("compiled")
    assert [(c["preset"], c["status"]) for c in report["agreement"]] == [("ski_tnn_mlm_tiny", "passed")]
    md = (out / "report.md").read_text()
    for heading in ("# GPU check", "## Machine and software", "## Parts", "## Tests", "## Benchmark: benchmark fp32",
                    "## Benchmark: benchmark bf16", "## Training runs (scripts/train.sh)"):
        assert heading in md, heading
    assert "PASSED" in md and "## Failures" not in md
    assert "| causal | 2 x 32 | transformer_lm |" in md and "Tokens per second against fairseq's transformer_lm" in md


@pytest.mark.slow
def test_profile_part_on_cpu(tmp_path):
    """``--cpu --quick --only profile``: issue 39's measurement (benchmarks/gpu_profile.py) at toy sizes, its tables
    in the report: every configuration with its update time, kernel (here: operator) time and count, operations
    dispatched and the forward/backward/optimizer/rest split; the longest operators of one FD-TNN and one SKI-TNN
    update; the floor of each TNO's mixing beside its measured time."""
    out = tmp_path / "check"
    proc = gpu_check("--cpu", "--quick", "--only", "profile", "--out", out, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:] + (out / "report.md").read_text()[-5000:]
    report = json.loads((out / "report.json").read_text())
    assert [p["name"] for p in report["parts"]] == ["environment", "profile (where an update's time goes)"]
    prof = report["parts"][1]["profile"]
    assert prof["meta"]["device"] == "cpu" and prof["meta"]["precision"] == "fp32" and prof["meta"]["compiled"] == []
    assert prof["bandwidth_gbs"] > 0
    groups = {(g["section"], g["batch"], g["n"]): g for g in prof["groups"]}
    assert list(groups) == [("causal", 2, 32), ("masked", 2, 32)]
    keys = {(s, c["key"]) for (s, _, _), g in groups.items() for c in g["configs"]}
    assert keys == {("causal", "fd3"), ("causal", "bound_identity"), ("masked", "fd3"), ("masked", "ski"),
                    ("masked", "bound_identity")}
    for g in prof["groups"]:
        for c in g["configs"]:
            assert c["update_ms"] > 0 and c["kernel_ms"] > 0 and c["kernels"] > 0 and not c["compiled"]
            split = c["split_ms"]
            assert set(split) == {"forward", "backward", "optimizer", "rest", "total"}
            assert split["forward"] > 0 and split["backward"] > 0 and split["optimizer"] > 0
            assert abs(sum(split[k] for k in ("forward", "backward", "optimizer", "rest")) - split["total"]) < 1e-6
            assert 0 < c["ops"]["forward"] < c["ops"]["forward_backward"] < c["ops"]["update"]
        bound = next(c for c in g["configs"] if c["key"] == "bound_identity")
        fd = next(c for c in g["configs"] if c["key"] == "fd3")
        assert fd["ops"]["forward"] > bound["ops"]["forward"]  # the TNO's operations
        f = fd["floor"]
        assert f["least_bytes"] == 5 * 96 * 2 * 32 * 4  # d1 = 3 x 32 channels, fp32
        assert f["floor_ms"] > 0 and f["mixing_ms"] == f["layer_ms"] - f["no_mixing_layer_ms"]
    tops = {c["key"]: c["top_kernels"] for g in prof["groups"] for c in g["configs"] if "top_kernels" in c}
    assert set(tops) == {"fd3", "ski"}  # the first group that has each; tnn6 is not in this --configs
    for top in tops.values():
        assert 1 <= len(top) <= 15 and all(0 <= k["share"] <= 1 for k in top)
        assert [k["ms"] for k in top] == sorted((k["ms"] for k in top), reverse=True)
    md = (out / "report.md").read_text()
    for heading in ("## Profile: profile", "#### The floor of the mixing", "#### The 15 longest operators of one SKI-TNN"):
        assert heading in md, heading
    assert "| causal 2 x 32 | FD-TNN (RPE 3) |" in md


@pytest.mark.slow
def test_a_failing_part_fails_the_check_and_the_report_says_why(tmp_path):
    """A test that fails and a part past its time limit: exit status 1, the check going on past the first,
    and the report's failure section naming the failing test with the last lines of each log."""
    failing = tmp_path / "test_fails_on_purpose.py"
    failing.write_text("def test_passes():\n    pass\n\n\ndef test_fails_on_purpose():\n"
                       "    assert 1 + 1 == 3, 'a failure injected by test_gpu_check.py'\n")
    # every Python the check starts first sleeps 3 s (a sitecustomize on PYTHONPATH, which also makes each a
    # fresh process, not a fork), so the environment part always outlasts its 1 s limit: forked from an
    # interpreter with torch loaded, it took 1.0 to 1.5 s, and once finished within the second
    slow = tmp_path / "slow_start"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text("import time\ntime.sleep(3)\n")
    out = tmp_path / "check"
    proc = gpu_check("--cpu", "--quick", "--out", out, "--only", "tests", "--pytest", str(failing),
                     "--limit", "environment=1", env={"PYTHONPATH": str(slow)})
    assert proc.returncode == 1, proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert not report["ok"] and report["failed"] == 2
    env, tests = report["parts"]
    assert env["name"] == "environment" and env["status"] == "timed out" and env["exit_code"] == 124
    assert env["reasons"] == ["stopped at its time limit of 1 s"]
    assert tests["name"] == "tests" and tests["status"] == "failed" and tests["exit_code"] == 1  # ran after it
    assert tests["tests"]["passed"] == 1 and tests["tests"]["failures"] == 1
    # the name is relative to pytest's rootdir, which depends on where the checkout and tmp_path lie
    failing = [t["test"] for t in tests["tests"]["failing"]]
    assert len(failing) == 1 and failing[0].endswith("test_fails_on_purpose.py::test_fails_on_purpose")
    assert "a failure injected by test_gpu_check.py" in tests["tests"]["failing"][0]["message"]
    assert any("1 failed, 1 passed" in line for line in tests["log_tail"])
    md = (out / "report.md").read_text()
    assert "FAILED (2 of 2 parts failed)" in md and "## Failures" in md
    assert "### tests: failed" in md and f"- `{failing[0]}`: AssertionError: a failure injected by test_gpu_check.py" in md
    assert "### environment: timed out" in md and "Last lines of tests/pytest.log:" in md


def write_train_log(path, valid_loss, update_ms=(900.0, 50.0, 52.0, 48.0), warning=None):
    path.mkdir(parents=True)
    lines = ["{'_name': None, 'common': ...}", "TnnLanguageModel("]
    if warning:
        lines.append(warning)
    for i, ms in enumerate(update_ms):
        lines.append(json.dumps({"epoch": 1, "update": 0.1 * i, "loss": "9.1", "update_ms": str(ms),
                                 "gpu_peak_mb": "1200.5", "num_updates": str(20 * (i + 1))}))
    lines.append(json.dumps({"epoch": 1, "valid_loss": str(valid_loss), "valid_num_updates": "200"}))
    lines.append(json.dumps({"epoch": 1, "train_loss": "9.0", "train_update_ms": "60.0", "train_num_updates": "200"}))
    (path / "train.log").write_text("\n".join(lines) + "\n")


def test_report_fails_a_compiled_run_fallen_back_to_eager_and_compiled_eager_disagreement(tmp_path):
    """The report's checks of the training runs: update_ms (median after the first interval), the final
    validation loss, a compiled run whose layers fell back to eager fails, and compiled and eager runs of a
    preset must agree (2%), as must a run compiled with CUDA graphs (CUDA_GRAPHS=1) and the eager one."""
    out = tmp_path
    (out / "run.json").write_text(json.dumps({"command": "bash scripts/gpu_check.sh", "started": "now", "seconds": 9,
                                              "device": "cuda", "quick": False, "only": None}))
    (out / "environment.json").write_text(json.dumps({"gpus": ["NVIDIA H100 80GB HBM3"], "torch": "2.13", "driver": "580"}))
    warning = ("2026-01-01 | WARNING | fairseq_cli.train.fairseq_tnn.models.compile | --tnn-compile: compiling "
               "decoder.layers.0 failed: BackendCompilerFailed: no Triton. Running eagerly from now on")
    write_train_log(out / "train/a-compiled", 5.00, warning=warning)
    write_train_log(out / "train/a-eager", 5.01)
    write_train_log(out / "train/b-compiled", 5.00)
    write_train_log(out / "train/b-eager", 6.00)
    write_train_log(out / "train/c-graphs", 4.00)
    write_train_log(out / "train/c-compiled", 5.00)
    write_train_log(out / "train/c-eager", 5.05)
    parts = [("train a compiled", "train/a-compiled"), ("train a eager", "train/a-eager"),
             ("train b compiled", "train/b-compiled"), ("train b eager", "train/b-eager"),
             ("train c graphs", "train/c-graphs"), ("train c compiled", "train/c-compiled"),
             ("train c eager", "train/c-eager")]
    (out / "parts.tsv").write_text("".join(f"{name}\t0\t10.0\t80\t{d}.log\ttrain\t{d}\n" for name, d in parts))
    for _, d in parts:
        (out / f"{d}.log").write_text("training ...\nlast line of the run\n")
    proc = subprocess.run([sys.executable, str(REPORTER), "report", str(out)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    status = {p["name"]: p["status"] for p in report["parts"]}
    assert status == {"train a compiled": "failed", "train a eager": "passed", "train b compiled": "passed",
                      "train b eager": "passed", "train c graphs": "passed", "train c compiled": "passed",
                      "train c eager": "passed"}
    a = report["parts"][0]
    assert a["reasons"] == ["compiled run fell back to eager: decoder.layers.0: BackendCompilerFailed: no Triton. "
                            "Running eagerly from now on"]
    assert a["training"]["update_ms"] == 50.0 and a["training"]["valid_loss"] == 5.0 and a["training"]["peak_mb"] == 1200.5
    assert a["training"]["num_updates"] == 200 and a["log_tail"] == ["training ...", "last line of the run"]
    assert [(c["preset"], c["mode"], c["status"]) for c in report["agreement"]] == [
        ("a", "compiled", "passed"), ("b", "compiled", "failed"), ("c", "compiled", "passed"), ("c", "graphs", "failed")]
    assert report["failed"] == 3 and not report["ok"]
    md = (out / "report.md").read_text()
    assert "### compiled = eager, b: failed" in md and "relative difference 0.1667 > 0.02" in md
    assert "### graphs = eager, c: failed" in md and "final validation loss graphs 4.0000, eager 5.0500" in md
    assert "| train a compiled | failed | 200 | 50.00 | 5.0000 | 1200 | decoder.layers.0 |" in md
    assert "- GPU: NVIDIA H100 80GB HBM3" in md and "driver: 580" in md


def test_report_of_tests_stopped_at_their_limit_names_the_failures_from_the_log(tmp_path):
    """pytest stopped at the part's time limit may leave no junit XML: the failing tests are read from its
    -v log (plain and pytest-xdist lines), and the part is reported as timed out."""
    (tmp_path / "run.json").write_text(json.dumps({"command": "bash scripts/gpu_check.sh", "started": "now",
                                                   "seconds": 400, "device": "cuda", "quick": False, "only": "tests"}))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/pytest.log").write_text(
        "tests/ops/test_fd.py::test_a[cpu] PASSED [ 10%]\n"
        "tests/ops/test_fd.py::test_b[cuda] FAILED [ 20%]\n"
        "[gw1] [ 30%] FAILED tests/gpu/test_gpu.py::test_fairseq_train_on_gpu[--fp16-tnn_lm_wt103]\n"
        "!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!\n")
    (tmp_path / "parts.tsv").write_text("tests\t124\t361.0\t360\ttests/pytest.log\ttests\ttests/junit.xml\n")
    proc = subprocess.run([sys.executable, str(REPORTER), "report", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    part = json.loads((tmp_path / "report.json").read_text())["parts"][0]
    assert part["status"] == "timed out"
    assert part["reasons"] == ["stopped at its time limit of 360 s", "2 failing tests"]
    assert [t["test"] for t in part["tests"]["failing"]] == [
        "tests/ops/test_fd.py::test_b[cuda]", "tests/gpu/test_gpu.py::test_fairseq_train_on_gpu[--fp16-tnn_lm_wt103]"]
    md = (tmp_path / "report.md").read_text()
    assert "### tests: timed out" in md and "- `tests/ops/test_fd.py::test_b[cuda]`" in md
    assert "no junit XML (pytest did not finish)" in md


def test_environment_knobs_are_refused_as_their_flags_are(tmp_path):
    """The same refusals from LIMITS / ONLY / QUICK / OUT as from --limit / --only / --quick / --out, before any work."""
    for env, message in (({"LIMITS": "tests=soon"}, "LIMITS / --limit 'tests=soon' is invalid: must be PART=SECONDS"),
                         ({"ONLY": "tests,bench"}, "ONLY / --only 'tests,bench': unknown part 'bench'"),
                         ({"QUICK": "yes"}, "QUICK must be 0 or 1 (--quick sets 1), not 'yes'")):
        proc = gpu_check("--cpu", env={"OUT": str(tmp_path / "new"), **env}, timeout=300)
        assert proc.returncode == 2 and message in proc.stderr and proc.stdout == "", (env, proc.stderr)
    (tmp_path / "old").mkdir()
    proc = gpu_check(env={"OUT": str(tmp_path / "old"), "CPU": "1"}, timeout=300)
    assert proc.returncode == 2 and f"--out {tmp_path / 'old'} already exists" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]


def test_help_lists_the_flags_knobs_parts_and_time_limits():
    """``gpu_check.sh --help`` (python -m fairseq_tnn gpu-check --help): the usage line, every part in order, each
    flag with the knob it sets, every knob, and the default time limits (full and --quick), on stdout, exit 0."""
    proc = gpu_check("--help", timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    out = proc.stdout
    assert out.startswith("usage: bash scripts/gpu_check.sh [--out DIR] [--force] [--cpu] [--quick] [--only PART,...]")
    assert "environment profile tests bench-fp16 bench-bf16 data train" in out
    for flag in ("--out DIR (OUT)", "--force (FORCE=1)", "--cpu (CPU=1)", "--quick (QUICK=1)", "--only PART,... (ONLY)",
                 '--pytest "ARGS" (PYTEST_ARGS)', "--limit PART=SECONDS (adds to LIMITS"):
        assert flag in out, flag
    for knob in ("OUT [results/gpu-check]", "FORCE [0]", "CPU [0]", "QUICK [0]", "ONLY []", "PYTEST_ARGS []", "LIMITS []",
                 "TEST_WORKERS []", "FAIRSEQ_BIN [<repo>/.venv/bin]", "PYTHON [$FAIRSEQ_BIN/python]"):
        assert f"\n  {knob} " in out, knob
    assert "environment=45 profile=420 tests=600 bench-fp16=480 bench-bf16=300 data=45 train=180" in out
    assert "QUICK=1: environment=600 profile=900 tests=900 bench-fp16=900 bench-bf16=900 data=600 train=900" in out
