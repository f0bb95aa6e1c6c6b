"""The error a refused session or response setting raises: its message and the field at fault."""

from __future__ import annotations


class ConfigError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
