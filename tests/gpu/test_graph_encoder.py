"""Graph mode on a whole encoder: one CUDA graph per bucket, captured once, replayed for
batches of different lengths; each replay equals the eager run of the same plan bit for bit,
and the valid rows agree with an eager run on an ordinary per-batch plan."""

from __future__ import annotations

import functools

import pytest
import torch

import attn_backends as ab
from attn_backends.reference import relative_error
from attn_backends.testing.graphs import capture_graph
from tests.gpu.tiny_encoder import TinyEncoder, embeddings

pytestmark = pytest.mark.gpu

SPECS = {
    "bge-m3-like": ab.AttentionSpec(16, 16, 64, torch.bfloat16, causal=False),
    "qwen3-like-rope": ab.AttentionSpec(16, 8, 128, torch.bfloat16, True, rope=ab.RopeSpec(1e6)),
}
BUCKETS = {
    ab.GraphBucket(max_tokens=128, max_batch=8): [(16,), (9, 40, 3, 17), (1,) * 8, (128,)],
    ab.GraphBucket(max_tokens=1024, max_batch=16): [(512, 300, 7), (64,) * 16, (1000,), (5,)],
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_one_graph_per_bucket_replays_every_batch_exactly(name):
    spec = SPECS[name]
    device = torch.device("cuda")
    model = TinyEncoder.build(spec, layers=4, hidden=512, device=device)
    for bucket, batches in BUCKETS.items():
        plan = model.backend.prepare_graph(bucket, device=device)
        plan.update(
            ab.FMHAParams.from_lengths(batches[0], device=device, padded_rows=bucket.max_tokens)
        )
        static = embeddings(batches[0], bucket.max_tokens, model.hidden, spec.dtype, device)
        captured = capture_graph(functools.partial(model, static, plan), device)
        for lengths in batches:
            params = ab.FMHAParams.from_lengths(
                lengths, device=device, padded_rows=bucket.max_tokens
            )
            fresh = embeddings(lengths, bucket.max_tokens, model.hidden, spec.dtype, device)
            plan.update(params)
            static.copy_(fresh)
            captured.replay()
            replayed = captured.output[: params.token_q_num].clone()
            eager = model(fresh.clone(), plan)[: params.token_q_num]
            assert torch.equal(replayed, eager), f"{name} {lengths}: replay != eager"
            tokens = params.token_q_num
            own = ab.FMHAParams.from_lengths(lengths, device=device)
            plain = model(fresh[:tokens].clone(), model.backend.prepare(own))
            err = relative_error(replayed.float(), plain.float())
            assert err < 2e-2, f"{name} {lengths}: graph vs per-batch plan {err:.3g}"
