"""What a session's MCP tool entries may be (agent/realtime/mcp_config.py) and how a failed MCP
operation is told (agent/realtime/mcp_client.py describe):

- with no allowed host every MCP entry is refused naming its server_url; an allowed host is
  matched by name or by name:port (the scheme's port when none is given); user info, other
  schemes and hosts not named are refused;
- allowed_tools as a list or a {tool_names, read_only} filter picks the tools offered;
- require_approval: absent or "always" asks for every tool, "never" for none, a filter object
  asks for what `always` names and not what `never` names (never wins), the rest asked;
- `authorization` becomes a Bearer header; it and headers.Authorization together are refused;
- two entries with one label are refused; a label-only entry reuses the session's definition;
  connectors are refused;
- a timeout, an HTTP status, an unreachable host and an MCP protocol error each become GA's
  error object (http_error 504 / the status / 502, protocol_error with its code), also from
  inside the exception groups the client raises.
"""

from __future__ import annotations

import asyncio

import httpx2
import pytest
from mcp.shared.exceptions import MCPError

from agent.realtime.config_error import ConfigError
from agent.realtime.mcp_client import describe
from agent.realtime.mcp_config import McpServer, check_servers

ALLOW = ("127.0.0.1", "tools.example:8443")


def _one(allow: tuple[str, ...] = ALLOW, **entry: object) -> McpServer:
    tool = {"type": "mcp", "server_label": "desk", "server_url": "http://127.0.0.1:9000/mcp", **entry}
    (server,) = check_servers([tool], allow, "session.tools")
    return server


def _refused(tools: list, allow: tuple[str, ...] = ALLOW, known: dict | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        check_servers(tools, allow, "session.tools", known or {})
    return info.value


def test_hosts_must_be_allowed() -> None:
    assert _one().url == "http://127.0.0.1:9000/mcp"
    assert _one(server_url="https://tools.example:8443/mcp").label == "desk"
    assert _one(allow=("tools.example:443",), server_url="https://TOOLS.example/mcp").url  # the scheme's port
    for url, allow in (
        ("http://127.0.0.1:9000/mcp", ()),  # nothing allowed: MCP is off
        ("https://tools.example/mcp", ALLOW),  # 443, not 8443
        ("http://169.254.169.254/latest", ALLOW),
        ("http://user:pw@127.0.0.1/mcp", ALLOW),
        ("ftp://127.0.0.1/mcp", ALLOW),
        ("not a url", ALLOW),
    ):
        error = _refused([{"type": "mcp", "server_label": "desk", "server_url": url}], allow)
        assert error.param == "session.tools[0].server_url", (url, error)
    assert "--mcp-allow" in str(_refused([{"type": "mcp", "server_label": "x", "server_url": "http://a/"}], ()))


def test_allowed_tools_pick_what_is_offered() -> None:
    everything = _one()
    assert everything.offers("anything", read_only=False)
    listed = _one(allowed_tools=["forecast"])
    assert listed.offers("forecast", False) and not listed.offers("book", False)
    read_only = _one(allowed_tools={"read_only": True})
    assert read_only.offers("forecast", True) and not read_only.offers("book", False)
    both = _one(allowed_tools={"tool_names": ["forecast", "book"], "read_only": True})
    assert both.offers("forecast", True) and not both.offers("book", False) and not both.offers("x", True)
    assert _refused([{"type": "mcp", "server_label": "d", "server_url": "http://127.0.0.1/", "allowed_tools": [1]}])


def test_approval_rules() -> None:
    assert _one().needs_approval("forecast", True)  # GA's default: ask
    assert _one(require_approval="always").needs_approval("forecast", True)
    assert not _one(require_approval="never").needs_approval("book", False)
    rule = _one(require_approval={"never": {"read_only": True}, "always": {"tool_names": ["book", "forecast"]}})
    assert not rule.needs_approval("forecast", True)  # never wins where both match
    assert rule.needs_approval("book", False)
    assert rule.needs_approval("other", False)  # named by neither: asked
    error = _refused([{"type": "mcp", "server_label": "d", "server_url": "http://127.0.0.1/", "require_approval": 1}])
    assert error.param == "session.tools[0].require_approval"


def test_headers_and_authorization() -> None:
    server = _one(headers={"X-Desk": "front"}, authorization="tok")
    assert dict(server.headers) == {"X-Desk": "front", "Authorization": "Bearer tok"}
    error = _refused(
        [
            {
                "type": "mcp",
                "server_label": "d",
                "server_url": "http://127.0.0.1/",
                "headers": {"authorization": "Basic x"},
                "authorization": "tok",
            }
        ]
    )
    assert error.param == "session.tools[0].authorization"
    bad = {"type": "mcp", "server_label": "d", "server_url": "http://127.0.0.1/", "headers": {"X": "a\r\nB: c"}}
    assert _refused([bad]).param == "session.tools[0].headers"


def test_labels_reuse_and_connectors() -> None:
    entry = {"type": "mcp", "server_label": "desk", "server_url": "http://127.0.0.1/mcp"}
    assert _refused([entry, {**entry}]).param == "session.tools[1].server_label"
    assert _refused([{**entry, "server_label": "a b"}]).param == "session.tools[0].server_label"
    known = {"desk": _one()}
    (reused,) = check_servers([{"type": "mcp", "server_label": "desk"}], ALLOW, "session.tools", known)
    assert reused is known["desk"]
    assert _refused([{"type": "mcp", "server_label": "other"}], known=known).param == "session.tools[0].server_url"
    connector = {"type": "mcp", "server_label": "cal", "connector_id": "connector_googlecalendar"}
    assert _refused([connector]).param == "session.tools[0].connector_id"
    function = {"type": "function", "name": "f"}
    assert check_servers([function], (), "session.tools") == ()  # function tools are not this module's


class _Group(Exception):
    """An exception group's shape (ExceptionGroup is 3.11's; the client raises it)."""

    def __init__(self, *inner: BaseException) -> None:
        super().__init__("group")
        self.exceptions = inner


def test_failures_become_ga_error_objects() -> None:
    assert describe(asyncio.TimeoutError(), 5)["code"] == 504
    request = httpx2.Request("POST", "http://127.0.0.1/mcp")
    status = httpx2.HTTPStatusError("no", request=request, response=httpx2.Response(401, request=request))
    assert describe(status, 5) == {"type": "http_error", "code": 401, "message": "the MCP server answered HTTP 401"}
    grouped = _Group(_Group(httpx2.ConnectError("refused")))  # (as anyio's task groups raise them)
    assert describe(grouped, 5)["type"] == "http_error" and describe(grouped, 5)["code"] == 502
    protocol = describe(MCPError(-32601, "no such method"), 5)
    assert protocol == {"type": "protocol_error", "code": -32601, "message": "no such method"}
    assert describe(ValueError("odd"), 5)["type"] == "protocol_error"
