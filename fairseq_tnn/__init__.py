"""fairseq-tnn: Toeplitz neural networks (TNN, FD-TNN, SKI-TNN) as a fairseq plugin.

Use with ``--user-dir /abs/path/to/fairseq_tnn``; importing this package
registers the models, architectures and tasks.
"""
from . import compat  # noqa: F401  (torch >= 2.6 checkpoint loading, see compat.py)
from . import checkpoints, models, tasks  # noqa: F401  (registration and loading side effects)
from .models import tnn_lm, tnn_mlm  # noqa: F401
from .tasks import tnn_language_modeling, tnn_masked_lm  # noqa: F401

__version__ = "0.1.0"
