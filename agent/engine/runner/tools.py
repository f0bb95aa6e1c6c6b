"""Tool calls, the StreamingRunner's component for their commands (on the engine thread): a
session's tools and tool choice, and a response's own.

The tools reach the model's context as text (the session's instructions with Qwen's tool block,
rendered on the protocol side: agent/tools/qwen_format.py); what is set here is what constrains
a reply's tokens (agent/engine/stages/tool_grammar.py; the reply lifecycle starts each reply's
matcher from it). A tool set is compiled when it is set, so a schema the grammar cannot take is
refused to the client there, never in the middle of a reply.
"""

from __future__ import annotations

from agent.engine.runner.sessions import SessionTable
from agent.engine.runner.speculation import Speculation
from agent.engine.stages.tool_grammar import ToolGrammars
from agent.tools.spec import ToolSet


class ToolCommands:
    def __init__(self, sessions: SessionTable, grammars: ToolGrammars, speculation: Speculation) -> None:
        self.sessions, self.grammars, self.speculation = sessions, grammars, speculation

    def set_tools(self, session_id: str, tools: ToolSet | None) -> int:
        """The session's tools and choice for its next replies (a reply keeps the ones it began
        with); returns how many tools."""
        self.speculation.drop_speculation(session_id)  # it began with the tools as they were
        self._check(tools)
        self.sessions[session_id].choices.tools = tools
        return 0 if tools is None else len(tools.tools)

    def set_reply_tools(self, session_id: str, tools: ToolSet | None) -> int:
        """The next reply's own tools and choice (None: the session's). Call before begin_reply."""
        self.speculation.drop_speculation(session_id)
        self._check(tools)
        self.sessions[session_id].turn.reply_tools = tools
        return 0 if tools is None else len(tools.tools)

    def _check(self, tools: ToolSet | None) -> None:
        if tools is not None:
            self.grammars.start(tools)  # compiles (and caches) it: ToolSchemaError now, not mid-reply
