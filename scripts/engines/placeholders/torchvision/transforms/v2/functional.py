from ..._absent import InterpolationMode, absent

__all__ = ["InterpolationMode"]
__getattr__ = absent(__name__)
