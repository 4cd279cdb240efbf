"""The TFLOP/s benchmark's dry mode runs its whole grid on CPU and checks every path against
the float64 reference; its FLOP count and its wrong-result guard are the paper's and real."""

from __future__ import annotations

import json

import torch

from tests.script_support import load_script


def _load():
    return load_script("benchmarks/attention_tflops.py")


def test_dry_grid_checks_every_path(tmp_path):
    bench = _load()
    assert bench.main(["--dry", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "attention_tflops.json").read_text())["rows"]
    grid = {(r["seq_len"], r["head_dim"], r["causal"]) for r in rows if r["shape"] == "fa3-grid"}
    assert len(grid) == len(bench.SEQ_LENS) * len(bench.HEAD_DIMS) * 2
    assert {r["shape"] for r in rows} == {"fa3-grid", *(w.name for w in bench.VARLEN)}
    for r in rows:
        assert r["path"] == "api" and r["error"] is not None and r["error"] < bench.TOLERANCE


def test_varlen_workloads_are_the_embedding_batches():
    bench = _load()
    bge, qwen = bench.VARLEN
    assert (bge.heads, bge.kv_heads, bge.head_dim, bge.causal) == (16, 16, 64, False)
    assert (qwen.heads, qwen.kv_heads, qwen.head_dim, qwen.causal) == (16, 8, 128, True)
    lengths = qwen.lengths()
    assert len(lengths) == 32 and lengths[0] == 2048 and lengths[-1] == 64
    assert bench.varlen_flops([4, 2], 2, 8, causal=False) == 4.0 * (16 + 4) * 2 * 8


def test_flops_follow_the_papers_count():
    bench = _load()
    assert bench.flops(8, 2048, 16, 128, causal=False) == 4.0 * 8 * 2048**2 * 16 * 128
    assert bench.flops(8, 2048, 16, 128, causal=True) == 2.0 * 8 * 2048**2 * 16 * 128


def test_a_wrong_output_is_caught():
    bench = _load()
    import attn_backends as ab

    spec = ab.AttentionSpec(2, 2, 64, torch.bfloat16, causal=True)
    qkv = torch.randn(32, 3 * 2 * 64, dtype=torch.bfloat16)
    want = bench.reference(qkv, spec, 32)
    assert bench.error(want.to(torch.bfloat16), want) < 1e-2
    wrong = bench.reference(qkv, ab.AttentionSpec(2, 2, 64, torch.bfloat16, causal=False), 32)
    assert bench.error(wrong, want) > bench.TOLERANCE
