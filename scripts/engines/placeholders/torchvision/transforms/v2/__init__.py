from ..._absent import InterpolationMode, absent
from . import functional

__all__ = ["InterpolationMode", "functional"]
__getattr__ = absent(__name__)
