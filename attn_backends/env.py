"""The environment variables attn-backends reads, by name.

``ATTN_BACKEND`` chooses a backend by name; ``ATTN_BACKENDS_STRICT`` runs the canary on every
selection; ``ATTN_BACKENDS_PLUGINS`` and ``ATTN_BACKENDS_DISABLE`` are the plugin allow and
block lists; ``ATTN_BACKENDS_PLUGIN_TIMEOUT`` bounds each step of loading one plugin.
"""

from __future__ import annotations

from ._select._isolation import PLUGIN_TIMEOUT_ENV
from ._select._policy import DISABLE_ENV, PLUGINS_ENV
from ._select._selector import BACKEND_ENV, STRICT_ENV

__all__ = ["BACKEND_ENV", "DISABLE_ENV", "PLUGINS_ENV", "PLUGIN_TIMEOUT_ENV", "STRICT_ENV"]
