"""The tools a reply may call and how it must call them: plain frozen values, torch-free.

The protocol side builds these from a client's `tools` / `tool_choice` (and turns a
ToolSchemaError into an `error` event); the engine side compiles them into a grammar
(agent/engine/stages/tool_grammar.py). Every value is frozen and hashable, so a ToolSet can key
a cache and cross threads without copies: a tool's JSON schema is kept as compact JSON text
and `parameters` is a private dict parsed from it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

ChoiceMode = Literal["auto", "none", "required", "function"]
MODES: tuple[str, ...] = ("auto", "none", "required", "function")

# OpenAI's rule for function names; it also keeps a name a plain JSON string (no escapes) in the
# grammar and in the call text the model writes.
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


class ToolSchemaError(ValueError):
    """A tool the engine cannot offer: a bad name or a schema the grammar library cannot compile.

    `tool_name` is the offending tool's name ("" when the error is about the set, not one tool)."""

    def __init__(self, message: str, tool_name: str = "") -> None:
        super().__init__(f"tool {tool_name!r}: {message}" if tool_name else message)
        self.message = message
        self.tool_name = tool_name


def canonical_json(value: Any) -> str:
    """Compact JSON in the value's own key order. Keys are not sorted: the order of a schema's
    properties is the order the grammar makes the model write them in (Qwen writes arguments in
    the order the schema lists them), so two orders are two grammars, two keys."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class Tool:
    """A function the model may call. `parameters`: a JSON schema for the call's `arguments`, an
    object schema; None or {} stands for an object without properties (the call takes none).
    Once built, `parameters` is always a dict: a private copy (do not change it)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)
    # The schema as compact JSON: what equality, hashing and the cache key read.
    schema_json: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            raise ToolSchemaError("a tool name is 1 to 64 of A-Z a-z 0-9 _ -", str(self.name))
        params = self.parameters
        if params is None or (isinstance(params, Mapping) and len(params) == 0):
            params = EMPTY_OBJECT
        if not isinstance(params, Mapping):
            raise ToolSchemaError("parameters must be a JSON schema object", self.name)
        if params.get("type", "object") != "object":
            raise ToolSchemaError('parameters must describe an object ("type": "object")', self.name)
        try:
            text = canonical_json(params)
        except (TypeError, ValueError) as exc:
            raise ToolSchemaError(f"parameters are not JSON: {exc}", self.name) from exc
        # A private copy: the caller's dict may change later, this tool may not.
        object.__setattr__(self, "schema_json", text)
        object.__setattr__(self, "parameters", json.loads(text))

    def schema(self) -> dict[str, Any]:
        """A fresh copy of the parameters schema (the caller may change it)."""
        return json.loads(self.schema_json)


@dataclass(frozen=True)
class ToolChoice:
    """How the reply must use the tools: "auto" (the model decides), "none" (never call),
    "required" (at least one call, nothing else), "function" (calls of `name` only, at least one)."""

    mode: ChoiceMode = "auto"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ToolSchemaError(f"tool_choice must be one of {', '.join(MODES)}, not {self.mode!r}")
        if (self.mode == "function") != (self.name is not None):
            raise ToolSchemaError('tool_choice names a function exactly when its mode is "function"')

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | None) -> ToolChoice:
        """A client's tool_choice: "auto" | "none" | "required", or a named function in either
        OpenAI shape ({"type": "function", "name": n} or {"type": "function", "function": {"name": n}})."""
        if value is None:
            return cls()
        if isinstance(value, str):
            return cls(value)  # type: ignore[arg-type]
        if isinstance(value, Mapping) and value.get("type") == "function":
            name = value.get("name") or (value.get("function") or {}).get("name")
            if isinstance(name, str):
                return cls("function", name)
        raise ToolSchemaError(f"unsupported tool_choice {value!r}")


@dataclass(frozen=True)
class ToolSet:
    """The tools offered to one reply and the choice over them. `parallel`: a reply may make
    several calls in a row (OpenAI's parallel_tool_calls); False allows exactly one."""

    tools: tuple[Tool, ...]
    choice: ToolChoice = ToolChoice()
    parallel: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools", tuple(self.tools))
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ToolSchemaError(f"tool names must be unique: {names}")
        if self.choice.mode == "function" and self.choice.name not in names:
            raise ToolSchemaError("tool_choice names a function that is not among the tools", self.choice.name or "")

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools a call may name: the one named by a "function" choice, else all of them."""
        if self.choice.mode == "function":
            return tuple(t for t in self.tools if t.name == self.choice.name)
        return self.tools

    @property
    def calls(self) -> bool:
        """Whether a reply may call anything at all."""
        return self.choice.mode != "none" and bool(self.tools)

    def key(self) -> str:
        """Compact JSON of everything here (canonical_json): equal sets, equal keys (a cache key)."""
        return canonical_json(
            {
                "tools": [
                    {"name": t.name, "description": t.description, "parameters": t.parameters} for t in self.tools
                ],
                "choice": {"mode": self.choice.mode, "name": self.choice.name},
                "parallel": self.parallel,
            }
        )
