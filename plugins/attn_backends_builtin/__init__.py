"""Backends shipped with attn-backends, each registered through the ``attn_backends``
entry-point group exactly as a third-party plugin would be."""
