"""The gateway's request check: ``kvflow.openai_api`` (vLLM's schema), fast on the data path.

``kvflow.openai_api.validate`` is the rule: a body is accepted exactly when it accepts it, and a
refused body gets its 400, which is vLLM's. Building the pydantic model costs tens of µs that the
gateway, which forwards the original bytes, does not otherwise need. So the usual body is first
checked by msgspec structs *generated from the pydantic models* (same fields, same bounds), in
strict mode, after the same vLLM before-checks: whatever they accept pydantic accepts too (strict
is the narrower of the two). Anything else — a type pydantic would coerce, a field whose type has
no msgspec form — goes to pydantic, which decides. A new field is added to the pydantic model
only; tests/gateway/test_validation.py pins that the two agree on every field.

What vLLM refuses only after the schema (sampling ranges, context length, vocabulary) the gateway
forwards, and the client gets the model server's own error.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

import annotated_types
import msgspec
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kvflow import openai_api
from kvflow.openai_api import (
    CHAT_CHECKS,
    COMPLETION_CHECKS,
    Check,
    ChatCompletionRequest,
    CompletionRequest,
    run_checks,
)


class _Untranslatable(Exception):
    """A pydantic type with no msgspec equivalent: such a field is checked by pydantic."""


_SCALARS = (bool, int, float, str, type(None), typing.Any)
_CONSTRAINTS = {annotated_types.Ge: "ge", annotated_types.Le: "le", annotated_types.Gt: "gt", annotated_types.Lt: "lt",
                annotated_types.MinLen: "min_length", annotated_types.MaxLen: "max_length"}


def _meta(metadata: list[Any]) -> msgspec.Meta | None:
    kwargs: dict[str, Any] = {}
    for item in metadata:
        name = _CONSTRAINTS.get(type(item))
        if name is None:
            raise _Untranslatable(repr(item))  # a validator or constraint msgspec cannot express
        kwargs[name] = getattr(item, name)
    return msgspec.Meta(**kwargs) if kwargs else None


def _translate(tp: Any, metadata: list[Any] | None = None) -> Any:
    """The msgspec form of a pydantic annotation, or ``_Untranslatable``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        flat = [x for m in args[1:] for x in (m.metadata if isinstance(m, FieldInfo) else [m])]
        return _translate(args[0], flat)
    if metadata:
        meta = _meta(metadata)
        if meta is None:
            return _translate(tp)
        if origin in (typing.Union, types.UnionType):  # pydantic constrains the non-null arms
            return _union([a if a is type(None) else Annotated[_translate(a), meta] for a in args])
        return Annotated[_translate(tp), meta]
    if tp in _SCALARS:
        return tp
    if origin is Literal:
        return tp
    if origin is list:
        return list[_translate(args[0])]  # type: ignore[misc]
    if origin is dict:
        return dict[_translate(args[0]), _translate(args[1])]  # type: ignore[misc]
    if origin in (typing.Union, types.UnionType):
        return _union([_translate(a) for a in args])
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        decorators = tp.__pydantic_decorators__
        if decorators.model_validators or decorators.field_validators:
            raise _Untranslatable(f"{tp.__name__} has validators msgspec cannot run")
        return struct_for(tp)
    raise _Untranslatable(repr(tp))


def _union(arms: list[Any]) -> Any:
    union: Any = typing.Union[tuple(arms)]  # noqa: UP007 - built from a list
    try:
        msgspec.inspect.type_info(union)  # msgspec refuses ambiguous unions (two list types, ...)
    except TypeError as exc:
        raise _Untranslatable(str(exc)) from None
    return union


_STRUCTS: dict[type[BaseModel], tuple[type[msgspec.Struct], frozenset[str]]] = {}


def struct_for(model: type[BaseModel]) -> type[msgspec.Struct]:
    return _generate(model)[0]


def slow_fields(model: type[BaseModel]) -> frozenset[str]:
    """Fields whose type msgspec cannot express: a body that sets one is checked by pydantic."""
    return _generate(model)[1]


def _generate(model: type[BaseModel]) -> tuple[type[msgspec.Struct], frozenset[str]]:
    if model not in _STRUCTS:
        fields: list[tuple[str, Any, Any]] = []
        slow: set[str] = set()
        for name, info in model.model_fields.items():
            try:
                tp = _translate(info.annotation, list(info.metadata))
            except _Untranslatable:
                tp = Any
                slow.add(name)
            if info.is_required():
                fields.append((name, tp, msgspec.NODEFAULT))
            else:
                fields.append((name, typing.Union[tp, msgspec.UnsetType], msgspec.UNSET))  # noqa: UP007
        struct = msgspec.defstruct(f"Fast{model.__name__}", fields, kw_only=True)
        _STRUCTS[model] = (struct, frozenset(slow))
    return _STRUCTS[model]


def _token_ids(items: list[Any]) -> bool:
    return all(type(t) is int and t >= 0 for t in items)


def _plain_prompt(prompt: Any) -> bool:
    """A prompt of the accepted shapes, in the plainest types (anything else: pydantic decides)."""
    if type(prompt) is str or prompt is None:
        return True
    if type(prompt) is not list or not prompt:
        return False
    first = type(prompt[0])
    if first is str:
        return all(type(p) is str for p in prompt)
    if first is int:
        return _token_ids(prompt)
    return all(type(p) is list and _token_ids(p) for p in prompt)


_FAST: dict[str, tuple[type[BaseModel], tuple[Check, ...], dict[str, Callable[[Any], bool]]]] = {
    "completions": (CompletionRequest, COMPLETION_CHECKS, {"prompt": _plain_prompt}),
    "chat": (ChatCompletionRequest, CHAT_CHECKS, {}),
}


def fast_accepts(kind: str, body: dict[str, Any]) -> bool:
    """True when the body is surely valid (vLLM's before-checks raise their 400 here)."""
    model, checks, custom = _FAST[kind]
    data = dict(body)
    run_checks(checks, data)
    if not _SLOW[kind].isdisjoint(data):
        return False
    try:
        msgspec.convert(data, struct_for(model), strict=True)
    except msgspec.ValidationError:
        return False
    return all(ok(data.get(name)) for name, ok in custom.items())


_SLOW = {kind: slow_fields(model) - custom.keys() for kind, (model, _, custom) in _FAST.items()}
"""Per endpoint, the fields that send a body to pydantic when set (those without a custom check)."""


def validate(kind: str, body: Any) -> None:
    """Nothing when ``kvflow.openai_api.validate(kind, body)`` accepts the body; its 400 otherwise."""
    if kind in _FAST and type(body) is dict and fast_accepts(kind, body):
        return
    openai_api.validate(kind, body)  # type: ignore[arg-type]
