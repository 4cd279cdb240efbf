"""Running one piece of work on several threads released together, for the concurrency tests."""

from __future__ import annotations

import threading
from collections.abc import Callable


def in_threads(count: int, work: Callable[[int], object], *, timeout: float = 60) -> list[object]:
    """``work(i)`` on ``count`` threads released together by a barrier; the results in thread
    order. Re-raises the first failure; a thread still running after ``timeout`` fails."""
    barrier = threading.Barrier(count)
    results: list[object] = [None] * count
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=timeout)
            results[i] = work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]
    return results
