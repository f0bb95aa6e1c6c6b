"""The client event shapes the `openai` SDK's GA param types allow, generated from its TypedDicts
(imported by the conformance tests, not a test itself).

A shape is an object with some fields given (at least the required ones) and the others either
absent or null: `shapes(td, base)` gives `base`, then `base` with every optional field of `td`
null, then for each optional field that may be an object of the SDK's (a nested TypedDict, or a
union holding some), `base` with that field set to each such object in each of its own shapes.
A nested object that needs a value of its own (an id, a name, a number) is left out: no null or
absent field can stand for it. The SDK's modules use postponed annotations, so its TypedDicts'
`__required_keys__` are empty: required fields are read from the `Required[...]` of the
resolved annotations.
"""

from __future__ import annotations

import typing
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

import typing_extensions


def fields(td: type) -> dict[str, tuple[bool, Any]]:
    """Each field of a TypedDict: (required, its type without Required/NotRequired)."""
    out = {}
    for key, hint in get_type_hints(td, include_extras=True).items():
        required = get_origin(hint) is typing.Required
        if required or get_origin(hint) is typing.NotRequired:
            hint = get_args(hint)[0]
        out[key] = (required, hint)
    return out


def _members(hint: Any) -> list[Any]:
    """The alternatives of a type (Optional and Union flattened, Annotated unwrapped)."""
    origin = get_origin(hint)
    if origin is typing.Annotated:
        return _members(get_args(hint)[0])
    if origin is Union:
        return [m for arg in get_args(hint) for m in _members(arg)]
    return [hint]


def _literal(hint: Any) -> Optional[Any]:
    """The value of a single-valued Literal type, else None."""
    values = get_args(hint) if get_origin(hint) is Literal else ()
    return values[0] if len(values) == 1 else None


def _object_base(td: type) -> Optional[dict[str, Any]]:
    """The fields an object of `td` takes as given: its required single-valued Literals and a
    single-valued `type` (it names the union member, as a client does); None when a required
    field needs a value of its own."""
    base = {}
    for key, (required, hint) in fields(td).items():
        value = _literal(hint)
        if value is not None and (required or key == "type"):
            base[key] = value
        elif required:
            return None
    return base


def shapes(td: type, base: dict[str, Any], depth: int = 4) -> list[dict[str, Any]]:
    """`base`, `base` with every other optional field null, and `base` with each optional object
    field in each of its shapes (nested `depth` levels at most)."""
    spec = fields(td)
    optional = [key for key, (required, _) in spec.items() if not required and key not in base]
    out = [dict(base)]
    if optional:
        out.append({**base, **{key: None for key in optional}})
    if depth:
        for key in optional:
            for member in _members(spec[key][1]):
                # (the SDK's TypedDicts are typing_extensions', which typing.is_typeddict misses)
                sub = _object_base(member) if typing_extensions.is_typeddict(member) else None
                if sub is not None:
                    out += [{**base, key: shape} for shape in shapes(member, sub, depth - 1)]
    return out


def null_paths(value: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Where a shape holds null (paths into nested objects)."""
    if not isinstance(value, dict):
        return []
    out = []
    for key, item in value.items():
        out += [(*path, key)] if item is None else null_paths(item, (*path, key))
    return out


def at(value: Any, path: tuple[str, ...]) -> tuple[bool, Any]:
    """(whether `path` is in `value`, the value there)."""
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return False, None
        value = value[key]
    return True, value
