"""The whole-model graph runner on a GPU: one CUDA graph per bucket, captured at the bucket's
first batch and replayed for every later one, with the valid rows equal to the same model run
eagerly through the integration on the packed batch."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import attn_backends as ab
from attn_backends.integrations import transformers as abt
from attn_backends.integrations.graph_runner import GraphRunner
from attn_backends.reference import relative_error

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

VOCAB = 1000
SMALL = ab.GraphBucket(max_tokens=128, max_batch=8)
LARGE = ab.GraphBucket(max_tokens=512, max_batch=32)


def _model(kind: str) -> Any:
    t = transformers
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,  # head_dim 64
    }
    if kind == "xlmr":
        config = t.XLMRobertaConfig(**common, max_position_embeddings=640, pad_token_id=1)
    else:
        config = t.Qwen3Config(**common, num_key_value_heads=2, head_dim=64, use_cache=False)
    torch.manual_seed(0)
    return (
        t.AutoModel.from_config(config, attn_implementation=abt.register(), dtype=torch.bfloat16)
        .cuda()
        .eval()
    )


def _batch(lengths: tuple[int, ...], seed: int) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (sum(lengths),), generator=gen)[None].cuda()
    return ids, [0, *itertools.accumulate(lengths)]


def _eager(model: torch.nn.Module, ids: torch.Tensor, cu: list[int], offset: int) -> torch.Tensor:
    """The packed batch through the integration, outside the runner."""
    lengths = [b - a for a, b in itertools.pairwise(cu)]
    packed = abt.pack_sequences(
        [ids[0, a:b].tolist() for a, b in itertools.pairwise(cu)],
        device="cuda",
        position_offset=offset,
    )
    assert packed["max_length_q"] == max(lengths)
    with torch.inference_mode():
        return model(**packed).last_hidden_state  # type: ignore[no-any-return]


@pytest.mark.parametrize(("kind", "offset"), [("xlmr", 2), ("qwen3", 0)])
def test_one_graph_per_bucket_is_captured_once_and_replayed(kind, offset):
    model = _model(kind)
    runner = GraphRunner(model, [SMALL, LARGE], position_offset=offset, pad_token_id=1)
    assert runner.plans == "graph" and runner.capture
    batches = [(16,), (9, 40, 3, 17), (1,) * 8, (128,), (300, 200, 7), (5, 5), (600,)]
    for seed, lengths in enumerate(batches):
        ids, cu = _batch(lengths, seed)
        out = runner(ids, cu)
        expected = _eager(model, ids, cu, offset)
        err = relative_error(out.float(), expected.float())
        assert err < 2e-2, f"{kind} {lengths}: graph vs eager {err:.3g}"
        again = runner(ids, cu)
        assert torch.equal(again, out), "a replay of the same batch is bit for bit the same"
    assert runner.stats.captures == 2, "one capture per bucket, never again"
    assert runner.stats.eager == 1 + 1, "the first batch (checked) and the 600-token misfit"
    assert runner.stats.replays == 2 * (len(batches) - 1)
    assert runner._pool is not None


def test_the_graph_reads_the_batch_not_the_first_one():
    """Negative control: a graph that replayed its first batch's plan would give the first
    batch's answer; the second batch's rows differ from the first's and match eager."""
    model = _model("qwen3")
    runner = GraphRunner(model, [SMALL])
    first_ids, first_cu = _batch((20, 30), 0)
    second_ids, second_cu = _batch((50,), 1)
    runner(first_ids, first_cu)
    out = runner(second_ids, second_cu)
    assert relative_error(out.float(), _eager(model, second_ids, second_cu, 0).float()) < 2e-2
    wrong = _eager(model, second_ids, first_cu, 0)  # the second tokens in the first layout
    assert relative_error(out.float(), wrong.float()) > 2e-2
