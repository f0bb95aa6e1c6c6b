"""Priority classes: which sessions are served first when the engine cannot serve everyone.

A session is `high` or `normal`, fixed when it is created (the offer's `?priority=` or its
session's `omni.priority`; an ephemeral key's session fixes it for whoever uses the key). Two
places act on it:
- admission (`refusal`): the last `reserved` of `max_sessions` slots take high-priority
  sessions only, so a burst of normal calls cannot lock the important ones out;
- the engine's scheduler (agent/engine/runner/scheduler.py): among replies waiting for their first
  audio, and among speaking sessions that are near underrun, high ones go first when a tick
  has fewer rows than candidates.
It is not access control: whoever may open a call may ask for `high`. Hand out ephemeral keys
(minted by a backend that decides) when that matters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

HIGH = "high"
NORMAL = "normal"
PRIORITIES = (HIGH, NORMAL)
# The scheduler's number: higher is served first (room below NORMAL for work that may wait).
RANK = {HIGH: 1, NORMAL: 0}


def parse(value: Any) -> str:
    """A priority class from an offer or a session; ValueError names the accepted values."""
    if value not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)} (got {value!r})")
    return value


def refusal(active: Mapping[str, int], priority: str, max_sessions: int, reserved: int) -> Optional[str]:
    """Why a new session of `priority` is refused ("capacity", or "reserved" when only the slots
    kept for high priority are left), or None when it is admitted. `active`: sessions per class."""
    total = sum(active.values())
    if total >= max_sessions:
        return "capacity"
    if priority != HIGH and total >= max_sessions - reserved:
        return "reserved"
    return None
