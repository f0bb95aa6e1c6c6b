"""Watching a call on the call page: poll a snapshot of it and latch each condition the first
time it holds (the fake microphone loops, so a sign of a working call may come and go).

Shared by the browser tests that drive a whole call (tests/e2e/test_browser.py, test_browser_turn.py).
"""

from __future__ import annotations

import time
from typing import Callable, Optional


def watch_call(
    page,
    snapshot_js: str,
    checks: Callable[[dict], dict[str, bool]],
    timeout_s: float,
    finished: Callable[[dict], bool] = lambda snap: True,
    on_timeout: Optional[Callable[[], None]] = None,
) -> tuple[dict[str, dict], dict]:
    """Poll `snapshot_js` (it returns at least `state`, `errors` and `errorBox`) every 0.2 s until
    every check has held once and `finished` holds for the latest snapshot; returns the
    snapshot each check first held in, and the latest. An error event or a failed or closed
    call fails at once; after `timeout_s`, `on_timeout` runs and the missing checks are named."""
    seen: dict[str, dict] = {}
    snap: dict = {}
    names: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = page.evaluate(snapshot_js)
        assert not snap["errors"], f"agent sent error events: {snap['errors']}"
        assert snap["state"] not in ("failed", "closed"), f"call {snap['state']}: {snap['errorBox']}"
        now = checks(snap)
        names = list(now)
        for name, ok in now.items():
            if ok and name not in seen:
                seen[name] = snap
        if len(seen) == len(now) and finished(snap):
            return seen, snap
        time.sleep(0.2)
    if on_timeout is not None:
        on_timeout()
    missing = [n for n in names if n not in seen]
    raise AssertionError(f"after {timeout_s} s still missing {missing}; last snapshot: {snap}")
