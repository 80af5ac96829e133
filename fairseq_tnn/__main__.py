"""``python -m fairseq_tnn <command> ...``: the project's commands (fairseq_tnn/commands)."""
import sys

from fairseq_tnn.commands import main

sys.exit(main())
