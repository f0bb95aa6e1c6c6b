"""A session's MCP part: its servers and their listings (agent/realtime/mcp_servers.py) and the
calls run on them (agent/realtime/mcp_calls.py), side by side, behind the few methods the
session, its replies and its client events use. The allowed hosts and the time limit are the
operator's (Config.mcp_allow, Config.mcp_timeout_s)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from agent.config import Config
from agent.realtime import mcp_config, tool_config
from agent.realtime.conversation import Conversation
from agent.realtime.engine_port import EnginePort
from agent.realtime.function_calls import FunctionCall
from agent.realtime.mcp_calls import McpCalls
from agent.realtime.mcp_servers import McpServers, Route
from agent.realtime.outbox import Outbox
from agent.tools.spec import Tool


class Mcp:
    def __init__(
        self,
        engine: EnginePort,
        outbox: Outbox,
        conversation: Conversation,
        config: Config,
        on_tools: Callable[[], None],
        settings: Callable[[], dict[str, Any]],
    ) -> None:
        self._allow = config.mcp_allow
        self._settings = settings  # (a function tool keeps its name: an MCP tool of that name is not called)
        self.servers = McpServers(outbox, conversation, config.mcp_timeout_s, on_tools)
        self.calls = McpCalls(engine, outbox, conversation, config.mcp_timeout_s)

    def check(self, tools: Any, param: str) -> tuple[mcp_config.McpServer, ...]:
        """The servers a `tools` list names, checked (ConfigError: refused)."""
        return mcp_config.check_servers(tools, self._allow, param, self.servers.known)

    def configure(self, tools: Any, param: str) -> None:
        """The session's tools are `tools` now: list the servers new to it, drop those gone."""
        self.servers.configure(self.check(tools, param))

    def close(self) -> None:
        self.servers.close()
        self.calls.close()

    # ---- the replies' port (agent/realtime/replies.py McpPort) ------------------------------
    def offered(self) -> dict[str, tuple[Tool, ...]]:
        return self.servers.offered()

    def route(self, name: str) -> Optional[Route]:
        if any(t.name == name for t in tool_config.check_tools(self._settings().get("tools", []), "session.tools")):
            return None  # the session's function tool of that name (tool_config.offered: it comes first)
        return self.servers.route(name)

    def ready(self, call: FunctionCall) -> None:
        self.calls.ready(call)

    def response_done(self, response_id: str) -> None:
        self.calls.response_done(response_id)
