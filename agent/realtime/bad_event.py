"""The error a refused client event raises: its message, the client's error code, and the field
at fault (`param`). agent/realtime/client_events.py turns it into an `error` event."""

from __future__ import annotations

from typing import Optional


class BadEvent(ValueError):
    def __init__(self, message: str, code: str = "invalid_value", param: Optional[str] = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param
