"""The plugin hook. The ``attn_backends`` entry point in ``pyproject.toml`` names this module;
attn-backends imports it, calls the hook once and records the result (``attn-backends list``)."""

from __future__ import annotations

from attn_backends.plugin import PluginManifest, hookimpl

from .backend import MatmulSoftmaxBackend

API_VERSION = "2.0"
"""The plugin API this package was written against; a host with another major version refuses
it with a reason naming both versions."""


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(api_version=API_VERSION, backends=[MatmulSoftmaxBackend])
