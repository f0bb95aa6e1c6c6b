"""A tool call's text, parsed as it streams: its function name as soon as it is written, then its
arguments as deltas whose concatenation is exactly the final arguments text.

The text is what the model writes between <tool_call> and </tool_call> (the engine strips the
tags): `\n{"name": "NAME", "arguments": {...}}\n`. The arguments are the raw JSON the model
wrote (the grammar keeps it valid and in one layout). A trailing run of `}` and whitespace is
held back until the end: the last `}` closes the call's object, not the arguments.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

# Up to the arguments' first character (so that the whitespace before it is never theirs).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')
_TRAILING = re.compile(r"[}\s]*\Z")


class CallParseError(ValueError):
    pass


class CallParser:
    def __init__(self) -> None:
        self.text = ""
        self.name: Optional[str] = None
        self._args_at = -1  # where the arguments start in `text`, once the name is known
        self.sent = ""  # the arguments text given out as deltas so far

    def push(self, chunk: str) -> str:
        """Take more of the call's text; returns the new arguments delta ("" if none yet). Once
        `name` is set, the item can be announced."""
        self.text += chunk
        if self.name is None:
            head = _HEAD.match(self.text)
            if head is None:
                return ""
            self.name = json.loads(head.group(1))
            self._args_at = head.end()
        body = self.text[self._args_at :]
        upto = body[: _TRAILING.search(body).start()]
        delta, self.sent = upto[len(self.sent) :], upto
        return delta

    def finish(self, chunk: str = "") -> tuple[str, dict[str, Any], str]:
        """The call's end: (name, arguments object, the last arguments delta). Raises
        CallParseError when the text is not one call object."""
        pushed = self.push(chunk)  # what this last chunk adds goes out with the rest, below
        try:
            call = json.loads(self.text)
        except ValueError as exc:
            raise CallParseError(f"the call is not JSON: {exc}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
            raise CallParseError('a call is {"name": ..., "arguments": {...}}')
        if self.name is None:  # a layout the streaming pattern did not know: no deltas went out
            self.name, self.sent = call["name"], json.dumps(call["arguments"], ensure_ascii=False)
            return self.name, call["arguments"], self.sent  # (push() sends nothing before a name)
        body = self.text[self._args_at :].rstrip()
        if not body.endswith("}"):
            raise CallParseError("the call's object is not closed")
        final = body[:-1].rstrip()
        if not final.startswith(self.sent):
            raise CallParseError("the arguments changed after they were sent")
        delta, self.sent = pushed + final[len(self.sent) :], final
        if json.loads(final) != call["arguments"]:
            raise CallParseError("the arguments text is not the call's arguments")
        return self.name, call["arguments"], delta
