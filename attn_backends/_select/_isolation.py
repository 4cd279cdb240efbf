"""Runs plugin code where it can neither hang the host nor call back into it.

Every piece of a plugin that runs while it loads (its import, pluggy's inspection of it, its
hook, its backends' ``name`` and ``capabilities``) runs through `call_plugin_code`: in a daemon
thread, waited for a bounded time. Whatever it raises is turned into a `PluginLoadError` for the
registry to record, except `KeyboardInterrupt`, which reaches the caller so that an operator can
still stop the process. The thread is marked, so a plugin calling back into the registry gets a
`ReentrantRegistryError` instead of waiting forever on a lock its own loader holds.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .._values._errors import InvalidArgumentError, PluginLoadError, ReentrantRegistryError

logger = logging.getLogger("attn_backends")

PLUGIN_TIMEOUT_ENV = "ATTN_BACKENDS_PLUGIN_TIMEOUT"
"""Seconds one step of loading one plugin (its import, or its hook) may take."""
DEFAULT_PLUGIN_TIMEOUT = 10.0
"""Generous for a plugin that imports lazily, as the plugin guide asks; short enough that a
hung plugin delays start-up by seconds, not forever."""

T = TypeVar("T")


class _PluginThread(threading.local):
    """Per-thread flag: True in a thread that runs plugin code for the loader."""

    active: bool = False


_plugin_thread = _PluginThread()


def refuse_reentry(call: str) -> None:
    """Raise `ReentrantRegistryError` when plugin code being loaded makes this ``call``."""
    if _plugin_thread.active:
        raise ReentrantRegistryError(
            f"{call} was called by a plugin while it was being loaded; the registry is not "
            "ready yet and waiting for it would deadlock. Call it later, when the backend is "
            "used (plan_kernel/attend), not at import or in attn_backends_register"
        )


def check_timeout(seconds: float) -> float:
    """``seconds`` as a float, or `InvalidArgumentError` unless it is a positive finite number."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise InvalidArgumentError(
            f"plugin_timeout must be a number of seconds, got {type(seconds).__name__}"
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidArgumentError(f"plugin_timeout must be positive and finite, got {seconds!r}")
    return float(seconds)


def timeout_from_env(environ: Mapping[str, str] | None = None) -> float:
    """``$ATTN_BACKENDS_PLUGIN_TIMEOUT`` in seconds; unset gives the default, and so does a
    value that is not a positive number (with a warning, so a typo never stops loading)."""
    env = os.environ if environ is None else environ
    raw = env.get(PLUGIN_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_PLUGIN_TIMEOUT
    try:
        return check_timeout(float(raw))
    except (ValueError, InvalidArgumentError):
        logger.warning(
            "%s=%r is not a positive number of seconds; using %g",
            PLUGIN_TIMEOUT_ENV,
            raw,
            DEFAULT_PLUGIN_TIMEOUT,
        )
        return DEFAULT_PLUGIN_TIMEOUT


def describe_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class _Outcome(Generic[T]):
    """What the plugin thread left behind; written once, before ``done`` is set."""

    done: threading.Event
    values: list[T] = field(default_factory=list)
    """Empty, or the one value ``fn`` returned (a list, since ``None`` is a valid value)."""
    error: BaseException | None = None
    interrupt: KeyboardInterrupt | None = None


def call_plugin_code(fn: Callable[[], T], *, timeout: float, what: str) -> T:
    """``fn()`` run in a marked daemon thread and waited for at most ``timeout`` seconds.

    Raises `PluginLoadError` saying what happened when ``fn`` raises anything (``SystemExit``,
    ``GeneratorExit``, a test framework's outcome exceptions included) or does not return in
    time; the thread of a plugin that hangs is left behind, harmless, since it only computes a
    value nobody will read. A `KeyboardInterrupt` raised by ``fn`` is re-raised here.
    """
    outcome: _Outcome[T] = _Outcome(threading.Event())

    def run() -> None:
        _plugin_thread.active = True
        try:
            outcome.values.append(fn())
        except KeyboardInterrupt as exc:
            outcome.interrupt = exc
        except BaseException as exc:  # a plugin may raise anything; all of it is recorded
            outcome.error = exc
        finally:
            outcome.done.set()

    threading.Thread(target=run, name=f"attn-backends plugin: {what}", daemon=True).start()
    if not outcome.done.wait(timeout):
        raise PluginLoadError(
            f"{what} did not finish within {timeout:g} s (raise ${PLUGIN_TIMEOUT_ENV} if it is "
            "only slow; a plugin should import no GPU library at import time)"
        )
    if outcome.interrupt is not None:
        raise outcome.interrupt
    if outcome.error is not None:
        raise PluginLoadError(describe_exception(outcome.error)) from outcome.error
    return outcome.values[0]
