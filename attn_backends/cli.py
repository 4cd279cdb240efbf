"""``attn-backends``: list backends, explain a selection, check a backend on this machine.

Exit status: 0 done; 1 the answer is no (no backend fits, or the canary found wrong numbers);
2 a usage mistake, told in one line on stderr; 141 (128 + SIGPIPE, as a shell reports for a tool
stopped by a closed pipe) when stdout was closed before the output was written, said nothing.
Output that fits the pipe's buffer is written in full before a reader can close it, so
``attn-backends list | head -1`` exits 0; only a reader that quits while output is still coming
gives 141.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence

import torch

from ._backend._capabilities import check_platform
from ._cli import _args
from ._cli._args import CommandLineError, CommandParser, unrecognized
from ._cli._commands import installed_subcommands
from ._cli._spec import spec_from_args
from ._select._canary import run_canary
from ._select._registry import get_registry
from ._select._selector import BACKEND_ENV, Selection, SelectRequest, select_request
from ._select._warmup import warmup
from ._values._errors import (
    AttentionBackendError,
    KVCacheFlagError,
    NoBackendError,
    PlatformError,
    SpecError,
)
from ._values._platform import Platform, detect_platform
from ._values._records import dumps
from ._values._spec import PRESETS
from ._version import __version__
from .integrations._engine_plugins import engine_plugins

__all__ = ["build_parser", "main", "spec_from_args"]

PROG = "attn-backends"
EXIT_OK = 0
EXIT_NO = 1
EXIT_USAGE = 2
EXIT_PIPE_CLOSED = 141

_USAGE_ERRORS = (CommandLineError, SpecError, PlatformError, KVCacheFlagError)
"""Library errors that, on the command line, report what the user typed: exit 2, one line."""


def _platform_of(args: argparse.Namespace) -> Platform:
    plat: Platform | None = args.platform
    return plat if plat is not None else detect_platform(args.device)


def _add_platform_args(parser: CommandParser, *, dry_run: bool) -> None:
    where = parser.add_mutually_exclusive_group()
    parser.set_defaults(platform=None)  # check has no --platform; it reads None like the others
    if dry_run:
        where.add_argument(
            "--platform",
            metavar="P",
            type=_args.platform,
            help="dry run for another machine: cpu, cuda:sm90, rocm:gfx942 (library checks "
            "assumed); excludes --device",
        )
    where.add_argument(
        "--device",
        metavar="DEV",
        type=_args.device,
        help="device of this machine: cpu, cuda or cuda:N (default: cuda if present, else cpu)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _add_spec_args(parser: CommandParser) -> None:
    g = parser.add_argument_group(
        "attention spec",
        "a preset, or --heads and --head-dim; each flag given replaces that field of the preset "
        "and the fields not given keep the preset's value",
    )
    g.add_argument("--preset", choices=sorted(PRESETS), help="start from a model's spec")
    g.add_argument("--heads", type=_args.heads, metavar="N", help="query heads")
    g.add_argument(
        "--kv-heads",
        type=_args.heads,
        metavar="N",
        help="KV heads, dividing --heads (default: the preset's, else --heads)",
    )
    g.add_argument("--head-dim", type=_args.head_dim, metavar="N", help="head dim")
    g.add_argument("--dtype", type=_args.dtype, help="fp16, bf16, fp32, fp8 ... (default: bf16)")
    mask = g.add_mutually_exclusive_group()
    mask.add_argument(
        "--causal", dest="causal", action="store_true", default=None, help="causal mask"
    )
    mask.add_argument(
        "--bidirectional", dest="causal", action="store_false", help="no mask (BERT-like)"
    )
    g.add_argument(
        "--rope-theta", type=_args.rope_theta, metavar="T", help="enable RoPE with this theta"
    )
    g.add_argument(
        "--rotary-dim",
        type=_args.even_positive_int,
        metavar="N",
        help="partial rotary dims (default: head dim); needs RoPE",
    )
    g.add_argument("--interleaved", action="store_true", help="GPT-J style RoPE pairs")
    g.add_argument("--no-rope", action="store_true", help="drop the preset's RoPE")
    g.add_argument(
        "--logn-base",
        type=_args.logn_base,
        metavar="N",
        help="enable logn scaling relative to this training context length",
    )
    g.add_argument(
        "--rope-scaling",
        type=_args.rope_parameters,
        metavar="JSON",
        help="RoPE scaling as a Hugging Face config's rope_parameters (or rope_scaling) dict, "
        'e.g. \'{"rope_type": "linear", "factor": 4}\'; needs RoPE',
    )
    g.add_argument(
        "--max-position-embeddings",
        type=_args.positive_int,
        metavar="N",
        help="the config's max_position_embeddings, for --rope-scaling (dynamic needs it; yarn "
        "and longrope derive a missing factor from it)",
    )
    g.add_argument(
        "--window",
        type=_args.window,
        metavar="LEFT,RIGHT",
        help="sliding window: the query at i sees keys i-LEFT .. i+RIGHT (RIGHT 0 on causal "
        "specs; HF sliding_window W of Mistral/Qwen2/Gemma is W-1,0)",
    )
    g.add_argument(
        "--chunk-size",
        type=_args.chunk_size,
        metavar="N",
        help="chunked attention: the query at position i sees keys j with i//N == j//N only "
        "(HF attention_chunk_size of Llama 4)",
    )
    g.add_argument(
        "--logit-softcap",
        type=_args.logit_softcap,
        metavar="CAP",
        help="soft-cap the scaled scores to CAP*tanh(s/CAP) (Gemma 2: 50)",
    )
    g.add_argument("--alibi", action="store_true", help="ALiBi bias with BLOOM's slopes")
    g.add_argument("--mla", action="store_true", help="the layer uses MLA")
    s = parser.add_argument_group("selection")
    s.add_argument(
        "--backend",
        metavar="NAME",
        help=f"explicit backend, refused with reasons if it does not fit (default: "
        f"${BACKEND_ENV}, else by the ranking table)",
    )
    s.add_argument("--kv-cache", action="store_true", help="a KV cache is present")
    s.add_argument(
        "--need-rope-kv-cache",
        choices=("true", "false"),
        help="explicit flag value (default: derived)",
    )


def _check_backend_name(args: argparse.Namespace) -> None:
    """An explicit backend name that nothing registered is a typo: say so, list the names."""
    given: str | None = args.backend
    env = os.environ.get(BACKEND_ENV, "").strip() or None
    name = given if given is not None else env
    registry = get_registry()
    if name is None or registry.get(name) is not None:
        return
    known = ", ".join(sorted(e.name for e in registry.entries()))
    unloaded = sorted(r.name for r in registry.records() if r.status != "loaded")
    note = f"; plugins that did not load: {', '.join(unloaded)}" if unloaded else ""
    if given is not None:
        raise CommandLineError(
            f"--backend {name!r} is not a registered backend; use one of {known} "
            f"(`attn-backends list` shows each){note}"
        )
    raise CommandLineError(
        f"{BACKEND_ENV}={name!r} (from the environment) is not a registered backend; unset "
        f"{BACKEND_ENV} or set it to one of {known}{note}"
    )


def request_from_args(args: argparse.Namespace) -> SelectRequest:
    """The `SelectRequest` the spec and selection flags describe."""
    given: str | None = args.need_rope_kv_cache
    return SelectRequest(
        spec_from_args(args),
        device=args.device,
        platform=args.platform,
        has_kv_cache=args.kv_cache,
        need_rope_kv_cache=None if given is None else given == "true",
        backend=args.backend,
    )


def _select_from_args(args: argparse.Namespace) -> Selection:
    _check_backend_name(args)
    request = request_from_args(args)
    try:
        return select_request(request)
    except KVCacheFlagError as exc:
        given: str | None = args.need_rope_kv_cache
        cache = "with --kv-cache" if args.kv_cache else "without --kv-cache"
        raise CommandLineError(f"--need-rope-kv-cache {given} {cache}: {exc}") from exc


def cmd_list(args: argparse.Namespace) -> int:
    registry = get_registry()
    platform = _platform_of(args)
    rows = []
    for entry in registry.entries():
        caps = entry.capabilities
        reasons = check_platform(caps, platform)
        rows.append(
            {
                "name": entry.name,
                "plugin": entry.plugin,
                "available": not reasons,
                "reasons": [r.to_dict() for r in reasons],
                "capabilities": caps.to_dict(),
            }
        )
    plugins = [r.to_dict() for r in registry.records()]
    engines = engine_plugins()
    if args.json:
        print(
            dumps(
                {
                    "platform": platform.to_dict(),
                    "backends": rows,
                    "plugins": plugins,
                    "engines": [e.to_dict() for e in engines],
                }
            )
        )
        return EXIT_OK
    print(f"platform: {platform}" + (" (dry run)" if platform.assumed else ""))
    for row, entry in zip(rows, registry.entries(), strict=True):
        state = "available" if row["available"] else "unavailable"
        print(f"\n{row['name']}  [{state}]  plugin {row['plugin']}")
        for reason in check_platform(entry.capabilities, platform):
            print(f"    - {reason}")
        for line in declaration_lines(entry.capabilities.to_dict()):
            print(f"    {line}")
    passes = [(r.name, r.rope_passes) for r in registry.records() if r.rope_passes]
    if passes:
        print("\nRoPE passes from plugins:")
        for plugin, names in passes:
            print(f"  {plugin}: {', '.join(names)}")
    print("\nengine plugins (this library as an engine's attention backend):")
    for e in engines:
        found = f"{e.engine} {e.installed}" if e.installed else f"{e.engine} not installed"
        print(f"  {e.engine}: {e.state} ({found}; tested {e.tested}): {e.detail}")
    problems = [p for p in registry.records() if p.status != "loaded" or p.error]
    if problems:
        print("\nplugin problems:")
        for p in problems:
            print(f"  {p.name}: {p.status}: {p.error}  ({p.source})")
    return EXIT_OK


def declaration_lines(declared: Mapping[str, object]) -> list[str]:
    """What a backend declares, every field of ``Capabilities.to_dict()`` (so a new feature
    shows up here by itself): values one per line, the yes/no flags on two lines, an unset
    bound (None) left out."""
    lines = []
    yes = [key for key, value in declared.items() if value is True]
    no = [key for key, value in declared.items() if value is False]
    for key, value in declared.items():
        if value is None or isinstance(value, bool):
            continue
        lines.append(f"{key}: {value}")
    lines.append(f"declares: {', '.join(yes) or '(nothing)'}")
    lines.append(f"does not declare: {', '.join(no) or '(nothing)'}")
    return lines


def cmd_explain(args: argparse.Namespace) -> int:
    if not args.json:
        print(_select_from_args(args).explain())
        return EXIT_OK
    try:
        selection = _select_from_args(args)
    except NoBackendError as exc:
        if exc.record is None:
            raise
        # the answer is no, and the record says why: JSON on stdout, the text on stderr
        print(dumps(dict(exc.record)))
        print(f"{PROG}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_NO
    print(dumps(selection.to_dict()))
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    selection = _select_from_args(args)
    chosen: torch.device | None = args.device
    device = chosen or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = run_canary(selection.backend, selection.spec, device, seed=args.seed)
    ok = result.status == "passed"
    if args.json:
        print(dumps({"backend": selection.name, "device": str(device), **result.to_dict()}))
    else:
        print(f"{'OK' if ok else 'MISMATCH'}: {selection.name}: {result.detail}")
    return EXIT_OK if ok else EXIT_NO


def cmd_warmup(args: argparse.Namespace) -> int:
    chosen: torch.device | None = args.device
    device = chosen or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names: list[str] = args.preset
    print(f"warming up {', '.join(names)} on {device} (a kernel not compiled yet takes minutes)")
    report = warmup(names, device=device, progress=lambda line: print(line, flush=True))
    print(f"done in {report.seconds:.1f} s; a second run finds every kernel in its library's cache")
    return EXIT_OK


_EPILOG = (
    "exit status: 0 done; 1 no backend fits, or the canary found wrong numbers; 2 usage "
    "mistake (one line on stderr); 141 stdout was closed before all the output was written "
    "(a reader such as `head` that quit while output was still coming)"
)


def _build() -> tuple[CommandParser, dict[str, CommandParser]]:
    parser = CommandParser(
        prog=PROG,
        description="Pick, explain and check no-KV-cache prefill attention backends.",
        epilog=_EPILOG,
        allow_abbrev=False,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log selection details")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p_list = sub.add_parser(
        "list",
        help="every registered backend, available or not and why",
        description="List registered backends, their capabilities, "
        "availability on this machine (or --platform) and plugin errors.",
        epilog=_EPILOG,
        allow_abbrev=False,
    )
    _add_platform_args(p_list, dry_run=True)
    p_list.set_defaults(func=cmd_list)
    p_explain = sub.add_parser(
        "explain",
        help="which backend a spec gets, and why",
        description="Explain the selection for a spec: every candidate "
        "with its verdict and reasons, and where the decision came from.",
        epilog=_EPILOG,
        allow_abbrev=False,
    )
    _add_platform_args(p_explain, dry_run=True)
    _add_spec_args(p_explain)
    p_explain.set_defaults(func=cmd_explain)
    p_check = sub.add_parser(
        "check",
        help="run a canary through the selected backend",
        description="Run a small varlen batch through the selected backend "
        "on a device of this machine and compare it with the float64 reference; exit 1 "
        "on mismatch. For another machine's decision, use explain --platform.",
        epilog=_EPILOG,
        allow_abbrev=False,
    )
    _add_platform_args(p_check, dry_run=False)
    _add_spec_args(p_check)
    p_check.add_argument(
        "--seed",
        type=_args.non_negative_int,
        default=0,
        metavar="N",
        help="input seed (default 0)",
    )
    p_check.set_defaults(func=cmd_check)
    p_warmup = sub.add_parser(
        "warmup",
        help="build or load every kernel the given models use, before traffic",
        description="Run one tiny batch through every per-batch path of the backend each "
        "preset selects on this machine, so kernels compiled on first use (flashinfer's JIT: "
        "minutes each) are built now, in parallel, instead of on the first request. "
        "Idempotent: a second run only loads them.",
        epilog=_EPILOG,
        allow_abbrev=False,
    )
    p_warmup.add_argument(
        "--preset",
        action="append",
        required=True,
        choices=sorted(PRESETS),
        help="a model to warm up (repeatable)",
    )
    p_warmup.add_argument(
        "--device",
        type=_args.device,
        default=None,
        help="cpu, cuda or cuda:<index> (default: cuda when available)",
    )
    p_warmup.set_defaults(func=cmd_warmup)
    for name, command in installed_subcommands(
        sub.choices
    ).items():  # other distributions' commands
        p_extra = sub.add_parser(
            name, help=command.help, description=command.description, allow_abbrev=False
        )
        command.add_arguments(p_extra)
        p_extra.set_defaults(func=command.run)
    return parser, dict(sub.choices)


def build_parser() -> CommandParser:
    """The ``attn-backends`` parser (its mistakes raise `CommandLineError`)."""
    return _build()[0]


def _parse(
    parser: CommandParser, commands: Mapping[str, CommandParser], argv: Sequence[str] | None
) -> argparse.Namespace:
    args, extras = parser.parse_known_args(argv)
    command: str | None = args.command
    if command is None:
        raise CommandLineError(f"give a command: {', '.join(commands)} (see attn-backends --help)")
    if extras:
        raise unrecognized(command, extras, parser, commands)
    return args


def _one_line(text: str) -> str:
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def _silence_stdout() -> None:
    """Point file descriptor 1 at the null device, so the interpreter's flush at exit cannot
    fail a second time on the closed pipe."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # not a real file (captured in tests): nothing to flush
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


def _run(argv: Sequence[str] | None) -> int:
    parser, commands = _build()
    try:
        args = _parse(parser, commands, argv)
    except SystemExit as done:  # --help and --version print, then exit
        sys.stdout.flush()
        return EXIT_OK if done.code in (None, 0) else EXIT_USAGE
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    code: int = args.func(args)
    sys.stdout.flush()  # here, so that a closed pipe is seen while it can still be handled
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``attn-backends`` with ``argv`` (default: the process's) and return the exit status."""
    try:
        return _run(argv)
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_PIPE_CLOSED
    except _USAGE_ERRORS as exc:
        print(f"{PROG}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except AttentionBackendError as exc:
        print(f"{PROG}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_NO


if __name__ == "__main__":
    sys.exit(main())
