"""What the placeholder hands out for any name: a class that refuses to be used."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, NoReturn


class InterpolationMode(enum.Enum):
    """The one torchvision value modules read at import time (as a default argument)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def absent(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__``: every name is a class whose use raises."""

    def lookup(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        class Absent:
            def __init__(self, *args: object, **kwargs: object) -> None:
                _refuse(f"{module}.{name}")

            def __class_getitem__(cls, item: object) -> type:
                return cls

        Absent.__name__ = Absent.__qualname__ = name
        return Absent

    return lookup


def _refuse(what: str) -> NoReturn:
    raise RuntimeError(
        f"{what} is a placeholder: this CPU test environment has no torchvision "
        "(scripts/engines/placeholders says why)"
    )
