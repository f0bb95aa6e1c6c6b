"""What a session sends the StreamingRunner between its replies (a component on the engine
thread, on the sessions table and the turn prefill): camera frames and microphone audio of the turn being
spoken, a turn discarded or held (interpreter mode), and the session's switches (camera,
scheduling priority). Audio is encoded and prefilled as it becomes final, at once on an idle
engine and otherwise in the ticks the scheduler leaves for it (`prefill_speaking`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from agent.engine.runner.replies import Replies
from agent.engine.runner.sessions import SessionTable
from agent.engine.runner.speculation import Speculation
from agent.engine.runner.transcriber import Transcriber
from agent.engine.stages.turn_prefill import TurnPrefill


class Intake:
    def __init__(
        self,
        sessions: SessionTable,
        turns: TurnPrefill,
        transcriber: Transcriber,
        replies: Replies,
        speculation: Speculation,
        clock: Callable[[], float],
    ) -> None:
        self.sessions, self.turns, self.transcriber = sessions, turns, transcriber
        self.replies, self.speculation, self.clock = replies, speculation, clock

    @torch.inference_mode()
    def append_video(self, session_id: str, image: np.ndarray, at: float) -> None:
        """A camera frame as it arrives, placed on the turn's audio clock; when no reply exists,
        every closed grid of every session is encoded at once, in one forward (those of the
        others waited while a reply ran; agent/engine/stages/video_prefill.py). The vision
        encoder has the lowest priority: not even a held speculation waits for it (its commit
        would), and the frames of a pause it answered are not needed if it is committed."""
        state = self.sessions.get(session_id)
        if state is not None:
            self.turns.video.add_frame(state, image, self.clock())
            self._encode_grids()

    @torch.inference_mode()
    def append_audio(self, session_id: str, pcm: np.ndarray) -> None:
        # More of the turn: the user went on, so a speculation on the pause goes (the session
        # keeps the pause's own audio back until it knows; drop_speculation says so earlier).
        self.speculation.drop_speculation(session_id)
        state = self.sessions[session_id]
        self.turns.queue_pcm(state, pcm)
        if not self.replies.busy():  # idle engine: encode and prefill now, nothing waits for it
            self.turns.encode_audio(state)
            self._encode_grids()
            self.turns.flush_audio(state)

    def _encode_grids(self) -> None:
        """With no reply anywhere: every session's closed grids in one forward of the tower."""
        if all(s.reply is None for s in self.sessions.values()):
            self.turns.video.encode_waiting(list(self.sessions.values()))

    @torch.inference_mode()
    def discard_turn(self, session_id: str, keep_items: bool = True) -> None:
        """The turn being spoken is dropped (a false start, input_audio_buffer.clear): its audio
        leaves the cache and the transcript; a new turn begins. With `keep_items` the audio of
        user items committed in it stays, and only the speech after them goes (the turn goes on:
        TurnPrefill.drop_speech)."""
        self.speculation.drop_speculation(session_id)
        state = self.sessions[session_id]
        turn = state.turn
        self.transcriber.discard(session_id)
        if keep_items and self.turns.drop_speech(state):
            return
        if turn.header_done:  # only ever prefilled while no reply runs, so nothing came after it
            state.thinker.crop(turn.start_length, turn.start_pos)
        state.turn = self.turns.new_turn()
        # Only the audio goes: text and image items the client added are conversation items,
        # not part of what was spoken, and wait for the next turn's end (none is prefilled yet).
        state.turn.text_ids, state.turn.images = turn.text_ids, turn.images
        self.turns.video.seed(state, self.clock())

    @torch.inference_mode()
    def hold_turn(self, session_id: str) -> int:
        """Interpreter pipelining: the user's utterance ended while a reply is still being made.
        The turn is closed now (its audio encoded to the end, its transcript finished) and held;
        the next begin_reply answers it, before the turn being spoken now (the session sends
        that once the reply in flight is done; it may be done already). Returns the turns held."""
        state = self.sessions[session_id]
        if state.choices.captions_only:
            raise RuntimeError("a transcription-only session has no replies")
        self.speculation.drop_speculation(session_id)  # (none runs while a reply does; the turn ends here)
        turn = self.turns.close_turn(state)
        self.turns.video.seed(state, self.clock())  # the next utterance's turn: the camera's newest frame
        state.held_turns.append(turn)
        self.transcriber.ended(session_id, turn)
        return len(state.held_turns)

    def set_video(self, session_id: str, on: bool) -> bool:
        """The session's camera switch (Realtime `omni.video`): off, its frames are not looked at
        from the next turn on (a turn whose video block is open keeps it). Returns the setting."""
        state = self.sessions[session_id]
        state.choices.video = bool(on)
        if not on and not state.turn.audio_open:
            state.turn.video.grids = None
        return state.choices.video

    def set_priority(self, session_id: str, priority: int) -> int:
        """The session's scheduling priority (agent/gate/priority.py RANK: higher first), from now on."""
        return self.sessions.set_priority(session_id, priority)

    def prefill_speaking(self, budget: int) -> None:
        """Encode microphone audio of users speaking, and prefill it (bounded, one batched
        forward) where no reply of theirs holds the thinker cache (a barge-in's audio waits for
        its reply to end). Before it, in a forward and budget of their own, the system prompts
        still going into the cache: a session's audio goes in after its prompt."""
        states = list(self.sessions.values())
        self.turns.system.run_waiting(states, budget)
        for state in states:
            self.turns.encode_audio(state)
        self.turns.flush_audios(states, budget)
