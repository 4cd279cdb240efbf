"""pytest plugin (entry point ``pytest11``): ``pytest --attn-backend NAME`` runs the
conformance suite for that backend, from any directory, with no test file of your own."""

from __future__ import annotations

from pathlib import Path

import pytest

_SUITE = Path(__file__).with_name("test_conformance.py")


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


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("attn_backend"):
        return
    suite = str(_SUITE)
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        if suite not in config.args:
            config.args.append(suite)
    else:
        config.args[:] = [suite]
