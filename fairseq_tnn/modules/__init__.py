from .layers import Glu, Gtu, TnnLayer
from .norm import SimpleRMSNorm, build_norm
from .rpe import Rpe
from .tno import TNO_FIELDS, FdTno, SkiTno, TnnTno, build_tno

__all__ = ["Glu", "Gtu", "TnnLayer", "SimpleRMSNorm", "build_norm", "Rpe", "TNO_FIELDS", "FdTno", "SkiTno", "TnnTno", "build_tno"]
