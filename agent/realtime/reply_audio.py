"""Where a session's spoken replies go: the outbound track's paced audio on WebRTC, audio deltas
on a WebSocket; and, on WebRTC, which response's audio the track plays and the
`output_audio_buffer.*` events that say so.

A part of the session's Replies (agent/realtime/replies.py), which alone calls it; given the
outbox only. The track is set once the session has made it (its hooks call `on_first_audio`
and `on_drained` here). The track owns the pacing; this knows only whose audio it is.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from agent.config import OUTPUT_RATE
from agent.media.playout import AgentAudioTrack
from agent.realtime.outbox import Outbox
from agent.realtime.response import Response


class ReplyAudio:
    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self.track: Optional[AgentAudioTrack] = None  # WebRTC: the outbound track (set by the session)
        self.playing: Optional[Response] = None  # the response whose audio the track plays (WebRTC)
        # WebSocket: when the client will have played the deltas sent so far, at real-time pace.
        self._heard_until = 0.0

    def begin(self, reply: Response) -> None:
        """A response begins: the track plays its audio from now on (a spoken one, on WebRTC)."""
        if self.track is not None and reply.audio:
            self.track.begin_reply()
            self.playing = reply

    def push(self, reply: Response, pcm: np.ndarray) -> None:
        """Some of the response's speech: to the track (counted: what a barge-in heard is cut
        by it), or as an audio delta on a WebSocket. On WebRTC only the playing response's: a
        response whose audio was cleared (output_audio_buffer.clear, the response left to run:
        a client should cancel it first) plays nothing more."""
        if self.track is not None:
            if reply is not self.playing:
                return
            reply.samples += len(pcm)
            self.track.push(pcm)
        else:
            self._outbox.emit(reply.audio_delta(pcm))
            now = time.monotonic()
            self._heard_until = max(self._heard_until, now) + len(pcm) / OUTPUT_RATE

    def sounding(self) -> bool:
        """The user may still be hearing a reply: the track plays one (WebRTC), or the deltas
        sent have not all been played yet at real-time pace (WebSocket)."""
        if self.track is not None:
            return self.playing is not None
        return time.monotonic() < self._heard_until

    def end(self, reply: Response) -> None:
        """The engine made all of the response's audio: the track plays it out, then drains."""
        if self.track is not None and self.playing is reply:
            self.track.end_reply()

    def level(self, current: Optional[Response]) -> Optional[float]:
        """The level the agent plays now, None while silent (`current`: the response being made).
        On a WebSocket the client plays the deltas at its own pace; all that is known is that a
        spoken reply is under way (level 0: the duration rule applies, the threshold is not
        raised)."""
        if self.track is not None:
            return self.track.level.level()
        return 0.0 if current is not None and current.audio else None

    def clear(self, last: Optional[Response]) -> float:
        """output_audio_buffer.clear (WebRTC): the track drops what it has not played; returns
        the seconds dropped. `last`: the latest response, named when none is playing."""
        playing, self.playing = self.playing, None
        if self.track is None:
            return 0.0
        dropped = self.track.flush()
        response_id = playing.id if playing is not None else (last.id if last else None)
        if response_id is not None:
            self._outbox.emit({"type": "output_audio_buffer.cleared", "response_id": response_id})
        return dropped

    def on_first_audio(self, _wall: float) -> None:
        """The track's hook: the response's first sound went out."""
        if self.playing is not None:
            self._outbox.emit(
                {
                    "type": "output_audio_buffer.started",
                    "response_id": self.playing.id,
                    "omni": {"ttfa_ms": None if self.playing.ttfa is None else round(self.playing.ttfa * 1000, 1)},
                }
            )

    def on_drained(self, _wall: float) -> None:
        """The track's hook: the response's audio has all been played."""
        playing, self.playing = self.playing, None
        if playing is not None:
            self._outbox.emit({"type": "output_audio_buffer.stopped", "response_id": playing.id})
