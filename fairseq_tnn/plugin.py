"""Registration with fairseq: the plugin's models, architectures, tasks and criterion, and its fairseq patches.

``register()`` installs the patches (the table ``PATCHES`` in fairseq_tnn/patches/__init__.py, each checked against
the installed fairseq's code) and imports the fairseq glue, whose
``@register_model`` / ``@register_model_architecture`` / ``@register_task`` decorators fill fairseq's
registries. It runs when anything imports the glue, fairseq_tnn.models or fairseq_tnn.tasks (``--user-dir``:
fairseq imports every module of the plugin's ``tasks/`` and ``models/`` folders), and from
``fairseq_tnn.register()``. Idempotent. Importing the package itself, or its ops and modules layers
(torch alone), never triggers it.
"""
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True  # before the imports below: they call register() again, which must return
    from . import patches
    patches.install()
    from .models import tnn_lm, tnn_mlm  # noqa: F401
    from .tasks import tnn_language_modeling, tnn_masked_lm  # noqa: F401
    from .criterions import cross_entropy, masked_lm  # noqa: F401
