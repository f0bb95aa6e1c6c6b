"""Text deltas from a stream of byte-level BPE tokens, without broken characters."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class IncrementalDecoder:
    """A reply's text as deltas whose concatenation is exactly the full decode of its tokens.

    The reply is re-decoded per token and a trailing run of U+FFFD held back: a multi-byte
    character split across byte-level tokens, which the next token may complete. finish()
    releases what is held. Assumes a prefix-stable decode (byte-level BPE, as Qwen's).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(self._decode().rstrip("\ufffd"))

    def finish(self) -> str:
        return self._advance(self._decode())

    def _decode(self) -> str:
        return self._tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _advance(self, target: str) -> str:
        if not target.startswith(self.text):  # a decode that rewrites sent text: keep what was sent
            log.warning("decode is not prefix-stable; dropping %r", target[len(self.text) :])
            return ""
        delta, self.text = target[len(self.text) :], target
        return delta
