"""What every user-facing script (scripts/*.sh, scripts/slurm/*, scripts/*.py) shares: bash syntax and
strict mode, scripts/lib.sh's helpers sourced rather than copied, --help on the Python scripts, and a usage
message with exit status 2 on wrong arguments."""
import re
import shlex
import sys

import pytest

from helpers import ROOT, SCRIPTS, SLURM, ok, sh

LIBRARIES = [SCRIPTS / "lib.sh"]  # sourced, not run
BASH_SCRIPTS = [SCRIPTS / "train.sh", SCRIPTS / "prepare-wikitext-103.sh", SCRIPTS / "eval_extrapolation.sh",
                *LIBRARIES, *sorted(SLURM.glob("*.sbatch")), SLURM / "local_cluster.sh", SCRIPTS / "demo.sh",
                SCRIPTS / "preprocess.sh", SCRIPTS / "prepare-corpus.sh", SCRIPTS / "setup.sh", SCRIPTS / "test.sh",
                SCRIPTS / "make_sample_data.sh",
                SCRIPTS / "gpu_check.sh"]
PY_SCRIPTS = [SCRIPTS / "plot_training.py", SCRIPTS / "gpt2_bpe_encode.py",
              SCRIPTS / "plot_kernels.py", SCRIPTS / "make_experiment_configs.py"]
# the venv that runs pytest has the fairseq CLIs; keep SLURM variables of a real job out of the dry runs


@pytest.mark.parametrize("script", BASH_SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax_and_strict_mode(script):
    ok(["bash", "-n", script])
    text = script.read_text()
    if script not in LIBRARIES:
        assert "set -euo pipefail" in text


def test_every_script_uses_the_shared_helpers():
    """scripts/lib.sh holds die, say, usage_error, quote_cmd, is_pos_int and hand_over; every script that uses one
    sources it and none defines its own copy."""
    scripts = sorted({*SCRIPTS.glob("*.sh"), *SLURM.glob("*.sh"), *SLURM.glob("*.sbatch")})
    assert set(scripts) == set(BASH_SCRIPTS)  # a new script is checked here too
    users = []
    for script in scripts:
        if script.name == "lib.sh":
            continue
        text = script.read_text()
        if re.search(r"\b(die|say|usage_error|quote_cmd|is_pos_int|hand_over)\b", text):
            users.append(script.name)
            assert re.search(r'^\s*source "\$ROOT/scripts/lib\.sh"', text, re.M), f"{script.name} does not source lib.sh"
        own = re.findall(r"^\s*(\w*die|say|quote_cmd|usage_error|is_pos_int)\s*\(\)", text, re.M)
        assert not own, f"{script.name} defines {own}; use scripts/lib.sh's"
    assert set(users) == {s.name for s in scripts} - {"lib.sh", "test.sh"}, users  # test.sh: two lines, no errors


def test_die_names_the_calling_script_and_takes_an_exit_code(tmp_path):
    script = tmp_path / "caller.sh"
    script.write_text(f'set -euo pipefail\nROOT={shlex.quote(str(ROOT))}\nsource "$ROOT/scripts/lib.sh"\n'
                      'quote_cmd a "b c" "it\'s"\n[[ "${1:-}" == 3 ]] && die "three" 3\ndie "plain"\n')
    rc, out, err = sh(["bash", script])
    assert (rc, out, err) == (1, "a 'b c' 'it'\\''s'\n", "caller.sh: error: plain\n")
    assert shlex.split(out) == ["a", "b c", "it's"]
    rc, _, err = sh(["bash", script, "3"], {"PROG": "named"})
    assert (rc, err) == (3, "named: error: three\n")


@pytest.mark.parametrize("script", PY_SCRIPTS, ids=lambda p: p.name)
def test_python_scripts_compile_and_have_help(script):
    out, _ = ok([sys.executable, script, "--help"])
    assert "usage:" in out


@pytest.mark.parametrize("cmd", [
    ["train.sh"], ["train.sh", "tnn_lm_tiny"], ["train.sh", "no_such_preset", "data-bin"],
    ["eval_extrapolation.sh"], ["prepare-wikitext-103.sh", "a", "b"], ["prepare-wikitext-103.sh", "--dest"],
    ["preprocess.sh"], ["preprocess.sh", "data/sample"], ["preprocess.sh", "/no/such/dir", "/tmp/x"],
    ["demo.sh", "--fast"], ["setup.sh", "x"], ["make_sample_data.sh", "x"], ["slurm/local_cluster.sh"],
    ["slurm/local_cluster.sh", "restart"], ["prepare-corpus.sh"], ["prepare-corpus.sh", "a", "b", "c"],
    ["prepare-corpus.sh", "-x"],
], ids=lambda c: " ".join(c) or "none")
def test_wrong_arguments_print_usage_and_fail(cmd):
    rc, out, err = sh(["bash", SCRIPTS / cmd[0], *cmd[1:]])
    assert rc == 2, (rc, out, err)
    assert "usage: bash scripts/" + cmd[0] in err
    assert out == ""


@pytest.mark.parametrize("script,knobs", [
    ("prepare-corpus.sh", ["BPE [sentencepiece]", "VOCAB_SIZE [0]", "TOKENS_PER_SAMPLE [512]", "FORCE [0]"]),
    ("preprocess.sh", ["FORCE [0]", "WORKERS [0]", "SRCDICT "]),
    ("prepare-wikitext-103.sh", ["RAW_DIR [", "CONNECT_TIMEOUT [10]", "DRY_RUN [0]"]),
    ("make_sample_data.sh", ["KJV_VERSION [4.38]", "TRAIN_BOOKS [Ge Psa John Rom]", "VOCAB_SIZE [2000]"]),
])
def test_a_handing_over_script_names_its_command_whose_help_lists_the_knobs(script, knobs):
    """The script's header names `python -m fairseq_tnn <command> --help`; that and the script's --help print
    the usage and every knob with its default (fairseq_tnn/commands)."""
    command = re.search(r"python -m fairseq_tnn ([\w-]+) --help", (SCRIPTS / script).read_text()).group(1)
    for argv in (["bash", SCRIPTS / script, "--help"], [sys.executable, "-m", "fairseq_tnn", command, "--help"]):
        out, _ = ok(argv)
        assert "usage: " in out and "knobs are environment variables" in out, out
        for knob in knobs:
            assert f"\n  {knob}" in out, (knob, out)
