"""Argument parsing for ``attn-backends``: a parser whose mistakes are one named error, and
value types that say which flag is wrong and what to give instead."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from .._values._dtypes import parse_dtype
from .._values._errors import AttentionBackendError, PlatformError
from .._values._features import MAX_CHUNK_SIZE
from .._values._platform import Platform, parse_platform
from .._values._spec import MAX_ROPE_THETA

if TYPE_CHECKING:
    from _typeshed import SupportsWrite


_NEGATIVE_VALUE = re.compile(r"-\.?\d")
"""A value that starts with a dash (``--window -1,0``, ``--logit-softcap -5``), never an option."""


class CommandLineError(AttentionBackendError, ValueError):
    """A command-line argument is wrong or does not apply; the message names the fix.

    ``main`` prints it as one line on stderr and exits 2.
    """


class CommandParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` that raises `CommandLineError` instead of printing usage
    text and exiting, so that every mistake ends in the same one line and ``main(argv)`` returns
    its exit code in-process too."""

    def error(self, message: str) -> NoReturn:
        if "not allowed with argument" in message:  # argparse's mutually-exclusive message
            message += ": give one of them, not both"
        raise CommandLineError(message)

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        # argparse swallows OSError here, so `--help | head` would exit 0 or 141 depending on
        # buffering; let a closed pipe reach `main`, which ends it the same way every time.
        if message:
            (file or sys.stderr).write(message)

    def _parse_optional(self, arg_string: str) -> Any:
        # argparse takes "-1,0" for an unknown option ("expected one argument"): no option here
        # starts with a digit, so a dash and a digit is a value, which the flag's type judges.
        if _NEGATIVE_VALUE.match(arg_string):
            return None
        return super()._parse_optional(arg_string)

    def option_names(self) -> frozenset[str]:
        """Every option string this parser accepts (``--heads``, ``-v`` ...)."""
        # argparse keeps its actions in a private list; reading option_strings is stable API.
        return frozenset(name for action in self._actions for name in action.option_strings)


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected an integer > 0, got {value}")
    return value


MAX_HEADS = 1024
"""Largest ``--heads``/``--kv-heads``: 8x the most heads of any released model (128)."""
MAX_HEAD_DIM = 1024
"""Largest ``--head-dim``: above every released model's (576, MLA's query/key dim)."""


def heads(text: str) -> int:
    """A head count, bounded so that a typo cannot ask the canary for an impossible buffer."""
    return _at_most(positive_int(text), MAX_HEADS, "heads")


def head_dim(text: str) -> int:
    return _at_most(positive_int(text), MAX_HEAD_DIM, "a head dim")


def _at_most(value: int, limit: int, what: str) -> int:
    if value > limit:
        raise argparse.ArgumentTypeError(
            f"expected {what} from 1 to {limit} (a real model's are far smaller), got {value}"
        )
    return value


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def even_positive_int(text: str) -> int:
    value = positive_int(text)
    if value % 2:
        raise argparse.ArgumentTypeError(
            f"expected an even integer > 0 (dims rotate in pairs), got {value}"
        )
    return value


def logn_base(text: str) -> int:
    value = _integer(text)
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"expected the training context length, an integer >= 2 (e.g. 8192), got {value}"
        )
    return value


def rope_theta(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 10000, got {text!r}") from None
    if not (math.isfinite(value) and 1.0 < value <= MAX_ROPE_THETA):
        raise argparse.ArgumentTypeError(
            f"expected a finite number > 1 and at most 2**126 (e.g. 10000 or 1e6), got {text!r}"
        )
    return value


def window(text: str) -> tuple[int, int]:
    """``LEFT,RIGHT``: keys visible before and after the query (`SlidingWindow`)."""
    parts = text.split(",")
    hint = (
        "expected LEFT,RIGHT: keys seen before and after the query, e.g. 4095,0 (causal) or 64,64"
    )
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{hint}; got {text!r}")
    try:
        left, right = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{hint}; got {text!r}") from None
    if left < 0 or right < 0:
        raise argparse.ArgumentTypeError(f"{hint}, both >= 0; got {text!r}")
    return left, right


def chunk_size(text: str) -> int:
    """``N``: positions per chunk of chunked attention (`AttentionSpec.chunk_size`)."""
    value = _integer(text)
    if not 1 <= value <= MAX_CHUNK_SIZE:
        raise argparse.ArgumentTypeError(
            f"expected positions per chunk from 1 to {MAX_CHUNK_SIZE} (Llama 4: 8192), got {text!r}"
        )
    return value


def logit_softcap(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 50, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"expected a finite number > 0 (Gemma 2: 50 for attention), got {text!r}"
        )
    return value


def rope_parameters(text: str) -> dict[str, object]:
    """A JSON object as in a Hugging Face config's ``rope_parameters`` (or ``rope_scaling``)."""
    hint = 'e.g. \'{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32768}\''
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}); give an object, {hint}") from None
    except RecursionError:
        raise argparse.ArgumentTypeError(
            f"JSON nested too deeply to read; give a flat object, {hint}"
        ) from None
    except ValueError:  # an integer literal past Python's digit limit for int()
        raise argparse.ArgumentTypeError(
            f"a number in the JSON is too long to read; give an object, {hint}"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, {hint}; got {text!r}")
    return value


def dtype(text: str) -> torch.dtype:
    try:
        return parse_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def platform(text: str) -> Platform:
    try:
        return parse_platform(text)
    except PlatformError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_DEVICE_TYPES = ("cpu", "cuda")
_DRY_RUN_HINT = "or run `attn-backends explain --platform cuda:sm90` for a dry run"


def device(text: str) -> torch.device:
    """A device of this machine that torch can use: ``cpu``, ``cuda`` or ``cuda:<index>``.

    ROCm GPUs are ``cuda`` devices in torch. Checked here, at parse time, so that a device that
    does not exist is a usage error instead of a traceback from deep inside torch.
    """
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device; use cpu, cuda or cuda:<index>"
        ) from None
    if dev.type not in _DEVICE_TYPES:
        raise argparse.ArgumentTypeError(
            f"attn-backends runs on cpu or cuda devices (ROCm GPUs are cuda in torch), got "
            f"{text!r}; use cpu, cuda or cuda:<index>"
        )
    if dev.type == "cpu":
        return dev
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            f"{text!r}: this torch sees no CUDA device (torch.cuda.is_available() is False); "
            f"use --device cpu, {_DRY_RUN_HINT}"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise argparse.ArgumentTypeError(
            f"{text!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}; "
            "pick one of those"
        )
    return dev


_NOT_HERE: Mapping[tuple[str, str], str] = {
    ("check", "--platform"): "runs kernels on a device of this machine; use --device, "
    "or `attn-backends explain --platform ...` for a dry run",
}
"""Why an option of another command is refused here, where a reason helps more than a list."""


def unrecognized(
    command: str,
    extras: list[str],
    top: CommandParser,
    commands: Mapping[str, CommandParser],
) -> CommandLineError:
    """The error for arguments ``command`` does not take: where the option belongs instead."""
    option = next((e.split("=", 1)[0] for e in extras if e.startswith("-")), None)
    if option is None:
        return CommandLineError(
            f"unexpected argument {extras[0]!r}: {command} takes options only; "
            f"see attn-backends {command} --help"
        )
    if option in top.option_names():
        return CommandLineError(
            f"{option} is an option of attn-backends itself: put it before the command "
            f"(attn-backends {option} {command} ...)"
        )
    owners = sorted(name for name, parser in commands.items() if option in parser.option_names())
    if not owners:
        return CommandLineError(
            f"{command} has no option {option}; see attn-backends {command} --help"
        )
    reason = _NOT_HERE.get((command, option))
    where = f"it is an option of {' and '.join(owners)}"
    return CommandLineError(
        f"{option} does not apply to {command}, which {reason}"
        if reason
        else f"{option} does not apply to {command}; {where}"
    )
