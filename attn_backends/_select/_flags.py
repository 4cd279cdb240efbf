"""The RoPE/KV-cache flag rule, in one function, so no model or backend re-derives it.

Upstream engines used one flag, ``need_rope_kv_cache``, for two things: "apply RoPE" and "write
the KV cache". Turning it off to skip a cache write also skipped RoPE and logn; leaving a cache
present with the flag off made attention read a cache nobody wrote. This rule refuses both.
"""

from __future__ import annotations

import logging

from .._values._errors import KVCacheFlagError
from .._values._spec import AttentionSpec

logger = logging.getLogger("attn_backends")


def _position_work(spec: AttentionSpec) -> list[str]:
    work = []
    if spec.rope is not None:
        work.append("RoPE")
    if spec.use_logn_attn:
        work.append("logn scaling")
    if spec.use_mla:
        work.append("MLA")
    return work


def derive_need_rope_kv_cache(
    spec: AttentionSpec, has_kv_cache: bool, explicit: bool | None = None
) -> bool:
    """Resolve the flag, or raise `KVCacheFlagError` when it contradicts the model.

    With a KV cache, the flag must be on (an explicit ``False`` would leave the cache unwritten).
    Without one, the derived value is on exactly when the model has RoPE, logn or MLA; an
    explicit ``True`` is kept, an explicit ``False`` that would skip RoPE or logn is refused.
    """
    if has_kv_cache:
        if explicit is False:
            raise KVCacheFlagError(
                "a KV cache is present but need_rope_kv_cache=False: attention would read a "
                "cache that nobody writes. Leave the flag unset (or True) when a cache exists."
            )
        return True
    work = _position_work(spec)
    if explicit is None:
        return bool(work)
    if explicit:
        if not work:
            logger.info(
                "need_rope_kv_cache=True kept as given, though the spec has no RoPE, logn or "
                "MLA and no KV cache: nothing extra will run"
            )
        return True
    if spec.rope is not None or spec.use_logn_attn:
        raise KVCacheFlagError(
            f"need_rope_kv_cache=False would skip {' and '.join(w for w in work if w != 'MLA')} "
            "on a model that needs it. Leave the flag unset: without a KV cache the no-cache "
            "path applies RoPE/logn itself and writes no cache."
        )
    return False
