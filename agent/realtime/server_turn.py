"""The turn the server's voice detection follows, from the endpointer's events to the session's.

A `Session` owns one `ServerTurn`; it alone changes the turn's state: the user audio item being
spoken, whether a speculative reply runs on it (agent/engine/runner/speculation.py), and the audio held
since a pause of the turn. That audio joins the turn only if the user goes on, so a turn ends where
its last pause began, with speculation or without, and both answer the same audio. Barge-in
candidates pause the agent's voice (the outbound track holds its queue) until they are confirmed
(the session interrupts the reply) or dropped (the voice plays on).

It also serves the client's input_audio_buffer.commit and .clear, with or without turn detection.
It is given what it acts on, never the Session: the engine port, the outbox, the input buffer,
the replies and edits (a barge-in), the transcription, the items port (the turn's user item),
the outbound track (WebRTC), the settings and plain values.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np

from agent import metrics
from agent.config import Config
from agent.engine.api import EngineBusy
from agent.engine.commands import EndTurn
from agent.gate.ladder import Admission
from agent.media.playout import AgentAudioTrack
from agent.media.turn_events import (
    BargeInCandidate,
    BargeInDropped,
    SpeechAudio,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
    SpeechStopped,
)
from agent.realtime.edits import Edits
from agent.realtime.engine_port import EnginePort
from agent.realtime.events import new_id
from agent.realtime.idle_timeout import IdleTimer
from agent.realtime.input_buffer import InputBuffer
from agent.realtime.input_transcription import InputTranscription
from agent.realtime.items import Items
from agent.realtime.outbox import Outbox
from agent.realtime.replies import Replies


class ServerTurn:
    def __init__(
        self,
        engine: EnginePort,
        outbox: Outbox,
        input: InputBuffer,
        replies: Replies,
        edits: Edits,
        transcription: InputTranscription,
        items: Items,
        track: Optional[AgentAudioTrack],
        settings: Callable[[], dict[str, Any]],
        admission: Admission,
        config: Config,
        *,
        transcription_only: bool,
    ) -> None:
        self._engine, self._outbox, self._input = engine, outbox, input
        self._replies, self._edits, self._transcription, self._items = replies, edits, transcription, items
        self._track, self._settings, self._admission, self._config = track, settings, admission, config
        self._transcription_only = transcription_only
        self.item_id: Optional[str] = None  # the user audio item being spoken
        self.speech_at = 0.0  # where its audio starts (session clock, s)
        self.speculating = False  # a reply was started on a pause of this turn (held by the engine)
        self.after_pause: Optional[list[np.ndarray]] = None  # audio since a pause, held
        self._idle = IdleTimer()

    def reset(self) -> None:
        """The turn so far is gone (cleared, or judged by new rules)."""
        self.item_id, self.speculating, self.after_pause = None, False, None

    def commit_buffer(self, event_id: Optional[str]) -> None:
        """input_audio_buffer.commit: the buffered audio becomes a user item (no reply by itself)."""
        if not self._input.manual:
            if not self._input.in_turn:
                # Under turn detection the buffer holds the speech the endpointer heard (silence
                # never reaches the model), so a commit with none has nothing to commit.
                self._outbox.error(
                    "the input audio buffer holds no speech (with turn_detection on, only speech is buffered)",
                    "input_audio_buffer_commit_empty",
                    event_id=event_id,
                )
                return
            self._input.reset()
            self._items.commit(self._commit_turn())
            self._item_ended()
            return
        if self._input.buffered_ms() < 100:
            self._outbox.error(
                "commit needs at least 100 ms of audio", "input_audio_buffer_commit_empty", event_id=event_id
            )
            return
        item_id, seconds = new_id("item"), self._input.buffered_ms() / 1000
        try:
            self._transcription.speech_started(item_id)  # the audio below is this item's
            for pcm in self._input.take():
                self._engine.append_audio(pcm)
        except EngineBusy:
            self._outbox.error(
                "engine is overloaded; the audio was dropped", "engine_busy", kind="server_error", event_id=event_id
            )
            return
        self._items.commit(item_id)
        self._transcription.speech_stopped(item_id, seconds)  # (its transcript's usage: the seconds committed)
        self._item_ended()

    def _item_ended(self) -> None:
        """A commit with no reply asked: a transcription session's turn ends; a conversation's
        item has its transcript completed (the turn goes on until a reply answers it)."""
        if self._transcription_only:
            self._engine.send(EndTurn())
        else:
            self._transcription.item_ended()

    def clear_buffer(self) -> None:
        """input_audio_buffer.clear: forget uncommitted audio (with server VAD: the turn so far)."""
        if self._input.in_turn:
            self._engine.discard_turn()
        self._input.reset()
        self.reset()
        self._outbox.emit({"type": "input_audio_buffer.cleared"})

    def _commit_turn(self) -> str:
        """input_audio_buffer.commit during a server-VAD turn: the turn ends here without a
        response. Returns the item id the audio becomes."""
        item_id, self.item_id = self.item_id or new_id("item"), None
        if self.speculating:  # a commit without a response: nothing to answer yet
            self.speculating = False
            self._engine.drop_speculation()
        for pcm in self.after_pause or []:
            self._engine.append_audio(pcm)
        self.after_pause = None
        return item_id

    def split(self) -> None:
        """response.create while the user is speaking: the engine answers the turn as it is, so
        the speech so far becomes an item now (committed, listed before the reply), and the rest
        of the utterance a new one, announced as speech starting here (no barge-in: the
        endpointer saw no new start; the turn goes on)."""
        item_id = self._commit_turn()
        self._items.commit(item_id)
        now = self._input.audio_in.clock
        self._transcription.speech_stopped(item_id, now - self.speech_at)
        self.item_id, self.speech_at = new_id("item"), now
        self._transcription.speech_started(self.item_id, time.monotonic())
        self._outbox.emit(
            {"type": "input_audio_buffer.speech_started", "audio_start_ms": int(now * 1000), "item_id": self.item_id}
        )

    def on_event(self, event: object) -> None:
        """One endpointer event (agent/media/vad.py), in order."""
        td = self._input.turn_detection
        try:
            if isinstance(event, BargeInCandidate):
                self._pause_output()
            elif isinstance(event, BargeInDropped):
                if self._track is not None:
                    self._track.resume()  # a false alarm: play on from where it paused
            elif isinstance(event, SpeechStarted):
                self.item_id, self.speculating, self.after_pause = new_id("item"), False, None
                self.speech_at = event.at
                # Speech onset on the server clock: the endpointer confirms speech a little later.
                onset = time.monotonic() - max(0.0, self._input.audio_in.clock - event.onset)
                self._transcription.speech_started(self.item_id, onset)
                self._outbox.emit(
                    {
                        "type": "input_audio_buffer.speech_started",
                        "audio_start_ms": int(event.at * 1000),
                        "item_id": self.item_id,
                    }
                )
                # The cause first, then what it does (OpenAI's order: a client that stops its
                # playback on speech_started sees it before the reply's cancelled response.done).
                if td is not None and td.interrupt_response:
                    self._edits.barge_in()  # the reply stops; its context keeps what was heard
                if self._track is not None:
                    self._track.resume()  # after interrupt()'s flush: nothing; without one: play on
            elif isinstance(event, SpeechAudio):
                if self.after_pause is not None:
                    self.after_pause.append(event.chunk.pcm)
                else:
                    self._engine.append_audio(event.chunk.pcm)
            elif isinstance(event, SpeechPaused):
                self.after_pause = []
                self._speculate()
            elif isinstance(event, SpeechResumed):
                if self.speculating:  # mid-sentence: the held reply goes, unseen
                    self.speculating = False
                    try:
                        self._engine.drop_speculation()
                    except EngineBusy:
                        pass  # the audio below discards it too (StreamingRunner.append_audio)
                after, self.after_pause = self.after_pause or [], None
                for pcm in after:  # the pause was part of the sentence
                    self._engine.append_audio(pcm)
            elif isinstance(event, SpeechStopped):
                item_id = self.item_id or new_id("item")
                self.item_id = None
                # The rest of the silence is not part of the turn; create_response commits the
                # speculation (a refusal drops it; the turn stays).
                speculated, self.speculating, self.after_pause = self.speculating, False, None
                self._outbox.emit(
                    {
                        "type": "input_audio_buffer.speech_stopped",
                        "audio_end_ms": int(event.end_of_speech * 1000),
                        "item_id": item_id,
                        # The endpointer's decision: the silence it waited, and whether a
                        # speculative reply was ready (the turn's timing and trace read them).
                        "omni": {
                            "silence_ms": round((event.at - event.end_of_speech) * 1000),
                            "speculated": speculated,
                        },
                    }
                )
                self._end_turn(item_id, event.end_of_speech - self.speech_at)
        except EngineBusy:
            metrics.ERRORS.labels(where="engine_busy").inc()
            self._outbox.error("engine is overloaded; this turn was dropped", "engine_busy", kind="server_error")

    def _end_turn(self, item_id: str, seconds: float) -> None:
        """The turn's audio (`seconds` of it) is the user item `item_id`: committed, then
        answered as the turn detection says (a transcription session only ends the turn)."""
        td = self._input.turn_detection
        self._items.commit(item_id)
        self._transcription.speech_stopped(item_id, seconds)
        if self._transcription_only:
            self._engine.send(EndTurn())
        elif td is None or td.create_response:
            if not self._replies.respond_to_turn(item_id):
                self._transcription.item_ended()  # unanswered: committed as if none was asked
        else:
            self._transcription.item_ended()

    def check_idle(self) -> None:
        """After each chunk of input audio: server_vad's idle_timeout_ms (agent/realtime/idle_timeout.py)."""
        td = self._input.turn_detection
        timeout = td.idle_timeout_ms / 1000 if td is not None and td.idle_timeout_ms else None
        replying = self._replies.in_flight or self._replies.audio.sounding()
        due = self._idle.observe(self._input.audio_in.clock, replying, self._input.in_turn, timeout)
        if due is None or self._transcription_only or td is None or not td.create_response:
            return
        start, end = due
        item_id = new_id("item")
        self._outbox.emit(
            {
                "type": "input_audio_buffer.timeout_triggered",
                "audio_start_ms": int(start * 1000),
                "audio_end_ms": int(end * 1000),
                "item_id": item_id,
            }
        )
        # The silence becomes a user audio item the model hears (its last second: what the
        # microphone picked up, under the voice detector), and a reply is made to it.
        try:
            self._engine.append_audio(self._input.recent(1.0))
        except EngineBusy:
            metrics.ERRORS.labels(where="engine_busy").inc()
            self._outbox.error("engine is overloaded; the idle timeout was dropped", "engine_busy", kind="server_error")
            return
        self._transcription.speech_started(item_id, time.monotonic())
        self._end_turn(item_id, end - start)

    def _pause_output(self) -> None:
        """A barge-in candidate while the agent speaks: pause its voice now (the track holds the
        queue) rather than after barge_in_ms. Only where a confirmed turn would interrupt, and
        with the echo guard on: without it the agent's own echo is a candidate, and pausing on
        it would stutter the reply."""
        td, config = self._input.turn_detection, self._config
        if (
            self._track is not None
            and config.barge_in_pause
            and config.echo_guard
            and td is not None
            and td.interrupt_response
        ):
            self._track.pause(config.barge_in_pause_max_ms / 1000)

    def _speculate(self) -> None:
        """A pause in the user's turn: let the engine start the reply that the end of turn would
        create, held until then (StreamingRunner.speculate). Only where that reply would follow
        by itself (server VAD creating responses), none is running, and the ladder allows it."""
        td = self._input.turn_detection
        if (
            self.speculating
            or self._transcription_only
            or not self._config.speculative_start
            or td is None
            or not td.create_response
            or self._replies.in_flight
            or not self._admission.ladder.speculate
        ):
            return
        mode = self._replies.reply_mode(self._settings()["output_modalities"])
        if mode == "fallback":
            return
        # It is shown the frames the engine has taken so far (no flush here: each pause would
        # push frames past the in-flight cap while the engine is behind); the end of turn flushes.
        try:
            self._engine.speculate(mode)
        except EngineBusy:
            return  # a busy engine has no room for a reply that may be thrown away
        self.speculating = True
