"""`bash scripts/test.sh --fast`: the ops, modules and models layers without the tests marked slow, other
arguments passed on to pytest (here --collect-only, so that nothing runs)."""
import re
import sys

import pytest

from helpers import ROOT, command_env, execute, run

LAYERS = ["tests/ops", "tests/modules", "tests/models"]


def collected(out):
    """The test ids of a `pytest --collect-only -q` output, and its deselected count."""
    ids = [line for line in out.splitlines() if re.match(r"tests/\w+/test_\w+\.py::", line)]
    m = re.search(r"(\d+) deselected", out)
    return ids, int(m.group(1)) if m else 0


@pytest.mark.slow  # two collections of the three layers, each importing torch and fairseq
@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").exists(), reason="scripts/test.sh runs .venv's pytest")
def test_fast_lane_selects_three_layers_without_slow_tests():
    fast, deselected = collected(run(["bash", ROOT / "scripts/test.sh", "--fast", "--collect-only", "-q"]))
    assert {i.split("/")[1] for i in fast} == {"ops", "modules", "models"}, fast[:5]
    code, out, _ = execute([sys.executable, "-m", "pytest", *LAYERS, "-m", "slow", "--collect-only", "-q"],
                           command_env(), 600, merge=True)
    assert code in (0, 5), out[-3000:]  # 5: no test collected, none of them slow
    slow, _ = collected(out)
    # the slow tests of those layers, and only they, are left out
    assert not set(fast) & set(slow) and deselected == len(slow)
    assert len(fast) > 300
