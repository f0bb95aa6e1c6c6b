"""server_vad's `idle_timeout_ms`: when the user says nothing for that long after the agent's
last reply has been heard, the server prompts a reply itself (`input_audio_buffer.timeout_triggered`).

OpenAI's rule: the timeout counts from when the last response's audio finished playing, and it
fires once; its reply (like any) is heard, and the count starts again from the end of that. Time
is the session's input audio clock, the one `audio_start_ms`/`audio_end_ms` are offsets on, read
per chunk of microphone audio: a client that sends no audio has no clock and no timeout. Owned
by the session's ServerTurn, which feeds it and acts on what it returns.
"""

from __future__ import annotations

from typing import Optional


class IdleTimer:
    def __init__(self) -> None:
        self._replying = False  # a reply was being made or heard when last observed
        self._since: Optional[float] = None  # audio clock when the last reply had been heard

    def observe(
        self, clock: float, replying: bool, speaking: bool, timeout_s: Optional[float]
    ) -> Optional[tuple[float, float]]:
        """One chunk of input audio at `clock` (s). `replying`: a reply is in flight or its audio
        still playing; `speaking`: the user is in a turn. Returns (start, end) of the silence
        once it reaches `timeout_s` (None: no timeout), and then waits for the next reply."""
        if replying:
            self._replying, self._since = True, None
            return None
        if speaking:  # the user took the turn: counting waits for the reply to it
            self._replying, self._since = False, None
            return None
        if self._replying:
            self._replying, self._since = False, clock
        if self._since is None or timeout_s is None or clock - self._since < timeout_s - 1e-9:
            return None
        start, self._since = self._since, None
        return start, clock
