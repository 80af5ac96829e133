"""Toeplitz neural operators (TNOs): (batch, n, d) -> (batch, n, d), one Toeplitz matrix per channel.

Every TNO type has the same interface (``base.Tno``) and is built by ``build_tno`` from its
``--tno-type`` name, so a layer never needs to know which one it holds:

- ``tnn`` (tnn.py): Qin et al.'s TNO, an RPE MLP of the integer lag times a decay lambda^|t|.
- ``fd`` (fd.py): the SKI paper's FD-TNO, an RPE MLP of the frequency (section 3.3); causal
  through the discrete Hilbert transform, bidirectional through a complex response.
- ``ski`` (ski.py): the SKI paper's SKI-TNO (section 3.2): m-tap depthwise convolution plus the
  asymmetric SKI low-rank part W A W^T with an inverse time warp; bidirectional only.

A new type is one module beside these (a ``Tno`` subclass decorated with ``@register_tno``, with
its ``Settings`` dataclass) and its name in the import line below: the model config makes its
``--tno-type`` choice and its options from the registered types (fairseq_tnn/models/config.py).
"""
from . import tnn, fd, ski  # noqa: F401,I001  (the registered TNO types, in this order: each module registers its class)
from .base import TNO_TYPES, SpectralTno, Tno, TnoSettings, build_tno, register_tno, tno_class, tno_settings
from .fd import FdTno
from .ski import SkiTno
from .tnn import TnnTno

__all__ = ["TNO_TYPES", "SpectralTno", "Tno", "TnoSettings", "build_tno", "register_tno", "tno_class", "tno_settings",
           "FdTno", "SkiTno", "TnnTno"]
