"""The benchmark's CPU-side parts: workload data, floor/ratio/target math, the report, the CLI's
refusal without CUDA, and the numbers of the torch-only paths. Nothing here is timed."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import sys

import pytest
import torch
import torch.nn.functional as F

from attn_backends import (
    TOLERANCE,
    AttentionSpec,
    FMHAParams,
    RopeSpec,
    reference_attention,
    relative_error,
)
from attn_backends.bench import cli, report
from attn_backends.bench.paths import (
    PreparedPath,
    Skip,
    build_legacy,
    build_legacy_flashinfer,
    build_padded_sdpa,
    build_public,
    paged_cache,
    rope_tables,
    rotated,
    with_batch_preprocess,
)
from attn_backends.bench.results import (
    BenchResult,
    Ceilings,
    PathResult,
    Timing,
    WorkloadResult,
    evaluate_targets,
    floor_ms,
    path_metrics,
    rope_cost,
)
from attn_backends.bench.runner import BenchConfig, run_benchmark
from attn_backends.bench.workloads import (
    WORKLOADS,
    Targets,
    attention_bytes,
    attention_flops,
    get_workload,
    rope_bytes,
    workload_names,
)
from tests.fakes.fake_flashinfer import install as install_fake_flashinfer

# --- workloads -------------------------------------------------------------------------------


def test_workloads_are_the_five_model_shapes():
    shapes = {
        w.name: (
            w.batch,
            w.min_len,
            w.max_len,
            w.spec().num_heads,
            w.spec().num_kv_heads,
            w.spec().head_dim,
            w.spec().causal,
            w.to_dict()["rope_theta"],
        )
        for w in WORKLOADS
    }
    assert shapes == {
        "bert-base": (32, 512, 512, 12, 12, 64, False, None),
        "bge-m3": (64, 16, 512, 16, 16, 64, False, None),
        "qwen3-emb-0.6b": (32, 64, 2048, 16, 8, 128, True, 1e6),
        "short": (256, 64, 64, 16, 8, 128, True, 1e6),
        "gte-qwen2-7b": (4, 8192, 8192, 28, 4, 128, True, 1e6),
    }
    assert {w.name for w in WORKLOADS if w.varlen} == {"bge-m3", "qwen3-emb-0.6b"}
    for w in WORKLOADS:
        spec = w.spec()
        assert spec.dtype == torch.bfloat16
        assert (spec.rope is not None) == (w.to_dict()["rope_theta"] is not None)
        if spec.rope is not None:
            assert spec.rope.theta == 1e6
            assert spec.rotary_dim == spec.head_dim
            assert not spec.rope.interleaved


def test_targets_sit_on_their_workloads():
    legacy = {w.name for w in WORKLOADS if w.targets.legacy_speedup == 2.0}
    padded = {w.name for w in WORKLOADS if w.targets.padded_speedup == 8.0}
    rope = {w.name for w in WORKLOADS if w.targets.rope_overhead == 1.10}
    assert legacy == {"bert-base", "qwen3-emb-0.6b", "short"}
    assert padded == {w.name for w in WORKLOADS if w.varlen}
    assert rope == {"qwen3-emb-0.6b", "short"}
    assert all(w.targets.api_within == 1.05 for w in WORKLOADS)


def test_lengths_are_seeded_and_in_range():
    qwen = get_workload("qwen3-emb-0.6b")
    first = qwen.lengths(0)
    assert first == qwen.lengths(0)
    assert first != qwen.lengths(1)
    assert len(first) == 32
    assert all(64 <= n <= 2048 for n in first)
    assert len(set(first)) > 16  # really variable
    assert get_workload("bge-m3").lengths(0) != first[: len(get_workload("bge-m3").lengths(0))]
    assert get_workload("bert-base").lengths(7) == (512,) * 32


def test_unknown_workload_names_the_known_ones():
    with pytest.raises(ValueError, match="bert-base"):
        get_workload("bert-large")
    assert workload_names()[0] == "bert-base"


def test_flops_and_bytes():
    assert attention_flops([512] * 32, 12, 64, causal=False) == 4 * 32 * 512**2 * 12 * 64
    assert attention_flops([10, 20], 16, 128, causal=True) == 2 * (100 + 400) * 16 * 128
    spec = get_workload("short").spec()
    tokens = 256 * 64
    # read Q (16 heads) + K + V (8 heads each), write O (16 heads), 2 bytes each
    assert attention_bytes(tokens, spec) == tokens * (16 + 16 + 16) * 128 * 2
    assert rope_bytes(tokens, spec) == 2 * tokens * (16 + 8) * 128 * 2


# --- floors, ratios, targets -----------------------------------------------------------------

CEILINGS = Ceilings(
    copy_bytes_per_s=4e12, matmul_flops_per_s=800e12, copy_buffer_bytes=2 << 30, matmul_n=8192
)


def test_floor_is_the_larger_of_compute_and_memory_time():
    # 8e11 FLOPs at 800 TFLOP/s = 1 ms; 4e9 bytes at 4 TB/s = 1 ms
    assert floor_ms(8e11, 2_000_000_000, CEILINGS) == pytest.approx(1.0)
    assert floor_ms(8e11, 8_000_000_000, CEILINGS) == pytest.approx(2.0)
    assert floor_ms(1.6e12, 4_000_000_000, CEILINGS) == pytest.approx(2.0)


def _timing(ms: float) -> Timing:
    return Timing(
        median_ms=ms,
        p10_ms=ms * 0.95,
        p90_ms=ms * 1.1,
        min_ms=ms * 0.9,
        iters=50,
        warmup=10,
        input_sets=3,
    )


def _path(path, ms, status="ok", **kw):
    kind = path.split(":")[0]
    backend = path.split(":")[1] if ":" in path else kw.pop("backend", None)
    error = None if status == "skipped" else (2e-3 if status != "wrong" else 1.4)
    label = {"api": "public API", "backend": f"{backend} alone"}.get(kind, kind)
    return PathResult(
        path=path,
        kind=kind,
        label=label,
        status=status,
        backend=backend,
        rel_error=kw.pop("rel_error", error),
        tolerance=1e-2,
        timing=_timing(ms) if ms is not None else None,
        **kw,
    )


def _qwen(paths: tuple[PathResult, ...]) -> WorkloadResult:
    w = get_workload("qwen3-emb-0.6b")
    lengths = w.lengths(0)
    spec = w.spec()
    return WorkloadResult(
        name=w.name,
        title=w.title,
        shape=w.shape_text(),
        spec=spec.to_dict(),
        lengths=lengths,
        flops=attention_flops(lengths, 16, 128, True),
        bytes=attention_bytes(sum(lengths), spec),
        rope_bytes=rope_bytes(sum(lengths), spec),
        targets=w.targets,
        paths=paths,
    )


def _qwen_paths() -> tuple[PathResult, ...]:
    return (
        _path(
            "api",
            0.55,
            backend="flashinfer",
            details={"preprocess": "torch", "selected_by": "priority"},
        ),
        _path("backend:flashinfer", 0.54, details={"preprocess": "torch"}),
        _path("backend:flashinfer-rope", 1.08, details={"preprocess": "fused"}),
        _path("backend:trt", 0.30, status="wrong", rel_error=float("inf")),  # never "fastest"
        _path("backend:headwise", None, status="skipped", note="[headwise] needs a config"),
        _path("attention-alone:flashinfer", 0.48, details={"preprocess": "none"}),
        _path("legacy", 1.10, backend="flashinfer"),
        _path("padded-sdpa", 5.5),
        _path("varlen-attn", None, status="error", note="RuntimeError: boom"),
    )


def _by_target(work: WorkloadResult) -> dict[str, tuple[str, object]]:
    return {t.target: (t.status, t.value) for t in evaluate_targets(work)}


def test_targets_judge_ratios_from_correct_paths_only():
    got = _by_target(_qwen(_qwen_paths()))
    assert got["api-vs-fastest"] == ("PASS", pytest.approx(0.55 / 0.54))
    assert got["legacy-speedup"] == ("PASS", pytest.approx(1.10 / 0.55))
    assert got["padded-speedup"] == ("PASS", pytest.approx(10.0))
    assert got["rope-overhead"] == ("FAIL", pytest.approx(0.55 / 0.48))


def test_target_fails_when_the_public_api_is_wrong_and_is_na_when_the_baseline_is():
    paths = _qwen_paths()
    wrong_api = (dataclasses.replace(paths[0], status="wrong", note="err 1.4"), *paths[1:])
    assert {s for s, _ in _by_target(_qwen(wrong_api)).values()} == {"FAIL"}
    no_legacy = tuple(p for p in paths if p.path != "legacy")
    got = _by_target(_qwen(no_legacy))
    assert got["legacy-speedup"] == ("N/A", None)
    assert got["api-vs-fastest"][0] == "PASS"


def test_api_slower_than_the_fastest_backend_fails():
    paths = tuple(
        dataclasses.replace(p, timing=_timing(0.60)) if p.path == "api" else p
        for p in _qwen_paths()
    )
    status, value = _by_target(_qwen(paths))["api-vs-fastest"]
    assert status == "FAIL"
    assert value == pytest.approx(0.60 / 0.54)


def test_path_metrics():
    work = _qwen(_qwen_paths())
    api = work.get("api")
    assert api is not None
    m = path_metrics(work, api, CEILINGS)
    assert m.tflops == pytest.approx(work.flops / 0.55e-3 / 1e12)
    assert m.floor_ratio == pytest.approx(0.55 / floor_ms(work.flops, work.bytes, CEILINGS))
    assert m.vs_legacy == pytest.approx(2.0)
    assert m.vs_padded == pytest.approx(10.0)
    trt = work.get("backend:trt")
    assert trt is not None
    assert path_metrics(work, trt, None).floor_ratio is None


def test_rope_cost_derives_the_separate_pass():
    work = _qwen(_qwen_paths())
    cost = rope_cost(work)
    assert cost is not None
    assert cost.ratio == pytest.approx(0.55 / 0.48)
    assert cost.pass_ms == pytest.approx(0.07)
    assert cost.pass_bytes_per_s == pytest.approx(work.rope_bytes / 0.07e-3)
    fused = tuple(
        dataclasses.replace(p, details={"preprocess": "fused"}) if p.path == "api" else p
        for p in _qwen_paths()
    )
    cost = rope_cost(_qwen(fused))
    assert cost is not None
    assert cost.pass_ms is None


# --- report ----------------------------------------------------------------------------------


def _result() -> BenchResult:
    bert = get_workload("bert-base")
    spec = bert.spec()
    bert_work = WorkloadResult(
        name=bert.name,
        title=bert.title,
        shape=bert.shape_text(),
        spec=spec.to_dict(),
        lengths=bert.lengths(0),
        flops=attention_flops(bert.lengths(0), 12, 64, False),
        bytes=attention_bytes(16384, spec),
        rope_bytes=0,
        targets=bert.targets,
        paths=(
            _path(
                "api",
                0.12,
                backend="trt",
                details={"preprocess": "none", "selected_by": "priority"},
            ),
            _path("backend:trt", 0.119),
            _path("backend:flashinfer", 0.13),
            _path("legacy", 0.29, backend="flashinfer"),
            _path("padded-sdpa", 1.09),
        ),
    )
    return BenchResult(
        meta={
            "device_name": "NVIDIA H200",
            "torch": "2.11.0+cu130",
            "cuda": "13.0",
            "flashinfer": "0.7.0.post1",
            "dtype": "bfloat16",
            "iters": 50,
            "warmup": 10,
            "date": "2026-11-30T00:00:00+00:00",
            "command": "attn-backends bench --out x",
        },
        ceilings=CEILINGS,
        workloads=(bert_work, _qwen(_qwen_paths())),
        skipped_workloads=(("gte-qwen2-7b", "time budget of 300 s used up"),),
    )


def test_markdown_has_the_tables_targets_and_reasons():
    md = report.render_markdown(_result())
    assert "| workload | path | backend |" in md
    assert "| qwen3-emb-0.6b | public API | flashinfer (by priority) |" in md
    assert "ok 2.0e-03 | 0.550 |" in md
    assert "| 10.0x | - |" in md  # prepare ms column (none recorded in the synthetic result)
    assert "WRONG inf" in md
    assert "| qwen3-emb-0.6b | legacy / public API | 2.00x | >= 2x | PASS |" in md
    assert "| qwen3-emb-0.6b | public API (RoPE + attention) / attention alone | 1.15x" in md
    assert "| bert-base | public API | trt (by priority) |" in md
    assert "RuntimeError: boom" in md
    assert "headwise: [headwise] needs a config" in md  # refused backends listed, not tabled
    assert "| qwen3-emb-0.6b | headwise alone |" not in md
    assert "`gte-qwen2-7b`: time budget of 300 s used up" in md
    assert "Command: `attn-backends bench --out x`" in md
    assert "4.00 TB/s" in md
    assert "800 TFLOP/s" in md


def test_json_round_trips_and_keeps_non_finite_errors():
    result = _result()
    text = report.to_json(result)
    data = json.loads(text)  # strict JSON: no NaN/Infinity tokens
    trt = data["workloads"][1]["paths"][3]
    assert trt["path"] == "backend:trt"
    assert trt["rel_error"] == "inf"
    assert data["workloads"][1]["derived"]["targets"][0]["status"] == "PASS"
    back = report.from_json(text)
    assert back == result
    assert report.to_json(back) == text


def test_json_of_another_format_is_refused():
    with pytest.raises(ValueError, match="format"):
        report.from_json('{"format": "something-else"}')
    with pytest.raises(ValueError, match="not JSON"):
        report.from_json("{")


def test_report_without_matplotlib_skips_the_chart(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    logged: list[str] = []
    written = report.write_report(_result(), tmp_path, logged.append)
    assert [p.name for p in written] == ["bench.json", "bench.md"]
    assert not (tmp_path / "bench.png").exists()
    assert any("matplotlib is not installed" in line for line in logged)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_report_writes_a_png_chart(tmp_path):
    written = report.write_report(_result(), tmp_path)
    assert [p.name for p in written] == ["bench.json", "bench.md", "bench.png"]
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chart_series_plot_only_correct_timed_paths():
    names, series = report.chart_series(_result())
    assert names == ["bert-base", "qwen3-emb-0.6b"]
    assert series["public API"] == [0.12, 0.55]
    assert series["flashinfer, no RoPE"] == [None, 0.48]
    assert "trt alone" in series and series["trt alone"] == [0.119, None]  # WRONG on qwen
    assert "varlen_attn" not in series


# --- CLI -------------------------------------------------------------------------------------


def test_cli_refuses_without_cuda(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err
    assert not (tmp_path / "out").exists()


def test_cli_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    assert "--time-budget-s" in capsys.readouterr().out
    for bad in (["--iters", "10"], ["--workloads", "bert-base,nope"], ["--time-budget-s", "0"]):
        with pytest.raises(SystemExit) as done:
            cli.main(bad)
        assert done.value.code == 2


def test_cli_parses_subsets_into_the_parent_namespace():
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli.add_arguments(sub.add_parser("bench"))
    args = parser.parse_args(
        ["bench", "--workloads", "short,bert-base", "--backends", "flashinfer,trt", "--iters", "40"]
    )
    assert [w.name for w in args.bench_workloads] == ["short", "bert-base"]
    assert args.bench_backends == ["flashinfer", "trt"]
    assert args.bench_iters == 40


def test_cli_renders_an_earlier_json_without_a_gpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    source = tmp_path / "run.json"
    source.write_text(report.to_json(_result()))
    out = tmp_path / "again"
    assert (
        cli.main(
            [
                "--render",
                str(source),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    md = (out / "bench.md").read_text()
    assert capsys.readouterr().out == md  # the table is what is printed last
    assert "### Targets" in md
    assert cli.main(["--render", str(tmp_path / "missing.json")]) == 2


def test_runner_starts_no_workload_past_its_time_budget():
    """The budget is spent before the first workload: each is recorded as skipped, with the
    partial JSON checkpointed after each (nothing is timed)."""
    checkpoints: list[BenchResult] = []
    config = BenchConfig(
        workloads=(get_workload("short"), get_workload("bert-base")),
        time_budget_s=1e-9,
        measure_ceilings=False,
    )
    result = run_benchmark(
        config, device="cpu", log=lambda line: None, checkpoint=checkpoints.append
    )
    assert result.workloads == ()
    assert [name for name, _ in result.skipped_workloads] == ["short", "bert-base"]
    assert all("time budget of 1e-09 s used up" in why for _, why in result.skipped_workloads)
    assert [len(c.skipped_workloads) for c in checkpoints] == [1, 2]
    assert not checkpoints[-1].complete and result.complete
    assert "`short`: time budget" in report.render_markdown(result)


# --- the torch paths compute the right numbers -------------------------------------------------


def _case(spec: AttentionSpec, lengths: tuple[int, ...], seed: int = 0):
    params = FMHAParams.from_lengths(lengths, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(params.token_q_num, spec.qkv_width, generator=gen).to(spec.dtype)
    return params, qkv, reference_attention(qkv, spec, params)


GQA_ROPE = AttentionSpec(
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    dtype=torch.bfloat16,
    causal=True,
    rope=RopeSpec(theta=1e6),
)
SPECS = [
    GQA_ROPE,
    AttentionSpec(num_heads=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, causal=False),
    AttentionSpec(
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,
        dtype=torch.float32,
        causal=True,
        rope=RopeSpec(theta=1e4, rotary_dim=32, interleaved=True),
    ),
]
LENGTHS = (5, 1, 70, 33)


@pytest.mark.parametrize("spec", SPECS, ids=["gqa-rope", "mha-bidir", "mqa-partial-interleaved"])
def test_padded_sdpa_matches_the_reference_and_leaves_its_input(spec):
    params, qkv, ref = _case(spec, LENGTHS)
    path = build_padded_sdpa(spec, params, rope_tables(spec, params))
    before = qkv.clone()
    out = path.run(qkv)
    assert out.shape == (params.token_q_num, spec.q_width)
    assert relative_error(out, ref) < TOLERANCE[spec.dtype]
    assert torch.equal(qkv, before)


def _torch_ragged(spec: AttentionSpec, params: FMHAParams):
    """Stand-in for flashinfer's ragged kernel: SDPA per sequence."""

    def kernel(q, k, v):
        out = torch.empty_like(q)
        cu = params.cu_seqlens_host
        for s, e in itertools.pairwise(cu):
            out[s:e] = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1),
                k[s:e].transpose(0, 1),
                v[s:e].transpose(0, 1),
                is_causal=spec.causal,
                scale=spec.scale,
                enable_gqa=True,
            ).transpose(0, 1)
        return out

    return kernel


@pytest.mark.parametrize("spec", SPECS, ids=["gqa-rope", "mha-bidir", "mqa-partial-interleaved"])
def test_legacy_path_matches_the_reference_and_fills_the_paged_cache(spec):
    params, qkv, ref = _case(spec, LENGTHS, seed=1)
    tables = rope_tables(spec, params)
    cache = paged_cache(spec, params, block=64)
    assert cache.tensor.shape == (1 + 1 + 2 + 1, 2, 64, spec.num_kv_heads, spec.head_dim)
    path = build_legacy(spec, params, tables, _torch_ragged(spec, params), cache)
    before = qkv.clone()
    out = path.run(qkv)
    assert relative_error(out, ref) < TOLERANCE[spec.dtype]
    assert torch.equal(qkv, before)
    k = qkv[:, spec.q_width : spec.q_width + spec.kv_width].unflatten(1, (spec.num_kv_heads, -1))
    v = qkv[:, spec.q_width + spec.kv_width :].unflatten(1, (spec.num_kv_heads, -1))
    k_rot = rotated(k, tables) if tables is not None else k
    token, first_block = 0, 0
    for length in params.input_lengths:
        for p in range(length):
            blk, off = first_block + p // 64, p % 64
            assert torch.equal(cache.tensor[blk, 0, off], k_rot[token])
            assert torch.equal(cache.tensor[blk, 1, off], v[token])
            token += 1
        first_block += -(-length // 64)


@pytest.mark.parametrize("spec", SPECS[:2], ids=["gqa-rope", "mha-bidir"])
def test_legacy_path_plans_flashinfer_like_the_backend(spec, monkeypatch):
    """Through the fake flashinfer (real signatures and checks, torch math)."""
    fake = install_fake_flashinfer(monkeypatch)
    params, qkv, ref = _case(spec, LENGTHS, seed=3)
    path = build_legacy_flashinfer(spec, params, rope_tables(spec, params))
    assert isinstance(path, PreparedPath)
    assert relative_error(path.run(qkv), ref) < TOLERANCE[spec.dtype]
    (plan,) = fake.named("BatchPrefillWithRaggedKVCacheWrapper.plan")
    assert plan.args["causal"] == spec.causal
    assert plan.args["sm_scale"] == spec.scale
    assert plan.args["q_data_type"] == spec.dtype
    assert plan.args["qo_indptr"].device.type == "cpu"  # host offsets: no device sync


def test_legacy_path_is_skipped_without_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError
    params, _, _ = _case(GQA_ROPE, (4,))
    skip = build_legacy_flashinfer(GQA_ROPE, params, None)
    assert isinstance(skip, Skip)
    assert "flashinfer is not installed" in skip.reason


def test_public_api_path_runs_forward_with_rope_in_place():
    spec = GQA_ROPE
    params, qkv, ref = _case(spec, LENGTHS, seed=2)
    path = build_public(spec, params, backend="torch-sdpa", prepare_iters=2)
    assert isinstance(path, PreparedPath)
    assert path.backend == "torch-sdpa"
    assert path.details["preprocess"] != "none"
    assert path.details["selected_by"] == "explicit"
    assert path.prepare_ms is not None and path.prepare_ms >= 0
    buffer = qkv.clone()
    out = path.run(buffer)
    assert relative_error(out, ref) < TOLERANCE[spec.dtype]
    assert not torch.equal(buffer, qkv)  # the contract rotated Q/K in place


def test_a_per_batch_preprocess_policy_is_reported_as_what_the_batch_ran():
    policy = "fused for batches of max_seqlen <= 256, else native"
    details = {"preprocess": policy, "input_layout": "views"}
    assert with_batch_preprocess(details, "native") == {
        "preprocess": "native",
        "preprocess_policy": policy,
        "input_layout": "views",
    }
    same = {"preprocess": "native"}
    assert with_batch_preprocess(same, "native") == same


def test_public_api_path_skips_a_backend_that_refuses_with_its_reasons():
    fp8 = dataclasses.replace(GQA_ROPE, dtype=torch.float8_e4m3fn)
    params = FMHAParams.from_lengths((3,), device="cpu")
    skip = build_public(fp8, params, backend="torch-sdpa")
    assert isinstance(skip, Skip)
    assert skip.reason.startswith("[fp8]")  # the reasons, not the generic preamble
    unknown = build_public(GQA_ROPE, params, backend="no-such-backend")
    assert isinstance(unknown, Skip)
    assert "unknown backend" in unknown.reason


def test_targets_default_is_only_the_api_target():
    assert Targets().to_dict() == {
        "api_within": 1.05,
        "legacy_speedup": None,
        "padded_speedup": None,
        "rope_overhead": None,
    }
    work = dataclasses.replace(_qwen(_qwen_paths()), targets=Targets())
    assert [t.target for t in evaluate_targets(work)] == ["api-vs-fastest"]
