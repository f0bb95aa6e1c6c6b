"""The MCP servers a session's `tools` name (`{"type": "mcp", ...}` entries), checked: plain
frozen values the listing and the calls read (agent/realtime/mcp_servers.py, mcp_calls.py).

An entry is `{"type": "mcp", "server_label", "server_url", "allowed_tools"?, "require_approval"?,
"headers"?, "authorization"?, "server_description"?}`. The agent reaches only the hosts its
operator allowed (`--mcp-allow`, none by default): a client must not make the agent fetch from
the agent's own network (its metadata service, the engine's admin routes, a database). A later
entry with only a `server_label` reuses the session's earlier definition of that label, as GA
does. Connectors (`connector_id`) and tunnels reach OpenAI's own services: refused here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit

from agent.realtime.config_error import ConfigError

LABEL = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_SERVERS = 16


@dataclass(frozen=True)
class ToolFilter:
    """Tools picked by name and/or by the server's `readOnlyHint` (GA's filter object; a plain
    list of names is `ToolFilter(names)`). Empty (no names, no read_only): matches nothing."""

    names: Optional[frozenset[str]] = None
    read_only: Optional[bool] = None

    def matches(self, name: str, read_only: bool) -> bool:
        if self.names is None and self.read_only is None:
            return False
        return (self.names is None or name in self.names) and (self.read_only is None or read_only == self.read_only)


@dataclass(frozen=True)
class McpServer:
    label: str
    url: str
    headers: tuple[tuple[str, str], ...] = ()
    allowed: Optional[ToolFilter] = None  # None: every tool the server lists
    # require_approval: "always" (GA's default), "never", or per tool (`never` wins over `always`
    # where both match, a tool neither names needs approval).
    approve_all: bool = True
    always: Optional[ToolFilter] = None
    never: Optional[ToolFilter] = None
    description: str = ""

    def offers(self, name: str, read_only: bool) -> bool:
        return self.allowed is None or self.allowed.matches(name, read_only)

    def needs_approval(self, name: str, read_only: bool) -> bool:
        if self.never is not None and self.never.matches(name, read_only):
            return False
        if self.always is not None and self.always.matches(name, read_only):
            return True
        return self.approve_all


def is_mcp(tool: Any) -> bool:
    return isinstance(tool, dict) and tool.get("type") == "mcp"


def check_servers(
    tools: Any, allow: tuple[str, ...], param: str, known: Mapping[str, McpServer] = {}
) -> tuple[McpServer, ...]:
    """The MCP servers of a `tools` list (param: its name in errors, e.g. "session.tools"); known:
    the session's servers so far, which an entry with only a label reuses. Refuses (ConfigError)
    a malformed entry, two entries with one label, and any server whose host the operator did
    not allow."""
    if not isinstance(tools, list):
        return ()
    out: list[McpServer] = []
    for i, tool in enumerate(tools):
        if not is_mcp(tool):
            continue
        at = f"{param}[{i}]"
        server = _server(tool, at, allow, known)
        if any(s.label == server.label for s in out):
            raise ConfigError(f"two MCP tools have the server_label {server.label!r}", f"{at}.server_label")
        out.append(server)
    if len(out) > MAX_SERVERS:
        raise ConfigError(f"at most {MAX_SERVERS} MCP servers", param)
    return tuple(out)


def _server(tool: dict[str, Any], at: str, allow: tuple[str, ...], known: Mapping[str, McpServer]) -> McpServer:
    label = tool.get("server_label")
    if not isinstance(label, str) or not LABEL.fullmatch(label):
        raise ConfigError("server_label is 1-64 letters, digits, _ or -", f"{at}.server_label")
    for field in ("connector_id", "tunnel_id"):
        if tool.get(field) is not None:
            raise ConfigError(f"{field} reaches OpenAI's own services: give a server_url", f"{at}.{field}")
    url = tool.get("server_url")
    if url is None:
        if label in known and set(tool) <= {"type", "server_label"}:
            return known[label]
        raise ConfigError("an MCP tool needs a server_url", f"{at}.server_url")
    if not isinstance(url, str):
        raise ConfigError("server_url must be a string", f"{at}.server_url")
    check_url(url, allow, f"{at}.server_url")
    description = tool.get("server_description")
    if description is not None and not isinstance(description, str):
        raise ConfigError("server_description must be a string", f"{at}.server_description")
    always, never, approve_all = _approval(tool.get("require_approval"), f"{at}.require_approval")
    return McpServer(
        label=label,
        url=url,
        headers=_headers(tool.get("headers"), tool.get("authorization"), at),
        allowed=_filter(tool.get("allowed_tools"), f"{at}.allowed_tools"),
        approve_all=approve_all,
        always=always,
        never=never,
        description=description or "",
    )


def check_url(url: str, allow: tuple[str, ...], param: str) -> None:
    """An http(s) URL to a host (or host:port) the operator allowed with --mcp-allow."""
    if not allow:
        raise ConfigError(
            "MCP tools are off on this server: its operator names the MCP hosts it may reach (--mcp-allow)", param
        )
    try:
        parts = urlsplit(url)
        host, port = (parts.hostname or "").lower(), parts.port
    except ValueError:
        raise ConfigError("server_url is not a URL", param) from None
    if parts.scheme not in ("http", "https") or not host or parts.username or parts.password:
        raise ConfigError("server_url is an http or https URL to a host, without user info", param)
    port = port or (443 if parts.scheme == "https" else 80)
    if host not in allow and f"{host}:{port}" not in allow:
        raise ConfigError(f"this server may not reach {host}:{port} (its operator's --mcp-allow)", param)


def _headers(headers: Any, authorization: Any, at: str) -> tuple[tuple[str, str], ...]:
    if headers is None:
        headers = {}
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and "\n" not in k + v and "\r" not in k + v
        for k, v in headers.items()
    ):
        raise ConfigError("headers is an object of string values", f"{at}.headers")
    pairs = dict(headers)
    if authorization is not None:
        if not isinstance(authorization, str) or "\n" in authorization or "\r" in authorization:
            raise ConfigError("authorization must be a string (an access token)", f"{at}.authorization")
        if any(k.lower() == "authorization" for k in pairs):
            raise ConfigError("give authorization or headers.Authorization, not both", f"{at}.authorization")
        pairs["Authorization"] = f"Bearer {authorization}"
    return tuple(pairs.items())


def _filter(value: Any, param: str) -> Optional[ToolFilter]:
    if value is None:
        return None
    if isinstance(value, list):
        if not all(isinstance(n, str) for n in value):
            raise ConfigError("a list of tool names", param)
        return ToolFilter(frozenset(value))
    if isinstance(value, dict) and set(value) <= {"tool_names", "read_only"}:
        names, read_only = value.get("tool_names"), value.get("read_only")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise ConfigError("tool_names is a list of tool names", f"{param}.tool_names")
        if read_only is not None and not isinstance(read_only, bool):
            raise ConfigError("read_only is a boolean", f"{param}.read_only")
        return ToolFilter(None if names is None else frozenset(names), read_only)
    raise ConfigError('a list of tool names or {"tool_names": [...], "read_only": bool}', param)


def _approval(value: Any, param: str) -> tuple[Optional[ToolFilter], Optional[ToolFilter], bool]:
    """(always, never, approve the rest) of a require_approval value."""
    if value is None or value == "always":
        return None, None, True
    if value == "never":
        return None, None, False
    if isinstance(value, dict) and set(value) <= {"always", "never"}:
        always = _filter(value.get("always"), f"{param}.always")
        never = _filter(value.get("never"), f"{param}.never")
        return always, never, True
    raise ConfigError('require_approval is "always", "never" or {"always": ..., "never": ...}', param)
