"""GPU check of the native in-place RoPE/logn kernel (``csrc/``), then its bandwidth.

1. Builds the kernel (timed) and checks it against a float64 reference on every RoPE variant
   (rotate-half, interleaved, partial rotary_dim, theta), logn on and off, logn alone, fp32 /
   fp16 / bf16, varlen batches with single-token and empty sequences, padding rows, strided and
   misaligned rows (the element-wise path), positions up to 32k, and every launch variant. V
   columns, padding rows and the columns around a strided slice must stay bit-identical. The
   torch path and flashinfer's ``apply_rope_pos_ids_inplace`` are measured on the same cases
   (reported, not asserted).
2. Checks the public path end to end: ``select`` + ``prepare`` + ``forward`` must pick the
   native pass on this GPU and match ``reference_attention``.
3. Times, on the Qwen3-Embedding workload (32 seeded varlen sequences of 64..2048 tokens, 16/8
   heads x 128, bf16, theta 1e6), the native kernel (default and tuning variants), flashinfer's
   in-place RoPE and the torch path, against a device-to-device copy of the same byte count in
   the same run: bytes = read + write of the Q and K columns of the valid rows. CUDA events,
   warm-up, median of RUNS runs, fresh random input and a flushed L2 before every run.

Usage: python scripts/gpu/rope_kernel.py OUT_DIR   (writes OUT_DIR/rope_kernel.json)
Exit status 1 when a native numeric check fails.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from attn_backends_builtin._flashinfer_common import is_aligned
from attn_backends_builtin._flashinfer_rope import apply_flashinfer_rope, flashinfer_rope_refusal

from attn_backends import AttentionSpec, FMHAParams, RopeSpec, reference_attention, select
from attn_backends._backend._reference import _rotate
from attn_backends._path import _native as native  # the kernels measured: below the public API
from attn_backends._path._preprocess import apply_preprocess
from attn_backends._path._rope import PositionTables, build_position_tables
from attn_backends.errors import NativeBuildError
from attn_backends.plugin import dtype_name
from attn_backends.reference import TOLERANCE, relative_error

PAD_VALUE = 1.0e4
RUNS = 40
WARMUP = 5
COPY_TARGET = 0.80
HALF_ULP = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
ATOL = 1.0e-5
"""Absolute slack for float32 math (sincos, products) on values of order 1."""

Apply = Callable[[torch.Tensor, AttentionSpec, FMHAParams], object]
Json = dict[str, Any]
"""A JSON object of the report: values of mixed types, written out as they are."""


@dataclass(frozen=True)
class Case:
    """One numeric check: a spec, a batch, and how the buffer sits in memory."""

    name: str
    spec: AttentionSpec
    lengths: tuple[int, ...]
    padding_rows: int = 5
    lead: int = 0
    """Columns before the QKV slice in each row (odd: misaligned base, element-wise path)."""
    trail: int = 0


def _spec(
    dtype: torch.dtype,
    dim: int = 128,
    heads: tuple[int, int] = (4, 2),
    rope: RopeSpec | None = None,
    logn: int | None = None,
) -> AttentionSpec:
    return AttentionSpec(
        heads[0],
        heads[1],
        dim,
        dtype,
        causal=True,
        rope=rope,
        use_logn_attn=logn is not None,
        logn_base=logn,
    )


def numeric_cases(dtypes: tuple[torch.dtype, ...], *, long: bool = True) -> list[Case]:
    varlen = (1, 17, 1, 300, 0, 45, 1, 64)
    variants: list[tuple[str, dict[str, Any]]] = [
        ("rh-full-1e4", {"rope": RopeSpec(1e4)}),
        ("rh-full-1e6", {"rope": RopeSpec(1e6)}),
        ("il-full-1e4", {"rope": RopeSpec(1e4, interleaved=True)}),
        ("rh-r64", {"rope": RopeSpec(1e4, 64)}),
        ("il-r64", {"rope": RopeSpec(1e4, 64, interleaved=True)}),
        ("rh-r24", {"rope": RopeSpec(1e4, 24)}),
        ("il-r20", {"rope": RopeSpec(1e4, 20, interleaved=True)}),
        ("d64-mha", {"rope": RopeSpec(1e4), "dim": 64, "heads": (4, 4)}),
        ("d96-gqa8", {"rope": RopeSpec(1e6), "dim": 96, "heads": (8, 1)}),
        ("d72-rh", {"rope": RopeSpec(1e4), "dim": 72}),
        ("d65-il-r32", {"rope": RopeSpec(1e4, 32, interleaved=True), "dim": 65}),
        ("d256-rh-r128", {"rope": RopeSpec(1e6, 128), "dim": 256, "heads": (2, 1)}),
        ("norope", {}),
    ]
    layouts = (("plain", 0, 0), ("strided", 24, 8), ("misaligned", 3, 1))
    cases: list[Case] = []
    for dtype in dtypes:
        tag = dtype_name(dtype)
        for vname, kw in variants:
            for logn in (None, 16):
                if vname == "norope" and logn is None:
                    continue
                spec = _spec(dtype, logn=logn, **kw)
                for lname, lead, trail in layouts:
                    name = f"{tag}-{vname}-{'logn' if logn else 'nologn'}-{lname}"
                    cases.append(Case(name, spec, varlen, lead=lead, trail=trail))
        if long:
            for theta in (1e4, 1e6):
                for logn in (None, 8192):
                    spec = _spec(dtype, heads=(2, 1), rope=RopeSpec(theta), logn=logn)
                    name = f"{tag}-long-{theta:g}-{'logn' if logn else 'nologn'}"
                    cases.append(Case(name, spec, (32768, 1, 5000), padding_rows=3))
    return cases


@dataclass(frozen=True, eq=False)
class Buffers:
    backing: torch.Tensor
    packed: torch.Tensor
    params: FMHAParams


def make_buffers(case: Case, device: torch.device | str, seed: int) -> Buffers:
    spec = case.spec
    tokens = sum(case.lengths)
    rows = tokens + case.padding_rows
    width = spec.qkv_width
    gen = torch.Generator().manual_seed(seed)
    backing = torch.randn(rows, case.lead + width + case.trail, generator=gen)
    backing[tokens:] = PAD_VALUE
    backing = backing.to(device=device, dtype=spec.dtype)
    packed = backing[:, case.lead : case.lead + width]
    params = FMHAParams.from_lengths(case.lengths, device=device, padded_rows=rows)
    return Buffers(backing, packed, params)


def expected_qk(pristine: torch.Tensor, spec: AttentionSpec, params: FMHAParams) -> torch.Tensor:
    """Float64 Q|K columns of the valid rows after RoPE and logn, ``[tokens, Hq + Hkv, D]``."""
    tokens = params.token_q_num
    hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    x = pristine[:tokens].to(torch.float64)
    q = x[:, : hq * d].reshape(tokens, hq, d)
    k = x[:, hq * d : (hq + hkv) * d].reshape(tokens, hkv, d)
    positions = torch.cat([torch.arange(n, device=x.device) for n in params.input_lengths]).to(
        torch.float64
    )
    if spec.rope is not None:
        q = _rotate(q, positions, spec)
        k = _rotate(k, positions, spec)
    if spec.use_logn_attn:
        assert spec.logn_base is not None
        factor = (torch.log(positions + 1.0) / math.log(spec.logn_base)).clamp(min=1.0)
        q = q * factor[:, None, None]
    return torch.cat((q, k), dim=1)


def check(case: Case, apply: Apply, device: torch.device | str, seed: int) -> Json:
    """Run ``apply`` on a fresh buffer; errors against float64, and what must stay untouched.

    ``bound_ratio`` is the worst ``|out - ref| / (half_ulp * |ref| + ATOL)``: at most 1 means
    every element is the correctly rounded result up to float32 math noise.
    """
    spec = case.spec
    buf = make_buffers(case, device, seed)
    before = buf.backing.clone()
    pristine = buf.packed.clone()
    apply(buf.packed, spec, buf.params)
    if buf.packed.is_cuda:
        torch.cuda.synchronize()
    tokens = buf.params.token_q_num
    qk_cols = spec.q_width + spec.kv_width
    ref = expected_qk(pristine, spec, buf.params)
    out = buf.packed[:tokens, :qk_cols].to(torch.float64).reshape(ref.shape)
    err = (out - ref).abs()
    allowed = HALF_ULP[spec.dtype] * ref.abs() + ATOL
    ratio = float((err / allowed).max()) if err.numel() else 0.0
    lead, width = case.lead, spec.qkv_width
    outside = torch.equal(buf.backing[:, :lead], before[:, :lead]) and torch.equal(
        buf.backing[:, lead + width :], before[:, lead + width :]
    )
    v_same = torch.equal(buf.packed[:, qk_cols:], pristine[:, qk_cols:])
    pad_same = torch.equal(buf.packed[tokens:], pristine[tokens:])
    return {
        "bound_ratio": ratio if math.isfinite(ratio) else math.inf,
        "max_abs_err": float(err.max()) if err.numel() else 0.0,
        "rel_err": relative_error(out, ref),
        "v_untouched": v_same,
        "padding_untouched": pad_same,
        "outside_untouched": outside,
    }


def native_apply(unroll: int = 0, target: int = 0) -> Apply:
    def run(packed: torch.Tensor, spec: AttentionSpec, params: FMHAParams) -> None:
        native.rope_logn_(
            packed,
            params.cu_seqlens_q,
            params.token_q_num,
            spec,
            unroll=unroll,
            target_threads_per_sm=target,
        )

    return run


def torch_apply(packed: torch.Tensor, spec: AttentionSpec, params: FMHAParams) -> None:
    apply_preprocess("torch", packed, spec, params, None)


NATIVE_VARIANTS: dict[str, tuple[int, int]] = {
    "default": (0, 0),
    "unroll1": (1, 0),
    "unroll4": (4, 0),
    "one-group": (0, 1),
    "max-groups": (0, 1 << 20),
}
"""Launch variants (unroll, target_threads_per_sm); each instantiation must be exact."""


def native_ok(result: Json) -> bool:
    return (
        float(result["bound_ratio"]) <= 1.0
        and bool(result["v_untouched"])
        and bool(result["padding_untouched"])
        and bool(result["outside_untouched"])
    )


def run_numerics(
    cases: list[Case], device: str, flashinfer_ready: bool, variants: dict[str, tuple[int, int]]
) -> tuple[list[Json], int]:
    from attn_backends import detect_platform

    platform = detect_platform(device) if device != "cpu" else None
    results: list[Json] = []
    failures = 0
    for i, case in enumerate(cases):
        seed = 1000 + i
        row: Json = {"case": case.name, "spec": case.spec.to_dict()}
        for vname, (unroll, target) in variants.items():
            res = check(case, native_apply(unroll, target), device, seed)
            row[f"native-{vname}"] = res
            if not native_ok(res):
                failures += 1
                if failures <= 20:  # the JSON holds them all
                    print(f"  FAIL native-{vname} {case.name}: {res}", flush=True)
        row["torch"] = check(case, torch_apply, device, seed)
        if (
            flashinfer_ready
            and platform is not None
            and flashinfer_rope_refusal(case.spec, platform) is None
            and case.lead == 0
            and case.trail == 0
        ):
            row["flashinfer"] = check(case, apply_flashinfer_rope, device, seed)
        results.append(row)
    return results, failures


def end_to_end(device: str) -> Json:
    """The public API on this GPU: which pass it picks, and the attention it computes."""
    spec = AttentionSpec(16, 8, 128, torch.bfloat16, causal=True, rope=RopeSpec(1e6))
    sel = select(spec, device=device, backend="torch-sdpa")
    lengths = (1, 37, 300, 5)
    params = FMHAParams.from_lengths(lengths, device=device, padded_rows=sum(lengths) + 4)
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(params.rows, spec.qkv_width, generator=gen).to(device, spec.dtype)
    qkv[params.token_q_num :] = PAD_VALUE
    pristine = qkv.clone()
    plan = sel.backend.prepare(params)
    out = sel.backend.forward(qkv, plan)
    err = relative_error(out, reference_attention(pristine, spec, params))
    return {
        "details": dict(sel.details),
        "plan_preprocess": plan.preprocess,
        "rel_err": err,
        "ok": plan.preprocess == "native" and err < TOLERANCE[spec.dtype],
    }


# ---------------------------------------------------------------- timing


def qwen3_workload(device: str) -> tuple[AttentionSpec, FMHAParams]:
    gen = torch.Generator().manual_seed(0)
    lengths = tuple(int(n) for n in torch.randint(64, 2049, (32,), generator=gen))
    spec = AttentionSpec(16, 8, 128, torch.bfloat16, causal=True, rope=RopeSpec(1e6))
    return spec, FMHAParams.from_lengths(lengths, device=device)


def time_paths(
    paths: dict[str, Callable[[], object]], refill: Callable[[], None], flush: torch.Tensor
) -> dict[str, list[float]]:
    """Milliseconds per path; paths alternate within each round, so drift hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for rnd in range(WARMUP + RUNS):
        for name, fn in paths.items():
            refill()
            flush.zero_()
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn()
            end.record()
            end.synchronize()
            if rnd >= WARMUP:
                times[name].append(start.elapsed_time(end))
    return times


def bandwidth(device: str, flashinfer_ready: bool) -> Json:
    spec, params = qwen3_workload(device)
    tokens = params.token_q_num
    qk_cols = spec.q_width + spec.kv_width
    elem = torch.finfo(spec.dtype).bits // 8
    moved = 2 * tokens * qk_cols * elem
    packed = torch.empty(tokens, spec.qkv_width, device=device, dtype=spec.dtype)
    src = torch.empty(tokens * qk_cols, device=device, dtype=spec.dtype).normal_()
    dst = torch.empty_like(src)
    flush = torch.empty(256 << 20, device=device, dtype=torch.uint8)
    logn_spec = replace(spec, use_logn_attn=True, logn_base=512)
    il_spec = replace(spec, rope=RopeSpec(1e6, interleaved=True))
    tables = apply_tables(spec, params)

    def refill() -> None:
        packed.normal_()

    def copy() -> None:
        dst.copy_(src)

    paths: dict[str, Callable[[], object]] = {"copy": copy}
    for vname, (unroll, target) in NATIVE_VARIANTS.items():
        paths[f"native-{vname}"] = _bind_native(packed, spec, params, unroll, target)
    paths["native-logn"] = _bind_native(packed, logn_spec, params, 0, 0)
    paths["native-interleaved"] = _bind_native(packed, il_spec, params, 0, 0)
    if flashinfer_ready and is_aligned(packed):
        paths["flashinfer"] = lambda: apply_flashinfer_rope(packed, spec, params)
    paths["torch"] = lambda: apply_preprocess("torch", packed, spec, params, tables)

    # Correct before timed: every RoPE path on the workload against float64.
    checks: dict[str, float] = {}
    for name in ("native-default", "flashinfer", "torch"):
        if name not in paths:
            continue
        refill()
        pristine = packed.clone()
        paths[name]()
        torch.cuda.synchronize()
        ref = expected_qk(pristine, spec, params)
        out = packed[:, :qk_cols].to(torch.float64).reshape(ref.shape)
        checks[name] = relative_error(out, ref)
        del pristine
    times = time_paths(paths, refill, flush)
    copy_ms = statistics.median(times["copy"])
    result: Json = {
        "workload": {
            "lengths": list(params.input_lengths),
            "tokens": tokens,
            "spec": spec.to_dict(),
            "bytes_moved": moved,
        },
        "method": (
            f"CUDA events, {WARMUP} warm-up rounds, median of {RUNS}; before every run the "
            "input is refilled with fresh normal values and 256 MiB are zeroed to flush L2; "
            "bytes = read + write of the Q|K columns of the valid rows; copy = contiguous "
            "device-to-device copy of the same byte count"
        ),
        "rel_err_before_timing": checks,
        "paths": {},
    }
    rows: dict[str, dict[str, float]] = {}
    for name, ms in times.items():
        med = statistics.median(ms)
        rows[name] = {
            "median_ms": med,
            "min_ms": min(ms),
            "max_ms": max(ms),
            "runs": len(ms),
            "bandwidth_GBps": moved / (med * 1e-3) / 1e9,
            "fraction_of_copy": copy_ms / med,
        }
    result["paths"] = rows
    native_best = max(
        (r["fraction_of_copy"], n)
        for n, r in rows.items()
        if n.startswith("native-") and n not in ("native-logn", "native-interleaved")
    )
    result["native_default_fraction_of_copy"] = rows["native-default"]["fraction_of_copy"]
    result["native_best_variant"] = {"name": native_best[1], "fraction_of_copy": native_best[0]}
    result["target_fraction_of_copy"] = COPY_TARGET
    result["target_met_by_default"] = rows["native-default"]["fraction_of_copy"] >= COPY_TARGET
    return result


def apply_tables(spec: AttentionSpec, params: FMHAParams) -> PositionTables:
    return build_position_tables(spec, params.positions)


def _bind_native(
    packed: torch.Tensor, spec: AttentionSpec, params: FMHAParams, unroll: int, target: int
) -> Callable[[], object]:
    apply = native_apply(unroll, target)
    return lambda: apply(packed, spec, params)


# ---------------------------------------------------------------- main


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    out_dir = Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("needs a CUDA or ROCm GPU")
        return 2
    device = "cuda"
    report: Json = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "flashinfer": _version("flashinfer-python"),
        "command": "python scripts/gpu/rope_kernel.py " + argv[1],
    }
    t0 = time.perf_counter()
    try:
        native.load()
    except NativeBuildError as exc:
        report["native_build_error"] = str(exc)
        report["native_build_output"] = str(exc.__cause__)  # the compiler's own words
        print(f"native build FAILED: {exc}\n{str(exc.__cause__)[-6000:]}", flush=True)
        _write(out_dir, report)
        return 1
    report["native_build_s"] = time.perf_counter() - t0
    print(f"native build (or cache load): {report['native_build_s']:.1f} s", flush=True)
    flashinfer_ready = report["flashinfer"] is not None
    if flashinfer_ready:
        t0 = time.perf_counter()
        try:
            spec, params = qwen3_workload(device)
            warm = torch.zeros(params.token_q_num, spec.qkv_width, device=device, dtype=spec.dtype)
            apply_flashinfer_rope(warm, spec, params)
            torch.cuda.synchronize()
        except Exception as exc:  # a broken flashinfer install is reported, not fatal
            report["flashinfer_error"] = f"{type(exc).__name__}: {exc}"
            flashinfer_ready = False
        report["flashinfer_first_call_s"] = time.perf_counter() - t0
        print(f"flashinfer first call: {report['flashinfer_first_call_s']:.1f} s", flush=True)

    t0 = time.perf_counter()
    cases = numeric_cases((torch.bfloat16, torch.float16, torch.float32))
    numerics, failures = run_numerics(cases, device, flashinfer_ready, NATIVE_VARIANTS)
    report["numerics"] = numerics
    report["numeric_cases"] = len(cases)
    report["numeric_failures"] = failures
    report["numerics_s"] = time.perf_counter() - t0
    worst = {
        path: max(
            (float(r[path]["bound_ratio"]) for r in numerics if path in r),
            default=0.0,
        )
        for path in ("native-default", "torch", "flashinfer")
    }
    report["worst_bound_ratio"] = worst
    print(
        f"numerics: {len(cases)} cases x {len(NATIVE_VARIANTS)} native variants, "
        f"{failures} failures, worst bound ratio {worst} ({report['numerics_s']:.1f} s)",
        flush=True,
    )

    report["end_to_end"] = end_to_end(device)
    print(f"end to end: {report['end_to_end']}", flush=True)

    bw = bandwidth(device, flashinfer_ready)
    report["bandwidth"] = bw
    _write(out_dir, report)
    _print_table(bw)
    ok = failures == 0 and bool(report["end_to_end"]["ok"])
    print(
        f"numerics {'PASS' if ok else 'FAIL'}; bandwidth target "
        f"{'MET' if bw['target_met_by_default'] else 'MISSED'} by the default launch "
        f"(best variant: {bw['native_best_variant']})",
        flush=True,
    )
    return 0 if ok else 1


def _write(out_dir: Path, report: Json) -> None:
    path = out_dir / "rope_kernel.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {path}", flush=True)


def _print_table(bw: Json) -> None:
    paths: dict[str, dict[str, float]] = bw["paths"]
    print(
        f"\nQwen3-Embedding in-place RoPE, {bw['workload']['tokens']} tokens "
        f"({bw['workload']['bytes_moved'] / 1e6:.0f} MB moved)"
    )
    print(f"{'path':<22}{'median ms':>11}{'GB/s':>9}{'of copy':>9}")
    for name, row in paths.items():
        print(
            f"{name:<22}{row['median_ms']:>11.4f}{row['bandwidth_GBps']:>9.0f}"
            f"{row['fraction_of_copy']:>9.1%}"
        )
    print(f"errors before timing: {bw['rel_err_before_timing']}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
