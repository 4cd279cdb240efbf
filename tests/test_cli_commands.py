"""Subcommands from entry points (`attn_backends.plugin.Subcommand`): the core CLI offers a tool
it never imports, and a broken or clashing entry point costs that command only, with a warning
that says why."""

from __future__ import annotations

import argparse
import logging
from importlib.metadata import EntryPoint

import pytest

from attn_backends import cli
from attn_backends._cli import _commands
from attn_backends.plugin import COMMAND_GROUP, Subcommand


def _greet_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", dest="greet_name", required=True)


def _greet(args: argparse.Namespace) -> int:
    print(f"hello {args.greet_name}")
    return 0


GREET = Subcommand("say hello", _greet_arguments, _greet, description="Greets someone.")
NOT_A_COMMAND = object()


@pytest.fixture
def installed(monkeypatch):
    """Declare entry points ``{name: "module:object"}`` as installed distributions would."""

    def install(**declared: str) -> None:
        entries = [EntryPoint(name, value, COMMAND_GROUP) for name, value in declared.items()]
        monkeypatch.setattr(
            _commands,
            "entry_points",
            lambda group: entries if group == COMMAND_GROUP else [],
        )

    return install


def test_an_installed_subcommand_parses_and_runs(installed, capsys):
    installed(greet=f"{__name__}:GREET")
    assert cli.main(["greet", "--name", "Ada"]) == 0
    assert capsys.readouterr().out == "hello Ada\n"
    assert cli.main(["greet"]) == 2  # its own usage errors end like the built-ins' do
    assert "--name" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    assert "say hello" in capsys.readouterr().out


def test_without_entry_points_there_is_no_such_command(installed, capsys):
    installed()
    assert cli.main(["greet", "--name", "Ada"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'greet'" in err


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("no_such_module_here:COMMAND", "ModuleNotFoundError"),
        (f"{__name__}:NOT_A_COMMAND", "it is a object, not an attn_backends.plugin.Subcommand"),
    ],
    ids=["import-fails", "not-a-subcommand"],
)
def test_a_broken_entry_point_leaves_out_its_own_command_only(
    installed, capsys, caplog, value, problem
):
    installed(broken=value, greet=f"{__name__}:GREET")
    with caplog.at_level(logging.WARNING, logger=_commands.__name__):
        assert cli.main(["greet", "--name", "Ada"]) == 0  # the others still work
        assert cli.main(["list", "--platform", "cpu"]) == 0
    assert f"command 'broken' from {value} is left out: {problem}" in caplog.text
    capsys.readouterr()
    assert cli.main(["broken"]) == 2
    assert "invalid choice: 'broken'" in capsys.readouterr().err


def test_a_subcommand_cannot_replace_a_built_in(installed, capsys, caplog):
    installed(list=f"{__name__}:GREET")
    with caplog.at_level(logging.WARNING, logger=_commands.__name__):
        assert cli.main(["list", "--platform", "cpu"]) == 0
    assert "hello" not in capsys.readouterr().out
    assert "command 'list'" in caplog.text and "the name is taken" in caplog.text
