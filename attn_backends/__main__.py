"""``python -m attn_backends``: the ``attn-backends`` command, where its script is not on PATH."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
