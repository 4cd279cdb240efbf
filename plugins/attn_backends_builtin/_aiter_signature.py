"""Read the parameter list an installed aiter declares for one of its functions.

aiter's compiled ops (``mha_varlen_fwd``, ``fmha_v3_varlen_fwd``) reach Python as
``torch_compile_guard``'s ``wrapper_custom(*args, **kwargs)`` (aiter/jit/utils/torch_guard.py, in
every release since 0.1.7), which forwards to ``torch.ops.aiter.<name>`` and carries no
signature. Their parameter list is the ``def`` in aiter/ops/mha.py, so it is read from that
module's source with `ast`: nothing of aiter runs. Plain Python functions, such as the FP8 entry
point, give theirs to `inspect.signature`.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any, Literal

from attn_backends.errors import BackendFailure

DECLARING_MODULE = "aiter.ops.mha"
"""Where aiter declares every varlen attention entry point (re-exported by ``aiter``)."""

SignatureSource = Literal["inspect.signature", "aiter/ops/mha.py"]


class _DeclaredDefault:
    """Stands for a default that is not a literal (``dtypes.fp8``): optional all the same."""

    def __repr__(self) -> str:
        return "<declared default>"


DECLARED_DEFAULT = _DeclaredDefault()


def installed_version() -> str:
    """The version of the imported aiter: its ``aiter._version`` (written by setuptools-scm at
    build time), else the amd-aiter distribution's, else ``"unknown"``."""
    try:
        version = importlib.import_module("aiter._version").__version__
    except (ImportError, AttributeError):
        version = None
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version("amd-aiter")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def read_signature(fn: Callable[..., Any], name: str) -> tuple[inspect.Signature, SignatureSource]:
    """``fn``'s own signature when it has one, else the one aiter/ops/mha.py declares for ``name``.

    ``fn`` is ``Any``-typed at the call because aiter ships no type information.
    """
    try:
        signature: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None
    if signature is not None and not _forwards_everything(signature):
        return signature, "inspect.signature"
    return declared_signature(name), "aiter/ops/mha.py"


def declared_signature(name: str) -> inspect.Signature:
    """The signature of the top-level ``def name`` in aiter/ops/mha.py's source."""
    try:
        source = inspect.getsource(importlib.import_module(DECLARING_MODULE))
    except Exception as exc:  # an import error or a missing source file: say which
        raise BackendFailure(
            f"cannot read the parameters of aiter's {name}: its Python object takes "
            f"(*args, **kwargs) and the source of {DECLARING_MODULE} is not readable "
            f"({type(exc).__name__}: {exc}); install amd-aiter with its Python sources"
        ) from exc
    signature = signature_from_source(source, name)
    if signature is None:
        raise BackendFailure(
            f"{DECLARING_MODULE} declares no top-level {name}; this aiter is not one the aiter "
            "backends know: pick another backend with backend=..."
        )
    return signature


def signature_from_source(source: str, name: str) -> inspect.Signature | None:
    """The signature of the last top-level ``def name`` in ``source``, or None if there is none.

    Annotations are kept as source text; defaults that are not literals become
    `DECLARED_DEFAULT`.
    """
    found = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name
    ]
    return _signature_of(found[-1].args) if found else None


def _forwards_everything(signature: inspect.Signature) -> bool:
    kinds = {p.kind for p in signature.parameters.values()}
    return bool(kinds) and kinds <= {
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    }


def _signature_of(args: ast.arguments) -> inspect.Signature:
    kind = inspect.Parameter
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    defaults += args.defaults
    parameters = [
        _parameter(
            arg,
            kind.POSITIONAL_ONLY if i < len(args.posonlyargs) else kind.POSITIONAL_OR_KEYWORD,
            default,
        )
        for i, (arg, default) in enumerate(zip(positional, defaults, strict=True))
    ]
    if args.vararg is not None:
        parameters.append(_parameter(args.vararg, kind.VAR_POSITIONAL, None))
    parameters += [
        _parameter(arg, kind.KEYWORD_ONLY, default)
        for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    if args.kwarg is not None:
        parameters.append(_parameter(args.kwarg, kind.VAR_KEYWORD, None))
    return inspect.Signature(parameters)


def _parameter(
    arg: ast.arg, kind: inspect._ParameterKind, default: ast.expr | None
) -> inspect.Parameter:
    annotation = inspect.Parameter.empty if arg.annotation is None else ast.unparse(arg.annotation)
    value: object = inspect.Parameter.empty if default is None else _literal(default)
    return inspect.Parameter(arg.arg, kind, default=value, annotation=annotation)


def _literal(node: ast.expr) -> object:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return DECLARED_DEFAULT
