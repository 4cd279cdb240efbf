"""The shipped conformance suite, bound to ``flex`` on this machine's device (fp32 and the
16-bit dtypes it declares, every window, soft-cap and ALiBi case its capabilities generate)."""

from __future__ import annotations

from attn_backends_builtin import flex

from attn_backends import get_registry
from attn_backends.testing import NoCachePrefillConformance

if get_registry().get(flex.FlexBackend.name) is None:
    # An install from an older checkout lacks the entry point; register the module as it would.
    get_registry().register_plugin(flex, name="flex")


class TestFlexConformance(NoCachePrefillConformance):
    backend_names = ("flex",)
