"""Shorten aiortc's receive hold on audio from 80 ms to 20 ms.

RTCRtpReceiver releases an audio frame only once ``prefetch`` later frames have arrived
(``JitterBuffer(capacity=16, prefetch=4)``: 4 x 20 ms of delay on every turn). A browser
holds ~20-30 ms; on loopback or a good LAN one frame is enough. The buffer is a private,
name-mangled attribute, so every assumption is checked and anything unexpected leaves the
receiver untouched: an aiortc upgrade costs us 60 ms, never a crash.
``tests/unit/test_jitter.py`` fails when such an upgrade breaks the hook.

Call it right after setRemoteDescription (the receivers exist, no packet has arrived yet).
"""

from __future__ import annotations

import logging
from typing import Optional

from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.rtcrtpreceiver import RTCRtpReceiver

logger = logging.getLogger(__name__)

# RTCRtpReceiver.__init__ sets self.__jitter_buffer / self.__kind: Python mangles both.
_BUFFER_ATTR = "_RTCRtpReceiver__jitter_buffer"
_KIND_ATTR = "_RTCRtpReceiver__kind"


class ImmediateAudioJitterBuffer(JitterBuffer):
    """Releases an audio packet the moment it arrives in order.

    aiortc's buffer knows a frame is complete only when a packet of the *next* frame
    arrives (video frames span packets), which holds every audio frame at least 20 ms. An
    Opus frame is one packet, so an in-order packet is a whole frame at once. A hole (loss
    or reordering) is waited for until `patience` newer packets are here, then skipped.
    """

    def __init__(self, capacity: int = 16, patience: int = 2) -> None:
        super().__init__(capacity=capacity, prefetch=0)
        self._patience = patience

    def _remove_frame(self, sequence_number: int) -> Optional[JitterFrame]:
        slot = self._origin % self._capacity  # type: ignore[operator]
        if self._packets[slot] is None:
            if sum(p is not None for p in self._packets) < self._patience:
                return None  # maybe only reordered: give it a packet or two
            while self._packets[self._origin % self._capacity] is None:  # type: ignore[operator]
                self.remove(1)  # lost: skip the hole
            slot = self._origin % self._capacity  # type: ignore[operator]
        packet = self._packets[slot]
        assert packet is not None
        self.remove(1)
        return JitterFrame(data=packet._data, timestamp=packet.timestamp)  # type: ignore[attr-defined]


def lower_audio_jitter_hold(receiver: RTCRtpReceiver, prefetch: int = 1) -> bool:
    """Replace an audio receiver's jitter buffer with one holding ``prefetch`` frames.

    ``prefetch=0`` installs ImmediateAudioJitterBuffer (no hold for in-order packets).
    True when the receiver now holds ``prefetch`` frames; False (with a warning) when it
    is not an unused audio receiver of the expected shape, in which case it is unchanged.
    """
    kind = getattr(receiver, _KIND_ATTR, None)
    if kind != "audio":
        return _refuse(f"receiver kind is {kind!r}, not 'audio'")
    buffer = getattr(receiver, _BUFFER_ATTR, None)
    if type(buffer) not in (JitterBuffer, ImmediateAudioJitterBuffer):
        return _refuse(f"{_BUFFER_ATTR} is {type(buffer).__name__}, not aiortc's JitterBuffer")
    for attr in ("_origin", "_prefetch", "_packets", "capacity"):
        if not hasattr(buffer, attr):
            return _refuse(f"JitterBuffer has no {attr!r}")
    capacity = buffer.capacity
    if not 0 <= prefetch < capacity:
        return _refuse(f"prefetch {prefetch} not in 0..{capacity - 1}")
    if buffer._prefetch == prefetch and (prefetch > 0) != isinstance(buffer, ImmediateAudioJitterBuffer):
        return True  # already lowered (a second call, or aiortc's default changed)
    if buffer._origin is not None or any(p is not None for p in buffer._packets):
        # Packets are in flight: swapping now would lose them.
        return _refuse("jitter buffer already in use")
    try:
        replacement: JitterBuffer = (
            ImmediateAudioJitterBuffer(capacity=capacity)
            if prefetch == 0
            else JitterBuffer(capacity=capacity, prefetch=prefetch)
        )
    except TypeError as exc:  # the constructor's signature changed
        return _refuse(f"JitterBuffer(capacity=, prefetch=) failed: {exc}")
    setattr(receiver, _BUFFER_ATTR, replacement)
    return True


def _refuse(reason: str) -> bool:
    logger.warning("audio jitter hold left at aiortc's default: %s", reason)
    return False
