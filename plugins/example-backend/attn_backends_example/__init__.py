"""An example attn-backends plugin: copy this package to ship your own backend.

`backend.py` holds the backend (declarations plus a thin kernel call); `plugin.py` holds the hook
that the ``attn_backends`` entry point in ``pyproject.toml`` names.
"""

from __future__ import annotations

from .backend import MatmulSoftmaxBackend

__all__ = ["MatmulSoftmaxBackend"]
