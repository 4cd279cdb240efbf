"""The whole truth table of the RoPE/KV-cache flag rule."""

from __future__ import annotations

import logging

import pytest
import torch

import attn_backends as ab
import attn_backends.errors
from attn_backends._select._flags import derive_need_rope_kv_cache

PLAIN = ab.AttentionSpec(4, 4, 64, torch.float32, causal=False)
ROPE = ab.AttentionSpec(4, 4, 64, torch.float32, causal=True, rope=ab.RopeSpec(1e4))
LOGN = ab.AttentionSpec(4, 4, 64, torch.float32, causal=True, use_logn_attn=True, logn_base=8)
MLA = ab.AttentionSpec(4, 4, 64, torch.float32, causal=True, use_mla=True)
ERR = ab.errors.KVCacheFlagError

# (spec, has_kv_cache, explicit) -> expected bool, or the error raised
TABLE = [
    (PLAIN, True, None, True),
    (PLAIN, True, True, True),
    (PLAIN, True, False, ERR),
    (ROPE, True, None, True),
    (ROPE, True, True, True),
    (ROPE, True, False, ERR),
    (PLAIN, False, None, False),
    (PLAIN, False, True, True),
    (PLAIN, False, False, False),
    (ROPE, False, None, True),
    (ROPE, False, True, True),
    (ROPE, False, False, ERR),
    (LOGN, False, None, True),
    (LOGN, False, True, True),
    (LOGN, False, False, ERR),
    (MLA, False, None, True),
    (MLA, False, True, True),
    (MLA, False, False, False),
    (LOGN, True, False, ERR),
    (MLA, True, None, True),
]


@pytest.mark.parametrize(("spec", "cache", "explicit", "expected"), TABLE)
def test_truth_table(spec, cache, explicit, expected):
    if expected is ERR:
        with pytest.raises(ERR) as info:
            derive_need_rope_kv_cache(spec, cache, explicit)
        assert "need_rope_kv_cache=False" in str(info.value)
    else:
        assert derive_need_rope_kv_cache(spec, cache, explicit) is expected


def test_explicit_true_without_work_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="attn_backends"):
        assert derive_need_rope_kv_cache(PLAIN, False, True) is True
    assert "kept as given" in caplog.text


def test_select_fails_fast_on_cache_with_flag_off():
    with pytest.raises(ERR, match="cache that nobody writes"):
        ab.select(ROPE, platform="cpu", has_kv_cache=True, need_rope_kv_cache=False)


def test_select_refuses_every_backend_with_cache():
    with pytest.raises(ab.NoBackendError, match="no-KV-cache prefill only") as info:
        ab.select(ROPE, platform="cpu", has_kv_cache=True)
    codes = {r.code for _, reasons in info.value.reasons for r in reasons}
    assert ab.ReasonCode.KV_CACHE_PRESENT in codes
    assert all(
        ab.ReasonCode.KV_CACHE_PRESENT in {r.code for r in reasons}
        for _, reasons in info.value.reasons
    )


def test_select_records_flag_source():
    sel = ab.select(ROPE, platform="cpu")
    assert sel.need_rope_kv_cache is True and sel.flag_given is None
    assert sel.to_dict()["need_rope_kv_cache"] is True
    sel = ab.select(PLAIN, platform="cpu", need_rope_kv_cache=True)
    assert sel.flag_given is True
