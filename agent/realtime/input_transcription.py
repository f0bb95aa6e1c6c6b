"""Live input transcription as GA events: conversation.item.input_audio_transcription.*.

Owned by the Session, given only its engine port, outbox and conversation. It tells the engine
whether to transcribe (SetTranscription) and which user item the turn being spoken is
(SetTranscriptItem), and turns the engine's transcripts (agent/engine/runner/transcriber.py) into
events:

- `…delta` while the user speaks, for each partial that made more text stable: `delta` is only
  that text, so a client that appends deltas (as the GA API's do) never shows words that are
  later taken back, and a delta is never empty (GA clients take an empty one for a broken
  stream). The project extra `omni` carries the whole hypothesis,
  `{"text", "stable_chars", "since_speech_ms"}` (server time since the speech onset): its first
  `stable_chars` characters are final, the rest may still change. A partial that made no more
  text stable (about one per half second of speech in all) is the project extra event
  `omni.input_audio_transcription.partial` with the same `item_id`, `content_index` and `omni`,
  so live captions still follow the hypothesis. The last delta of an item brings the deltas up
  to the transcript.
- `…completed` with the final `transcript` at the end of the turn (after speech_stopped), or
  when its item is committed with no reply asked (`item_ended`),
  with `usage` (the seconds of audio) and `omni.after_end_ms` (server time from the end of
  speech to the transcript).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from agent.engine.api import TranscriptOut
from agent.engine.commands import EndUserItem, SetTranscription, SetTranscriptItem
from agent.realtime import session_config
from agent.realtime.conversation import Conversation
from agent.realtime.engine_port import EnginePort
from agent.realtime.outbox import Outbox

PARTIAL_EVENT = "omni.input_audio_transcription.partial"  # a partial with no new stable text


class InputTranscription:
    def __init__(
        self, engine: EnginePort, outbox: Outbox, conversation: Conversation, transcription_only: bool
    ) -> None:
        self._engine, self._outbox, self._conversation = engine, outbox, conversation
        self._transcription_only = transcription_only
        self.on = False
        self._asked: Optional[asyncio.Future[Any]] = None  # the latest SetTranscription sent
        self._sent: dict[str, int] = {}  # item -> characters already sent as delta
        self._started: dict[str, float] = {}  # item -> monotonic time of its speech onset
        self._ended: dict[str, float] = {}  # item -> monotonic time of its end of speech
        self._seconds: dict[str, float] = {}  # item -> seconds of its audio

    def apply(self, settings: dict[str, Any]) -> None:
        """Start or stop transcribing to match the session (at start and on session.update)."""
        want = session_config.transcribes(settings)
        if want == self.on:
            return
        self.on = want
        mode = ("only" if self._transcription_only else "on") if want else "off"
        asked = self._asked = self._engine.send(SetTranscription(mode), param="session.audio.input.transcription")
        if want:
            # Refused (a conversation transcribes in a cache slot of its own, and every slot can
            # be taken): the client has its error event; the session is not transcribing, so
            # its turns send no transcript items and a later session.update may ask again.
            asked.add_done_callback(self._refused)

    def _refused(self, asked: "asyncio.Future[Any]") -> None:
        # Only the latest ask decides: an off and another on may have come since.
        if asked is self._asked and not asked.cancelled() and asked.exception() is not None:
            self.on = False

    def speech_started(self, item_id: str, onset: Optional[float] = None) -> None:
        """A user turn begins (before its audio goes to the engine): transcribe it as item_id.
        onset: time.monotonic() of the speech onset (default: now)."""
        if self.on:
            self._started[item_id] = time.monotonic() if onset is None else onset
            self._engine.send(SetTranscriptItem(item_id))

    def item_ended(self) -> None:
        """The user item being spoken was committed with no reply asked (a manual commit, or
        server VAD without create_response or with its response refused): the engine marks
        where it ends, so that a later discard of the turn keeps its audio, and its transcript
        completes now, not with the next reply (a transcription session ends its turn
        instead: EndTurn)."""
        if not self._transcription_only:  # (not only for the transcript: where the item ends)
            self._engine.send(EndUserItem())

    def speech_stopped(self, item_id: str, audio_seconds: float) -> None:
        if self.on:
            self._ended[item_id] = time.monotonic()
            self._seconds[item_id] = audio_seconds

    def on_transcript(self, out: TranscriptOut) -> None:
        item_id = out.item_id
        if item_id is None or self._engine.closed:
            return
        now = time.monotonic()
        sent = self._sent.get(item_id, 0)
        upto = len(out.text) if out.final else out.stable_chars
        started = self._started.get(item_id)
        if upto > sent or not out.final:
            event: dict[str, Any] = {
                "type": "conversation.item.input_audio_transcription.delta",
                "item_id": item_id,
                "content_index": 0,
                "delta": out.text[sent:upto],
                "omni": {"text": out.text, "stable_chars": out.stable_chars, "since_speech_ms": _ms(now, started)},
            }
            if upto <= sent:  # nothing newly stable: the hypothesis alone, as the project's extra
                event["type"] = PARTIAL_EVENT
                del event["delta"]
            self._outbox.emit(event)
            self._sent[item_id] = max(sent, upto)
        if not out.final:
            return
        self._conversation.set_input_transcript(item_id, out.text)
        ended = self._ended.pop(item_id, None)
        seconds = self._seconds.pop(item_id, None)
        self._outbox.emit(
            {
                "type": "conversation.item.input_audio_transcription.completed",
                "item_id": item_id,
                "content_index": 0,
                "transcript": out.text,
                "usage": {"type": "duration", "seconds": round(seconds, 3) if seconds is not None else 0},
                "omni": {"after_end_ms": _ms(now, ended)},
            }
        )
        self._sent.pop(item_id, None)
        self._started.pop(item_id, None)


def _ms(now: float, since: Optional[float]) -> Optional[float]:
    return None if since is None else round((now - since) * 1000, 1)
