"""Subcommands other distributions add to ``attn-backends``, found through entry points.

The core names no optional tool: an installed distribution declares an entry point in
`COMMAND_GROUP` whose object is a `Subcommand`, and the CLI adds one subparser per entry point,
so the core never imports the tools it offers.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

COMMAND_GROUP = "attn_backends.commands"
"""Entry-point group of ``attn-backends`` subcommands: ``name = "module:object"``, where the
object is a `Subcommand` and ``name`` the word typed after ``attn-backends``."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Subcommand:
    """One ``attn-backends`` subcommand: its help line, its options and what it runs."""

    help: str
    """One line for ``attn-backends --help``."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds the subcommand's options to its parser; destinations should carry a prefix of the
    subcommand's own, so that they never collide with the top-level options."""
    run: Callable[[argparse.Namespace], int]
    """Runs the parsed command and returns the process exit status."""
    description: str | None = None


def _load(entry: EntryPoint) -> Subcommand | str:
    """The entry point's `Subcommand`, or why it cannot be one."""
    try:
        found: object = entry.load()
    except Exception as exc:  # any error of a third-party module: that command only fails
        return f"{type(exc).__name__}: {exc}"
    if not isinstance(found, Subcommand):
        return f"it is a {type(found).__name__}, not an attn_backends.plugin.Subcommand"
    return found


def installed_subcommands(taken: Collection[str]) -> dict[str, Subcommand]:
    """Every subcommand the installed distributions declare, by name, in name order.

    An entry point that fails to load, or whose name is a built-in's (in ``taken``) or was
    declared before, is left out with a warning that says why: the other commands still work.
    """
    commands: dict[str, Subcommand] = {}
    for entry in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: (e.name, e.value)):
        if entry.name in taken or entry.name in commands:
            loaded: Subcommand | str = "the name is taken"
        else:
            loaded = _load(entry)
        if isinstance(loaded, str):
            logger.warning(
                "attn-backends command %r from %s is left out: %s", entry.name, entry.value, loaded
            )
        else:
            commands[entry.name] = loaded
    return commands
