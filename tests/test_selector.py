"""Selection: the ranking table and plugin ranks, explicit and environment choices honoured
or refused with reasons, every candidate on record, caching, dry runs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from attn_backends_builtin import torch_sdpa

import attn_backends as ab
import attn_backends.deploy
import attn_backends.errors
import attn_backends.plugin as abp
from attn_backends._select import _selector
from attn_backends._select._ranking import Row
from tests.static_plugin import StaticPlugin

SPEC = ab.AttentionSpec(8, 2, 64, torch.bfloat16, causal=True, rope=ab.RopeSpec(1e6))


def make_backend(name, *, platforms=("cpu",), dtypes=(torch.bfloat16,), **caps):
    class _Backend(abp.PrefillBackend):
        capabilities = abp.Capabilities(
            platforms=frozenset(platforms), dtypes=frozenset(dtypes), **caps
        )

        def plan_kernel(self, spec, params, *, fused_rope):
            return None

        def attend(self, views, plan):
            return torch.zeros(views.q.shape, dtype=plan.spec.output_dtype)

    _Backend.name = name
    return _Backend


@pytest.fixture
def registry():
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    reg.register_plugin(
        StaticPlugin(
            make_backend("fast", head_dims=frozenset({64})),
            make_backend("slow"),
            make_backend("gpu-only", platforms=("cuda",), min_sm=80, requires=("flashinfer",)),
            make_backend("unranked"),
            placements=[
                abp.Placement("fast", before="torch-sdpa", platform="cpu", note="measured"),
                abp.Placement("slow", after="torch-sdpa"),
                abp.Placement("gpu-only", before="torch-sdpa", platform="cuda"),
            ],
        ),
        name="test-plugin",
    )
    return reg


def test_plugin_ranks_place_backends_next_to_a_named_one(registry):
    sel = ab.select(SPEC, platform=ab.detect_platform("cpu"), registry=registry)
    assert sel.name == "fast" and sel.source == "ranking"
    verdicts = {c.name: c.verdict for c in sel.candidates}
    assert verdicts == {
        "fast": "selected",
        "torch-sdpa": "eligible",
        "slow": "eligible",
        "unranked": "not ranked",
        "gpu-only": "rejected",
    }
    ranks = {c.name: c.place for c in sel.candidates}
    assert (ranks["fast"], ranks["torch-sdpa"], ranks["slow"]) == (1, 2, 3)
    gpu = next(c for c in sel.candidates if c.name == "gpu-only")
    assert {r.code for r in gpu.reasons} == {ab.ReasonCode.PLATFORM, ab.ReasonCode.LIBRARY_MISSING}
    text = sel.explain()
    assert "selected: fast (by ranking)" in text
    assert "decided by: plugin placement: fast before torch-sdpa on cpu (measured)" in text
    assert "placed by row " in text and "torch-sdpa on cpu" in text
    assert "does not run on cpu" in text


def test_a_refused_backend_passes_the_turn_down_the_line(registry):
    d128 = ab.AttentionSpec(8, 2, 128, torch.bfloat16, causal=True)
    sel = ab.select(d128, platform="cpu", registry=registry)
    assert sel.name == "torch-sdpa"
    fast = next(c for c in sel.candidates if c.name == "fast")
    assert [r.code for r in fast.reasons] == [ab.ReasonCode.HEAD_DIM]
    assert fast.reasons[0].got == "128" and fast.reasons[0].allowed == "64"
    fp16 = ab.AttentionSpec(8, 2, 64, torch.float16, causal=True)
    reg = ab.deploy.Registry()
    reg.register_plugin(
        StaticPlugin(make_backend("fp16-only", dtypes=(torch.float16,)), first_on="cpu"),
        name="p",
    )
    unplaced = ab.select(fp16, platform="cpu", registry=reg, backend="fp16-only")
    (why,) = next(c for c in unplaced.candidates if c.name == "fp16-only").reasons or (None,)
    assert why is None, "chosen by name: no reason recorded against the winner"
    with pytest.raises(ab.NoBackendError, match="placed next to torch-sdpa, which is not in line"):
        ab.select(fp16, platform="cpu", registry=reg)


def test_a_plugin_rank_never_reaches_where_its_anchor_is_not_in_line(registry):
    """``gpu-only`` placed before torch-sdpa on CUDA is not considered on ROCm, and a rank
    before a backend no row places for the request gives no place at all."""
    sel = ab.select(SPEC, platform="rocm:gfx942", registry=registry)
    gpu = next(c for c in sel.candidates if c.name == "gpu-only")
    assert gpu.place is None
    reg = ab.deploy.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    reg.register_plugin(
        StaticPlugin(
            make_backend("eager"), placements=[abp.Placement("eager", before="flashinfer")]
        ),
        name="vendor",
    )
    sel = ab.select(SPEC, platform="cpu", registry=reg)
    assert sel.name == "torch-sdpa"
    eager = next(c for c in sel.candidates if c.name == "eager")
    assert eager.verdict == "not ranked"
    assert "placed next to flashinfer, which is not in line" in eager.reasons[0].message


def test_dry_run_platform_assumes_libraries(registry):
    sel = ab.select(SPEC, platform="cuda:sm90", registry=registry)
    assert sel.name == "gpu-only" and sel.platform.assumed
    assert "dry run" in sel.explain()
    assert "(assumed installed: flashinfer)" in sel.explain()
    gpu = next(c for c in sel.candidates if c.name == "gpu-only")
    assert gpu.to_dict()["assumed_libraries"] == ["flashinfer"]
    real = ab.select(SPEC, platform=ab.detect_platform("cpu"), registry=registry)
    assert all(not c.assumed_libraries for c in real.candidates)
    old = ab.select(SPEC, platform="cuda:sm75", registry=registry)
    assert old.name == "torch-sdpa"
    (arch,) = next(c for c in old.candidates if c.name == "gpu-only").reasons
    assert arch.code == ab.ReasonCode.ARCH and (arch.got, arch.allowed) == ("sm75", "sm80 or newer")


def test_explicit_choice_is_honoured_or_refused_never_swapped(registry):
    sel = ab.select(SPEC, platform="cpu", registry=registry, backend="unranked")
    assert sel.name == "unranked" and sel.source == "explicit"
    with pytest.raises(ab.NoBackendError, match="not swapped") as info:
        ab.select(SPEC, platform="cpu", registry=registry, backend="gpu-only")
    assert info.value.reasons[0][0] == "gpu-only"
    with pytest.raises(
        ab.NoBackendError, match="known backends: torch-sdpa, fast, slow, gpu-only, unranked"
    ):
        ab.select(SPEC, platform="cpu", registry=registry, backend="nope")


def test_environment_choice(registry, monkeypatch):
    monkeypatch.setenv("ATTN_BACKEND", "slow")
    sel = ab.select(SPEC, platform="cpu", registry=registry)
    assert sel.name == "slow" and sel.source == "environment"
    monkeypatch.setenv("ATTN_BACKEND", "gpu-only")
    with pytest.raises(ab.NoBackendError, match="environment"):
        ab.select(SPEC, platform="cpu", registry=registry)
    monkeypatch.setenv("ATTN_BACKEND", "typo")
    with pytest.raises(ab.NoBackendError, match=r"\$ATTN_BACKEND='typo'"):
        ab.select(SPEC, platform="cpu", registry=registry)
    assert ab.select(SPEC, platform="cpu", registry=registry, backend="fast").name == "fast"


def test_nothing_fits_lists_every_candidate(registry, monkeypatch):
    monkeypatch.setenv("ATTN_BACKENDS_DISABLE", "torch-sdpa")
    fp16 = ab.AttentionSpec(8, 2, 64, torch.float16, causal=True)
    with pytest.raises(ab.NoBackendError) as info:
        ab.select(fp16, platform="cpu", registry=registry)
    message = str(info.value)
    for name in ("torch-sdpa", "fast", "slow", "gpu-only", "unranked"):
        assert f"  - {name}: " in message
    assert len(info.value.reasons) == 5


def test_decisions_are_cached_per_key(registry):
    a = ab.select(SPEC, platform="cpu", registry=registry)
    assert ab.select(SPEC, platform="cpu", registry=registry) is a
    assert ab.select(SPEC, platform="cpu", registry=registry, backend="slow") is not a
    registry.register_plugin(StaticPlugin(make_backend("late")), name="late-plugin")
    b = ab.select(SPEC, platform="cpu", registry=registry)
    assert b is not a and b.name == a.name


def test_record_is_json_and_complete(registry):
    sel = ab.select(SPEC, platform="cpu", registry=registry)
    record = json.loads(json.dumps(sel.to_dict()))
    assert record["selected"] == "fast"
    assert record["spec"]["rope"] == {"theta": 1e6, "rotary_dim": 64, "interleaved": False}
    assert record["platform"]["kind"] == "cpu"
    names = {c["name"] for c in record["candidates"]}
    assert names == {"torch-sdpa", "fast", "slow", "gpu-only", "unranked"}
    fast = next(c for c in record["candidates"] if c["name"] == "fast")
    assert fast["place"] == 1 and fast["placed_by"].startswith("plugin placement: fast before")
    assert record["details"]["preprocess"] in {"torch", "native", "flashinfer"}
    assert record["plugins"][0]["status"] == "loaded"


def test_bound_backend_is_a_no_cache_prefill(registry):
    sel = ab.select(SPEC, platform="cpu", registry=registry)
    assert isinstance(sel.backend, ab.NoCachePrefill)
    assert sel.backend.spec is SPEC


def test_default_registry_has_the_reference_backend():
    sel = ab.select(SPEC, device="cpu")
    assert sel.name == "torch-sdpa"
    assert sel.platform.kind == "cpu" and not sel.platform.assumed


@pytest.mark.parametrize(
    ("text", "kind", "arch"),
    [
        ("cpu", "cpu", None),
        ("cuda:sm90", "cuda", "sm90"),
        ("CUDA:sm_80", "cuda", "sm80"),
        ("rocm:gfx942", "rocm", "gfx942"),
        ("cuda:sm90a", "cuda", "sm90a"),
    ],
)
def test_parse_platform(text, kind, arch):
    p = ab.parse_platform(text)
    assert (p.kind, p.arch, p.assumed) == (kind, arch, True)


@pytest.mark.parametrize("text", ["gpu", "cuda", "cuda:90", "rocm:mi300", "cpu:x86", ""])
def test_parse_platform_rejects(text):
    with pytest.raises(ab.errors.PlatformError, match=r"use|needs|must|takes"):
        ab.parse_platform(text)


def test_select_rejects_non_spec():
    with pytest.raises(ab.SpecError, match="takes an AttentionSpec"):
        ab.select({"num_heads": 8})  # type: ignore[arg-type]


def test_fusion_limit_is_per_batch_and_validated():
    rope = ab.AttentionSpec(8, 2, 64, torch.float16, True, rope=ab.RopeSpec(1e4))
    caps = abp.Capabilities(
        platforms=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16}),
        fused_rope=True,
        fused_rope_max_seqlen=128,
    )
    assert caps.fuses_rope(rope, 128) and not caps.fuses_rope(rope, 129)
    interleaved = dataclasses.replace(rope, rope=ab.RopeSpec(1e4, interleaved=True))
    assert not caps.fuses_rope(interleaved, 1), "a RoPE the kernel does not compute is never fused"
    unlimited = dataclasses.replace(caps, fused_rope_max_seqlen=None)
    assert unlimited.fuses_rope(rope, 1 << 20)
    assert caps.to_dict()["fused_rope_max_seqlen"] == 128
    for bad in ({"fused_rope_max_seqlen": 0}, {"fused_rope": False}):
        with pytest.raises(ValueError, match="fused_rope_max_seqlen"):
            dataclasses.replace(caps, **bad)


def test_ranking_rows_can_hold_on_fusable_rope():
    row = Row("x", "cuda", "why", rope_fusable=True)
    cuda = ab.Platform(kind="cuda", arch="sm90")
    fusable = ab.AttentionSpec(8, 2, 64, torch.float16, True, rope=ab.RopeSpec(1e4))
    assert row.holds(fusable, cuda)
    assert not row.holds(dataclasses.replace(fusable, rope=None), cuda)
    assert not row.holds(dataclasses.replace(fusable, use_logn_attn=True, logn_base=8), cuda)
    assert "fusable RoPE" in row.condition()


def test_ranking_rows_can_hold_on_windows_and_alibi():
    masked = Row("x", "cuda", "why", masked=True)
    plain = Row("x", "cuda", "why", masked=False)
    cuda = ab.Platform(kind="cuda", arch="sm90")
    spec = ab.AttentionSpec(8, 2, 64, torch.float16, False)
    for feature in ({"window": ab.SlidingWindow(4, 4)}, {"alibi": ab.AlibiSpec()}):
        featured = dataclasses.replace(spec, **feature)
        assert masked.holds(featured, cuda) and not plain.holds(featured, cuda)
    capped = dataclasses.replace(spec, logit_softcap=30.0)
    assert plain.holds(capped, cuda) and not masked.holds(capped, cuda), (
        "a soft-cap neither restricts nor biases by position"
    )
    assert "window or ALiBi" in masked.condition()
    assert "no window, no ALiBi" in plain.condition()


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("has_kv_cache", "False"),
        ("has_kv_cache", None),
        ("has_kv_cache", 0),
        ("strict", "false"),
        ("strict", 1),
        ("cuda_graph", 1),
        ("cuda_graph", "no"),
        ("need_rope_kv_cache", "yes"),
        ("need_rope_kv_cache", 0),
    ],
)
def test_flags_must_be_real_bools(registry, flag, value):
    with pytest.raises(
        ab.errors.InvalidArgumentError, match=rf"select\({flag}=\.\.\.\) takes True"
    ) as info:
        ab.select(SPEC, platform="cpu", registry=registry, **{flag: value})
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, ab.AttentionBackendError)


def test_none_is_accepted_where_the_signature_allows_it(registry):
    sel = ab.select(SPEC, platform="cpu", registry=registry, strict=None, need_rope_kv_cache=None)
    assert sel.name == "fast"
    assert not sel.strict


def test_registry_argument_must_be_a_registry():
    with pytest.raises(ab.errors.InvalidArgumentError, match="takes a Registry or None, got dict"):
        ab.select(SPEC, platform="cpu", registry={})  # type: ignore[arg-type]


def test_selection_cache_is_a_bounded_lru(registry, monkeypatch):
    assert _selector.SELECTION_CACHE_SIZE == 256
    monkeypatch.setattr(_selector, "SELECTION_CACHE_SIZE", 4)
    ab.deploy.clear_selection_cache()
    specs = [ab.AttentionSpec(8, 2, d, torch.bfloat16, causal=True) for d in (16, 32, 48, 64, 80)]
    first = [ab.select(s, platform="cpu", registry=registry) for s in specs[:4]]
    assert ab.select(specs[0], platform="cpu", registry=registry) is first[0]  # now most recent
    ab.select(specs[4], platform="cpu", registry=registry)  # drops the least recent: specs[1]
    assert len(_selector._cache) == 4
    assert ab.select(specs[0], platform="cpu", registry=registry) is first[0]
    assert ab.select(specs[2], platform="cpu", registry=registry) is first[2]
    again = ab.select(specs[1], platform="cpu", registry=registry)
    assert again is not first[1]
    assert again.fingerprint() == first[1].fingerprint()
    assert len(_selector._cache) == 4


def test_fingerprint_normalises_equal_values():
    one = ab.select(
        ab.AttentionSpec(4, 2, 64, torch.float32, causal=True, rope=ab.RopeSpec(10000)),
        platform="cpu",
    )
    other = ab.select(
        ab.AttentionSpec(4, 2, 64, torch.float32, causal=True, rope=ab.RopeSpec(10000.0)),
        platform="cpu",
    )
    assert one.fingerprint() == other.fingerprint()
    changed = ab.select(
        ab.AttentionSpec(4, 2, 64, torch.float32, causal=True, rope=ab.RopeSpec(10001.0)),
        platform="cpu",
    )
    assert changed.fingerprint() != one.fingerprint()


def test_a_select_request_is_checked_normalised_and_hashable(registry):
    given = ab.SelectRequest(SPEC, device="cpu", platform="cpu")
    same = ab.SelectRequest(SPEC, device=torch.device("cpu"), platform=ab.parse_platform("cpu"))
    assert given == same and hash(given) == hash(same) and len({given, same}) == 1
    assert given.device == torch.device("cpu") and given.platform == ab.parse_platform("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        given.strict = True  # type: ignore[misc]
    chosen = ab.select_request(given, registry=registry)
    assert chosen is ab.select(SPEC, device="cpu", platform="cpu", registry=registry)
    assert chosen.name == "fast" and chosen.to_dict()["cuda_graph"] is False


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        (
            {"cuda_graph": "yes"},
            ab.errors.InvalidArgumentError,
            r"select\(cuda_graph=\.\.\.\) takes True",
        ),
        ({"has_kv_cache": 0}, ab.errors.InvalidArgumentError, r"select\(has_kv_cache=\.\.\.\)"),
        ({"platform": "gpu"}, ab.errors.PlatformError, "cannot parse platform 'gpu'"),
        ({"platform": 90}, ab.errors.PlatformError, "platform must be a Platform"),
        ({"device": "tpu"}, ab.errors.PlatformError, "device 'tpu'"),
        ({"backend": 3}, ab.NoBackendError, r"backend= must be a backend name \(str\)"),
    ],
)
def test_a_bad_select_request_is_refused_when_built(fields, error, match):
    with pytest.raises(error, match=match):
        ab.SelectRequest(SPEC, **fields)


def test_select_request_takes_only_a_select_request():
    with pytest.raises(
        ab.errors.InvalidArgumentError, match="takes a SelectRequest, got AttentionSpec"
    ):
        ab.select_request(SPEC)  # type: ignore[arg-type]
    with pytest.raises(ab.SpecError, match="takes an AttentionSpec, got str"):
        ab.SelectRequest("qwen3")  # type: ignore[arg-type]


def test_a_failed_selection_carries_its_decision_record(registry, monkeypatch):
    monkeypatch.setenv("ATTN_BACKENDS_DISABLE", "torch-sdpa")
    fp16 = ab.AttentionSpec(8, 2, 64, torch.float16, causal=True)
    with pytest.raises(ab.NoBackendError) as info:
        ab.select(fp16, platform="cpu", registry=registry)
    record = info.value.record
    assert record is not None
    record = json.loads(json.dumps(record))
    assert record["selected"] is None and record["spec"]["dtype"] == "float16"
    assert record["error"]["type"] == "NoBackendError"
    by_name = {c["name"]: c for c in record["candidates"]}
    assert set(by_name) == {"torch-sdpa", "fast", "slow", "gpu-only", "unranked"}
    assert by_name["fast"]["verdict"] == "rejected"
    assert by_name["fast"]["reasons"][0]["code"] == "dtype"


def test_with_no_backend_registered_the_error_says_which_plugins_did_not_load_and_why(
    monkeypatch,
):
    monkeypatch.setenv("ATTN_BACKENDS_PLUGINS", "none")
    reg = ab.deploy.Registry()
    reg.load_entry_points()
    assert reg.entries() == [] and reg.records()
    with pytest.raises(ab.NoBackendError) as info:
        ab.select(SPEC, platform="cpu", registry=reg)
    text = str(info.value)
    assert "no backend is registered, because no plugin loaded one" in text
    assert (
        "plugin torch-sdpa: disabled: plugin 'torch-sdpa' is not in $ATTN_BACKENDS_PLUGINS" in text
    )
    assert "name 'none', which match no plugin; unset $ATTN_BACKENDS_PLUGINS" in text
    assert info.value.reasons, "the reasons name every plugin that did not load"
    codes = {r.code for _, reasons in info.value.reasons for r in reasons}
    assert codes == {ab.ReasonCode.DISABLED}
