"""The StreamingRunner's transcription commands (sessions send them as typed commands,
Engine.send, in order with their audio): a session's transcription mode, the item id of the turn being spoken,
the end of a turn in a transcription-only session, and the end of a user item committed with no
reply in a conversation. The transcripts themselves are the
Transcriber's (agent/engine/runner/transcriber.py); their slots come from the sessions table.
"""

from __future__ import annotations

import torch

from agent.engine.runner.sessions import SessionTable
from agent.engine.runner.transcriber import Transcriber
from agent.engine.stages.turn_prefill import TurnPrefill


class TranscriptionCommands:
    def __init__(self, sessions: SessionTable, transcriber: Transcriber, turns: TurnPrefill) -> None:
        self.sessions, self.transcriber, self.turns = sessions, transcriber, turns

    def set_transcription(self, session_id: str, mode: str) -> str:
        """mode 'on': transcribe the user's turns in a slot of their own (a conversation);
        'only': a transcription-only session (no replies; its own slot transcribes); 'off'."""
        state = self.sessions[session_id]
        if mode not in ("on", "only", "off"):
            raise ValueError(f"transcription mode {mode!r}")
        if mode == "off" or (mode == "on") == state.choices.captions_only:
            self.sessions.give(self.transcriber.close(session_id))
            state.choices.captions_only = False
        if mode == "off" or session_id in self.transcriber.sessions:
            return mode
        if mode == "only":
            if state.reply is not None or state.turn.header_done:
                raise RuntimeError("a conversation cannot become a transcription-only session")
            state.choices.captions_only = True
            self.transcriber.open(session_id, state.slot, own=False)
        else:
            self.transcriber.open(session_id, self.sessions.take_slot(), own=True)
        return mode

    def set_transcript_item(self, session_id: str, item_id: str) -> None:
        self.transcriber.set_item(session_id, item_id)

    @torch.inference_mode()
    def end_turn(self, session_id: str) -> None:
        """End of a turn in a transcription-only session: its audio tail, then the final run."""
        turn = self.turns.close_turn(self.sessions[session_id])
        self.transcriber.ended(session_id, turn)

    @torch.inference_mode()
    def end_user_item(self, session_id: str, transcript: bool = True) -> None:
        """A conversation's user item committed with no reply asked: without this its transcript
        would wait for the turn's end, the next reply. Its audio is encoded to the end now (the
        turn goes on, from a fresh audio stream: TurnPrefill.cut_audio) and its final run
        follows (while the session transcribes). Where it ends is marked either way: a later
        discard keeps the item's audio (TurnPrefill.drop_speech)."""
        state = self.sessions[session_id]
        if state.choices.captions_only:
            raise RuntimeError("a transcription-only session ends its turns with EndTurn")
        self.turns.cut_audio(state)
        if transcript and session_id in self.transcriber.sessions:
            self.transcriber.item_ended(session_id, state.turn)
