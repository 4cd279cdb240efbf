"""One decision across ranks, checked with two real CPU processes over gloo.

Each rank writes what happened in each scenario to a JSON file; the test reads them back, so a
failing rank shows up as a clear assertion instead of a hung or crashed process group.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from attn_backends_builtin import torch_sdpa
from torch.multiprocessing.spawn import start_processes

import attn_backends as ab
from tests.static_plugin import StaticPlugin

WORLD = 2
SPEC = ab.AttentionSpec(4, 2, 32, torch.float32, causal=True)

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)


class _CudaOnly(torch_sdpa.TorchSdpaBackend):
    """A backend ranked on CUDA: a rank that believes it is on sm90 picks it."""

    name = "cuda-kernel"
    capabilities = ab.Capabilities(
        platforms=frozenset({"cuda"}),
        dtypes=frozenset({torch.float32}),
        priority=(ab.PriorityRule("cuda", 50),),
    )


def _outcome(run: Callable[[], object]) -> dict[str, object]:
    try:
        result = run()
    except ab.RankMismatchError as exc:
        return {"error": "RankMismatchError", "message": str(exc), "ranks": len(exc.decisions)}
    except ab.AttentionBackendError as exc:
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
        timeout=timedelta(seconds=30),
    )
    reg = ab.Registry()
    reg.register_plugin(torch_sdpa, name="torch-sdpa")
    reg.register_plugin(StaticPlugin(_CudaOnly()), name="vendor")
    same = ab.select(SPEC, platform="cpu", registry=reg)
    # rank 1 sees another platform (a dry run for sm90 here; a different GPU in real life)
    mine = ab.select(SPEC, platform="cuda:sm90" if rank == 1 else "cpu", registry=reg)
    pinned = "torch-sdpa" if rank == 0 else "no-such-backend"
    results = {
        "same": _outcome(lambda: ab.check_consistent_across_ranks(same)),
        "platform": _outcome(lambda: ab.check_consistent_across_ranks(mine)),
        "one-fails": _outcome(
            lambda: ab.select_across_ranks(SPEC, backend=pinned, platform="cpu", registry=reg)
        ),
        "select-agrees": _outcome(
            lambda: ab.select_across_ranks(SPEC, platform="cpu", registry=reg)
        ),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, object]]]:
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


def test_ranks_that_agree_pass(outcomes: list[dict[str, dict[str, object]]]) -> None:
    for result in outcomes:
        assert result["same"] == {"agreed": ["torch-sdpa", "torch-sdpa"]}
        assert result["select-agrees"] == {"selected": "torch-sdpa"}


def test_a_rank_on_another_platform_is_named_on_every_rank(
    outcomes: list[dict[str, dict[str, object]]],
) -> None:
    for result in outcomes:
        got = result["platform"]
        assert got["error"] == "RankMismatchError"
        assert got["ranks"] == WORLD
        message = str(got["message"])
        assert "rank 0 (cpu): torch-sdpa [input_layout=views" in message
        assert "rank 1 (cuda:sm90): cuda-kernel [input_layout=views" in message
        assert "every rank must run the same backend" in message


def test_a_rank_whose_selection_fails_does_not_hang_the_others(
    outcomes: list[dict[str, dict[str, object]]],
) -> None:
    for result in outcomes:
        got = result["one-fails"]
        assert got["error"] == "RankMismatchError"
        message = str(got["message"])
        assert "rank 0 (cpu): torch-sdpa" in message
        assert (
            "rank 1 (cpu): no backend (NoBackendError: unknown backend backend='no-such-backend'"
            in message
        )


def test_without_a_process_group_there_is_one_rank() -> None:
    assert not dist.is_initialized()
    sel = ab.select(SPEC, platform="cpu")
    (decision,) = ab.check_consistent_across_ranks(sel)
    assert decision.rank == 0
    assert decision.backend == sel.name
    assert decision.fingerprint == sel.fingerprint()
