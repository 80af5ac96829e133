"""``np.compat.long``, which numpy 2 removed, for the one fairseq module that still uses it
(``fairseq.data.token_block_dataset``; the ``numpy2-compat-long`` row of the table in ``__init__``)."""
import types

import numpy


class _NumpyWithCompatLong(types.ModuleType):
    """numpy, as seen by one fairseq module, with the ``np.compat.long`` alias numpy 2 removed (what the
    alias meant on the 64-bit platforms fairseq supports)."""

    compat = types.SimpleNamespace(long=numpy.int64)

    def __getattr__(self, name):
        return getattr(numpy, name)


NUMPY_FOR_TOKEN_BLOCK = _NumpyWithCompatLong("numpy")


def needed() -> bool:
    return not hasattr(numpy, "compat")
