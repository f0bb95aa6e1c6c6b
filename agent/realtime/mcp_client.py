"""The agent as an MCP client: list a server's tools, call one, each over its own Streamable
HTTP connection (the official `mcp` package), within a time limit. The one module that imports
`mcp`; what it returns is plain values, and every failure is a value too (GA's error shapes on
an `mcp_call` item), never an exception, so a server that is down, slow or malformed costs the
session an error item and nothing else.

A connection per operation, not one kept per session: a call is one HTTP round trip more
(~10 ms on loopback), and nothing of a session's MCP state outlives the operation that made it
(no task to tear down at close, no half-open stream after a server restarts). The `mcp`
client follows a redirect only within the server's own origin, so an allowed host cannot hand
the agent on to one the operator did not allow.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from dataclasses import dataclass
from typing import Any, Optional

from agent.realtime.mcp_config import McpServer

# `mcp` (and its HTTP client, httpx2) is imported where it is used: ~0.6 s of imports that a
# process serving no MCP tool never pays (every agent process imports this module). The first
# use imports it on a worker thread (_loaded), not on the loop that paces every call's audio.
_MODULES = ("httpx2", "mcp", "mcp.client.streamable_http", "mcp.shared._httpx_utils", "mcp.shared.exceptions")


async def _loaded() -> None:
    if all(name in sys.modules for name in _MODULES):
        return
    await asyncio.get_running_loop().run_in_executor(None, lambda: [importlib.import_module(m) for m in _MODULES])


MAX_OUTPUT_CHARS = 32 * 1024  # what one call's output may put in the model's context
MAX_TOOLS = 128  # what one listing may offer the model (the grammar compiles each schema)


@dataclass(frozen=True)
class ListedTool:
    name: str
    description: str
    input_schema: dict[str, Any]
    annotations: Optional[dict[str, Any]]
    read_only: bool  # the server's readOnlyHint (allowed_tools / require_approval filters read it)

    def item_entry(self) -> dict[str, Any]:
        """As the `mcp_list_tools` item lists it."""
        entry: dict[str, Any] = {"name": self.name, "input_schema": self.input_schema, "description": self.description}
        if self.annotations is not None:
            entry["annotations"] = self.annotations
        return entry


@dataclass(frozen=True)
class Listing:
    tools: tuple[ListedTool, ...] = ()
    error: Optional[str] = None  # why the listing failed (None: it did not)


@dataclass(frozen=True)
class Outcome:
    """A call's result: its output text, or GA's error object for the `mcp_call` item."""

    output: Optional[str] = None
    error: Optional[dict[str, Any]] = None


def _client(server: McpServer, timeout_s: float) -> tuple[Any, Any]:
    """An HTTP client and an MCP client over it, both to be entered (async with)."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    http = create_mcp_http_client(headers=dict(server.headers), timeout=httpx2.Timeout(timeout_s, read=timeout_s))
    return http, Client(streamable_http_client(server.url, http_client=http), read_timeout_seconds=timeout_s)


async def list_tools(server: McpServer, timeout_s: float) -> Listing:
    async def listing() -> Listing:
        http, client = _client(server, timeout_s)
        tools: list[ListedTool] = []
        async with http, client:
            cursor: Optional[str] = None
            while True:
                page = await client.list_tools(cursor=cursor)
                for tool in page.tools:
                    hints = tool.annotations
                    tools.append(
                        ListedTool(
                            name=tool.name,
                            description=tool.description or "",
                            input_schema=dict(tool.input_schema),
                            annotations=None if hints is None else hints.model_dump(exclude_none=True, by_alias=True),
                            read_only=bool(hints is not None and hints.read_only_hint),
                        )
                    )
                cursor = page.next_cursor
                if cursor is None or len(tools) >= MAX_TOOLS:
                    return Listing(tuple(tools[:MAX_TOOLS]))

    try:
        await _loaded()
        return await asyncio.wait_for(listing(), timeout_s)
    except Exception as exc:  # every failure is the listing's outcome, never the session's
        return Listing(error=str(describe(exc, timeout_s)["message"]))


async def call_tool(server: McpServer, name: str, arguments: dict[str, Any], timeout_s: float) -> Outcome:
    async def call() -> Outcome:
        http, client = _client(server, timeout_s)
        async with http, client:
            result = await client.call_tool(name, arguments)
        text = _output_text(result.content, result.structured_content)
        if result.is_error:
            return Outcome(error={"type": "tool_execution_error", "message": text or "the tool failed"})
        return Outcome(output=text)

    try:
        await _loaded()
        return await asyncio.wait_for(call(), timeout_s)
    except Exception as exc:
        return Outcome(error=describe(exc, timeout_s))


def _output_text(content: list[Any], structured: Any) -> str:
    """A result's text parts, one a line; other parts named by type; the structured result as
    JSON where no text was given. Cut to MAX_OUTPUT_CHARS."""
    parts = [getattr(p, "text", None) if getattr(p, "type", "") == "text" else f"[{p.type}]" for p in content]
    text = "\n".join(p for p in parts if p)
    if not text and structured is not None:
        text = json.dumps(structured, ensure_ascii=False)
    if len(text) > MAX_OUTPUT_CHARS:
        text = text[:MAX_OUTPUT_CHARS] + " [cut: the output was longer]"
    return text


def describe(exc: BaseException, timeout_s: float) -> dict[str, Any]:
    """GA's error object for a failed operation (an exception group: its first leaf)."""
    import httpx2
    from mcp.shared.exceptions import MCPError

    while isinstance(getattr(exc, "exceptions", None), tuple) and exc.exceptions:  # (an ExceptionGroup)
        exc = exc.exceptions[0]
    if isinstance(exc, (asyncio.TimeoutError, httpx2.TimeoutException)):
        return {"type": "http_error", "code": 504, "message": f"the MCP server did not answer within {timeout_s:g} s"}
    if isinstance(exc, httpx2.HTTPStatusError):
        code = exc.response.status_code
        return {"type": "http_error", "code": code, "message": f"the MCP server answered HTTP {code}"}
    if isinstance(exc, httpx2.HTTPError):
        return {"type": "http_error", "code": 502, "message": f"the MCP server could not be reached: {exc}"}
    if isinstance(exc, MCPError):
        return {"type": "protocol_error", "code": exc.code, "message": exc.message}
    return {"type": "protocol_error", "code": -32603, "message": f"{type(exc).__name__}: {exc}"[:500]}
