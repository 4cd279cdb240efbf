"""One decision across ranks, checked with two real CPU processes over gloo.

Each rank writes what happened in each scenario to a JSON file; the test reads them back, so a
failing rank shows up as a clear assertion instead of a hung or crashed process group. The
process group's timeout is short: a rank left waiting fails the test in seconds, not minutes.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from attn_backends_builtin import torch_sdpa
from torch.multiprocessing.spawn import start_processes

import attn_backends as ab
import attn_backends.plugin as abp
from attn_backends._select._distributed import rank_fingerprint
from attn_backends._select._registry import RegistrySnapshot
from attn_backends._values import _records
from attn_backends.deploy import (
    RankDecision,
    Registry,
    check_consistent_across_ranks,
    select_across_ranks,
)
from attn_backends.errors import InvalidArgumentError, RankMismatchError
from tests.static_plugin import StaticPlugin

WORLD = 2
SPEC = ab.AttentionSpec(4, 2, 32, torch.float32, causal=True)
COLLECTIVE_TIMEOUT = timedelta(seconds=5)

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)

Outcomes = list[dict[str, dict[str, object]]]


class _CudaOnly(torch_sdpa.TorchSdpaBackend):
    """A backend ranked first on CUDA: a rank that believes it is on sm90 picks it."""

    name = "cuda-kernel"
    capabilities = abp.Capabilities(
        platforms=frozenset({"cuda"}), dtypes=frozenset({torch.float32})
    )


class _BrokenRegistry(Registry):
    """A registry whose table cannot be read: `select` raises a plain RuntimeError."""

    def snapshot(self) -> RegistrySnapshot:
        raise RuntimeError("the plugin table is corrupt")


class _InterruptedRegistry(Registry):
    def snapshot(self) -> RegistrySnapshot:
        raise KeyboardInterrupt


def _gpu(device_name: str, flashinfer: str) -> ab.Platform:
    """A detected (not dry-run) sm90 platform with the given device and flashinfer version."""
    return ab.Platform(
        kind="cuda", arch="sm90", device_name=device_name, libraries=(("flashinfer", flashinfer),)
    )


def _outcome(run: Callable[[], object]) -> dict[str, object]:
    try:
        result = run()
    except RankMismatchError as exc:
        return {
            "error": "RankMismatchError",
            "message": str(exc),
            "ranks": len(exc.decisions),
            "failed": [[d.rank, d.error_type, d.error] for d in exc.decisions if d.error_type],
            "cause": type(exc.__cause__).__name__ if exc.__cause__ is not None else None,
        }
    except Exception as exc:  # recorded so that the test names it instead of a dead rank
        return {"error": type(exc).__name__, "message": str(exc)}
    if isinstance(result, ab.Selection):
        return {"selected": result.name}
    assert isinstance(result, tuple)
    return {"agreed": [d.backend for d in result]}


def _worker(rank: int, store: str, out_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=COLLECTIVE_TIMEOUT,
    )
    reg = Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    reg.register_plugin(StaticPlugin(_CudaOnly, first_on="cuda"), name="vendor")
    same = ab.select(SPEC, platform="cpu", registry=reg)
    # rank 1 sees another platform (a dry run for sm90 here; a different GPU in real life)
    mine = ab.select(SPEC, platform="cuda:sm90" if rank == 1 else "cpu", registry=reg)
    pinned = "torch-sdpa" if rank == 0 else "no-such-backend"
    # the same RoPE written as an int on one rank and as a float on the other
    theta = ab.AttentionSpec(
        4, 2, 32, torch.float32, causal=True, rope=ab.RopeSpec(10000 if rank == 0 else 10000.0)
    )
    broken = reg if rank == 0 else _BrokenRegistry()
    results = {
        "same": _outcome(lambda: check_consistent_across_ranks(same)),
        "platform": _outcome(lambda: check_consistent_across_ranks(mine)),
        "one-fails": _outcome(
            lambda: select_across_ranks(SPEC, backend=pinned, platform="cpu", registry=reg)
        ),
        "raw-error": _outcome(lambda: select_across_ranks(SPEC, platform="cpu", registry=broken)),
        "select-agrees": _outcome(lambda: select_across_ranks(SPEC, platform="cpu", registry=reg)),
        "int-float-theta": _outcome(
            lambda: select_across_ranks(theta, platform="cpu", registry=reg)
        ),
        "library-version": _outcome(
            lambda: select_across_ranks(
                SPEC, platform=_gpu("H200", "0.7.0" if rank == 0 else "0.6.1"), registry=reg
            )
        ),
        "device-name": _outcome(
            lambda: select_across_ranks(
                SPEC, platform=_gpu("H200" if rank == 0 else "H100", "0.7.0"), registry=reg
            )
        ),
    }
    # last, since it leaves the group unusable: only rank 0 joins the check, on a group whose
    # timeout is one second
    lonely = dist.new_group(timeout=timedelta(seconds=1))
    if rank == 0:
        results["absent-peer"] = _outcome(lambda: check_consistent_across_ranks(same, lonely))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Outcomes:
    tmp = tmp_path_factory.mktemp("dist")
    ctx = start_processes(
        _worker, args=(str(tmp / "store"), str(tmp)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 60
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two gloo ranks did not finish within 60 s")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_ranks_that_agree_pass(outcomes: Outcomes) -> None:
    for result in outcomes:
        assert result["same"] == {"agreed": ["torch-sdpa", "torch-sdpa"]}
        assert result["select-agrees"] == {"selected": "torch-sdpa"}


def test_a_rank_on_another_platform_is_named_on_every_rank(outcomes: Outcomes) -> None:
    for result in outcomes:
        got = result["platform"]
        assert got["error"] == "RankMismatchError"
        assert got["ranks"] == WORLD
        message = str(got["message"])
        assert "rank 0 (cpu): torch-sdpa [input_layout=views" in message
        assert "rank 1 (cuda:sm90): cuda-kernel [input_layout=views" in message
        assert "backend differs: " in message
        assert "every rank must run the same backend" in message


def test_a_rank_whose_selection_fails_does_not_hang_the_others(outcomes: Outcomes) -> None:
    for result in outcomes:
        got = result["one-fails"]
        assert got["error"] == "RankMismatchError"
        message = str(got["message"])
        assert "rank 0 (cpu): torch-sdpa" in message
        assert (
            "rank 1 (cpu): no backend (NoBackendError: unknown backend backend='no-such-backend'"
            in message
        )


def test_a_raw_exception_on_one_rank_raises_the_same_named_error_on_every_rank(
    outcomes: Outcomes,
) -> None:
    messages = set()
    for rank, result in enumerate(outcomes):
        got = result["raw-error"]
        assert got["error"] == "RankMismatchError", got
        assert got["ranks"] == WORLD
        assert got["failed"] == [[1, "RuntimeError", "the plugin table is corrupt"]]
        # the failing rank keeps its own exception as the cause; the others have none
        assert got["cause"] == ("RuntimeError" if rank == 1 else None)
        messages.add(str(got["message"]))
    (message,) = messages
    assert "rank 0 (cpu): torch-sdpa" in message
    assert "rank 1 (cpu): no backend (RuntimeError: the plugin table is corrupt)" in message
    assert "rank 1 failed to select" in message


def test_an_int_and_a_float_that_are_equal_are_one_decision(outcomes: Outcomes) -> None:
    for result in outcomes:
        assert result["int-float-theta"] == {"selected": "torch-sdpa"}


def test_ranks_with_other_library_versions_are_named_with_the_field(outcomes: Outcomes) -> None:
    for result in outcomes:
        got = result["library-version"]
        assert got["error"] == "RankMismatchError", got
        message = str(got["message"])
        assert 'versions.flashinfer differs: "0.7.0" on rank 0; "0.6.1" on rank 1' in message
        assert "device_name differs" not in message


def test_ranks_on_other_gpus_are_named_with_the_field(outcomes: Outcomes) -> None:
    for result in outcomes:
        got = result["device-name"]
        assert got["error"] == "RankMismatchError", got
        message = str(got["message"])
        assert 'platform.device_name differs: "H200" on rank 0; "H100" on rank 1' in message
        assert "versions.flashinfer differs" not in message


def test_a_rank_that_never_joins_gives_the_named_error_not_a_raw_one(outcomes: Outcomes) -> None:
    got = outcomes[0]["absent-peer"]
    assert got["error"] == "RankMismatchError", got
    assert "rank 0 could not gather the other ranks' decisions" in str(got["message"])
    assert "every rank of the group must call" in str(got["message"])
    assert got["cause"] is not None


# ---------------------------------------------------------------- one process, no group


def test_without_a_process_group_there_is_one_rank() -> None:
    assert not dist.is_initialized()
    sel = ab.select(SPEC, platform="cpu")
    (decision,) = check_consistent_across_ranks(sel)
    assert decision.rank == 0
    assert decision.backend == sel.name
    assert decision.fingerprint == rank_fingerprint(sel)


def test_a_lone_rank_that_fails_raises_the_named_error_with_its_cause() -> None:
    with pytest.raises(RankMismatchError, match="rank 0 failed to select") as caught:
        select_across_ranks(SPEC, platform="cpu", registry=_BrokenRegistry())
    assert isinstance(caught.value.__cause__, RuntimeError)
    (decision,) = caught.value.decisions
    assert (decision.error_type, decision.error) == ("RuntimeError", "the plugin table is corrupt")
    assert decision.fingerprint is None


def test_keyboard_interrupt_is_not_turned_into_a_decision() -> None:
    with pytest.raises(KeyboardInterrupt):
        select_across_ranks(SPEC, platform="cpu", registry=_InterruptedRegistry())


def test_fingerprint_holds_versions_and_device_and_is_canonical(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    as_int = ab.AttentionSpec(4, 2, 32, torch.float32, causal=True, rope=ab.RopeSpec(1000000))
    as_float = ab.AttentionSpec(4, 2, 32, torch.float32, causal=True, rope=ab.RopeSpec(1e6))
    cpu = ab.parse_platform("cpu")
    first = rank_fingerprint(ab.select(as_int, platform=cpu))
    assert rank_fingerprint(ab.select(as_float, platform=cpu)) == first
    record = json.loads(first)
    assert record["spec"]["rope"]["theta"] == 1000000
    assert record["versions"]["torch"] == torch.__version__
    assert record["platform"]["device_name"] is None
    monkeypatch.setattr(torch, "__version__", "0.0.1-another-build")
    assert rank_fingerprint(ab.select(as_int, platform=cpu)) != first


def test_a_detail_that_only_explains_is_not_part_of_the_decision() -> None:
    sel = ab.select(SPEC, platform="cpu")
    on_one_host = replace(sel, details=(*sel.details, ("preprocess_fallback", "pid 1 on a")))
    on_another = replace(sel, details=(*sel.details, ("preprocess_fallback", "pid 2 on b")))
    assert rank_fingerprint(on_one_host) == rank_fingerprint(on_another)
    other_pass = replace(sel, details=(*sel.details, ("preprocess", "native")))
    assert rank_fingerprint(other_pass) != rank_fingerprint(sel)


class _GraphTwin(torch_sdpa.TorchSdpaBackend):
    """torch-sdpa's twin that declares graph mode, ranked below it on CPU."""

    name = "graph-sdpa"
    capabilities = replace(torch_sdpa.TorchSdpaBackend.capabilities, cuda_graph=True)


def test_graph_mode_and_a_whole_request_reach_the_rank_helper() -> None:
    reg = Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    below = abp.Placement("graph-sdpa", after="torch-sdpa", platform="cpu")
    reg.register_plugin(StaticPlugin(_GraphTwin, placements=[below]), name="graph")
    assert select_across_ranks(SPEC, platform="cpu", registry=reg).name == "torch-sdpa"
    graph = select_across_ranks(SPEC, platform="cpu", registry=reg, cuda_graph=True)
    assert graph.name == "graph-sdpa" and graph.cuda_graph
    request = ab.SelectRequest(SPEC, platform="cpu", cuda_graph=True)
    assert select_across_ranks(request, registry=reg) is graph
    with pytest.raises(RankMismatchError) as caught:
        select_across_ranks(request, registry=reg, strict=True)
    assert isinstance(caught.value.__cause__, InvalidArgumentError)
    assert "not both" in str(caught.value.__cause__)
    with pytest.raises(RankMismatchError) as caught:
        select_across_ranks(SPEC, registry=reg, cuda_graphs=True)
    assert isinstance(caught.value.__cause__, InvalidArgumentError)


def test_rank_mismatch_error_lives_beside_rank_decision() -> None:
    errors = Path(ab._values._errors.__file__).read_text()
    imported = {
        node.module
        for node in ast.walk(ast.parse(errors))
        if isinstance(node, ast.ImportFrom) and node.level > 0
    }
    assert imported == {"_reasons"}, "the errors module imports nothing above it"
    assert RankMismatchError.__module__ == "attn_backends._select._distributed"
    assert issubclass(RankMismatchError, ab.AttentionBackendError)
    assert issubclass(RankMismatchError, RuntimeError)


def test_a_rank_decision_travels_as_strict_json() -> None:
    decision = RankDecision(0, "cpu", None, None, error="inf", error_type="ValueError")
    payload = _records.dumps(dataclasses.asdict(decision), indent=None)
    assert json.loads(payload) == dataclasses.asdict(decision)
    assert json.loads(_records.dumps({"x": float("nan")}, indent=None)) == {
        "x": None,
        "x_not_finite": "nan",
    }
