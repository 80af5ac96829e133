"""``slurm-train``: scripts/slurm/train.sbatch's body, run inside the SLURM job (fairseq_tnn/commands/train.py)."""
from fairseq_tnn.commands.train import main_slurm as main  # noqa: F401  (the command's main(argv, prog))
