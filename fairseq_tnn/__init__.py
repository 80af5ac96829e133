"""fairseq-tnn: Toeplitz neural networks (TNN, FD-TNN, SKI-TNN) as a fairseq plugin.

Layers, each importing only the ones before it: ``ops`` (tensor functions, torch only), ``modules``
(nn.Modules, torch only), ``models`` and ``tasks`` (the fairseq glue), ``distributed`` (the
multi-process launcher and its check), ``hub`` (trained models from Python).

Use with ``--user-dir /abs/path/to/fairseq_tnn``: fairseq imports this package after itself, and
the models, architectures and tasks are then registered (``fairseq_tnn.plugin``). From Python,
importing ``fairseq_tnn.models`` or ``fairseq_tnn.tasks``, or calling ``fairseq_tnn.register()``,
does the same; ``import fairseq_tnn.ops.toeplitz`` (or ``.modules``) does not import fairseq.
"""
import sys

__version__ = "0.1.0"


def register() -> None:
    """Register the models, architectures and tasks with fairseq and install the plugin's fairseq
    patches (idempotent)."""
    from .plugin import register as _register
    _register()


if "fairseq" in sys.modules:  # loaded by fairseq (--user-dir), or after the caller imported fairseq
    register()
