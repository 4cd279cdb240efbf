"""pytest plugin (entry point ``pytest11``): ``pytest --attn-backend NAME`` runs the
conformance suite for that backend, from any directory, with no test file of your own.

A run whose numeric cases were all skipped proved nothing about the numbers: a GPU backend's
suite on a CPU machine runs only its refusal cases, and would be green. So the summary counts,
per backend, the numeric cases that ran and those skipped, and a backend with none run fails
the session, loudly, unless ``--attn-backend-allow-no-numbers`` says that is what was meant
(checking only a backend's refusals on a machine that cannot run it). Failing is the default
because the usual way to meet this is a CI job on the wrong runner, which must not pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

_SUITE = Path(__file__).with_name("_session.py")
NUMERIC_TESTS = frozenset({"test_numeric", "test_interleaved_plans", "test_graph_mode"})
"""Suite tests that compare a backend's output with the float64 reference."""
ALLOW_NO_NUMBERS = "--attn-backend-allow-no-numbers"


@dataclass(eq=False)  # hashable by identity: pytest keeps plugins in sets
class NumbersChecked:
    """Numeric cases of each backend of ``--attn-backend``: ran (passed or failed) or skipped;
    registered as a pytest plugin for the session."""

    backends: list[str]
    allow_none: bool
    backend_of: dict[str, str] = field(default_factory=dict)
    """Node id of each numeric case -> its backend."""
    ran: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)

    def silent(self) -> list[str]:
        """The backends of this run whose numbers nothing checked."""
        return [name for name in self.backends if not self.ran.get(name)]

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            if not isinstance(item, pytest.Function) or item.originalname not in NUMERIC_TESTS:
                continue
            # pytest sets ``callspec`` only on parametrized items (an untyped boundary)
            callspec = getattr(item, "callspec", None)
            case = callspec.params.get("conformance_case") if callspec is not None else None
            # the suite's parameters start with the backend name (suite.pytest_generate_tests)
            if isinstance(case, tuple) and case and isinstance(case[0], str):
                self.backend_of[item.nodeid] = case[0]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        backend = self.backend_of.get(report.nodeid)
        if backend is None:
            return
        if report.skipped:
            self.skipped[backend] = self.skipped.get(backend, 0) + 1
        elif report.when == "call":
            self.ran[backend] = self.ran.get(backend, 0) + 1

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.silent() and not self.allow_none and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        terminalreporter.section("attn-backends: numbers checked")
        for name in self.backends:
            ran, skipped = self.ran.get(name, 0), self.skipped.get(name, 0)
            terminalreporter.write_line(
                f"{name}: {ran} numeric case(s) compared with the float64 reference, "
                f"{skipped} skipped"
            )
        silent = self.silent()
        if not silent:
            return
        verdict = (
            f"Allowed by {ALLOW_NO_NUMBERS}: only refusals were checked."
            if self.allow_none
            else f"The run FAILS (pass {ALLOW_NO_NUMBERS} if only refusals were meant)"
        )
        banner = "!" * 78
        terminalreporter.write_line(banner, red=True, bold=True)
        terminalreporter.write_line(
            f"NO NUMBERS CHECKED for {', '.join(silent)}: every numeric case was skipped or not "
            "collected on this machine, so nothing proved the outputs right; run it where the "
            f"backend can run (--attn-device, a GPU runner). {verdict}",
            red=True,
            bold=True,
        )
        terminalreporter.write_line(banner, red=True, bold=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attn-backends", "attn-backends conformance suite")
    group.addoption(
        "--attn-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run the no-cache prefill conformance suite for this registered backend "
        "(repeatable); see `attn-backends list` for names",
    )
    group.addoption(
        "--attn-device",
        default=None,
        metavar="DEVICE",
        help="device for conformance cases (default: cuda when available, else cpu)",
    )
    group.addoption(
        ALLOW_NO_NUMBERS,
        action="store_true",
        default=False,
        help="do not fail the run when no numeric case of a backend could run here (only its "
        "refusals were checked); the summary still says so",
    )


def pytest_configure(config: pytest.Config) -> None:
    backends: list[str] = config.getoption("attn_backend")
    if not backends:
        return
    from .._select._registry import get_registry  # after pytest parsed the options
    from .suite import unregistered_message

    registry = get_registry()
    unknown = [name for name in backends if registry.get(name) is None]
    if unknown:
        # a usage error here, before collection: one line, no traceback, no summary banner
        raise pytest.UsageError("; ".join(unregistered_message(name, registry) for name in unknown))
    allow_none: bool = config.getoption("attn_backend_allow_no_numbers")
    config.pluginmanager.register(NumbersChecked(backends, allow_none), "attn-backends-numbers")
    suite = str(_SUITE)
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        if suite not in config.args:
            config.args.append(suite)
    else:
        config.args[:] = [suite]
