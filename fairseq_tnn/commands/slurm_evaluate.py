"""``slurm-evaluate``: the body of scripts/slurm/extrapolation.sbatch's array tasks (fairseq_tnn/commands/evaluate.py
documents both commands)."""
from typing import List

from fairseq_tnn.commands.common import run_main
from fairseq_tnn.commands.evaluate import slurm_evaluate


def main(argv: List[str], prog: str) -> int:
    return run_main(prog, lambda: slurm_evaluate(argv, prog))
