"""Conversation edits behind the Realtime API's items, the StreamingRunner's component for them
(on the engine thread; the runner's methods of the same names, which the engine loop calls for the typed commands
of agent/engine/commands.py, delegate here): user text items, instructions, the voice, truncating the latest reply to what was
heard (conversation.item.truncate and the server's barge-in), and a read-only view of the slot.

Every edit first discards a speculative reply (agent/engine/runner/speculation.py): it answered the
conversation as it was before the edit.
"""

from __future__ import annotations

import numpy as np
import torch

from agent.engine.checkpoints.model import LoadedModel, assistant_start_ids
from agent.engine.runner.sessions import SessionTable
from agent.engine.runner.speculation import Speculation
from agent.engine.stages.talker import TalkerOps
from agent.engine.stages.turn_prefill import TurnPrefill
from agent.engine.state.session import LastReply, SessionState, join_text

# Images one user turn may show (each is a few hundred vision tokens at the sizes the Realtime
# layer sends: agent/realtime/message_content.py).
MAX_TURN_IMAGES = 8


class ConversationEdits:
    def __init__(
        self,
        sessions: SessionTable,
        loaded: LoadedModel,
        turns: TurnPrefill,
        talker: TalkerOps,
        speculation: Speculation,
    ) -> None:
        self.sessions, self.loaded, self.turns, self.talker = sessions, loaded, turns, talker
        self.speculation = speculation

    def add_user_text(self, session_id: str, text: str) -> int:
        """A user text message: it joins the turn being spoken, after its audio (prefilled at the
        end of the turn), on a line of its own after the turn's earlier text (`join_text`).
        Returns the tokens added."""
        self.speculation.drop_speculation(session_id)  # a speculation answers the turn without it
        turn = self.sessions[session_id].turn
        before = len(turn.text_ids)
        turn.text_ids = join_text(turn.text_ids, self.turns.text_ids(text), self.loaded.ids.newline)
        return len(turn.text_ids) - before

    def add_user_image(self, session_id: str, image: np.ndarray) -> int:
        """An image of a user message: shown at the end of the turn being spoken, after its audio
        and the camera's frames, before its text (agent/engine/stages/reply_prefill.py). Returns
        how many images the turn holds; refused (ValueError) past MAX_TURN_IMAGES."""
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or min(image.shape[:2]) < 1:
            raise ValueError("an image is RGB uint8, height x width x 3")
        turn = self.sessions[session_id].turn
        if len(turn.images) >= MAX_TURN_IMAGES:
            raise ValueError(f"a turn shows at most {MAX_TURN_IMAGES} images")
        self.speculation.drop_speculation(session_id)  # a speculation answers the turn without it
        turn.images.append(image)
        return len(turn.images)

    def drop_turn_items(self, session_id: str) -> None:
        """The turn's text and image items go: the fallback model answered them (a turn
        discarded otherwise keeps them for the next one: agent/engine/runner/intake.py)."""
        turn = self.sessions[session_id].turn
        turn.text_ids, turn.images = [], []

    def set_voice(self, session_id: str, voice: str) -> str:
        """The talker speaker of the session's next replies (a reply keeps the one it began with)."""
        self.speculation.drop_speculation(session_id)
        name = self.talker.voice_name(voice)
        self.sessions[session_id].choices.voice = name
        return name

    @torch.inference_mode()
    def set_instructions(self, session_id: str, text: str) -> str:
        """The session's system prompt. Before the first turn it replaces the prefilled one
        ("replaced"); later it is added as a system message before the next user turn
        ("appended", where a system message item would go: `_append`), and it is what a history
        reset prefills."""
        ids = self.turns.system_message_ids(text)
        self.turns.check_system(ids)  # (a refusal changes nothing)
        self.speculation.drop_speculation(session_id)
        state = self.sessions[session_id]
        state.choices.system_prompt = text
        pristine = state.reply is None and state.last_reply is None and not state.turn.header_done
        if pristine and not state.closing:
            self.turns.system.start(state)  # (in chunks, from the next tick: SystemPrefill)
            return "replaced"
        self._append(state, ids)
        state.instruction_turns.append(ids)  # (a history reset's system prompt says it instead)
        return "appended"

    def add_system_text(self, session_id: str, text: str) -> int:
        """A system message item: it joins the conversation where it is added (`_append`), after
        the user's text items before it (a user turn of their own, as for an assistant item).
        The session's instructions stay as they are. Returns its token count."""
        self.speculation.drop_speculation(session_id)
        state = self.sessions[session_id]
        ids = self.turns.system_message_ids(text)
        self._append(state, [*self.turns.user_text_turn(state.turn), *ids])  # (the user's text came first)
        return len(ids)

    def add_assistant_text(self, session_id: str, text: str, joins: bool = False) -> int:
        """An assistant message item (a client replaying a conversation): a closed assistant turn
        where it is added (`_append`). The user's text items waiting for the turn's end came
        before it: they become a user turn of their own in front of it. The talker is not told
        (it hears user turns only, as of every earlier reply). Refused while the turn holds
        images not yet answered (they need the turn's own prefill) or turns wait to be
        answered. Returns the tokens added.

        `joins` (a replayed call right behind a replayed message or call): the text goes into
        the assistant turn replayed last, after a newline, as Qwen's template writes a message's
        text and its parallel calls (`_join`); a new turn if that one is no longer the last
        thing waiting to be prefilled."""
        self.speculation.drop_speculation(session_id)
        state = self.sessions[session_id]
        turn = state.turn
        if turn.images:
            raise ValueError("an assistant message cannot follow images not yet answered: ask for a response first")
        if state.held_turns:
            raise ValueError("an assistant message cannot be added while turns wait to be answered")
        if joins and not turn.text_ids and self._join(state, text):
            return len(state.replayed_turn)
        im_end = [self.loaded.ids.im_end, *self.loaded.ids.newline]
        ids = self.turns.user_text_turn(turn)
        state.replayed_turn = (*assistant_start_ids(self.loaded.ids), *self.turns.text_ids(text), *im_end)
        ids += state.replayed_turn
        self._append(state, ids)
        return len(ids)

    def _join(self, state: SessionState, text: str) -> bool:
        """Continue the assistant turn replayed last, where it still ends the turns waiting to be
        prefilled (after a reply in flight, or in front of the next user turn). Nothing added
        since can end with it: only this method and add_assistant_text write an assistant header
        there. False when it is gone (prefilled by a reply, or followed by another turn)."""
        replayed, im_end = state.replayed_turn, [self.loaded.ids.im_end, *self.loaded.ids.newline]
        if not replayed:
            return False
        # Where _append put it: after the reply in flight, or in front of the turn being spoken
        # (behind a turn that replaced the history, which cannot be taken back out).
        after = state.reply is not None or state.turn.history_reset
        pending = state.after_reply if after else state.closing
        if tuple(pending[-len(replayed) :]) != replayed:
            return False
        if not after:
            self.turns.unprefill_turn(state)  # the turn's prefill followed it: it goes again after
        del pending[len(pending) - len(im_end) :]
        added = self.turns.text_ids("\n" + text)
        pending += [*added, *im_end]
        state.replayed_turn = (*replayed[: -len(im_end)], *added, *im_end)
        return True

    def _append(self, state: SessionState, ids: list[int]) -> None:
        """Tokens of a whole turn, at the end of the conversation: after the reply in flight
        (its item came first), else after the user items committed in the turn being spoken
        (TurnPrefill.seal_items) and before the speech not committed yet (append_turns)."""
        if state.reply is not None:
            state.after_reply += ids  # closes the reply, before the next turn
        else:
            self.turns.seal_items(state)  # committed user items, then these (not before them)
            self.turns.append_turns(state, ids)

    def set_context_turns(self, session_id: str, turns: int) -> int:
        """Keep at most `turns` answered turns in the context (0: no bound): the turn after them
        starts the history over from the system prompt (interpreter mode, docs/realtime.md)."""
        if turns < 0:
            raise ValueError("turns must be >= 0")
        self.sessions[session_id].choices.max_turns = turns
        return turns

    def set_reply_instructions(self, session_id: str, text: str) -> int:
        """Per-response instructions: a system message right before this reply's assistant
        header (it stays in the history). Call before begin_reply; returns its token count."""
        self.speculation.drop_speculation(session_id)
        ids = self.turns.system_message_ids(text) if text else []
        self.sessions[session_id].turn.reply_system_ids = ids
        return len(ids)

    @torch.inference_mode()
    def truncate_reply(self, session_id: str, audio_frames: int, missing_ok: bool = False) -> dict:
        """The listener heard only the first `audio_frames` codec frames of the latest reply: keep
        the text tokens the talker had consumed by then (frame i was made after reading reply token
        i) and close the assistant turn there, in the thinker cache. Its tool calls stay whole (the
        talker spoke none of them, and the client has them as items). A turn being spoken is taken
        back out of the cache first and prefilled again after the new end. With `missing_ok`, no
        latest reply in the context (cancelled before its prefill ended, or the fallback's)
        answers `absent` instead of raising."""
        self.speculation.drop_speculation(session_id)
        state = self.sessions[session_id]
        last = state.last_reply
        if missing_ok and state.reply is None and last is None:
            return {"kept_tokens": 0, "dropped_tokens": 0, "context_tokens": state.thinker.length, "absent": True}
        if state.reply is not None or last is None:
            raise RuntimeError("only the latest reply can be truncated, once it has ended")
        spoken = len(last.tokens) if last.voice_end is None else last.voice_end
        keep = max(0, min(audio_frames, spoken))
        kept = [*last.tokens[:keep], *last.tokens[spoken:]]
        same = keep if keep < spoken else len(kept)  # kept and the reply agree up to here
        self.turns.unprefill_turn(state)
        im_end = [self.loaded.ids.im_end, *self.loaded.ids.newline]
        # The closing is the reply's unfed tokens and its end, then whatever was queued after it.
        after = state.closing[len(last.tokens) - last.fed + len(im_end) :]
        cut = min(same, last.fed)
        if cut < last.fed:
            state.thinker.crop(last.start_length + cut, last.start_pos + cut)
        state.closing = [*kept[cut:], *im_end, *after]
        state.closing_tail = len(state.closing) - len(after)
        voice_end = None if last.voice_end is None else keep
        state.last_reply = LastReply(last.start_length, last.start_pos, tuple(kept), cut, voice_end)
        return {
            "kept_tokens": keep,
            "dropped_tokens": len(last.tokens) - len(kept),
            "context_tokens": state.thinker.length,
        }

    def context(self, session_id: str) -> dict:
        """What the session's KV slot holds of its conversation's end (read-only, for tests and
        debugging): the thinker cache length, the latest reply's tokens as kept in the history
        and where they start, the tokens waiting to be prefilled with the next turn, and where
        the turn being spoken starts in the cache (None: not prefilled yet)."""
        state = self.sessions[session_id]
        last = state.last_reply
        return {
            "thinker_length": state.thinker.length,
            "last_reply": None
            if last is None
            else {"start_length": last.start_length, "tokens": list(last.tokens), "fed": last.fed},
            "closing": list(state.closing),
            "turn_start_length": state.turn.start_length if state.turn.header_done else None,
            "replying": state.reply is not None,
        }
