"""Every command shown in README.md and docs/*.md is run by a test: the table below names, for each command
pattern, the tests that run it (the same command on data/sample with tiny presets, or, for the multi-GPU,
SLURM and Wikitext-103 ones that need hardware or data this suite does not have, its dry run checked flag by
flag), and every ```python block is run as written by the test PYTHON_RUN_BY names. A command added to the
docs without a row here, a row whose tests are gone, a row no command uses, a Python example no test runs
and a link to a missing page all fail."""
import re
from pathlib import Path

import pytest

from helpers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CI = "ci: .ci/run"  # the command CI itself runs
# Pages whose every block a test runs as written, in order (no per-command rows needed)
RUN_AS_WRITTEN = {"docs/using-models.md": "scripts/test_docs_using_models.py"}
# The tests that run each page's ```python blocks as written
PYTHON_RUN_BY = {"README.md": ["scripts/test_docs_using_models.py", "modules/test_without_fairseq.py"],
                 **{page: [runner] for page, runner in RUN_AS_WRITTEN.items()}}

# (regex on the command line, tests that run it)
COVERAGE = [
    (r"^bash scripts/demo\.sh$", ["scripts/test_demo.py::test_demo_trains_tnn_and_fd_tnn_side_by_side_and_reports"]),
    (r"^bash scripts/test\.sh$", [CI]),
    (r"^bash scripts/test\.sh --fast$", ["scripts/test_fast_lane.py::test_fast_lane_selects_three_layers_without_slow_tests"]),
    (r"^bash scripts/setup\.sh$", ["scripts/test_demo.py::test_demo_trains_tnn_and_fd_tnn_side_by_side_and_reports"]),
    (r"^bash scripts/preprocess\.sh data/sample data-bin/sample$",
     ["scripts/test_preprocess.py::test_preprocess_skips_a_binarised_dir_and_redoes_it_with_force"]),
    (r"^bash scripts/prepare-wikitext-103\.sh$", ["scripts/test_prepare_wikitext.py::test_prepare_runs_offline_from_manually_placed_files",
                                                  "scripts/test_prepare_wikitext.py::test_prepare_dry_run_prints_the_pipeline"]),
    (r"^(NPROC=1 |DRY_RUN=1 )?bash scripts/train\.sh \w+_wt103(_rpe3)? data-bin/wikitext-103$",
     ["scripts/test_train_sh.py::test_train_dry_run_recipe_flag_by_flag"]),
    (r"^OMP_NUM_THREADS=1 CPU=1 MAX_UPDATE=20 .* bash scripts/train\.sh tnn_lm_tiny data-bin/sample$",
     ["scripts/test_train_sh.py::test_train_sh_trains_on_cpu_with_json_log_and_tensorboard"]),
    (r"^CPU=1 MAX_UPDATE=1 .* bash scripts/train\.sh tnn_mlm_tiny data-bin/sample$",
     ["scripts/test_train_sh.py::test_train_retries_a_run_that_saved_no_checkpoint"]),
    (r"^python -m fairseq_tnn\.distributed\.launch --nproc 2 --cpu -- ",
     ["reliability/test_distributed.py::test_two_processes_train_as_one_with_update_freq_2"]),
    (r"^python -m fairseq_tnn\.distributed\.launch --nproc 8 -- ", ["reliability/test_distributed.py::test_dry_run_variants"]),
    (r"^python -m fairseq_tnn\.distributed\.launch --nproc 2 --cpu --dry-run -- ",
     ["reliability/test_distributed.py::test_dry_run_cpu_prints_one_torchrun_command"]),
    (r"^(sbatch (--nodes=2 |--job-name=\w+ )?|DRY_RUN=1 SLURM_\S+ SLURM_\S+ SLURM_\S+ bash )scripts/slurm/train\.sbatch \w+_wt103(_rpe3)?$",
     ["scripts/test_slurm.py::test_sbatch_dry_run_is_train_sh_recipe_under_srun"]),
    (r"^(jid=\$\(sbatch --parsable|REPORT_ONLY=1 sbatch) .*scripts/slurm/extrapolation\.sbatch ",
     ["scripts/test_slurm.py::test_extrapolation_array_dry_run"]),
    (r"^fairseq-hydra-train --config-dir configs/experiments ",
     ["scripts/test_experiment_configs.py::test_hydra_experiment_trains_two_updates_with_the_local_launcher",
      "scripts/test_experiment_configs.py::test_experiment_yaml_equals_train_sh_recipe"]),
    (r"^fairseq-hydra-train --config-dir configs --config-name tnn_lm_sample ",
     ["cli/test_cli.py::test_hydra_train_with_a_config_from_configs"]),
    (r"^python scripts/plot_training\.py ", ["scripts/test_plot_training.py::test_plot_training_on_the_train_log"]),
    (r"^DATA=\S+ bash scripts/eval_extrapolation\.sh ",
     ["scripts/test_eval_extrapolation.py::test_eval_extrapolation_scores_every_token_at_every_length",
      "scripts/test_eval_extrapolation.py::test_eval_extrapolation_dry_run_commands"]),
    (r"^fairseq-eval-lm data-bin/sample ", ["cli/test_cli.py::test_eval_lm_scores_every_token"]),
    (r"^fairseq-validate data-bin/sample ", ["cli/test_cli.py::test_masked_lm_trains_and_validates_at_8x_length"]),
    (r"^python scripts/plot_kernels\.py checkpoints/\S+ ", ["scripts/test_plot_kernels.py::test_checkpoint_figures_and_json"]),
    (r"^python scripts/plot_kernels\.py --init-study ",
     ["scripts/test_plot_kernels.py::test_init_study_reproduces_the_smoothness_and_decay_figures"]),
    (r"^python benchmarks/run\.py (?!--device)", ["scripts/test_benchmarks.py::test_quick_benchmark_writes_json_markdown_and_plots"]),
    (r"^python benchmarks/memory\.py ", ["scripts/test_benchmarks.py::test_memory_accounting_of_every_configuration"]),
    (r"^python benchmarks/ski_diagnostics\.py ", ["scripts/test_quality.py::test_diagnostics_command_writes_its_tables"]),
    (r"^python benchmarks/quality\.py ", ["scripts/test_quality.py::test_quality_quick_trains_every_model_through_fairseq"]),
    (r"^python3? benchmarks/run\.py --device ",
     ["scripts/test_benchmarks.py::test_trainer_benchmark_through_fairseqs_trainer",  # eager
      "scripts/test_gpu_check.py::test_quick_cpu_check_writes_a_complete_report",  # compiled, fp32 and bf16
      "scripts/test_benchmarks.py::test_trainer_benchmark_refuses_cuda_without_a_gpu"]),
    (r"^(PRECISION=bf16|TNN_COMPILE=0|TNN_COMPILE=strict) bash scripts/train\.sh \w+_wt103 data-bin/wikitext-103$",
     ["scripts/test_train_sh.py::test_train_dry_run_precision_and_compile",
      "scripts/test_train_sh.py::test_train_dry_run_compile_mode"]),
    (r"^(PYTHONPATH=\S+ FAIRSEQ_BIN=\S+ PYTHON=python3 )?bash scripts/gpu_check\.sh( --cpu --quick)?$",
     ["scripts/test_gpu_check.py::test_quick_cpu_check_writes_a_complete_report",
      "scripts/test_gpu_check.py::test_refuses_without_a_gpu_unless_cpu"]),
    (r"^(FAIRSEQ_BIN=\S+ )?python3? -m pytest tests/gpu/test_gpu\.py", ["gpu/test_gpu.py::test_fairseq_train_on_gpu"]),
]


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
COVERED_BY_ROWS = [(p, c) for p, c in ALL if str(p) not in RUN_AS_WRITTEN]


def test_the_docs_show_commands():
    assert len(ALL) >= 25 and {str(p) for p, _ in ALL} >= {"README.md", "docs/training.md", "docs/evaluation.md"}


@pytest.mark.parametrize("page,command", ALL, ids=[f"{p}:{c[:40]}" for p, c in ALL])
def test_every_command_is_run_by_a_test(page, command):
    if str(page) in RUN_AS_WRITTEN:
        runner = (ROOT / "tests" / RUN_AS_WRITTEN[str(page)]).read_text()
        assert str(page) in runner or page.name in runner, f"{RUN_AS_WRITTEN[str(page)]} no longer runs {page}"
        return
    rows = [tests for pattern, tests in COVERAGE if re.search(pattern, command)]
    assert rows, f"{page}: no test runs `{command}`; add one and a row to COVERAGE in tests/scripts/test_docs.py"
    for tests in rows:
        for test in tests:
            if test == CI:
                assert (ROOT / ".ci" / "run").read_text().strip().endswith(command)
                continue
            file, name = test.split("::")
            assert re.search(rf"^def {name}\(", (ROOT / "tests" / file).read_text(), re.M), f"{test} is gone"


def test_every_python_example_is_run_by_a_test():
    pages = {str(p.relative_to(ROOT)) for p in DOCS if "```python\n" in p.read_text()}
    assert "README.md" in pages and pages == set(PYTHON_RUN_BY), (pages, PYTHON_RUN_BY)
    for page, runners in PYTHON_RUN_BY.items():
        for runner in runners:
            assert page in (ROOT / "tests" / runner).read_text(), f"{runner} no longer runs the Python of {page}"


def test_every_coverage_row_is_used():
    unused = [pattern for pattern, _ in COVERAGE if not any(re.search(pattern, c) for _, c in COVERED_BY_ROWS)]
    assert not unused, unused


def test_links_between_pages_resolve():
    for page in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            path = (page.parent / target).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)} links to missing {target}"
