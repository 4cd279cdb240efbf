"""The H200 prebuild's hand-over of ninja records, checked with a toy build on any machine.

flashinfer's loader runs ninja in each module's own directory; after the one combined build
that directory must hold the records, or the module compiles again on first load."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    shutil.which("ninja") is None or shutil.which("cc") is None,
    reason="needs ninja and a C compiler",
)


@pytest.fixture(scope="module")
def prebuild() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "attn_backends_prebuild", ROOT / "benchmarks" / "gpu" / "prebuild.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _toy_modules(jit_dir: Path, names: list[str]) -> Path:
    """Modules laid out like flashinfer's: absolute outputs, depfiles, one build.ninja each,
    and a combined file of subninja lines in the JIT directory."""
    src = jit_dir.parent / "src"
    src.mkdir()
    for name in names:
        (src / f"{name}.h").write_text("#define VALUE 1\n")
        (src / f"{name}.c").write_text(
            f'#include "{name}.h"\nint f_{name}(void) {{ return VALUE; }}\n'
        )
        module_dir = jit_dir / name
        module_dir.mkdir(parents=True)
        obj, lib = module_dir / f"{name}.o", module_dir / f"{name}.so"
        (module_dir / "build.ninja").write_text(
            "ninja_required_version = 1.3\n"
            "rule cc\n  command = cc -MMD -MF $out.d -fPIC -c $in -o $out\n"
            "  depfile = $out.d\n  deps = gcc\n"
            "rule link\n  command = cc -shared $in -o $out\n"
            f"build {obj}: cc {src / f'{name}.c'}\n"
            f"build {lib}: link {obj}\n"
            f"default {lib}\n"
        )
    combined = jit_dir / "combined.ninja"
    combined.write_text(
        "ninja_required_version = 1.3\n"
        + "".join(f"subninja {jit_dir / name / 'build.ninja'}\n" for name in names)
    )
    return combined


@pytest.fixture
def built(tmp_path: Path) -> Path:
    """Two toy modules after one combined ninja run; returns the JIT directory."""
    jit_dir = tmp_path / "jit"
    combined = _toy_modules(jit_dir, ["one", "two"])
    subprocess.run(
        ["ninja", "-C", str(jit_dir), "-f", str(combined)], check=True, capture_output=True
    )
    return jit_dir


def test_without_the_records_each_module_would_compile_again(
    prebuild: ModuleType, built: Path
) -> None:
    assert prebuild.pending_steps(built / "one") == 2  # the failure the hand-over prevents


def test_handed_over_records_leave_nothing_to_build(prebuild: ModuleType, built: Path) -> None:
    prebuild.hand_over_records(built, [built / "one", built / "two"])
    assert prebuild.pending_steps(built / "one") == 0
    assert prebuild.pending_steps(built / "two") == 0


def test_handed_over_records_still_see_a_changed_header(prebuild: ModuleType, built: Path) -> None:
    prebuild.hand_over_records(built, [built / "one", built / "two"])
    header = built.parent / "src" / "one.h"
    header.write_text("#define VALUE 2\n")
    stamp = header.stat().st_mtime_ns + 5_000_000_000  # clearly newer than the object
    os.utime(header, ns=(stamp, stamp))
    assert prebuild.pending_steps(built / "one") == 2  # the dependency record is live
    assert prebuild.pending_steps(built / "two") == 0
