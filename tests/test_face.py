"""The public faces: a small engine face, every error in one module, environment names in one,
deployment helpers in one, plugin-author names in one; each name lives on exactly one face
(the two start-up errors and the oracle excepted, by design)."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

import attn_backends as ab

FACES = (
    "attn_backends",
    "attn_backends.errors",
    "attn_backends.env",
    "attn_backends.deploy",
    "attn_backends.reference",
    "attn_backends.plugin",
    "attn_backends.integrations",
)
ON_TWO_FACES = {
    "AttentionBackendError": {"attn_backends", "attn_backends.errors"},
    "NoBackendError": {"attn_backends", "attn_backends.errors"},
    "SpecError": {"attn_backends", "attn_backends.errors"},
    "RankMismatchError": {"attn_backends.errors", "attn_backends.deploy"},
    "reference_attention": {"attn_backends", "attn_backends.reference"},
    "Reason": {"attn_backends", "attn_backends.plugin"},
    "ReasonCode": {"attn_backends", "attn_backends.plugin"},
}
"""Names a reader meets on two faces on purpose: the errors an engine meets at start-up, the
rank error beside the rank check, the oracle, and the reasons plugins return."""


def test_the_engine_face_is_at_most_thirty_names() -> None:
    assert len(ab.__all__) <= 30
    assert len(set(ab.__all__)) == len(ab.__all__)


@pytest.mark.parametrize("face", FACES)
def test_every_listed_name_exists_and_nothing_private_is_listed(face: str) -> None:
    module = importlib.import_module(face)
    for name in module.__all__:
        assert not name.startswith("_"), name
        assert hasattr(module, name), f"{face}.{name}"


def test_each_name_lives_on_one_face() -> None:
    where: dict[str, set[str]] = {}
    for face in FACES:
        for name in importlib.import_module(face).__all__:
            where.setdefault(name, set()).add(face)
    shared = {name: faces for name, faces in where.items() if len(faces) > 1}
    assert shared == ON_TWO_FACES


def test_every_error_is_on_the_errors_face_under_one_base() -> None:
    import attn_backends.errors as errors

    classes = [getattr(errors, n) for n in errors.__all__]
    assert all(issubclass(c, errors.AttentionBackendError) for c in classes)
    raised_anywhere = {
        obj
        for face in FACES
        for obj in vars(importlib.import_module(face)).values()
        if inspect.isclass(obj) and issubclass(obj, Exception)
    }
    assert raised_anywhere <= set(classes), "an error reachable from a face is not in errors"


def test_importing_the_engine_face_loads_no_deployment_machinery() -> None:
    """``import attn_backends`` stays light: the faces an engine does not use at every call
    (warm-up threads, torch.distributed ranks) load when imported."""
    code = (
        "import sys, attn_backends; "
        "print(sorted(m for m in ('attn_backends.deploy', 'attn_backends._select._warmup') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_tolerances_cannot_be_changed_for_the_whole_process() -> None:
    import torch

    from attn_backends.reference import TOLERANCE

    assert TOLERANCE[torch.float32] > 0
    with pytest.raises(TypeError):
        TOLERANCE[torch.float32] = 1.0  # type: ignore[index]
