"""nn.Modules built from the ops: the RPE, the TNOs, the GTU, the GLU and the TNN layer. Imports torch only."""
from .layers import Glu, Gtu, MaskedLMHead, TnnLayer
from .norm import SimpleRMSNorm, build_norm
from .rpe import Rpe
from .tno import TNO_TYPES, FdTno, SkiTno, SpectralTno, TnnTno, Tno, build_tno

__all__ = ["Glu", "Gtu", "TnnLayer", "MaskedLMHead", "SimpleRMSNorm", "build_norm", "Rpe", "TNO_TYPES", "FdTno", "SkiTno",
           "SpectralTno", "TnnTno", "Tno", "build_tno"]
