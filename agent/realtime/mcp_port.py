"""What a session's replies need of its MCP part (agent/realtime/mcp.py): the tools each server
offers the model now, where a call of the model's goes, and the two moments the calls follow
(a call's arguments complete, its response ended). The narrow port `Replies` is given instead
of the MCP part itself."""

from __future__ import annotations

from typing import Mapping, Optional, Protocol

from agent.realtime.function_calls import FunctionCall
from agent.realtime.mcp_servers import Route
from agent.tools.spec import Tool


class McpPort(Protocol):
    def offered(self) -> Mapping[str, tuple[Tool, ...]]: ...
    def route(self, name: str) -> Optional[Route]: ...
    def ready(self, call: FunctionCall) -> None: ...
    def response_done(self, response_id: str) -> None: ...
