"""Chunked attention (``AttentionSpec.chunk_size``): validation and its bound, the record that
keeps earlier fingerprints, ``explain``, the float64 reference against an independent loop, the
built-ins' one mask definition, the generated cases, a chunk off by one failing them, and the
refusals of the backends that do not declare it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch
from attn_backends_builtin import _masks, flex, torch_sdpa
from attn_backends_builtin._flex_kernel import MaskMod
from attn_backends_builtin.aiter import AiterAsmBackend, AiterNonAsmBackend
from attn_backends_builtin.flashinfer import FlashinferBackend
from attn_backends_builtin.trt import TrtBackend

import attn_backends as ab
import attn_backends.plugin as abp
import attn_backends.reference
from attn_backends._backend import _reference
from attn_backends._select._selector import _spec_line
from attn_backends._values._feature_table import CHUNK
from attn_backends.testing.cases import conformance_cases, refusal_cases
from attn_backends.testing.suite import run_case
from tests.spec_support import batch

CPU = ab.detect_platform("cpu")
LARGEST = 2**31 - 1


def spec_of(causal: bool = True, dtype: torch.dtype = torch.float32, **kw: object):
    return ab.AttentionSpec(8, 2, 16, dtype, causal, **kw)  # type: ignore[arg-type]


# ---- the spec -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -4, True, 8.0, "8", LARGEST + 1, 10**400])
def test_chunk_size_is_an_int_within_its_bound(value):
    with pytest.raises(ab.SpecError, match="chunk_size must be an int from 1 to 2147483647") as e:
        spec_of(chunk_size=value)
    assert len(str(e.value)) < 300


@pytest.mark.parametrize("value", [1, 8, LARGEST])
def test_chunk_sizes_within_the_bound_are_accepted(value):
    assert spec_of(chunk_size=value).chunk_size == value


def test_the_record_lists_the_chunk_only_when_set():
    plain, chunked = spec_of(), spec_of(chunk_size=8)
    assert "chunk_size" not in plain.to_dict()
    assert chunked.to_dict() == {**plain.to_dict(), "chunk_size": 8}
    assert chunked != plain and hash(chunked) != hash(plain)
    fingerprints = {ab.select(s, platform=CPU).fingerprint() for s in (plain, chunked)}
    assert len(fingerprints) == 2


def test_explain_names_the_chunk():
    line = _spec_line(spec_of(window=ab.SlidingWindow.causal(4), chunk_size=8))
    assert line.endswith(", window 3/0, chunk 8"), line


# ---- the reference, and the built-ins' one mask definition ---------------------------------


def _dense(qkv: torch.Tensor, spec: ab.AttentionSpec, lengths: tuple[int, ...]) -> torch.Tensor:
    """Attention one score at a time, written apart from the reference and the plugins."""
    hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    chunk = spec.chunk_size
    assert chunk is not None
    x = qkv.to(torch.float64)
    out = torch.zeros(sum(lengths), hq * d, dtype=torch.float64)
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
                    hidden = (spec.causal and j > i) or math.floor(i / chunk) != math.floor(
                        j / chunk
                    )
                    row.append(-math.inf if hidden else float(q[i] @ k[j]) * spec.scale)
                weights = torch.softmax(torch.tensor(row, dtype=torch.float64), dim=0)
                out[start + i, h * d : (h + 1) * d] = weights @ v
        start += n
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_reference_matches_an_independent_loop(causal, chunk):
    spec = ab.AttentionSpec(4, 2, 8, torch.float32, causal, chunk_size=chunk)
    lengths = (9, 1, 6)
    params, qkv = batch(spec, lengths, pad=2, seed=3)
    ref = ab.reference_attention(qkv, spec, params)
    torch.testing.assert_close(ref, _dense(qkv[: sum(lengths)], spec, lengths))


@pytest.mark.parametrize(
    "kw",
    [
        {"causal": True, "chunk_size": 4},
        {"causal": False, "chunk_size": 5},
        {"causal": False, "chunk_size": 4, "window": ab.SlidingWindow(3, 2)},
        {"causal": True, "chunk_size": 6, "headwise": ab.HeadwiseConfig(frozenset({2}), 2, 3, 8)},
    ],
    ids=["causal", "bidir", "bidir-window", "headwise"],
)
def test_dense_and_flex_masks_are_the_reference_mask(kw):
    from torch.nn.attention.flex_attention import create_mask

    spec = spec_of(**kw)
    length = 13
    heads = spec.num_heads
    dense = _masks.dense_mask(spec, length, torch.device("cpu"))
    terms = _masks.mask_terms(spec, (length,), torch.device("cpu"))
    by_flex = create_mask(_masks.visible(spec, terms), 1, heads, length, length, "cpu")[0]
    assert torch.equal(dense.expand(heads, length, length), by_flex)
    reference = _reference._mask(spec, length, range(heads), torch.device("cpu"))
    assert torch.equal(by_flex, reference)


def test_packed_chunks_restart_with_every_sequence():
    """Packed indices are not positions: the second sequence's chunks start at its first
    token, not at a multiple of the chunk size in the packed batch."""
    spec = spec_of(causal=False, chunk_size=4)
    terms = _masks.mask_terms(spec, (3, 5), torch.device("cpu"))
    mask = _masks.visible(spec, terms)
    idx = torch.arange(8)
    seen = mask(idx[:1], idx[:1], idx[:, None], idx[None, :])
    # the second sequence's tokens 3..6 are its positions 0..3: one chunk; token 7 is alone
    assert bool(seen[3:7, 3:7].all()) and not bool(seen[3:7, 7].any())
    assert not bool(seen[:3, 3:].any())


# ---- backends: served by flex and torch-sdpa, a chunk off by one fails ---------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", [flex.FlexBackend, torch_sdpa.TorchSdpaBackend])
def test_backends_match_the_reference(backend, causal, dtype):
    spec = spec_of(causal, dtype, chunk_size=4, rope=ab.RopeSpec(1e4))
    params, qkv = batch(spec, (9, 1, 14, 4, 9), pad=3, seed=1)
    bound = backend.bind(spec)
    out = bound.forward(qkv.clone(), bound.prepare(params))
    assert (
        ab.reference.relative_error(out, ab.reference_attention(qkv, spec, params))
        < ab.reference.TOLERANCE[dtype]
    )


def test_cpu_selects_a_declaring_backend():
    assert ab.select(spec_of(chunk_size=8), platform=CPU).name == "torch-sdpa"
    softcapped = spec_of(chunk_size=8, logit_softcap=30.0)
    assert ab.select(softcapped, platform=CPU).name == "flex"


@pytest.fixture(autouse=True)
def _no_kept_masks() -> Iterator[None]:
    """torch-sdpa keeps the masks it built; tests here replace the mask definition, so none
    may be kept across them."""
    torch_sdpa._kept_mask.cache_clear()
    yield
    torch_sdpa._kept_mask.cache_clear()


def _off_by(monkeypatch: pytest.MonkeyPatch, delta: int) -> None:
    """The built-ins' mask computing chunks of ``chunk_size + delta``."""
    right = _masks.visible

    def wrong(spec: ab.AttentionSpec, terms: _masks.MaskTerms) -> MaskMod:
        assert spec.chunk_size is not None
        return right(dataclasses.replace(spec, chunk_size=spec.chunk_size + delta), terms)

    monkeypatch.setattr(_masks, "visible", wrong)  # torch-sdpa's dense mask
    monkeypatch.setattr(flex, "visible", wrong)  # flex's mask_mod
    torch_sdpa._kept_mask.cache_clear()  # masks built by the right definition


@pytest.mark.parametrize("delta", [1, -1])
@pytest.mark.parametrize("backend", ["flex", "torch-sdpa"])
def test_a_chunk_off_by_one_fails_the_generated_cases(monkeypatch, backend, delta):
    caps = {"flex": flex.FlexBackend, "torch-sdpa": torch_sdpa.TorchSdpaBackend}[
        backend
    ].capabilities
    cases = [
        c
        for c in conformance_cases(caps)
        if c.spec.chunk_size in (3, 4, 8) and c.spec.window is None and c.spec.headwise is None
    ]
    assert len(cases) >= 4
    for case in cases:
        assert run_case(backend, case, "cpu") < 1e-4, case.id  # the right chunk passes
    _off_by(monkeypatch, delta)
    for case in cases:
        with pytest.raises(AssertionError, match="relative error"):
            run_case(backend, case, "cpu")


# ---- generated cases and refusals ------------------------------------------------------------


def test_declaring_backends_generate_chunk_cases_alone_and_combined():
    for caps in (flex.FlexBackend.capabilities, torch_sdpa.TorchSdpaBackend.capabilities):
        assert caps.support(CHUNK) == abp.ChunkSupport()
        ids = {c.id for c in conformance_cases(caps)}
        assert {
            "float32-causal-chunk-8",
            "float32-bidir-chunk-3",
            "float32-causal-chunk-largest",
            "float32-causal-chunk-mha-padding-strided",
            "float32-causal-window-chunk",
            "float32-bidir-alibi-chunk",
        } <= ids
        assert not any(r.code == ab.ReasonCode.CHUNKED for r in refusal_cases(caps, CPU))


@pytest.mark.parametrize(
    "backend", [FlashinferBackend, TrtBackend, AiterAsmBackend, AiterNonAsmBackend]
)
def test_kernels_without_the_mask_refuse_it_with_the_reason(backend):
    caps = backend.capabilities
    assert caps.support(CHUNK) is None
    platform = ab.parse_platform(
        "rocm:gfx942" if backend in (AiterAsmBackend, AiterNonAsmBackend) else "cuda:sm90"
    )
    spec = spec_of(dtype=torch.bfloat16, chunk_size=8)
    reasons = [r for r in abp.check_capabilities(caps, spec, platform) if r.field == "chunk_size"]
    assert [r.code for r in reasons] == [ab.ReasonCode.CHUNKED]
    assert "ChunkSupport()" in reasons[0].message and reasons[0].got == "chunk_size=8"
    refused = {r.id: r.code for r in refusal_cases(caps, CPU)}
    assert refused["chunk"] == ab.ReasonCode.CHUNKED


def test_selection_without_a_declaring_backend_names_the_reason():
    with pytest.raises(ab.NoBackendError) as info:
        ab.select(spec_of(chunk_size=8), backend="trt", platform=CPU)
    codes = {r.code for _, reasons in info.value.reasons for r in reasons}
    assert ab.ReasonCode.CHUNKED in codes
