"""The fairseq glue of the tasks (registered with fairseq on import: see fairseq_tnn/plugin.py)."""
from ..plugin import register

register()
