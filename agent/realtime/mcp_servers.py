"""A session's MCP servers and the tools each listed: what the model may call of them, and the
GA events of each listing.

When a session.update names a server (new, or defined anew), its listing begins: an
`mcp_list_tools` item joins the conversation (conversation.item.added, no tools yet) and
`mcp_list_tools.in_progress` is sent, both before the update's session.updated; the listing
runs off the loop's critical path (agent/realtime/mcp_client.py) and ends with
conversation.item.done (the tools the server offers, after `allowed_tools`) and
`mcp_list_tools.completed`, or `mcp_list_tools.failed` (the item then lists none). Only tools
already listed can be called: a reply that begins while a listing runs has what is listed so
far, as on GA. A server the session drops takes its tools with it.

Of the tools listed, the model is offered those it can call: a name as function names go and
an input schema the engine's grammar compiles (others are listed, never offered, and logged).
`McpServers` is a part of the Session; `on_tools` tells it the model's tools changed (its
system message and grammar are sent again).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from agent.realtime import mcp_client, tool_config
from agent.realtime.config_error import ConfigError
from agent.realtime.conversation import Conversation
from agent.realtime.events import new_id
from agent.realtime.mcp_client import ListedTool
from agent.realtime.mcp_config import McpServer
from agent.realtime.outbox import Outbox
from agent.tools.spec import NAME, Tool, ToolSchemaError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    """Where a call of the model's goes: an MCP server's tool, and whether it needs approval."""

    server: McpServer
    tool: ListedTool
    approval: bool


@dataclass
class _Server:
    server: McpServer
    item_id: str
    tools: tuple[ListedTool, ...] = ()
    offered: tuple[Tool, ...] = ()  # what the model may call (once listed)
    task: Optional[asyncio.Task] = field(default=None, repr=False)


class McpServers:
    def __init__(
        self,
        outbox: Outbox,
        conversation: Conversation,
        timeout_s: float,
        on_tools: Callable[[], None],
    ) -> None:
        self._outbox, self._conversation = outbox, conversation
        self._timeout_s = timeout_s
        self._on_tools = on_tools
        self._servers: dict[str, _Server] = {}

    @property
    def known(self) -> dict[str, McpServer]:
        """The session's servers by label (an entry with only a label reuses its definition)."""
        return {label: s.server for label, s in self._servers.items()}

    def offered(self) -> dict[str, tuple[Tool, ...]]:
        """Each server's tools the model may call now (label -> tools; empty while listing)."""
        return {label: s.offered for label, s in self._servers.items()}

    def route(self, name: str) -> Optional[Route]:
        """The MCP tool a call of the model's names (None: a function tool, or none listed)."""
        for s in self._servers.values():
            if any(t.name == name for t in s.offered):
                tool = next(t for t in s.tools if t.name == name)
                return Route(s.server, tool, s.server.needs_approval(name, tool.read_only))
        return None

    def configure(self, servers: tuple[McpServer, ...]) -> None:
        """The session's servers are now `servers`: list the new and the redefined, drop the gone."""
        wanted = {s.label: s for s in servers}
        changed = False
        for label in list(self._servers):
            if wanted.get(label) != self._servers[label].server:
                gone = self._servers.pop(label)
                if gone.task is not None:
                    gone.task.cancel()
                changed = changed or bool(gone.offered)
        for label, server in wanted.items():
            if label not in self._servers:
                self._begin(server)
        if changed:
            self._on_tools()

    def close(self) -> None:
        for s in self._servers.values():
            if s.task is not None:
                s.task.cancel()
        self._servers.clear()
        self._on_tools = _nothing  # (it refers back to the session)

    def _begin(self, server: McpServer) -> None:
        entry = _Server(server, new_id("mcpl"))
        self._servers[server.label] = entry
        item = self._item(entry)
        previous = self._conversation.add(item)
        self._outbox.emit({"type": "conversation.item.added", "previous_item_id": previous, "item": item})
        self._outbox.emit({"type": "mcp_list_tools.in_progress", "item_id": entry.item_id})
        entry.task = asyncio.ensure_future(self._list(entry))

    async def _list(self, entry: _Server) -> None:
        listing = await mcp_client.list_tools(entry.server, self._timeout_s)
        if self._servers.get(entry.server.label) is not entry:
            return  # dropped or redefined meanwhile
        entry.task = None
        if listing.error is None:
            entry.tools = tuple(t for t in listing.tools if entry.server.offers(t.name, t.read_only))
            entry.offered = tuple(filter(None, (_offer(entry.server, t) for t in entry.tools)))
        else:
            log.info("MCP server %s: listing failed: %s", entry.server.label, listing.error)
        item = self._item(entry)
        if entry.item_id in self._conversation:
            self._conversation.update(entry.item_id, item)
        self._outbox.emit({"type": "conversation.item.done", "item": item})
        kind = "mcp_list_tools.completed" if listing.error is None else "mcp_list_tools.failed"
        self._outbox.emit({"type": kind, "item_id": entry.item_id})
        if entry.offered:
            self._on_tools()

    @staticmethod
    def _item(entry: _Server) -> dict[str, Any]:
        return {
            "id": entry.item_id,
            "object": "realtime.item",
            "type": "mcp_list_tools",
            "server_label": entry.server.label,
            "tools": [t.item_entry() for t in entry.tools],
        }


def _offer(server: McpServer, tool: ListedTool) -> Optional[Tool]:
    """The model's view of a listed tool, where it can be called (None: listed, not offered)."""
    if not NAME.fullmatch(tool.name):
        log.info("MCP server %s: tool %r not offered: its name is not a function name", server.label, tool.name)
        return None
    try:
        schema = tool_config.parameters(tool.input_schema or None, "input_schema")
        return Tool(tool.name, tool.description, schema)
    except (ConfigError, ToolSchemaError) as exc:
        log.info("MCP server %s: tool %r not offered: %s", server.label, tool.name, exc)
        return None


def _nothing() -> None:
    pass
