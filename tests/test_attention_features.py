"""Sliding windows, logit soft-capping and ALiBi: spec validation, Hugging Face semantics,
the reference against an independent dense computation, backends against the reference,
refusals with reasons, flashinfer's plan arguments, and two plans per batch."""

from __future__ import annotations

import math

import pytest
import torch
from attn_backends_builtin import flashinfer as flashinfer_plugin
from attn_backends_builtin.flashinfer import FlashinferBackend

import attn_backends as ab
import attn_backends.plugin as abp
from attn_backends.deploy import Registry
from attn_backends.reference import TOLERANCE, relative_error
from tests.fakes.fake_flashinfer import install
from tests.spec_support import batch

CPU = ab.detect_platform("cpu")
SM90 = ab.Platform(kind="cuda", arch="sm90", libraries=(("flashinfer", "fake"),))
PLAN = "BatchPrefillWithRaggedKVCacheWrapper.plan"


def spec_of(causal: bool = True, dtype: torch.dtype = torch.float32, **kw: object):
    return ab.AttentionSpec(8, 2, 64, dtype, causal, **kw)  # type: ignore[arg-type]


# Spec validation.


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"window": ab.SlidingWindow(4, 2)}, "right=0"),
        ({"window": (4, 0)}, "SlidingWindow"),
        ({"logit_softcap": 0.0}, "logit_softcap"),
        ({"logit_softcap": math.inf}, "logit_softcap"),
        ({"logit_softcap": True}, "logit_softcap"),
        ({"alibi": ab.AlibiSpec((0.5, 0.25))}, "one slope per query head"),
        ({"alibi": 0.5}, "AlibiSpec"),
    ],
)
def test_spec_refuses_bad_feature_fields(kw, words):
    with pytest.raises(ab.SpecError, match=words):
        spec_of(causal=True, **kw)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ab.SlidingWindow(-1, 0),
        lambda: ab.SlidingWindow(1, True),
        lambda: ab.SlidingWindow.causal(0),
        lambda: ab.AlibiSpec((0.5, math.nan)),
        lambda: ab.AlibiSpec(()),
    ],
)
def test_feature_values_are_validated(make):
    with pytest.raises(ab.SpecError):
        make()


def test_features_are_frozen_hashable_and_serialised():
    slopes = [0.5 / (h + 1) for h in range(8)]
    spec = spec_of(
        causal=False,
        window=ab.SlidingWindow(3, 2),
        logit_softcap=30.0,
        alibi=ab.AlibiSpec(slopes),  # type: ignore[arg-type]
    )
    same = spec_of(
        causal=False,
        window=ab.SlidingWindow(3, 2),
        logit_softcap=30.0,
        alibi=ab.AlibiSpec(tuple(slopes)),
    )
    assert spec == same and hash(spec) == hash(same)
    record = spec.to_dict()
    assert record["window"] == {"left": 3, "right": 2}
    assert record["logit_softcap"] == 30.0
    assert record["alibi"] == {"slopes": slopes}
    assert spec_of(alibi=ab.AlibiSpec()).to_dict()["alibi"] == {"slopes": "bloom"}
    window = spec.window
    assert window is not None
    with pytest.raises(AttributeError):
        window.left = 1


def test_alibi_keeps_rope_out_of_the_fused_kernel():
    rope = ab.RopeSpec(1e4)
    assert spec_of(rope=rope).rope_fusable
    assert not spec_of(rope=rope, alibi=ab.AlibiSpec()).rope_fusable


# Hugging Face semantics, proven against transformers' own masks.


def _hf_sdpa_mask(mask_function, length: int) -> torch.Tensor:
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(
        batch_size=1,
        q_length=length,
        kv_length=length,
        mask_function=mask_function,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        device=torch.device("cpu"),
    )
    assert mask is not None
    return mask[0, 0].bool()


def _ours(spec: ab.AttentionSpec, length: int) -> torch.Tensor:
    from attn_backends_builtin._masks import dense_mask

    return dense_mask(spec, length, torch.device("cpu"))


@pytest.mark.parametrize("window", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("length", [1, 5, 8, 13])
def test_causal_window_matches_hf_sliding_window(window, length):
    pytest.importorskip("transformers")
    from transformers.masking_utils import sliding_window_causal_mask_function

    hf = _hf_sdpa_mask(sliding_window_causal_mask_function(window), length)
    spec = spec_of(window=ab.SlidingWindow.causal(window))
    assert torch.equal(_ours(spec, length), hf)


def _hf_model_mask(config, length: int, create) -> torch.Tensor:
    config._attn_implementation = "sdpa"
    embeds = torch.zeros(1, length, config.hidden_size)
    kwargs = {
        "config": config,
        "inputs_embeds": embeds,
        "attention_mask": torch.ones(1, length, dtype=torch.long),
        "cache": None,
    }
    mask: torch.Tensor = create(**kwargs)[0, 0].bool()
    return mask


@pytest.mark.parametrize("local_attention", [2, 4, 6, 9, 128])
@pytest.mark.parametrize("length", [1, 7, 12])
def test_modernbert_window_matches_hf(local_attention, length):
    pytest.importorskip("transformers")
    from transformers import ModernBertConfig
    from transformers.masking_utils import create_bidirectional_sliding_window_mask

    config = ModernBertConfig(
        hidden_size=16,
        num_attention_heads=2,
        num_hidden_layers=1,
        intermediate_size=32,
        local_attention=local_attention,
        vocab_size=32,
    )

    def create(**kwargs):
        # Materialised even where the window covers the sequence (HF returns None there).
        return create_bidirectional_sliding_window_mask(**kwargs, allow_is_bidirectional_skip=False)

    hf = _hf_model_mask(config, length, create)
    spec = spec_of(causal=False, window=ab.SlidingWindow.modernbert(local_attention))
    assert torch.equal(_ours(spec, length), hf)


@pytest.mark.parametrize("sliding_window", [2, 3, 8, 11, 512])
@pytest.mark.parametrize("length", [1, 6, 13])
def test_gemma3_bidirectional_window_matches_hf(sliding_window, length):
    """EmbeddingGemma's local layers: the mask Gemma3TextModel builds, through its own
    overlay on HF's sliding-window mask."""
    pytest.importorskip("transformers")
    from transformers import Gemma3TextConfig
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.gemma3 import modeling_gemma3

    config = Gemma3TextConfig(
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_hidden_layers=1,
        intermediate_size=32,
        vocab_size=32,
        sliding_window=sliding_window,
        use_bidirectional_attention=True,
    )
    assert config.sliding_window is not None
    overlay = modeling_gemma3._bidirectional_window_overlay(config.sliding_window)

    def create(**kwargs):
        return create_sliding_window_causal_mask(**kwargs, or_mask_function=overlay)

    hf = _hf_model_mask(config, length, create)
    window = ab.SlidingWindow.gemma3_bidirectional(config.to_dict()["sliding_window"])
    spec = spec_of(causal=False, window=window)
    assert torch.equal(_ours(spec, length), hf)


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 8, 12, 16, 20, 32, 40, 64])
def test_default_alibi_slopes_are_blooms(heads):
    pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    bias = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)  # [heads, 1, 2]
    theirs = bias[:, 0, 1].to(torch.float64)
    ours = torch.tensor(abp.bloom_alibi_slopes(heads), dtype=torch.float64)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


# The reference against an independent dense float64 computation.


def _dense(qkv: torch.Tensor, spec: ab.AttentionSpec, lengths: tuple[int, ...]) -> torch.Tensor:
    """Per sequence, per head, per query: scores over every key, then the features."""
    d, hq, hkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    x = qkv.to(torch.float64)
    out = torch.zeros(sum(lengths), hq * d, dtype=torch.float64)
    slopes = spec.alibi.slopes_for(hq) if spec.alibi is not None else None
    start = 0
    for n in lengths:
        for h in range(hq):
            g = h // (hq // hkv)
            q = x[start : start + n, h * d : (h + 1) * d]
            k = x[start : start + n, (hq + g) * d : (hq + g + 1) * d]
            v = x[start : start + n, (hq + hkv + g) * d : (hq + hkv + g + 1) * d]
            for i in range(n):
                row = []
                for j in range(n):
                    s = float(q[i] @ k[j]) * spec.scale
                    if spec.logit_softcap is not None:
                        s = spec.logit_softcap * math.tanh(s / spec.logit_softcap)
                    if slopes is not None:
                        s += slopes[h] * ((j - i) if spec.causal else -abs(i - j))
                    hidden = (spec.causal and j > i) or (
                        spec.window is not None
                        and not (i - spec.window.left <= j <= i + spec.window.right)
                    )
                    row.append(-math.inf if hidden else s)
                weights = torch.softmax(torch.tensor(row, dtype=torch.float64), dim=0)
                out[start + i, h * d : (h + 1) * d] = weights @ v
        start += n
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "kw",
    [
        {"window": "w"},
        {"logit_softcap": 2.0},
        {"alibi": ab.AlibiSpec()},
        {"window": "w", "logit_softcap": 3.0, "alibi": ab.AlibiSpec()},
    ],
    ids=["window", "softcap", "alibi", "all"],
)
def test_reference_matches_an_independent_dense_computation(causal, kw):
    kw = dict(kw)
    if "window" in kw:
        kw["window"] = ab.SlidingWindow(2, 0 if causal else 1)
    spec = ab.AttentionSpec(4, 2, 8, torch.float32, causal, **kw)
    lengths = (5, 1, 7)
    params, qkv = batch(spec, lengths, pad=2, seed=3)
    ref = ab.reference_attention(qkv, spec, params)
    torch.testing.assert_close(ref, _dense(qkv[: sum(lengths)], spec, lengths))


# torch-sdpa against the reference (fp32 and bf16), and refusals with fall-through.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_torch_sdpa_window_and_alibi(dtype, causal):
    window = ab.SlidingWindow(5, 0 if causal else 3)
    spec = spec_of(causal, dtype, window=window, alibi=ab.AlibiSpec(), rope=ab.RopeSpec(1e4))
    lengths = (9, 1, 33, 4, 9)
    params, qkv = batch(spec, lengths, pad=3, seed=1)
    sel = ab.select(spec, backend="torch-sdpa", platform=CPU)
    out = sel.backend.forward(qkv[:, :].clone(), sel.backend.prepare(params))
    err = relative_error(out, ab.reference_attention(qkv, spec, params))
    assert err < TOLERANCE[dtype]


def test_softcap_is_refused_by_torch_sdpa_with_the_reason():
    spec = spec_of(logit_softcap=30.0)
    with pytest.raises(ab.NoBackendError) as info:
        ab.select(spec, backend="torch-sdpa", platform=CPU)
    codes = {r.code for _, reasons in info.value.reasons for r in reasons}
    assert codes == {ab.ReasonCode.SOFTCAP}
    assert "logit_softcap" in str(info.value)


def _registry_with(
    *backends: type[abp.PrefillBackend], placements: list[abp.Placement]
) -> Registry:
    from tests.static_plugin import StaticPlugin

    registry = Registry()
    registry.register_plugin(StaticPlugin(*backends, placements=placements), name="features-test")
    return registry


def test_selector_falls_through_to_a_backend_declaring_the_feature():
    from attn_backends_builtin.torch_sdpa import TorchSdpaBackend

    class Plain(TorchSdpaBackend):
        name = "plain"
        capabilities = abp.Capabilities(
            platforms=frozenset({"cpu"}), dtypes=frozenset({torch.float32})
        )

    first = abp.Placement("plain", before="torch-sdpa", platform="cpu")
    registry = _registry_with(Plain, TorchSdpaBackend, placements=[first])
    plain = ab.select(spec_of(), platform=CPU, registry=registry)
    assert plain.name == "plain"
    for kw, code in (
        ({"window": ab.SlidingWindow.causal(4)}, ab.ReasonCode.SLIDING_WINDOW),
        ({"alibi": ab.AlibiSpec()}, ab.ReasonCode.ALIBI),
    ):
        sel = ab.select(spec_of(**kw), platform=CPU, registry=registry)
        assert sel.name == "torch-sdpa"
        refused = next(c for c in sel.candidates if c.name == "plain")
        assert [r.code for r in refused.reasons] == [code]


# flashinfer: plan arguments on the fake.


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(flashinfer_plugin, "device_sm", lambda device: 90)
    return install(monkeypatch)


@pytest.mark.parametrize("causal", [True, False])
def test_flashinfer_plans_window_and_softcap(fake, causal):
    spec = spec_of(causal, torch.bfloat16, window=ab.SlidingWindow.causal(4), logit_softcap=20.0)
    backend = ab.select(spec, backend="flashinfer", platform=SM90).backend
    params, qkv = batch(spec, (9, 1, 6), pad=2)
    out = backend.forward(qkv.clone(), backend.prepare(params))
    assert relative_error(out, ab.reference_attention(qkv, spec, params)) < 1e-2
    a = fake.named(PLAN)[-1].args
    assert a["window_left"] == 3 and a["logits_soft_cap"] == 20.0
    assert a["causal"] is True, "a left-only window sees no later key: planned causal"
    assert a["pos_encoding_mode"] == "NONE"
    assert fake.named("BatchPrefillWithRaggedKVCacheWrapper.__init__")[-1].args["backend"] == "fa3"


def test_flashinfer_plans_alibi_on_fa2(fake):
    spec = spec_of(True, torch.float16, alibi=ab.AlibiSpec(abp.bloom_alibi_slopes(8)))
    backend = ab.select(spec, backend="flashinfer", platform=SM90).backend
    params, qkv = batch(spec, (12, 3))
    out = backend.forward(qkv.clone(), backend.prepare(params))
    assert relative_error(out, ab.reference_attention(qkv, spec, params)) < 5e-3
    a = fake.named(PLAN)[-1].args
    assert a["pos_encoding_mode"] == "ALIBI" and a["window_left"] == -1
    assert a["logits_soft_cap"] is None
    assert fake.named("BatchPrefillWithRaggedKVCacheWrapper.__init__")[-1].args["backend"] == "fa2"
    (module,) = FlashinferBackend.jit_modules(spec, 90)
    assert (module.kind, module.pos_encoding) == ("fa2", 2)
    assert str(module) == "fa2 float16 d64 posenc=ALIBI"


def test_flashinfer_jit_module_names_the_variants():
    spec = spec_of(True, torch.bfloat16, window=ab.SlidingWindow.causal(8), logit_softcap=5.0)
    (module,) = FlashinferBackend.jit_modules(spec, 90)
    assert module.sliding_window and module.logit_softcap and module.pos_encoding == 0
    assert str(module) == "fa3 bfloat16 d64 posenc=NONE swa softcap"


@pytest.mark.parametrize(
    "kw",
    [
        {"causal": False, "window": ab.SlidingWindow(4, 4)},
        {"causal": False, "alibi": ab.AlibiSpec()},
        {"causal": True, "alibi": ab.AlibiSpec(tuple(0.1 for _ in range(8)))},
        {"causal": True, "alibi": ab.AlibiSpec(), "logit_softcap": 30.0},
    ],
    ids=["window-right", "alibi-bidirectional", "alibi-custom-slopes", "alibi-softcap"],
)
def test_flashinfer_refuses_what_it_cannot_express(kw):
    causal = kw.pop("causal")
    spec = spec_of(causal, torch.bfloat16, **kw)
    reasons = FlashinferBackend.supports(spec, SM90)
    assert reasons and {r.code for r in reasons} <= {
        ab.ReasonCode.SLIDING_WINDOW,
        ab.ReasonCode.ALIBI,
    }


def test_trt_declares_no_feature():
    from attn_backends_builtin.trt import TrtBackend

    assert TrtBackend.capabilities.features == ()


# Alternating local and global layers: one batch, one plan per distinct spec.


def test_one_batch_prepared_once_per_spec_serves_alternating_layers():
    rope = ab.RopeSpec(1e4)
    global_spec = spec_of(False, rope=rope)
    local_spec = spec_of(False, rope=rope, window=ab.SlidingWindow.modernbert(8))
    params, qkv = batch(global_spec, (20, 3, 11), pad=1, seed=7)
    backends = {spec: ab.select(spec, platform=CPU).backend for spec in (global_spec, local_spec)}
    plans = {spec: backend.prepare(params) for spec, backend in backends.items()}
    layers = [local_spec, local_spec, global_spec, local_spec, global_spec]
    for n, spec in enumerate(layers):
        layer_input = qkv * (1 + 0.1 * n)
        out = backends[spec].forward(layer_input.clone(), plans[spec])
        ref = ab.reference_attention(layer_input, spec, params)
        assert relative_error(out, ref) < TOLERANCE[spec.dtype]
    assert plans[global_spec].spec == global_spec and plans[local_spec].spec == local_spec
