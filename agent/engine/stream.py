"""StreamingRunner: Qwen3-Omni replies one codec frame (80 ms of audio) per engine step.

Per session: the system prompt is prefilled at open; the user's audio is encoded and
prefilled as it becomes final (AudioStream); at end of turn only the tail of the audio, the
frames and the assistant header are left. Then, per step: the thinker stays exactly one token
ahead of the talker, the talker makes codebook 0, the code predictor the 15 residual codes,
and code2wav renders that frame's samples, which go out at once.

Under greedy decoding the result equals transformers' generate() on the same prompt (same
text ids, same codec codes, same waveform up to float rounding): tests/unit/test_streaming_exact.py.
Policies that keep it so: a reply has at least one text token before its end (as GenerateRunner);
an earlier reply stays in the history as its text tokens then <|im_end|>\\n.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from agent.engine.api import AudioOut, Output, ReplyDone, StageTime, TextDelta
from agent.engine.audio_stream import AudioStream
from agent.engine.code2wav_stream import Code2WavStream
from agent.engine.model import LoadedModel, assistant_start_ids, encode_images, system_turn_ids
from agent.engine.reference import SAMPLES_PER_FRAME, talker_tokens_for, to_pcm16
from agent.engine.session_state import (
    KVState,
    ReplyRecord,
    ReplyState,
    SessionState,
    TalkerTurn,
    TurnState,
)
from agent.engine.talker import TalkerOps
from agent.engine.thinker import ImageFeatures, ThinkerOps

# Room kept free in the context for the reply and its closing tokens.
CLOSING_MARGIN = 8


class StreamingRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        system_prompt: str,
        max_reply_tokens: int = 48,
        max_reply_seconds: float = 4.0,
        context_limit: int = 32768,
        audio_window_s: float | None = None,
        record: bool = False,
    ) -> None:
        """audio_window_s: the audio encoder's attention window (n_window_infer) for the
        incremental prefill; None keeps the checkpoint's (8 s), which is what generate() uses.
        record: keep each session's last reply (codes, float waveform) in `records`."""
        if max_reply_tokens < 2:
            raise ValueError("max_reply_tokens must be >= 2 (a reply is one text token plus its end)")
        self.loaded = loaded
        self.system_prompt = system_prompt
        self.max_reply_tokens = max_reply_tokens
        self.talker_max_tokens = talker_tokens_for(max_reply_seconds, loaded.output_rate)
        self.context_limit = context_limit
        tower = loaded.model.thinker.model.audio_tower
        self.n_window_infer = None if audio_window_s is None else int(round(audio_window_s * 100))
        self.thinker = ThinkerOps(loaded)
        self.talker = TalkerOps(loaded)
        self.audio_tower = tower
        self.eos = set(loaded.thinker_eos_ids)
        self.record = record
        self.records: dict[str, ReplyRecord] = {}
        self._sessions: dict[str, SessionState] = {}
        self._code2wav: dict[str, Code2WavStream] = {}

    @classmethod
    def from_config(cls, loaded: LoadedModel, config) -> "StreamingRunner":
        """From agent.config.Config (system_prompt, max_reply_tokens, max_reply_seconds, audio_window_s)."""
        return cls(
            loaded,
            system_prompt=config.system_prompt,
            max_reply_tokens=config.max_reply_tokens,
            max_reply_seconds=config.max_reply_seconds,
            audio_window_s=config.audio_window_s,
        )

    # ---- Runner protocol -------------------------------------------------------------------

    def open_session(self, session_id: str) -> None:
        state = SessionState(
            thinker=KVState(self.thinker.new_cache()), talker=KVState(self.talker.new_cache()), turn=self._new_turn()
        )
        self._sessions[session_id] = state
        self._prefill_system(state)

    def close_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self._code2wav.pop(session_id, None)
        self.records.pop(session_id, None)

    def append_audio(self, session_id: str, pcm: np.ndarray) -> None:
        state = self._sessions[session_id]
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        with self._timed(state, "audio_encoder"):
            tokens = state.turn.audio.push(pcm)
        state.turn.samples += len(pcm)
        if tokens.shape[0]:
            state.turn.pending_audio.append(tokens)
        if state.reply is None:  # during a reply the thinker cache is busy: prefill later
            self._flush_audio(state)

    def discard_turn(self, session_id: str) -> None:
        state = self._sessions[session_id]
        turn = state.turn
        if turn.header_done:  # only ever prefilled while no reply runs, so nothing came after it
            state.thinker.crop(turn.start_length, turn.start_pos)
        state.turn = self._new_turn()

    def begin_reply(self, session_id: str, images: list[np.ndarray], text_only: bool = False) -> None:
        state = self._sessions[session_id]
        code2wav = None
        if not text_only:
            code2wav = self._code2wav.get(session_id)
            if code2wav is None:
                code2wav = self._code2wav[session_id] = Code2WavStream(self.loaded.model.code2wav)
            code2wav.reset()
        state.reply = ReplyState(
            text_only=text_only,
            talker_max_tokens=self.talker_max_tokens,
            turn=None,
            code2wav=code2wav,
            started=time.perf_counter(),
            images=list(images),
        )

    def cancel_reply(self, session_id: str) -> None:
        state = self._sessions.get(session_id)
        if state is not None and state.reply is not None:
            state.reply.cancelled = True

    def has_work(self) -> bool:
        return any(s.reply is not None for s in self._sessions.values())

    def step(self) -> list[Output]:
        """Advance every active reply by one codec frame (text-only replies: one token)."""
        outputs: list[Output] = []
        for session_id, state in list(self._sessions.items()):
            made = self._advance(session_id, state) if state.reply is not None else []
            outputs += [StageTime(name, s, session_id) for name, s in state.pending_stages]
            state.pending_stages.clear()
            outputs += made
        return outputs

    # ---- the turn: system, audio as it becomes final, the rest at end of turn ------------------

    def _new_turn(self) -> TurnState:
        stream = AudioStream(self.audio_tower, extractor=self.loaded.feature_extractor, n_window_infer=self.n_window_infer)
        return TurnState(audio=stream)

    def _prefill_system(self, state: SessionState) -> None:
        ids = system_turn_ids(self.loaded.ids, self.loaded.tokenizer, self.system_prompt)
        with self._timed(state, "thinker_prefill"):
            self.thinker.prefill(state.thinker, ids)

    def _flush_audio(self, state: SessionState) -> None:
        turn = state.turn
        if not turn.pending_audio:
            return
        ids = self._open_turn_ids(state)
        if not turn.audio_open:
            ids.append(self.loaded.ids.audio_start)
            turn.audio_open = True
        audio = torch.cat(turn.pending_audio, dim=0)
        turn.pending_audio.clear()
        ids += [self.loaded.ids.audio_pad] * audio.shape[0]
        turn.audio_feats.append(audio)
        self._prefill_turn(state, ids, audio=audio)

    def _open_turn_ids(self, state: SessionState) -> list[int]:
        """The previous reply's closing and this turn's header, the first time the turn prefills."""
        turn = state.turn
        if turn.header_done:
            return []
        turn.header_done = True
        turn.start_length, turn.start_pos = state.thinker.length, state.thinker.next_pos
        return [*state.closing, self.loaded.ids.im_start, *self.loaded.ids.user, *self.loaded.ids.newline]

    def _prefill_turn(
        self,
        state: SessionState,
        ids: list[int],
        audio: torch.Tensor | None = None,
        images: ImageFeatures | None = None,
        assistant_tail: int = 0,
    ):
        """Prefill part of the user turn. The first chunk starts with the previous reply's
        closing (assistant role); the last ends with the assistant header (`assistant_tail`
        tokens): neither is a user token for the talker."""
        turn = state.turn
        n_closing = len(state.closing) if not turn.ids else 0
        if state.thinker.length + len(ids) + self.max_reply_tokens + CLOSING_MARGIN > self.context_limit:
            return self._reset_history(state, ids[n_closing:], images, assistant_tail)
        with self._timed(state, "thinker_prefill"):
            out = self.thinker.prefill(state.thinker, ids, audio=audio, images=images)
        turn.prefill_tokens += len(ids)
        user = slice(n_closing, len(ids) - assistant_tail)
        turn.ids += ids[user]
        is_media = self.thinker.is_media(torch.tensor([ids[user]], device=self.loaded.device))
        turn.talker.ids += ids[user]
        turn.talker.embeds.append(self.talker.user_embeds(is_media, out.embeds[:, user], out.accept_hidden[:, user]))
        if images is not None:
            turn.talker.image_grids += images.grids
        return out

    def _reset_history(self, state: SessionState, new_ids: list[int], images, assistant_tail: int):
        """The context is full: drop the history, keep the system prompt and replay this turn."""
        turn = state.turn
        replay = turn.ids + new_ids
        audio = torch.cat(turn.audio_feats, dim=0) if turn.audio_feats else None
        state.thinker = KVState(self.thinker.new_cache())
        state.talker = KVState(self.talker.new_cache())
        state.talker_backlog, state.closing = [], []
        state.talker_history_length = state.talker_history_pos = 0
        self._prefill_system(state)
        if state.thinker.length + len(replay) + self.max_reply_tokens + CLOSING_MARGIN > self.context_limit:
            raise RuntimeError("one turn is longer than the context limit")
        turn.ids, turn.talker, turn.prefill_tokens, turn.history_reset = [], TalkerTurn(), 0, True
        turn.start_length, turn.start_pos = state.thinker.length, state.thinker.next_pos
        return self._prefill_turn(state, replay, audio=audio, images=images, assistant_tail=assistant_tail)

    def _prefill_reply(self, session_id: str, state: SessionState) -> list[Output]:
        """End of turn: the audio tail, the frames, <|im_end|>\\n<|im_start|>assistant\\n -> first token."""
        reply, turn = state.reply, state.turn
        with self._timed(state, "audio_encoder"):
            tail = turn.audio.finish()
        if tail.shape[0]:
            turn.pending_audio.append(tail)
        audio = torch.cat(turn.pending_audio, dim=0) if turn.pending_audio else None
        turn.pending_audio.clear()
        images = None
        if reply.images:
            with self._timed(state, "vision_encoder"):
                pixels = encode_images(self.loaded, reply.images)
                images = self.thinker.encode_images(pixels["pixel_values"], pixels["image_grid_thw"])
        ids = self._open_turn_ids(state)
        if audio is not None:
            if not turn.audio_open:
                ids.append(self.loaded.ids.audio_start)
                turn.audio_open = True
            ids += [self.loaded.ids.audio_pad] * audio.shape[0]
            turn.audio_feats.append(audio)
        if turn.audio_open:
            ids.append(self.loaded.ids.audio_end)
        for t, h, w in images.grids if images is not None else ():
            n_tokens = t * h * w // self.thinker.merge**2
            ids += [self.loaded.ids.vision_start, *([self.loaded.ids.image_pad] * n_tokens), self.loaded.ids.vision_end]
        header = assistant_start_ids(self.loaded.ids)
        ids += [self.loaded.ids.im_end, *self.loaded.ids.newline, *header]
        out = self._prefill_turn(state, ids, audio=audio, images=images, assistant_tail=len(header))
        # The turn is answered: audio from now on belongs to the next one (prefilled after the reply).
        state.closing = []
        reply.prefilled, reply.turn = True, turn
        state.turn = self._new_turn()
        # A reply has at least one text token: the end is held back for the first step.
        logits = out.last_logits.clone()
        logits[sorted(self.eos)] = float("-inf")
        return self._take_token(session_id, state, int(logits.argmax()))

    # ---- one step of a reply ---------------------------------------------------------------------

    def _advance(self, session_id: str, state: SessionState) -> list[Output]:
        reply = state.reply
        if reply.cancelled:
            return self._finish(session_id, state, "cancelled")
        outputs: list[Output] = []
        if not reply.prefilled:
            outputs += self._prefill_reply(session_id, state)
            if not reply.text_only:
                outputs += self._talker_prefill(state)
        elif reply.text_only or reply.talker_done:
            if not reply.thinker_done:
                outputs += self._thinker_next(session_id, state)
        else:
            outputs += self._talker_next(session_id, state)
        if reply.pending_frame:
            outputs += self._render_frame(session_id, state)
        if reply.thinker_done and (reply.text_only or reply.talker_done):
            outputs += self._finish(session_id, state, "")
        return outputs

    def _take_token(self, session_id: str, state: SessionState, token: int) -> list[Output]:
        reply = state.reply
        reply.tokens.append(token)
        if token in self.eos:
            reply.thinker_done, reply.thinker_reason = True, "stop"
            return []
        if len(reply.tokens) >= self.max_reply_tokens:
            reply.thinker_done, reply.thinker_reason = True, "length"
        text_ids = [t for t in reply.tokens if t not in self.eos]
        text = self.loaded.tokenizer.decode(text_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
            return []
        delta, reply.emitted_text = text[len(reply.emitted_text) :], text
        return [TextDelta(session_id, delta, (token,))] if delta else []

    def _thinker_next(self, session_id: str, state: SessionState) -> list[Output]:
        reply = state.reply
        with self._timed(state, "thinker_decode"):
            logits = self.thinker.decode(state.thinker, reply.tokens[-1])
        reply.fed += 1
        return self._take_token(session_id, state, int(logits.argmax()))

    def _talker_prefill(self, state: SessionState) -> list[Output]:
        reply, turn = state.reply, state.reply.turn
        # Drop the previous reply's part; the earlier user turns stay, the new ones are added.
        state.talker.crop(state.talker_history_length, state.talker_history_pos)
        turns = [*state.talker_backlog, turn.talker]
        user_ids = [i for t in turns for i in t.ids]
        grids = [g for t in turns for g in t.image_grids]
        header = self.thinker.token_embeds(assistant_start_ids(self.loaded.ids))
        first = self.thinker.token_embeds([reply.tokens[0]])
        embeds = torch.cat([*(e for t in turns for e in t.embeds), self.talker.assistant_prefix(header, first)], dim=1)
        ids = user_ids + [self.talker.tts_pad_id] * 9
        with self._timed(state, "talker_step"):
            logits, reply.last_hidden = self.talker.forward(state.talker, embeds, ids, grids)
        # From now on the cache holds every user turn: the next turn crops back to here.
        state.talker_history_length += len(user_ids)
        state.talker_history_pos = state.talker.next_pos - 9
        state.talker_backlog = []
        reply.talker_started = True
        return self._take_code0(state, self.talker.pick_code0(logits, reply.codes0))

    def _take_code0(self, state: SessionState, code: int) -> list[Output]:
        reply = state.reply
        reply.codes0.append(code)
        if code == self.talker.codec_eos:
            reply.talker_done, reply.talker_reason = True, "stop"
        elif len(reply.codes0) >= reply.talker_max_tokens:
            # generate() stops here too: the last codebook-0 token never gets residual codes.
            reply.talker_done, reply.talker_reason = True, "length"
        else:
            reply.pending_frame = True
        return []

    def _talker_next(self, session_id: str, state: SessionState) -> list[Output]:
        """Feed the last frame back to the talker with the next text-side entry -> codebook 0."""
        reply = state.reply
        outputs: list[Output] = []
        j = len(reply.codes0) - 1  # generate()'s generation_step
        # The thinker stays one token ahead: entry j needs reply token j + 1 (or the end).
        while not reply.thinker_done and len(reply.tokens) <= j + 1:
            outputs += self._thinker_next(session_id, state)
        n = len(reply.tokens)
        token_embed = None
        if j + 1 < n and not (reply.thinker_done and j + 1 == n - 1):
            token_embed = self.thinker.token_embeds([reply.tokens[j + 1]])
        with self._timed(state, "talker_step"):
            text_side = self.talker.text_side(token_embed, ended=j + 1 > n - 1)
            logits, reply.last_hidden = self.talker.forward(
                state.talker, reply.next_codec_embed + text_side, [self.talker.tts_pad_id], ()
            )
        return outputs + self._take_code0(state, self.talker.pick_code0(logits, reply.codes0))

    def _render_frame(self, session_id: str, state: SessionState) -> list[Output]:
        reply = state.reply
        reply.pending_frame = False
        code0 = reply.codes0[-1]
        with self._timed(state, "code_predictor"):
            residual, reply.next_codec_embed = self.talker.residual_codes(reply.last_hidden, code0)
        codes = [code0, *residual]
        reply.frame_codes.append(codes)
        with self._timed(state, "code2wav"):
            frame = torch.tensor(codes, dtype=torch.long, device=self.loaded.device).view(-1, 1)
            samples = reply.code2wav.push(frame)
        if self.record:
            reply.wav.append(samples.detach().float().cpu().numpy())
        pcm = to_pcm16(samples)
        reply.samples_out += len(pcm)
        if reply.first_audio is None:
            reply.first_audio = time.perf_counter() - reply.started
        return [AudioOut(session_id, pcm)] if len(pcm) else []

    def _finish(self, session_id: str, state: SessionState, reason: str) -> list[Output]:
        reply, turn = state.reply, state.reply.turn
        if not reason:
            capped = "length" in (reply.thinker_reason, reply.talker_reason)
            reason = "length" if capped else "stop"
        text_ids = [t for t in reply.tokens if t not in self.eos]
        if reply.prefilled:
            # The history keeps this reply as text: what the thinker has not fed yet, then the end.
            state.closing = [t for t in reply.tokens[reply.fed :] if t not in self.eos]
            state.closing += [self.loaded.ids.im_end, *self.loaded.ids.newline]
            if not reply.talker_started:  # its user turn is not in the talker cache yet
                state.talker_backlog.append(turn.talker)
        stats = {
            "prefill_tokens": turn.prefill_tokens if turn else 0,
            "history_reset": turn.history_reset if turn else False,
            "text_tokens": len(text_ids),
            "audio_frames": len(reply.frame_codes),
            "audio_samples": reply.samples_out,
            "context_tokens": state.thinker.length,
            "first_audio_seconds": reply.first_audio,
            "reply_seconds": time.perf_counter() - reply.started,
            "stage_seconds": dict(reply.stage_seconds),
        }
        if self.record:
            codes = np.array(reply.frame_codes, dtype=np.int64).T.reshape(self.talker.num_groups, -1)
            wav = np.concatenate(reply.wav) if reply.wav else np.zeros(0, dtype=np.float32)
            self.records[session_id] = ReplyRecord(tuple(text_ids), codes, wav, stats["prefill_tokens"])
        state.reply = None
        text = self.loaded.tokenizer.decode(text_ids, skip_special_tokens=True)
        outputs: list[Output] = []
        if text != reply.emitted_text:  # a split character held back at the very end
            outputs.append(TextDelta(session_id, text[len(reply.emitted_text) :], ()))
        return outputs + [ReplyDone(session_id, reason, text=text, stats=stats)]

    @contextmanager
    def _timed(self, state: SessionState, stage: str) -> Iterator[None]:
        """Time the block as a StageTime of the next step() output (and the reply's totals)."""
        started = time.perf_counter()
        yield
        elapsed = time.perf_counter() - started
        state.pending_stages.append((stage, elapsed))
        if state.reply is not None:
            state.reply.stage_seconds[stage] = state.reply.stage_seconds.get(stage, 0.0) + elapsed
