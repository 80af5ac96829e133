"""fairseq-tnn: Toeplitz neural networks (TNN, FD-TNN, SKI-TNN) as a fairseq plugin.

Layers, each importing only the ones before it: ``ops`` (tensor functions, torch only), ``modules``
(nn.Modules, torch only), ``models``, ``tasks`` and ``criterions`` (the fairseq glue), ``distributed`` (the
multi-process launcher and its check), ``hub`` (trained models from Python, through fairseq), ``pretrained``
(an exported model with torch alone), ``commands`` (``python -m fairseq_tnn <command>``: what the scripts run).

Use with ``--user-dir /abs/path/to/fairseq_tnn``: fairseq imports this package, then every module of
its ``tasks/`` and ``models/`` folders, whose import registers the models, architectures and tasks and
installs the plugin's fairseq patches (``fairseq_tnn.plugin``). From Python, importing
``fairseq_tnn.models`` or ``fairseq_tnn.tasks``, or calling ``fairseq_tnn.register()``, does the same.
Importing this package, ``fairseq_tnn.ops`` or ``fairseq_tnn.modules`` changes nothing, whether fairseq
was imported before or not (the ops and modules import torch alone). fairseq imports a ``--user-dir``
package only if it is not imported yet: a process that imported any part of this package before fairseq
reads ``--user-dir`` (e.g. ``fairseq_tnn.ops``) calls ``fairseq_tnn.register()`` itself.
"""

__version__ = "0.1.0"


def register() -> None:
    """Register the models, architectures, tasks and criterion with fairseq and install the plugin's fairseq
    patches (idempotent)."""
    from .plugin import register as _register
    _register()
