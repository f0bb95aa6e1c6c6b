"""A real MCP server for the tests: the official `mcp` package's MCPServer (FastMCP, renamed in
mcp 2) over Streamable HTTP, served by uvicorn on a loopback port in a thread of its own, with
a few tools whose results are known and every call it ran counted."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

from support.loopback import free_port

FORECASTS = {"Paris": "sunny, 21 C", "Oslo": "snow, -3 C"}


@dataclass
class McpTestServer:
    url: str
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (tool, arguments) as run
    headers: list[dict[str, str]] = field(default_factory=list)  # the requests' headers


def _build(record: McpTestServer, delay_s: float) -> MCPServer:
    server = MCPServer("weather-desk")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def forecast(city: Literal["Paris", "Oslo"]) -> str:
        """Today's forecast for a city."""
        record.calls.append(("forecast", {"city": city}))
        time.sleep(delay_s)
        return f"{city}: {FORECASTS[city]}"

    @server.tool()
    def book_table(city: Literal["Paris", "Oslo"]) -> str:
        """Book a table for tonight (it changes things: not read-only)."""
        record.calls.append(("book_table", {"city": city}))
        return f"booked in {city}"

    @server.tool()
    def broken(city: Literal["Paris", "Oslo"]) -> str:
        """A tool that always fails."""
        record.calls.append(("broken", {"city": city}))
        raise RuntimeError("the kitchen is closed")

    return server


@contextmanager
def mcp_server(delay_s: float = 0.0) -> Iterator[McpTestServer]:
    """An MCP server on 127.0.0.1 for the block's length; its URL ends in /mcp."""
    port = free_port()
    record = McpTestServer(url=f"http://127.0.0.1:{port}/mcp")
    app = _build(record, delay_s).streamable_http_app()

    async def keep_headers(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            record.headers.append({k.decode().lower(): v.decode() for k, v in scope["headers"]})
        await app(scope, receive, send)

    server = uvicorn.Server(uvicorn.Config(keep_headers, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="mcp-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the MCP test server did not start")
        time.sleep(0.05)
    try:
        yield record
    finally:
        server.should_exit = True
        thread.join(10)
