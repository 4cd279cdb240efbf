"""The serving hot path on an NVIDIA GPU: batch-major ``(q, k, v)`` through every CUDA backend
(views and dense copies) against the float64 reference, the bound forward without a host sync,
and transformers models through the integration (whole rows batch-major, padded and packed
batches) against the same weights on HF sdpa."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch

import attn_backends as ab
from attn_backends.integrations import transformers as abt
from attn_backends.plugin import PrefillBackend
from attn_backends.reference import TOLERANCE, relative_error

pytestmark = pytest.mark.gpu

BACKENDS = ("flashinfer", "torch-varlen", "torch-sdpa")


def _batch_major(
    spec: ab.AttentionSpec, count: int, length: int, dense: bool, seed: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    packed = torch.randn(count * length, spec.qkv_width, device="cuda", generator=gen)
    packed = packed.to(spec.dtype)
    q_end, k_end = spec.q_width, spec.q_width + spec.kv_width
    heads = (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)
    grids = [
        packed[:, lo:hi].view(count, length, h, spec.head_dim).transpose(1, 2)
        for (lo, hi), h in zip(((0, q_end), (q_end, k_end), (k_end, None)), heads, strict=True)
    ]
    if dense:
        grids = [g.contiguous() for g in grids]
    return packed, (grids[0], grids[1], grids[2])


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dense", [False, True], ids=["views", "dense"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("shape", [(1, 37), (6, 64)], ids=["1x37", "6x64"])
def test_batch_major_against_the_reference(name, dense, causal, shape):
    spec = ab.AttentionSpec(16, 8, 64, torch.bfloat16, causal=causal)
    backend = ab.select(spec, backend=name, device="cuda").backend
    count, length = shape
    params = ab.FMHAParams.from_lengths([length] * count, device="cuda")
    packed, qkv = _batch_major(spec, count, length, dense, seed=count + length)
    out = backend.forward(qkv, backend.prepare(params))
    err = relative_error(out, ab.reference_attention(packed, spec, params))
    assert err < TOLERANCE[spec.dtype], f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("name", BACKENDS)
def test_a_bound_batch_major_forward_never_syncs_the_host(name):
    spec = ab.AttentionSpec(16, 16, 64, torch.bfloat16, causal=False)
    backend = ab.select(spec, backend=name, device="cuda").backend
    assert isinstance(backend, PrefillBackend)
    params = ab.FMHAParams.from_lengths([48] * 4, device="cuda")
    plan = backend.prepare(params)
    packed, qkv = _batch_major(spec, 4, 48, dense=False, seed=1)
    bound = backend.bind_forward(qkv, plan)
    assert bound is not None
    bound(qkv)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = bound(qkv)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    err = relative_error(
        out.reshape(params.token_q_num, -1), ab.reference_attention(packed, spec, params)
    )
    assert err < TOLERANCE[spec.dtype], f"{name}: relative error {err:.3g}"


def _models(kind: str) -> tuple[Any, Any]:
    """The same random weights loaded on the integration and on HF sdpa, bf16 on cuda."""
    t = pytest.importorskip("transformers")
    common = {
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
    }
    if kind == "xlmr":
        config = t.XLMRobertaConfig(**common, max_position_embeddings=640, pad_token_id=1)
    else:
        config = t.Qwen3Config(**common, num_key_value_heads=2, head_dim=64, use_cache=False)
    torch.manual_seed(0)
    ours = t.AutoModel.from_config(config, attn_implementation=abt.register(), dtype=torch.bfloat16)
    # a config of its own: from_config sets the attention implementation on the one it is given
    sdpa = t.AutoModel.from_config(
        copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.bfloat16
    )
    sdpa.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == abt.DEFAULT_NAME
    return ours.cuda().eval(), sdpa.cuda().eval()


@pytest.mark.parametrize("kind", ["xlmr", "qwen3"])
def test_the_integration_matches_sdpa_on_whole_padded_and_packed_batches(kind):
    ours, sdpa = _models(kind)
    gen = torch.Generator().manual_seed(3)
    offset = 2 if kind == "xlmr" else 0
    with torch.inference_mode():
        for rows, cols in ((1, 23), (4, 17)):  # whole rows: batch-major to the backend
            ids = torch.randint(3, 1000, (rows, cols), generator=gen).cuda()
            got = ours(input_ids=ids).last_hidden_state
            want = sdpa(input_ids=ids).last_hidden_state
            assert relative_error(got.float(), want.float()) < 2e-2
        ids = torch.randint(3, 1000, (3, 20), generator=gen).cuda()
        mask = torch.ones_like(ids)
        mask[0, 15:] = 0
        mask[2, 7:] = 0
        got = ours(input_ids=ids, attention_mask=mask).last_hidden_state
        want = sdpa(input_ids=ids, attention_mask=mask).last_hidden_state
        valid = mask.bool()
        assert relative_error(got[valid].float(), want[valid].float()) < 2e-2
        lengths = (9, 30, 4)
        sequences = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in lengths]
        packed = abt.pack_sequences(sequences, device="cuda", position_offset=offset)
        hidden = ours(**packed).last_hidden_state
        slices = abt.unpack_hidden(hidden, packed["cu_seq_lens_q"])
        for seq, row in zip(sequences, slices, strict=True):
            one = torch.tensor([seq], device="cuda")
            alone = sdpa(input_ids=one).last_hidden_state[0]
            assert relative_error(row.float(), alone.float()) < 2e-2
    assert list(itertools.accumulate(lengths)) == packed["cu_seq_lens_q"][1:].tolist()
