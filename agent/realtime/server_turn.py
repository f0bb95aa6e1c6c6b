"""The turn the server's voice detection follows, from the endpointer's events to the session's.

A `Session` owns one `ServerTurn`; it alone changes the turn's state: the user audio item being
spoken, whether a speculative reply runs on it (agent/engine/runner/speculation.py), and the audio held
since a pause of the turn. That audio joins the turn only if the user goes on, so a turn ends where
its last pause began, with speculation or without, and both answer the same audio. Barge-in
candidates pause the agent's voice (the outbound track holds its queue) until they are confirmed
(the session interrupts the reply) or dropped (the voice plays on).

It holds its session weakly: the session holds it, and a cycle would outlive the call until a
full collection (see Session.close).
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Optional

import numpy as np

from agent import metrics
from agent.engine.api import EngineBusy
from agent.media.turn_events import (
    BargeInCandidate,
    BargeInDropped,
    SpeechAudio,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
    SpeechStopped,
)
from agent.realtime.events import new_id

if TYPE_CHECKING:
    from agent.realtime.session import Session


class ServerTurn:
    def __init__(self, session: "Session") -> None:
        self._session = weakref.proxy(session)
        self.item_id: Optional[str] = None  # the user audio item being spoken
        self.speech_at = 0.0  # where its audio starts (session clock, s)
        self.speculating = False  # a reply was started on a pause of this turn (held by the engine)
        self.after_pause: Optional[list[np.ndarray]] = None  # audio since a pause, held

    def reset(self) -> None:
        """The turn so far is gone (cleared, or judged by new rules)."""
        self.item_id, self.speculating, self.after_pause = None, False, None

    def commit(self) -> str:
        """input_audio_buffer.commit during a server-VAD turn: the turn ends here without a
        response. Returns the item id the audio becomes."""
        s = self._session
        item_id, self.item_id = self.item_id or new_id("item"), None
        if self.speculating:  # a commit without a response: nothing to answer yet
            self.speculating = False
            s.engine.drop_speculation(s.id)
        for pcm in self.after_pause or []:
            s.engine.append_audio(s.id, pcm)
        self.after_pause = None
        return item_id

    def on_event(self, event: object) -> None:
        """One endpointer event (agent/media/vad.py), in order."""
        s = self._session
        td = s.input.turn_detection
        try:
            if isinstance(event, BargeInCandidate):
                self._pause_output()
            elif isinstance(event, BargeInDropped):
                if s.track is not None:
                    s.track.resume()  # a false alarm: play on from where it paused
            elif isinstance(event, SpeechStarted):
                if td is not None and td.interrupt_response:
                    s.replies.interrupt("turn_detected")
                if s.track is not None:
                    s.track.resume()  # after interrupt()'s flush: nothing; without one: play on
                self.item_id, self.speculating, self.after_pause = new_id("item"), False, None
                self.speech_at = event.at
                # Speech onset on the server clock: the endpointer confirms speech a little later.
                onset = time.monotonic() - max(0.0, s.input.audio_in.clock - event.onset)
                s.transcription.speech_started(self.item_id, onset)
                s.emit(
                    {
                        "type": "input_audio_buffer.speech_started",
                        "audio_start_ms": int(event.at * 1000),
                        "item_id": self.item_id,
                    }
                )
            elif isinstance(event, SpeechAudio):
                if self.after_pause is not None:
                    self.after_pause.append(event.chunk.pcm)
                else:
                    s.engine.append_audio(s.id, event.chunk.pcm)
            elif isinstance(event, SpeechPaused):
                self.after_pause = []
                self._speculate()
            elif isinstance(event, SpeechResumed):
                if self.speculating:  # mid-sentence: the held reply goes, unseen
                    self.speculating = False
                    try:
                        s.engine.drop_speculation(s.id)
                    except EngineBusy:
                        pass  # the audio below discards it too (StreamingRunner.append_audio)
                after, self.after_pause = self.after_pause or [], None
                for pcm in after:  # the pause was part of the sentence
                    s.engine.append_audio(s.id, pcm)
            elif isinstance(event, SpeechStopped):
                item_id = self.item_id or new_id("item")
                self.item_id = None
                # The rest of the silence is not part of the turn; create_response commits the
                # speculation (a refusal discards the turn, and it with it).
                self.speculating, self.after_pause = False, None
                s.emit(
                    {
                        "type": "input_audio_buffer.speech_stopped",
                        "audio_end_ms": int(event.end_of_speech * 1000),
                        "item_id": item_id,
                    }
                )
                s.commit_item(item_id, None)
                s.transcription.speech_stopped(item_id, event.end_of_speech - self.speech_at)
                if s.transcription_only:
                    s.engine_call("end_turn")
                elif td is None or td.create_response:
                    s.replies.respond_to_turn(item_id)
        except EngineBusy:
            metrics.ERRORS.labels(where="engine_busy").inc()
            s.emit_error("engine is overloaded; this turn was dropped", "engine_busy", kind="server_error")

    def _pause_output(self) -> None:
        """A barge-in candidate while the agent speaks: pause its voice now (the track holds the
        queue) rather than after barge_in_ms. Only where a confirmed turn would interrupt, and
        with the echo guard on: without it the agent's own echo is a candidate, and pausing on
        it would stutter the reply."""
        s = self._session
        td = s.input.turn_detection
        if (
            s.track is not None
            and s.config.barge_in_pause
            and s.config.echo_guard
            and td is not None
            and td.interrupt_response
        ):
            s.track.pause(s.config.barge_in_pause_max_ms / 1000)

    def _speculate(self) -> None:
        """A pause in the user's turn: let the engine start the reply that the end of turn would
        create, held until then (StreamingRunner.speculate). Only where that reply would follow
        by itself (server VAD creating responses), none is running, and the ladder allows it."""
        s = self._session
        td = s.input.turn_detection
        if (
            self.speculating
            or s.transcription_only
            or not s.config.speculative_start
            or td is None
            or not td.create_response
            or s.replies.in_flight
            or not s.admission.ladder.speculate
        ):
            return
        mode = s.reply_mode(s.settings["output_modalities"])
        if mode == "fallback":
            return
        # It is shown the frames the engine has taken so far (no flush here: each pause would
        # push frames past the in-flight cap while the engine is behind); the end of turn flushes.
        try:
            s.engine.speculate(s.id, [], mode=mode)
        except EngineBusy:
            return  # a busy engine has no room for a reply that may be thrown away
        self.speculating = True
