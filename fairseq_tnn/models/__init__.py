"""The fairseq glue of the models (registered with fairseq on import: see fairseq_tnn/plugin.py)."""
from ..plugin import register

register()
