#!/usr/bin/env python3
"""Compile every flashinfer JIT module the H200 conformance run and the benchmark load, then exit.

Run from the repository root after ``. scripts/gpu/setup.sh`` (it sets the arch list, the job
count and the cache directory; the cached modules are only found again with the same settings):

    python3 benchmarks/gpu/prebuild.py              # build everything, print a per-module table
    python3 benchmarks/gpu/prebuild.py --dry-run    # list the modules and the estimate; any machine
    python3 benchmarks/gpu/prebuild.py --check      # also generate sources and a no-op ninja plan

The module list is derived, not written by hand: for ``flashinfer``, ``flashinfer-rope`` and
``trt``, every conformance case their declared capabilities generate
(``attn_backends.testing.cases``) and every benchmark workload in bf16
(``attn_backends_bench.workloads``, with and without its RoPE), on sm90, mapped by the backend's
own ``jit_modules`` to the module it loads. flashinfer's in-place RoPE module is added: the
contract uses it for the separate RoPE pass when the native kernel is unavailable, and
scripts/gpu/rope_kernel.py measures it.

Module names, flashinfer build specs, cost estimates and the final load are the ones
``attn-backends warmup`` uses (``attn_backends_builtin._flashinfer_jit``); this script only
adds the combined build below, which an offline maintainer's machine needs to finish all
modules within one 10-minute slot.

How: worker processes, one per module (never the same module twice), generate the sources and
the build file of their module in parallel. One ninja run then compiles the objects of all
modules together with ``MAX_JOBS`` jobs, so the eight heavy objects of an fa3 module and the
134 small ones of an FMHA v2 module share the cores evenly; a ninja per module would either
oversubscribe the cores or leave them idle. Finally every module is loaded once through the
loader the backend uses, which shows a cache hit, and the table gives per module its objects,
compile job-seconds (from ninja's log, about CPU-seconds), when it was done and its load time.

The combined build keeps ninja's records in the JIT directory, while flashinfer's loader runs
ninja in each module's own directory; the records are copied there (``hand_over_records``) and
``ninja -n`` then confirms per module that the loader has nothing left to compile (exit 4 if
not). Without that copy every module was compiled a second time on first load.

If the build would run past ``--budget`` seconds it is stopped cleanly (finished objects stay
in the cache) and the script exits 3: run it again to continue.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from attn_backends_builtin._flashinfer_common import JitModule
from attn_backends_builtin._flashinfer_jit import BUILD_CPU_SECONDS, ROPE_MODULE, jit_spec, load
from attn_backends_builtin.flashinfer import FlashinferBackend, FlashinferRopeBackend
from attn_backends_builtin.trt import TrtBackend

from attn_backends import AttentionSpec, RopeSpec, parse_platform
from attn_backends.testing.cases import conformance_cases

SM = 90
ARCH_LIST = "9.0a"
"""sm90a: what fa3 and the FMHA v2 warp-specialized kernels need ("9.0" means the same)."""
Backend = FlashinferBackend | TrtBackend


def backends() -> list[Backend]:
    return [FlashinferBackend, FlashinferRopeBackend, TrtBackend]


def bench_specs() -> list[AttentionSpec]:
    benchmarks = str(Path(__file__).resolve().parents[1])  # not installed
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    try:
        from attn_backends_bench.workloads import WORKLOADS
    except ImportError as exc:
        print(f"warning: no benchmark workloads ({exc}); building for conformance only")
        return []
    specs = []
    for workload in WORKLOADS:
        spec = workload.spec(torch.bfloat16)
        specs.append(spec)
        if spec.rope is not None:
            specs.append(replace(spec, rope=None))  # the benchmark's "attention alone" path
    return specs


def model_specs() -> list[AttentionSpec]:
    """The global layers of the whole models scripts/gpu/e2e_models.py and the serving
    benchmark run that no benchmark workload covers (their local layers go to flex)."""
    return [
        AttentionSpec(12, 12, 64, torch.bfloat16, causal=False, rope=RopeSpec(160_000.0)),
        AttentionSpec(3, 1, 256, torch.bfloat16, causal=False, rope=RopeSpec(1_000_000.0)),
    ]


def needed_modules() -> dict[JitModule, set[str]]:
    """Every module, with who needs it (``conformance:flashinfer``, ``bench:trt``...)."""
    platform = parse_platform(f"cuda:sm{SM}")
    users: dict[JitModule, set[str]] = defaultdict(set)
    bench = bench_specs()
    for backend in backends():
        cases = [c.spec for c in conformance_cases(backend.capabilities)]
        for use, specs in (("conformance", cases), ("bench", bench), ("models", model_specs())):
            for spec in specs:
                if backend.supports(spec, platform):
                    continue  # refused: skipped by the suite, not run by the benchmark
                for module in backend.jit_modules(spec, SM):
                    users[module].add(f"{use}:{backend.name}")
    users[ROPE_MODULE].add("rope_kernel.py; the RoPE pass when the native kernel is missing")
    return dict(users)


def order(modules: list[JitModule]) -> list[JitModule]:
    """Heaviest objects first, so the many small FMHA v2 objects fill the cores at the end."""
    rank = {"fa3": 0, "fa2": 1, "rope": 2, "fmha_v2": 3}
    return sorted(modules, key=lambda m: (rank[m.kind], m))


def generate(module: JitModule) -> dict[str, Any]:
    """Worker: write one module's sources and build file."""
    from filelock import FileLock

    start = time.perf_counter()
    spec = jit_spec(module)
    with FileLock(spec.lock_path, thread_local=False):
        spec.write_ninja()
    return {
        "name": spec.name,
        "ninja": str(spec.ninja_path),
        "sources": len(spec.sources),
        "aot": spec.is_aot,
        "seconds": time.perf_counter() - start,
    }


def _condense(line: str) -> str:
    """``[n/N] nvcc ... -o /path/obj.cuda.o`` -> ``[n/N] obj.cuda.o``."""
    head, _, rest = line.partition("] ")
    if " -o " in rest:
        return f"{head}] {Path(rest.rsplit(' -o ', 1)[1].split()[0]).name}"
    return line


def run_ninja(jit_dir: Path, ninja_file: Path, jobs: int, deadline: float, log: Path) -> int:
    """One ninja over all modules; progress condensed to stdout, everything in ``log``.

    Stopped (SIGTERM: ninja kills its jobs and keeps finished objects) at ``deadline``."""
    command = ["ninja", "-C", str(jit_dir), "-f", str(ninja_file), "-j", str(jobs)]
    lines: queue.Queue[str | None] = queue.Queue()
    shown = -1e9
    failing = False
    with (
        log.open("w") as sink,
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        ) as proc,
    ):
        stream = proc.stdout
        assert stream is not None

        def pump() -> None:
            for text in stream:
                lines.put(text)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        while True:
            if time.monotonic() > deadline:
                print("budget reached: stopping ninja; finished objects are kept, run again")
                proc.terminate()
                proc.wait()
                return 3
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                return proc.wait()
            sink.write(line)
            if line.startswith("["):
                failing = False
                if time.monotonic() - shown >= 15:
                    shown = time.monotonic()
                    print(f"  {shown - START:6.0f}s {_condense(line.rstrip())}")
            elif line.startswith("FAILED") or failing:
                failing = True
                print("  " + line.rstrip()[:400])


NINJA_RECORDS = (".ninja_log", ".ninja_deps")


def hand_over_records(jit_dir: Path, module_dirs: list[Path]) -> None:
    """Give each module's build directory the records of the combined build.

    flashinfer's loader runs ninja per module, in the module's directory, and ninja keeps its
    command log and dependency records in the directory it runs in. Without the combined
    build's records ninja there finds no record for any object and compiles the whole module
    again. The records name outputs by absolute path, so a copy of the combined files serves
    every module; ninja ignores the entries of other modules. Objects the combined build did
    not finish have no record and are still rebuilt, as they must be."""
    for module_dir in module_dirs:
        for name in NINJA_RECORDS:
            source = jit_dir / name
            if source.exists():
                (module_dir / name).write_bytes(source.read_bytes())


def pending_steps(module_dir: Path) -> int:
    """How many build steps ninja would still run for one module (0: the loader only loads)."""
    result = subprocess.run(
        ["ninja", "-n", "-C", str(module_dir), "-f", str(module_dir / "build.ninja")],
        capture_output=True,
        text=True,
    )
    if result.returncode:
        raise RuntimeError(f"ninja -n failed in {module_dir}: {result.stderr[-500:]}")
    return sum(1 for line in result.stdout.splitlines() if line.startswith("["))


def ninja_stats(log_path: Path, offset: int) -> dict[str, tuple[int, float, float]]:
    """Per module directory: (objects, summed seconds, last end in seconds) of this run."""
    stats: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    if not log_path.exists():
        return {}
    with log_path.open() as f:
        if log_path.stat().st_size >= offset:
            f.seek(offset)
        for line in f:
            fields = line.rstrip("\n").split("\t")
            if line.startswith("#") or len(fields) < 4:
                continue
            start_ms, end_ms, output = int(fields[0]), int(fields[1]), fields[3]
            entry = stats[Path(output).parent.name]
            entry[0] += 1
            entry[1] += (end_ms - start_ms) / 1000
            entry[2] = max(entry[2], end_ms / 1000)
    return {k: (int(v[0]), v[1], v[2]) for k, v in stats.items()}


START = time.monotonic()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="list modules, build nothing")
    parser.add_argument(
        "--check", action="store_true", help="generate sources and run `ninja -n`; compile nothing"
    )
    parser.add_argument("--no-rope", action="store_true", help="skip flashinfer's RoPE module")
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="TEXT",
        help="skip modules whose description contains TEXT (repeatable)",
    )
    parser.add_argument(
        "--only",
        metavar="REGEX",
        help="build only modules whose description matches REGEX (re.search), e.g. 'swa|ALIBI'",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=530.0,
        help="stop the build cleanly this many seconds after the start, leaving "
        "time to load the modules in a 10-minute slot (default 530)",
    )
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]

    # Read when flashinfer is imported (here and in the workers, which inherit them).
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", ARCH_LIST)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
    jobs = int(os.environ["MAX_JOBS"])
    users = needed_modules()
    modules = [
        m
        for m in order(list(users))
        if not (args.no_rope and m == ROPE_MODULE)
        and not any(s in str(m) for s in args.skip)
        and (args.only is None or re.search(args.only, str(m)))
    ]
    print(
        f"FLASHINFER_CUDA_ARCH_LIST={os.environ['FLASHINFER_CUDA_ARCH_LIST']} MAX_JOBS={jobs} "
        f"FLASHINFER_WORKSPACE_BASE={os.environ.get('FLASHINFER_WORKSPACE_BASE', '~')}"
    )
    estimate = sum(BUILD_CPU_SECONDS[m.kind] for m in modules)
    print(
        f"{len(modules)} modules, estimated {estimate:.0f} CPU-s, about "
        f"{estimate / jobs / 60:.1f} min on {jobs} jobs:"
    )
    for m in modules:
        print(f"  {m!s:40s} {', '.join(sorted(users[m]))}")
    if args.dry_run:
        return 0

    import flashinfer
    import flashinfer.jit.env as jit_env

    print(f"flashinfer {flashinfer.__version__}; cache {jit_env.FLASHINFER_WORKSPACE_DIR}")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(len(modules), jobs)) as pool:
        generated = pool.map(generate, modules)
    print(
        f"{time.monotonic() - START:6.0f}s sources generated "
        f"(slowest {max(g['seconds'] for g in generated):.1f} s)"
    )
    todo = [g for g in generated if not g["aot"]]
    jit_dir = jit_env.FLASHINFER_JIT_DIR
    combined = jit_dir / "tmp" / "attn_backends_prebuild.ninja"
    combined.parent.mkdir(parents=True, exist_ok=True)
    combined.write_text(
        "\n".join(["ninja_required_version = 1.3", *(f"subninja {g['ninja']}" for g in todo), ""])
    )
    if args.check:
        result = subprocess.run(
            ["ninja", "-n", "-C", str(jit_dir), "-f", str(combined), "-j", str(jobs)],
            capture_output=True,
            text=True,
        )
        steps = [ln for ln in result.stdout.splitlines() if ln.startswith("[")]
        print(f"ninja -n: exit {result.returncode}, {len(steps)} steps would run")
        if result.returncode:
            print(result.stdout[-3000:], result.stderr[-3000:])
        return result.returncode

    ninja_log = jit_dir / ".ninja_log"
    offset = ninja_log.stat().st_size if ninja_log.exists() else 0
    build_start = time.monotonic()
    status = run_ninja(
        jit_dir, combined, jobs, START + args.budget, jit_dir / "tmp" / "attn_backends_prebuild.log"
    )
    build_s = time.monotonic() - build_start
    print(f"{time.monotonic() - START:6.0f}s ninja exit {status} after {build_s:.0f} s")
    # Also after a stop: the finished objects' records then save the next run their compile.
    hand_over_records(jit_dir, [Path(g["ninja"]).parent for g in todo])
    if status:
        print(f"full ninja output: {jit_dir / 'tmp' / 'attn_backends_prebuild.log'}")
        return status
    stale = {g["name"]: pending_steps(Path(g["ninja"]).parent) for g in todo}
    stale = {name: steps for name, steps in stale.items() if steps}
    if stale:
        print(f"NOT up to date for flashinfer's per-module ninja (steps left): {stale}")
        return 4
    print(f"{time.monotonic() - START:6.0f}s every module up to date for its own ninja")

    stats = ninja_stats(ninja_log, offset)
    print(f"{'module':40s} {'objects':>7s} {'job_s':>7s} {'done_s':>7s} {'load_s':>7s}")
    failed = 0
    for module, gen in zip(modules, generated, strict=True):
        t0 = time.perf_counter()
        try:
            load(module)
            load_s = f"{time.perf_counter() - t0:7.1f}"
        except Exception as exc:
            failed += 1
            load_s = f"FAILED: {type(exc).__name__}: {str(exc)[:300]}"
        objects, job_s, done_s = stats.get(gen["name"], (0, 0.0, 0.0))
        print(f"{module!s:40s} {objects:7d} {job_s:7.0f} {done_s:7.0f} {load_s}")
    total_job = sum(v[1] for v in stats.values())
    print(
        f"{time.monotonic() - START:6.0f}s done: {total_job:.0f} job-seconds compiled, "
        f"{failed} load failures"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
