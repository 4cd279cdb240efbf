"""The benchmark's CPU-side parts: workload data, floor/ratio/target math, the timing helpers'
arithmetic, the report, the CLI, the runner's modes, and the numbers of every path that runs
without a GPU (torch paths, and the flashinfer paths through the fake library). Nothing here
asserts a duration."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import inspect
import itertools
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

# The benchmark is not installed: it is imported from the checkout's benchmarks/ folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from attn_backends_bench import cli, ragged, report
from attn_backends_bench.graphs import (
    GraphChoice,
    GraphTarget,
    bucket_for,
    capture_graphs,
    check_replay,
    choose_graph_backend,
    open_graph,
)
from attn_backends_bench.interleave import (
    ROUNDS,
    TimingPlan,
    Timings,
    alternating,
    time_interleaved,
)
from attn_backends_bench.legacy import (
    ROPE_TEXT,
    LegacyRope,
    build_legacy,
    build_legacy_flashinfer,
    legacy_variants,
    paged_cache,
)
from attn_backends_bench.paths import (
    PreparedPath,
    Skip,
    Unsupported,
    build_padded_sdpa,
    build_public,
    rope_tables,
    rotated,
    with_batch_preprocess,
)
from attn_backends_bench.ragged import RAGGED_KERNEL, flashinfer_ragged, kernel_name
from attn_backends_bench.raw import ApiPlan, RawRecipe, build_raw, raw_recipe
from attn_backends_bench.results import (
    MODES,
    BenchResult,
    Ceilings,
    HostTiming,
    Mode,
    PathResult,
    Timing,
    WorkloadResult,
    engine_view,
    floor_ms,
    path_metrics,
    rope_cost,
)
from attn_backends_bench.runner import BenchConfig, run_benchmark
from attn_backends_bench.targets import evaluate_targets
from attn_backends_bench.timing import (
    MAX_HOST_CALLS,
    host_calls,
    host_timing,
    time_host_calls,
    time_latency,
)
from attn_backends_bench.workloads import (
    WORKLOADS,
    Targets,
    attention_bytes,
    attention_flops,
    get_workload,
    rope_bytes,
    workload_names,
)

from attn_backends import (
    PRESETS,
    AlibiSpec,
    AttentionSpec,
    FMHAParams,
    GraphBucket,
    Platform,
    RopeScaling,
    RopeSpec,
    reference_attention,
)
from attn_backends.plugin import COMMAND_GROUP
from attn_backends.reference import TOLERANCE, relative_error
from tests.fakes import fake_flashinfer_rope
from tests.fakes.fake_flashinfer import install as install_fake_flashinfer

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# --- workloads -------------------------------------------------------------------------------


def test_workloads_are_the_model_shapes_and_query_batches():
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
    bge, qwen = (16, 16, 64, False, None), (16, 8, 128, True, 1e6)
    assert shapes == {
        "bert-base": (32, 512, 512, 12, 12, 64, False, None),
        "bge-m3": (64, 16, 512, *bge),
        "qwen3-emb-0.6b": (32, 64, 2048, *qwen),
        "short": (256, 64, 64, *qwen),
        "bge-m3-q1x16": (1, 16, 16, *bge),
        "bge-m3-q4x32": (4, 32, 32, *bge),
        "bge-m3-q16x64": (16, 64, 64, *bge),
        "qwen3-emb-q1x16": (1, 16, 16, *qwen),
        "qwen3-emb-q4x32": (4, 32, 32, *qwen),
        "qwen3-emb-q16x64": (16, 64, 64, *qwen),
        "gte-qwen2-7b": (4, 8192, 8192, 28, 4, 128, True, 1e6),
    }
    assert workload_names()[-1] == "gte-qwen2-7b"  # the one a tight budget drops
    assert len({w.salt for w in WORKLOADS}) == len(WORKLOADS)
    assert {w.name for w in WORKLOADS if w.varlen} == {"bge-m3", "qwen3-emb-0.6b"}
    assert get_workload("qwen3-emb-q4x32").lengths(3) == (32, 32, 32, 32)
    assert get_workload("qwen3-emb-q16x64").title == "Qwen3-Embedding-0.6B query 16 x 64"
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
    # the engine-view targets hold on every workload
    assert {(w.targets.host_overhead_us, w.targets.latency_within) for w in WORKLOADS} == {
        (5.0, 1.05)
    }
    queries = [w for w in WORKLOADS if w.name.rsplit("-", 1)[-1].startswith("q")]
    assert len(queries) == 6
    assert all(w.targets == Targets() for w in queries)


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


def _host(us: float) -> HostTiming:
    return HostTiming(median_us=us, min_us=us * 0.9, max_us=us * 1.2, calls=50, repeats=7)


def _path(path, ms, status="ok", **kw):
    kind = path.split(":")[0]
    default = path.split(":")[1] if kind in ("backend", "attention-alone") else None
    backend = kw.pop("backend", default)
    error = None if status in ("skipped", "unsupported") else (2e-3 if status != "wrong" else 1.4)
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
            latency=_timing(0.60),
            host=_host(55.0),
        ),
        _path("backend:flashinfer", 0.54, details={"preprocess": "torch"}),
        _path("backend:flashinfer-rope", 1.08, details={"preprocess": "fused"}),
        _path("backend:trt", 0.30, status="wrong", rel_error=float("inf")),  # never "fastest"
        _path("backend:headwise", None, status="skipped", note="[headwise] needs a config"),
        _path("attention-alone:flashinfer", 0.48, details={"preprocess": "none"}),
        _path(
            "legacy", 1.10, backend="flashinfer", details={"rope": ROPE_TEXT["flashinfer-inplace"]}
        ),
        _path("padded-sdpa", 5.5),
        _path("varlen-attn", None, status="error", note="RuntimeError: boom"),
        _path(
            "raw",
            0.53,
            backend="flashinfer",
            details={"rope": "attn_backends native rope_logn_, in place on the packed rows"},
            latency=_timing(0.58),
            host=_host(18.0),
        ),
        _path(
            "legacy:fused-copy-rope",
            1.00,
            backend="flashinfer",
            details={"rope": ROPE_TEXT["flashinfer-fused-copy"]},
        ),
        _path("legacy:torch-rope", 3.0, backend="flashinfer", details={"rope": ROPE_TEXT["torch"]}),
        _path(
            "graph",
            0.50,
            backend="flashinfer-rope",
            details={"selected_by": "priority", "preprocess": "native", "bucket": "max_tokens=9"},
            latency=_timing(0.52),
            host=_host(3.0),
            matches_eager=True,
        ),
        _path(
            "graph:torch-sdpa",
            None,
            status="unsupported",
            note="[cuda_graph] cannot be captured in a CUDA graph",
        ),
    )


def _by_target(work: WorkloadResult) -> dict[str, tuple[str, object]]:
    return {t.target: (t.status, t.value) for t in evaluate_targets(work)}


def test_targets_judge_ratios_from_correct_paths_only():
    got = _by_target(_qwen(_qwen_paths()))
    assert got["api-vs-fastest"] == ("PASS", pytest.approx(0.55 / 0.54))
    # the fastest correct legacy variant is the baseline (fused-copy RoPE, 1.00 ms)
    assert got["legacy-speedup"] == ("FAIL", pytest.approx(1.00 / 0.55))
    assert got["padded-speedup"] == ("PASS", pytest.approx(10.0))
    assert got["rope-overhead"] == ("FAIL", pytest.approx(0.55 / 0.48))
    # engine view: a difference in µs and a latency ratio against the raw kernel
    assert got["host-overhead"] == ("FAIL", pytest.approx(55.0 - 18.0))
    assert got["latency-vs-raw"] == ("PASS", pytest.approx(0.60 / 0.58))
    units = {t.target: t.unit for t in evaluate_targets(_qwen(_qwen_paths()))}
    assert units["host-overhead"] == "us" and units["latency-vs-raw"] == "x"


def test_target_fails_when_the_public_api_is_wrong_and_is_na_when_the_baseline_is():
    paths = _qwen_paths()
    wrong_api = (dataclasses.replace(paths[0], status="wrong", note="err 1.4"), *paths[1:])
    assert {s for s, _ in _by_target(_qwen(wrong_api)).values()} == {"FAIL"}
    no_legacy = tuple(p for p in paths if p.kind != "legacy")
    got = _by_target(_qwen(no_legacy))
    assert got["legacy-speedup"] == ("N/A", None)
    assert got["api-vs-fastest"][0] == "PASS"
    skipped_raw = tuple(
        dataclasses.replace(p, status="skipped", note="the public API runs trt", timing=None)
        if p.path == "raw"
        else p
        for p in paths
    )
    for target in evaluate_targets(_qwen(skipped_raw)):
        if target.target in ("host-overhead", "latency-vs-raw"):
            assert target.status == "N/A"
            assert target.note == "the raw kernel path is SKIPPED: the public API runs trt"


def test_targets_of_modes_not_run_are_na_and_a_missing_api_timing_fails():
    work = dataclasses.replace(_qwen(_qwen_paths()), modes=("latency", "host"))
    got = {t.target: t for t in evaluate_targets(work)}
    assert got["api-vs-fastest"].status == "N/A"
    assert got["api-vs-fastest"].note == "the throughput mode was not run"
    assert got["legacy-speedup"].status == "N/A"
    assert got["host-overhead"].status == "FAIL"  # measured: 37 µs over the raw call
    assert got["latency-vs-raw"].status == "PASS"
    untimed = tuple(
        dataclasses.replace(p, host=None) if p.path == "api" else p for p in _qwen_paths()
    )
    host = next(t for t in evaluate_targets(_qwen(untimed)) if t.target == "host-overhead")
    assert (host.status, host.note) == ("FAIL", "the public API path has no host timing")


def test_engine_view_compares_the_api_with_the_raw_kernel_in_each_mode():
    view = engine_view(_qwen(_qwen_paths()))
    assert view.host_overhead_us == pytest.approx(37.0)
    assert view.latency_ratio == pytest.approx(0.60 / 0.58)
    assert view.throughput_ratio == pytest.approx(0.55 / 0.53)
    assert view.graph_latency_ratio == pytest.approx(0.52 / 0.58)
    assert view.graph_host_us == pytest.approx(3.0)
    wrong_raw = tuple(
        dataclasses.replace(p, status="wrong") if p.path == "raw" else p for p in _qwen_paths()
    )
    assert engine_view(_qwen(wrong_raw)).to_dict() == {
        "host_overhead_us": None,
        "latency_ratio": None,
        "throughput_ratio": None,
        "graph_latency_ratio": None,
        "graph_host_us": 3.0,
    }


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
    assert m.vs_legacy == pytest.approx(1.00 / 0.55)  # the fastest legacy variant
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
                latency=_timing(0.16),
                host=_host(40.0),
            ),
            _path("backend:trt", 0.119),
            _path("backend:flashinfer", 0.13),
            _path("legacy", 0.29, backend="flashinfer", details={"rope": ROPE_TEXT["none"]}),
            _path("padded-sdpa", 1.09),
            _path(
                "raw",
                None,
                status="skipped",
                backend="flashinfer",
                note="the public API runs trt; the raw baseline is flashinfer's ragged kernel",
            ),
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
            "command": "python3 benchmarks/bench.py --out x",
            "modes": list(MODES),
            "host_calls": 50,
            "host_repeats": 7,
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
    assert "| qwen3-emb-0.6b | fastest legacy / public API | 1.82x | >= 2x | FAIL |" in md
    assert "| qwen3-emb-0.6b | public API (RoPE + attention) / attention alone | 1.15x" in md
    assert "| bert-base | public API | trt (by priority) |" in md
    assert "RuntimeError: boom" in md
    assert "headwise: [headwise] needs a config" in md  # refused backends listed, not tabled
    assert "| qwen3-emb-0.6b | headwise alone |" not in md
    assert "`gte-qwen2-7b`: time budget of 300 s used up" in md
    assert "Command: `python3 benchmarks/bench.py --out x`" in md
    assert "4.00 TB/s" in md
    assert "800 TFLOP/s" in md


def test_markdown_has_one_table_per_mode_with_the_engine_view():
    md = report.render_markdown(_result())
    sections = [line for line in md.splitlines() if line.startswith("### ")]
    assert sections[1:5] == [
        "### Host: µs of CPU per `forward` call",
        "### Latency: ms per synchronised call",
        "### Throughput: ms per layer, back-to-back",
        "### Graph replay",
    ]
    # host: the difference against the raw call, judged against raw + 5 µs
    assert (
        "| qwen3-emb-0.6b | flashinfer, torch | 55.0 | 18.0 | +37.0 | FAIL (<= 5 µs) | 3.0 |" in md
    )
    assert "| bert-base | trt, none | 40.0 | - | - | N/A (<= 5 µs) | - |" in md
    # latency: the ratio against the raw call, and the graph replay against the raw call
    assert "| 0.600 | 0.580 | 1.03x | PASS (<= 1.05x) | 0.520 | 0.90x |" in md
    # throughput: API, raw and graph replay side by side
    assert "| qwen3-emb-0.6b | 0.550 | 0.530 | 1.04x | 0.500 | 0.540 flashinfer |" in md
    # graph: a bitwise-checked replay, and a backend without graph mode with its reason
    assert "| graph | flashinfer-rope (by priority) | preprocess=native" in md
    assert "ok 2.0e-03, = eager | 0.500 | 0.520 | 3.0 | 0.600 |" in md
    assert (
        "| qwen3-emb-0.6b | graph:torch-sdpa | - | - | not supported: [cuda_graph] cannot be "
        "captured in a CUDA graph |" in md
    )
    # targets in their units
    assert "| public API host µs - raw kernel host µs | +37.0 µs | <= 5 µs | FAIL |" in md
    assert "| public API latency / raw kernel latency | 1.03x | <= 1.05x | PASS |" in md
    assert "the raw kernel path is SKIPPED: the public API runs trt" in md
    # which RoPE each legacy variant and the raw kernel ran
    assert (
        "| qwen3-emb-0.6b | legacy:fused-copy-rope | flashinfer apply_rope_pos_ids: copy and "
        "rotation in one pass | ok 2.0e-03 | 1.000 | 1.82x |" in md
    )
    assert "rope=attn_backends native rope_logn_, in place on the packed rows" in md
    assert "median of 7 repeats" in md


def test_markdown_leaves_out_the_tables_of_modes_not_run():
    result = _result()
    only_host = dataclasses.replace(
        result,
        workloads=tuple(dataclasses.replace(w, modes=("host",)) for w in result.workloads),
    )
    md = report.render_markdown(only_host)
    assert "### Host:" in md
    for absent in ("### Latency:", "### Throughput:", "### Graph replay"):
        assert absent not in md
    assert "N/A (the throughput mode was not run)" in md


def test_summary_lines_speak_in_the_targets_units():
    lines = report.summary_lines(evaluate_targets(_qwen(_qwen_paths())))
    assert "FAIL qwen3-emb-0.6b: public API host µs - raw kernel host µs = +37.0 µs " in "\n".join(
        lines
    )
    assert any(line.endswith("(required <= 1.05x)") and "latency" in line for line in lines)


def test_json_round_trips_and_keeps_non_finite_errors():
    result = _result()
    text = report.to_json(result)
    data = json.loads(text)  # strict JSON: no NaN/Infinity tokens
    assert data["format"] == "attn-backends-bench/2"
    qwen = data["workloads"][1]
    trt = qwen["paths"][3]
    assert trt["path"] == "backend:trt"
    assert trt["rel_error"] == "inf"
    assert qwen["derived"]["targets"][0]["status"] == "PASS"
    assert qwen["derived"]["engine"]["host_overhead_us"] == pytest.approx(37.0)
    assert qwen["modes"] == list(MODES)
    graph = next(p for p in qwen["paths"] if p["path"] == "graph")
    assert graph["matches_eager"] is True
    assert graph["host"]["median_us"] == 3.0
    assert graph["latency"]["median_ms"] == 0.52
    back = report.from_json(text)
    assert back == result
    assert report.to_json(back) == text


def test_fake_rope_functions_have_flashinfers_signatures():
    real = pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    for name in fake_flashinfer_rope.FLASHINFER_FUNCTIONS:
        theirs = inspect.signature(getattr(real, name)).parameters.values()
        ours = inspect.signature(getattr(fake_flashinfer_rope, name)).parameters.values()
        assert [(p.name, p.kind, p.default) for p in ours] == [
            (p.name, p.kind, p.default) for p in theirs
        ], name


def test_json_of_format_1_still_loads_as_throughput_only():
    data = json.loads(report.to_json(_result()))
    data["format"] = "attn-backends-bench/1"
    for work in data["workloads"]:
        del work["modes"]
        for key in ("host_overhead_us", "latency_within"):
            del work["targets"][key]
        for path in work["paths"]:
            for key in ("latency", "host", "matches_eager"):
                del path[key]
    old = report.from_dict(data)
    assert all(w.modes == ("throughput",) for w in old.workloads)
    qwen = old.workloads[1]
    assert qwen.targets.host_overhead_us is None
    assert {t.target for t in evaluate_targets(qwen)} == {
        "api-vs-fastest",
        "legacy-speedup",
        "padded-speedup",
        "rope-overhead",
    }
    md = report.render_markdown(old)
    assert "### Throughput:" in md and "### Host:" not in md


def test_json_of_another_format_is_refused():
    with pytest.raises(ValueError, match="format"):
        report.from_json('{"format": "something-else"}')
    data = json.loads(report.to_json(_result()))
    data["workloads"][0]["modes"] = ["throughput", "warp"]
    with pytest.raises(ValueError, match="unknown mode"):
        report.from_dict(data)
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
    assert series["legacy, fused-copy RoPE"] == [None, 1.0]
    assert series["raw kernel"] == [None, 0.53]
    assert series["graph replay"] == [None, 0.5]
    assert report.latency_series(_result()) == {
        "public API": [0.16, 0.60],
        "raw kernel": [None, 0.58],
        "graph replay": [None, 0.52],
    }


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


def _legacy_rope(spec: AttentionSpec) -> LegacyRope:
    return "torch" if spec.rope is not None else "none"


@pytest.mark.parametrize("spec", SPECS, ids=["gqa-rope", "mha-bidir", "mqa-partial-interleaved"])
def test_legacy_path_matches_the_reference_and_fills_the_paged_cache(spec):
    params, qkv, ref = _case(spec, LENGTHS, seed=1)
    tables = rope_tables(spec, params)
    cache = paged_cache(spec, params, block=64)
    assert cache.tensor.shape == (1 + 1 + 2 + 1, 2, 64, spec.num_kv_heads, spec.head_dim)
    rope = _legacy_rope(spec)
    path = build_legacy(spec, params, rope, _torch_ragged(spec, params), cache)
    assert path.details["rope"] == ROPE_TEXT[rope]
    before = qkv.clone()
    out = path.run(qkv)
    assert relative_error(out, ref) < TOLERANCE[spec.dtype]
    assert torch.equal(qkv, before)
    _assert_cache_holds_rotated_k(spec, params, qkv, cache, tables)


def _assert_cache_holds_rotated_k(spec, params, qkv, cache, tables, exact=True):
    k = qkv[:, spec.q_width : spec.q_width + spec.kv_width].unflatten(1, (spec.num_kv_heads, -1))
    v = qkv[:, spec.q_width + spec.kv_width :].unflatten(1, (spec.num_kv_heads, -1))
    k_rot = rotated(k, tables) if tables is not None else k
    token, first_block = 0, 0
    for length in params.input_lengths:
        for p in range(length):
            blk, off = first_block + p // 64, p % 64
            if exact:
                assert torch.equal(cache.tensor[blk, 0, off], k_rot[token])
            else:  # another RoPE kernel: the same rotation up to rounding
                assert torch.allclose(cache.tensor[blk, 0, off], k_rot[token], atol=2e-2)
            assert torch.equal(cache.tensor[blk, 1, off], v[token])
            token += 1
        first_block += -(-length // 64)


def test_legacy_variant_of_a_spec_without_rope_rejects_a_rope():
    spec = SPECS[1]
    params, _, _ = _case(spec, (4,))
    with pytest.raises(ValueError, match="does not fit"):
        build_legacy(spec, params, "torch", _torch_ragged(spec, params))
    with pytest.raises(ValueError, match="does not fit"):
        build_legacy(GQA_ROPE, params, "none", _torch_ragged(GQA_ROPE, params))


@pytest.mark.parametrize("rope", ["flashinfer-inplace", "flashinfer-fused-copy"])
@pytest.mark.parametrize("spec", [GQA_ROPE, SPECS[2]], ids=["gqa-rope", "mqa-partial-interleaved"])
def test_legacy_path_with_flashinfer_rope_matches_the_reference(spec, rope, monkeypatch):
    """Both flashinfer RoPE variants (in place on the copies, fused into the copy) through the
    fake library: right positions, theta, rotary_dim and style; the input stays untouched."""
    install_fake_flashinfer(monkeypatch)
    fake_flashinfer_rope.add_to(monkeypatch)
    params, qkv, ref = _case(spec, LENGTHS, seed=4)
    cache = paged_cache(spec, params, block=64)
    path = build_legacy(spec, params, rope, _torch_ragged(spec, params), cache)
    assert path.details["rope"] == ROPE_TEXT[rope]
    before = qkv.clone()
    assert relative_error(path.run(qkv), ref) < TOLERANCE[spec.dtype]
    assert torch.equal(qkv, before)
    _assert_cache_holds_rotated_k(spec, params, qkv, cache, rope_tables(spec, params), False)


CUDA_WITH_FLASHINFER = Platform(kind="cuda", arch="sm90", libraries=(("flashinfer", "0.7.0"),))
CUDA_WITHOUT_FLASHINFER = Platform(kind="cuda", arch="sm90", libraries=(("flashinfer", None),))


def test_legacy_variants_use_the_fastest_rope_available_and_say_which(monkeypatch):
    install_fake_flashinfer(monkeypatch)  # imports the plugin, which registers its RoPE pass
    variants = {v.path: v for v in legacy_variants(GQA_ROPE, CUDA_WITH_FLASHINFER)}
    assert list(variants) == ["legacy", "legacy:fused-copy-rope", "legacy:torch-rope"]
    assert variants["legacy"].rope == "flashinfer-inplace"
    assert "native kernel rotates packed Q|K|V rows" in variants["legacy"].why
    assert variants["legacy:fused-copy-rope"].rope == "flashinfer-fused-copy"
    assert variants["legacy:fused-copy-rope"].unavailable is None
    assert variants["legacy:torch-rope"].rope == "torch"
    # without flashinfer: torch ops on the copies, the fused variant skipped with the reason
    without = {v.path: v for v in legacy_variants(GQA_ROPE, CUDA_WITHOUT_FLASHINFER)}
    assert list(without) == ["legacy", "legacy:fused-copy-rope"]
    assert without["legacy"].rope == "torch"
    assert "flashinfer is not installed" in without["legacy"].why
    skip = build_legacy_flashinfer(
        GQA_ROPE, _case(GQA_ROPE, (4,))[0], without["legacy:fused-copy-rope"]
    )
    assert isinstance(skip, Skip) and "flashinfer is not installed" in skip.reason
    # no RoPE: one legacy path
    (plain,) = legacy_variants(SPECS[1], CUDA_WITH_FLASHINFER)
    assert (plain.path, plain.rope) == ("legacy", "none")


@pytest.mark.parametrize("spec", SPECS[:2], ids=["gqa-rope", "mha-bidir"])
def test_legacy_path_plans_flashinfer_like_the_backend(spec, monkeypatch):
    """Through the fake flashinfer (real signatures and checks, torch math)."""
    fake = install_fake_flashinfer(monkeypatch)
    params, qkv, ref = _case(spec, LENGTHS, seed=3)
    (variant, *_) = legacy_variants(spec, Platform(kind="cpu"))
    path = build_legacy_flashinfer(spec, params, variant)
    assert isinstance(path, PreparedPath)
    assert path.details["flashinfer_backend"] == "fa2"  # not Hopper: what the backend picks
    assert relative_error(path.run(qkv), ref) < TOLERANCE[spec.dtype]
    (plan,) = fake.named("BatchPrefillWithRaggedKVCacheWrapper.plan")
    assert plan.args["causal"] == spec.causal
    assert plan.args["sm_scale"] == spec.scale
    assert plan.args["q_data_type"] == spec.dtype
    assert plan.args["pos_encoding_mode"] == "NONE"
    assert plan.args["qo_indptr"].device.type == "cpu"  # host offsets: no device sync


def test_legacy_path_is_skipped_without_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError
    params, _, _ = _case(GQA_ROPE, (4,))
    (variant, *_) = legacy_variants(GQA_ROPE, Platform(kind="cpu"))
    skip = build_legacy_flashinfer(GQA_ROPE, params, variant)
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


def test_public_api_path_checks_each_timed_buffer_once(monkeypatch):
    """The timed calls rotate buffers through one plan, as an engine's layers do; the plan
    remembers every buffer, so forward's buffer checks run once per buffer, not per call."""
    from attn_backends._path import _contract

    checked: list[int] = []
    real_check = _contract.check_packed

    def counting_check(packed, spec, params):
        checked.append(packed.data_ptr())
        return real_check(packed, spec, params)

    monkeypatch.setattr(_contract, "check_packed", counting_check)
    spec = SPECS[1]
    params, qkv, ref = _case(spec, (3, 5), seed=9)
    sets = [qkv.clone(), qkv.clone(), qkv.clone()]
    path = build_public(spec, params, backend="torch-sdpa", prepare_iters=1)
    assert isinstance(path, PreparedPath)
    checked.clear()
    for i in range(9):
        assert relative_error(path.run(sets[i % 3]), ref) < TOLERANCE[spec.dtype]
    assert sorted(checked) == sorted(s.data_ptr() for s in sets)


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


def test_targets_default_is_the_api_and_engine_view_targets():
    assert Targets().to_dict() == {
        "api_within": 1.05,
        "legacy_speedup": None,
        "padded_speedup": None,
        "rope_overhead": None,
        "host_overhead_us": 5.0,
        "latency_within": 1.05,
    }
    work = dataclasses.replace(_qwen(_qwen_paths()), targets=Targets())
    assert [t.target for t in evaluate_targets(work)] == [
        "api-vs-fastest",
        "host-overhead",
        "latency-vs-raw",
    ]


# --- timing helpers: the arithmetic and the calls they make (no duration is asserted) ---------


def test_host_timing_divides_each_repeat_by_its_calls():
    t = host_timing([0.004, 0.001, 0.002], calls=20)
    assert t.median_us == pytest.approx(100.0)
    assert t.min_us == pytest.approx(50.0)
    assert t.max_us == pytest.approx(200.0)
    assert (t.calls, t.repeats) == (20, 3)
    for elapsed, calls in (([], 5), ([1.0], 0)):
        with pytest.raises(ValueError, match="at least one"):
            host_timing(elapsed, calls)


def test_host_calls_stay_below_the_launch_queue():
    assert host_calls(50) == 50
    assert host_calls(10_000) == MAX_HOST_CALLS == 100
    assert host_calls(0) == 1


def test_host_and_latency_timers_make_exactly_the_calls_they_report():
    cpu = torch.device("cpu")
    seen: list[int] = []
    host = time_host_calls(seen.append, calls=5, repeats=3, warmup=2, device=cpu)
    assert seen == list(range(2 + 5 * 3))  # consecutive input-set indices, warm-up first
    assert (host.calls, host.repeats) == (5, 3)
    assert host.min_us <= host.median_us <= host.max_us
    seen.clear()
    latency = time_latency(seen.append, iters=4, warmup=1, device=cpu, input_sets=2)
    assert seen == [0, 1, 2, 3, 4]
    assert (latency.iters, latency.warmup, latency.input_sets) == (4, 1, 2)
    assert latency.min_ms <= latency.median_ms
    with pytest.raises(ValueError, match="repeats"):
        time_host_calls(seen.append, calls=1, repeats=0, warmup=0, device=cpu)


def _recording_step(log: list[tuple[str, int]], name: str, fail_at: int | None = None):
    def step(i: int) -> None:
        if i == fail_at:
            raise RuntimeError(f"{name} broke at call {i}")
        log.append((name, i))

    return step


def test_compared_paths_are_timed_in_alternating_rounds():
    assert alternating([0, 1, 2], 4) == [[0, 1, 2], [2, 1, 0], [0, 1, 2], [2, 1, 0]]
    calls: list[tuple[str, int]] = []
    plan = TimingPlan(iters=10, warmup=1, host_repeats=2, input_sets=3, device=torch.device("cpu"))
    both: tuple[Mode, ...] = ("throughput", "latency", "host")
    api, raw = _recording_step(calls, "api"), _recording_step(calls, "raw")
    out = time_interleaved([(api, both), (raw, ("latency",))], plan)
    api_t, raw_t = out
    assert isinstance(api_t, Timings) and isinstance(raw_t, Timings)
    per_round = -(-10 // ROUNDS)
    assert api_t.throughput is not None and api_t.throughput.iters == 10
    assert raw_t.throughput is None  # not asked for: the api's throughput rounds are alone
    assert api_t.latency is not None and raw_t.latency is not None
    assert api_t.latency.iters == raw_t.latency.iters == ROUNDS * per_round
    assert api_t.host is not None and (api_t.host.calls, api_t.host.repeats) == (10, 2)
    assert raw_t.host is None
    # each path's calls walk its input sets in order: warm-up, then timed, block after block
    for name in ("api", "raw"):
        indices = [i for n, i in calls if n == name]
        assert indices == list(range(len(indices)))
    # the latency rounds alternate: api first, then raw first, ...
    latency_calls = calls[10 + 1 :]  # after the api's single throughput round (1 warm + 10)
    starts = [latency_calls[k * (1 + per_round)][0] for k in range(2 * ROUNDS)]
    assert starts == ["api", "raw", "raw", "api"] * (ROUNDS // 2) + ["api", "raw"] * (ROUNDS % 2)


def test_a_path_that_fails_while_timed_stops_alone():
    calls: list[tuple[str, int]] = []
    plan = TimingPlan(iters=4, warmup=0, host_repeats=1, input_sets=1, device=torch.device("cpu"))
    modes: tuple[Mode, ...] = ("latency",)
    broken = _recording_step(calls, "broken", fail_at=3)
    fine = _recording_step(calls, "fine")
    err, ok = time_interleaved([(broken, modes), (fine, modes)], plan)
    assert isinstance(err, RuntimeError) and "broke at call 3" in str(err)
    assert isinstance(ok, Timings) and ok.latency is not None
    assert ok.latency.iters == ROUNDS  # ceil(4 / ROUNDS) = 1 call per round, at least iters
    assert max(i for n, i in calls if n == "broken") == 2  # never called again


# --- CLI and runner: modes ---------------------------------------------------------------------


def _bench_args(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_selects_modes_in_canonical_order_and_refuses_unknown_ones(capsys):
    assert _bench_args([]).bench_modes == MODES == ("throughput", "latency", "host", "graph")
    args = _bench_args(["--modes", "graph, host", "--host-repeats", "3"])
    assert args.bench_modes == ("host", "graph")
    assert args.bench_host_repeats == 3
    for bad in (["--modes", "warp"], ["--modes", ","], ["--host-repeats", "0"]):
        with pytest.raises(SystemExit) as done:
            _bench_args(bad)
        assert done.value.code == 2
    err = capsys.readouterr().err
    assert "unknown mode(s) warp; known: throughput,latency,host,graph" in err
    assert "unknown mode(s) (none given)" in err
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "--modes" in capsys.readouterr().out


TINY = get_workload("bge-m3-q1x16")


def _run_tiny(modes) -> WorkloadResult:
    config = BenchConfig(
        workloads=(TINY,), iters=2, warmup=0, measure_ceilings=False, modes=modes, host_repeats=2
    )
    result = run_benchmark(config, device="cpu", log=lambda line: None)
    assert result.meta["modes"] == list(modes)
    (work,) = result.workloads
    assert work.modes == modes
    return work


def test_runner_times_the_engine_view_in_the_modes_asked_for_only():
    work = _run_tiny(("latency", "host"))
    assert [p.path for p in work.paths] == ["api", "raw"]  # no throughput-only paths
    api = work.get("api")
    assert api is not None and api.status == "ok" and api.backend == "torch-sdpa"
    assert api.timing is None
    assert api.latency is not None and (api.latency.iters, api.latency.warmup) == (2, 0)
    assert api.host is not None and (api.host.calls, api.host.repeats) == (2, 2)
    raw = work.get("raw")
    assert raw is not None and raw.status == "skipped"
    assert raw.note is not None and raw.note.startswith("the public API runs torch-sdpa")
    got = {t.target: (t.status, t.note) for t in evaluate_targets(work)}
    assert got["api-vs-fastest"] == ("N/A", "the throughput mode was not run")
    assert got["host-overhead"][0] == "N/A"
    assert got["latency-vs-raw"][0] == "N/A"


def test_runner_records_graph_mode_not_supported_with_its_reasons():
    work = _run_tiny(("throughput", "graph"))
    graphs = {p.path: p for p in work.paths if p.kind == "graph"}
    # the API's choice, then each backend that served the workload alone (on CPU: flex,
    # headwise, which serves every flex spec, and torch-sdpa)
    assert list(graphs) == ["graph", "graph:flex", "graph:headwise", "graph:torch-sdpa"]
    assert all(p.status == "unsupported" and p.timing is None for p in graphs.values())
    auto_reason = graphs["graph"].note or ""
    assert "without graph mode:" in auto_reason and "torch-sdpa" in auto_reason
    assert (graphs["graph:torch-sdpa"].note or "").startswith("[cuda_graph]")
    # every path of the workload is timed in one interleaved group: ROUNDS blocks each
    api, alone = work.get("api"), work.get("backend:torch-sdpa")
    assert api is not None and api.timing is not None and api.latency is None
    assert alone is not None and alone.timing is not None
    assert api.timing.iters == alone.timing.iters == ROUNDS  # ceil(2 / ROUNDS) = 1 per round
    md = report.render_markdown(BenchResult({"modes": list(work.modes)}, None, (work,)))
    assert "| bge-m3-q1x16 | graph:torch-sdpa | torch-sdpa | - | not supported: [cuda_graph]" in md


# --- the raw kernel ---------------------------------------------------------------------------


def _api(backend, preprocess, kernel=RAGGED_KERNEL) -> ApiPlan:
    details = {"preprocess": preprocess} if preprocess is not None else {}
    return ApiPlan.from_record(backend, {**details, "kernel": kernel} if kernel else details)


def test_raw_recipe_mirrors_the_api_plan():
    cpu = torch.device("cpu")
    assert raw_recipe(_api("flashinfer-rope", "fused"), GQA_ROPE, cpu) == RawRecipe("fa2", "fused")
    assert raw_recipe(_api("flashinfer", "native"), GQA_ROPE, cpu) == RawRecipe("fa2", "native")
    assert RawRecipe("fa2", "fused").details()["pos_encoding_mode"] == "ROPE_LLAMA"
    assert RawRecipe("fa3", "native").details() == {
        "flashinfer_backend": "fa3",
        "pos_encoding_mode": "NONE",
        "rope": "attn_backends native rope_logn_, in place on the packed rows",
    }
    for api, why in (
        (_api("trt", "none", "flashinfer.trtllm_fmha_v2_prefill"), "the public API runs trt"),
        (_api(None, None, None), "the public API runs nothing"),
        (_api("flashinfer", "no-such-pass"), "'no-such-pass' is not registered"),
    ):
        skip = raw_recipe(api, GQA_ROPE, cpu)
        assert isinstance(skip, Skip) and why in skip.reason


@pytest.mark.parametrize("rope", ["fused", "torch", "flashinfer"])
def test_raw_path_runs_the_api_plans_kernels_by_hand(rope, monkeypatch):
    fake = install_fake_flashinfer(monkeypatch)
    fake_flashinfer_rope.add_to(monkeypatch)
    params, qkv, ref = _case(GQA_ROPE, LENGTHS, seed=5)
    path = build_raw(GQA_ROPE, params, RawRecipe("fa2", rope))
    assert isinstance(path, PreparedPath)
    buffer = qkv.clone()
    assert relative_error(path.run(buffer), ref) < TOLERANCE[GQA_ROPE.dtype]
    (plan,) = fake.named("BatchPrefillWithRaggedKVCacheWrapper.plan")
    assert plan.args["pos_encoding_mode"] == ("ROPE_LLAMA" if rope == "fused" else "NONE")
    assert plan.args["rope_theta"] == (1e6 if rope == "fused" else None)
    # a separate pass rotates the caller's rows in place, as the API does; fused leaves them
    assert torch.equal(buffer, qkv) == (rope == "fused")
    (run,) = fake.named("BatchPrefillWithRaggedKVCacheWrapper.run")
    assert run.args["q"].data_ptr() == buffer.data_ptr()  # views of the rows, no copy
    assert run.args["k"].stride() == (GQA_ROPE.qkv_width, GQA_ROPE.head_dim, 1)


def test_raw_path_without_rope(monkeypatch):
    install_fake_flashinfer(monkeypatch)
    spec = SPECS[1]
    params, qkv, ref = _case(spec, LENGTHS, seed=6)
    path = build_raw(spec, params, RawRecipe("fa2", "none"))
    assert isinstance(path, PreparedPath)
    buffer = qkv.clone()
    assert relative_error(path.run(buffer), ref) < TOLERANCE[spec.dtype]
    assert torch.equal(buffer, qkv)
    assert path.details["rope"] == "none (the spec has no RoPE)"


# --- graph replay (a CUDA graph stood in for by an eager re-run) -------------------------------


class _EagerReplay:
    """Stands in for a captured CUDA graph: ``replay`` re-runs the call into the static output;
    ``skew`` is added to the output, as a broken capture would differ from eager."""

    def __init__(self, fn, skew: float = 0.0) -> None:
        self.fn = fn
        self.skew = skew
        self.output = fn().clone()
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.output.copy_(self.fn())
        self.output[0, 0] += self.skew


def _capture(skew: float = 0.0):
    captured: list[_EagerReplay] = []

    def capture(fn, device):
        replay = _EagerReplay(fn, skew)
        captured.append(replay)
        return replay, replay.output

    return capture, captured


def _graph_target(spec: AttentionSpec, params: FMHAParams) -> GraphTarget:
    """The flashinfer backend's graph plan through the fake library (graph mode proper needs
    CUDA, so the selector would refuse it here; the plan itself does not)."""
    from attn_backends_builtin.flashinfer import FlashinferBackend

    backend = FlashinferBackend.bind(spec, CUDA_WITH_FLASHINFER)
    assert isinstance(backend, FlashinferBackend)
    target = open_graph(GraphChoice("flashinfer", backend, {"selected_by": "explicit"}), params)
    assert isinstance(target, GraphTarget)
    return target


def test_a_graph_plan_is_opened_for_exactly_the_batch(monkeypatch):
    install_fake_flashinfer(monkeypatch)
    spec = SPECS[1]
    params, _, _ = _case(spec, LENGTHS)
    target = _graph_target(spec, params)
    assert target.plan.bucket == GraphBucket(109, 4, 70) == bucket_for(params)
    assert target.plan.token_q_num == params.token_q_num
    assert target.details == {
        "selected_by": "explicit",
        "preprocess": "none",
        "bucket": "max_tokens=109, max_batch=4, max_seqlen=70",
    }


def test_graph_replay_is_checked_bit_for_bit_against_the_eager_graph_plan(monkeypatch):
    install_fake_flashinfer(monkeypatch)
    spec = SPECS[1]  # no RoPE: graph mode needs no native kernel, so it runs on the CPU
    params, qkv, ref = _case(spec, LENGTHS, seed=7)
    target = _graph_target(spec, params)
    sets = [torch.randn_like(qkv, dtype=torch.float32).to(spec.dtype) for _ in range(2)]
    capture, captured = _capture()
    graphs = capture_graphs(target, qkv, sets, capture)
    assert len(captured) == 3 and len(graphs.replays) == 2  # the check buffer, then each set
    check = check_replay(target, graphs, qkv, ref)
    assert check.matches_eager and check.max_abs_diff == 0.0
    assert check.rel_error < TOLERANCE[spec.dtype]
    for i in range(5):
        graphs.step(i)  # rotates through the sets like the eager timed calls
    assert [r.replays for r in captured] == [1, 3, 2]


def test_captured_graphs_keep_their_graph_plan_alive(monkeypatch):
    """The captured kernels read the plan's fixed device buffers: the graphs must hold the
    plan for as long as they are replayed, even when nobody else does."""
    install_fake_flashinfer(monkeypatch)
    spec = SPECS[1]
    params, qkv, _ = _case(spec, (5, 9), seed=10)

    class Recorded:
        """Like a CUDA graph: it keeps the launches, not the Python objects behind them."""

        def replay(self) -> None:
            pass

    def capture(fn, device):
        return Recorded(), fn().clone()

    graphs = capture_graphs(_graph_target(spec, params), qkv, [qkv.clone()], capture)
    plan = weakref.ref(graphs.target.plan)
    gc.collect()
    assert plan() is not None
    del graphs
    gc.collect()
    assert plan() is None


def test_a_replay_that_differs_from_eager_is_caught(monkeypatch):
    install_fake_flashinfer(monkeypatch)
    spec = SPECS[1]
    params, qkv, ref = _case(spec, (5, 9), seed=8)
    target = _graph_target(spec, params)
    capture, _ = _capture(skew=1.0)
    check = check_replay(target, capture_graphs(target, qkv, [qkv.clone()], capture), qkv, ref)
    assert not check.matches_eager
    assert check.max_abs_diff == pytest.approx(1.0, rel=0.05)


def test_graph_mode_refusals_become_not_supported_reasons():
    params = FMHAParams.from_lengths((16,), device="cpu")
    spec = SPECS[1]
    explicit = choose_graph_backend(spec, params, "torch-sdpa")
    assert isinstance(explicit, Unsupported)
    assert explicit.reason.startswith("[cuda_graph]")
    auto = choose_graph_backend(spec, params, None)
    assert isinstance(auto, Unsupported)
    capable, *rest = auto.reason.split(" | ")
    assert capable.startswith("flashinfer: [platform]")  # graph-capable, but not on a CPU
    assert rest[-1].startswith("without graph mode: ") and "torch-sdpa" in rest[-1]


# --- outside the core: what the benchmark takes from the plugins and the CLI -------------------


def test_workload_layers_are_the_cli_presets_of_the_same_name():
    """A workload measures the layer ``attn-backends explain --preset NAME`` explains: the
    bench reads the core's public table."""
    assert {w.preset for w in WORKLOADS} <= set(PRESETS)
    for w in WORKLOADS:
        assert w.spec(torch.float16) == dataclasses.replace(PRESETS[w.preset], dtype=torch.float16)


def test_the_ragged_kernel_is_the_one_the_flashinfer_plugin_chooses(monkeypatch):
    """fa2 or fa3 is the plugin's rule, ALiBi included (the bench's own copy of the rule had
    lost it and named fa3, which ignores ALiBi, for an ALiBi spec on Hopper)."""
    monkeypatch.setattr(ragged, "device_sm", lambda device: 90)
    hopper = torch.device("cuda")
    plain = AttentionSpec(16, 8, 128, torch.bfloat16, causal=True)
    assert kernel_name(plain, hopper) == "fa3"
    assert kernel_name(plain, hopper, fused_rope=True) == "fa2"
    assert kernel_name(dataclasses.replace(plain, head_dim=96), hopper) == "fa2"
    assert kernel_name(dataclasses.replace(plain, alibi=AlibiSpec()), hopper) == "fa2"
    monkeypatch.setattr(ragged, "device_sm", lambda device: 80)
    assert kernel_name(plain, hopper) == "fa2"


def test_the_ragged_kernel_gets_the_plugins_workspace(monkeypatch):
    from attn_backends_builtin.flashinfer import WORKSPACE_BYTES

    fake = install_fake_flashinfer(monkeypatch)
    spec = SPECS[1]
    params, _, _ = _case(spec, LENGTHS)
    assert callable(flashinfer_ragged(spec, params))
    (init,) = fake.named("BatchPrefillWithRaggedKVCacheWrapper.__init__")
    assert init.args["float_workspace_buffer"].numel() == WORKSPACE_BYTES


def test_the_raw_baseline_follows_the_kernel_the_api_record_names():
    cpu = torch.device("cpu")
    flex = _api("flex", "torch", "torch.nn.attention.flex_attention")
    skip = raw_recipe(flex, GQA_ROPE, cpu)
    assert isinstance(skip, Skip) and "the public API runs flex" in skip.reason
    # any backend whose plan runs the ragged wrapper gets the raw baseline, whatever its name
    assert raw_recipe(_api("my-flashinfer", "torch"), GQA_ROPE, cpu) == RawRecipe("fa2", "torch")


@pytest.mark.parametrize(
    "spec",
    [
        dataclasses.replace(GQA_ROPE, use_logn_attn=True, logn_base=16),
        dataclasses.replace(
            GQA_ROPE, rope=RopeSpec(theta=1e6, scaling=RopeScaling("linear", factor=2.0))
        ),
    ],
    ids=["logn", "linear-scaling"],
)
def test_raw_torch_rope_beyond_plain_theta_goes_through_the_torch_pass(spec, monkeypatch):
    """The bench's own torch tables compute plain theta RoPE; logn and scaled RoPE are the
    registered torch pass's, called through its apply."""
    install_fake_flashinfer(monkeypatch)
    params, qkv, ref = _case(spec, LENGTHS, seed=11)
    path = build_raw(spec, params, RawRecipe("fa2", "torch"))
    assert isinstance(path, PreparedPath)
    assert relative_error(path.run(qkv.clone()), ref) < TOLERANCE[spec.dtype]


def test_the_benchmark_is_not_in_the_wheel_nor_a_subcommand():
    """The wheel holds the core and the built-in plugins only: the benchmark runs from a
    checkout (``benchmarks/bench.py``), and the core's CLI is offered no ``bench`` command."""
    import tomllib

    pyproject = tomllib.loads((BENCHMARKS.parent / "pyproject.toml").read_text())
    setuptools = pyproject["tool"]["setuptools"]
    assert "attn_backends_bench" not in setuptools["packages"]
    assert "attn_backends_bench" not in setuptools["package-dir"]
    assert "bench" not in pyproject["project"]["entry-points"].get(COMMAND_GROUP, {})
    # mypy and import-linter still check it, with benchmarks/ on their path.
    assert "benchmarks" in pyproject["tool"]["mypy"]["mypy_path"].split(":")
    assert "attn_backends_bench" in pyproject["tool"]["importlinter"]["root_packages"]


def _bench_script(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python3 benchmarks/bench.py ARGV`` from another folder, with no CUDA device visible."""
    return _python(str(BENCHMARKS / "bench.py"), *argv, cwd=BENCHMARKS.parent / "tests")


def _python(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        timeout=300,
    )


def test_bench_script_runs_the_benchmark_command(tmp_path):
    done = _bench_script("--iters", "3")
    assert done.returncode == 2
    assert "--iters" in done.stderr
    done = _bench_script("--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr
    assert not (tmp_path / "out").exists()
    done = _bench_script("--help")
    assert done.returncode == 0
    assert "--time-budget-s" in done.stdout
    assert done.stdout.startswith("usage: python3 benchmarks/bench.py")
    # From benchmarks/, the package runs as a module too.
    done = _python("-m", "attn_backends_bench", "--help", cwd=BENCHMARKS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python3 -m attn_backends_bench")


def test_bench_script_renders_an_earlier_json_and_records_its_command(tmp_path):
    source = tmp_path / "run.json"
    source.write_text(report.to_json(_result()))
    done = _bench_script("--render", str(source), "--out", str(tmp_path / "again"))
    assert done.returncode == 0, done.stderr
    assert done.stdout == (tmp_path / "again" / "bench.md").read_text()
    assert cli._command_line(["benchmarks/bench.py", "--out", "x y"]) == (
        "python3 benchmarks/bench.py --out 'x y'"
    )
    assert cli._command_line(["/x/attn_backends_bench/__main__.py", "--iters", "40"]) == (
        "python3 -m attn_backends_bench --iters 40"
    )
