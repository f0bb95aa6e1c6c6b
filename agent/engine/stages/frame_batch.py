"""One engine tick's decode work for many sessions, each stage one batched call.

For the rows the scheduler picked: the thinker decodes one token for every reply that needs
one (text-only replies, and spoken ones whose talker is about to need the next text token: the
thinker stays exactly one token ahead), in one forward; the talker steps every speaking reply
in one forward; then every reply with a new codebook-0 token (these, plus replies whose prefill
just finished) gets its 15 residual codes from one batched code-predictor loop and its 1920
samples from one batched code2wav call. Rows carry their own cache lengths and positions, so
sessions at any point of their replies share the calls.

A batched stage is reported for every session in the batch as StageTime(stage, seconds,
session_id, batch=B) with the whole call's time: each of them waited for all of it (so a
per-session view, e.g. "code predictor time of this frame", stays right; the engine's cost
per tick is the step time).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from agent.decoding import Decoding
from agent.engine.api import AudioOut, CallDelta, Output, StageTime, TextDelta
from agent.engine.checkpoints.model import LoadedModel
from agent.engine.codecs.code2wav import SlotCode2Wav
from agent.engine.codecs.detok import IncrementalDecoder
from agent.engine.codecs.output_audio import to_pcm16
from agent.engine.compile.wiring import Graphing
from agent.engine.ops.sampling import THINKER, row_tensor
from agent.engine.stages.code_predictor import CodePredictorOps
from agent.engine.stages.talker import TalkerOps
from agent.engine.stages.thinker import ThinkerOps
from agent.engine.stages.token_choice import TokenChoice
from agent.engine.stages.tool_grammar import MAX_CALL_TOKENS, apply_masks
from agent.engine.state.session import SessionState, add_batch_time

Row = tuple[str, SessionState]


class FrameBatcher:
    def __init__(
        self,
        loaded: LoadedModel,
        thinker: ThinkerOps,
        talker: TalkerOps,
        slots: int,
        max_reply_tokens: int,
        record: bool,
        graphing: Graphing | None = None,
        decoding: Decoding = Decoding.greedy(),
    ) -> None:
        """decoding: the thinker's and the code predictor's token choice (the talker's is
        TalkerOps'); a sampled stage draws from each reply's own seed (ReplyState.seed)."""
        self.loaded, self.thinker, self.talker = loaded, thinker, talker
        self.decoding = decoding
        if decoding.thinker.repetition_penalty != 1.0 and thinker.ids is None:
            raise ValueError("a thinker repetition penalty needs ThinkerOps(track_ids=True)")
        self.predictor = CodePredictorOps(
            loaded.model.talker, loaded.device, loaded.dtype, graphing, sampling=decoding.code_predictor
        )
        self.thinker_choice = TokenChoice(
            "thinker_pick", decoding.thinker, THINKER, thinker.vocab, loaded.device, graphing
        )
        self.code2wav = SlotCode2Wav(loaded.model.code2wav, slots, graphing=graphing)
        self.max_reply_tokens = max_reply_tokens
        self.record = record
        self.eos = set(loaded.thinker_eos_ids)
        self.tool_call, self.tool_call_end = loaded.ids.tool_call, loaded.ids.tool_call_end
        # Per slot: the codebook-0 ids its reply has produced (generate()'s repetition penalty).
        self.seen = torch.zeros(slots, talker.vocab, dtype=torch.bool, device=loaded.device)
        self.stage_times: list[StageTime] = []  # batched stages of this tick, drained by the runner

    def capture_graphs(self) -> None:
        self.thinker_choice.capture_graphs()
        self.predictor.capture_graphs()
        self.code2wav.capture_graphs()

    def start_reply(self, state: SessionState) -> None:
        self.seen[state.slot] = False
        self.code2wav.reset(state.slot)

    @contextmanager
    def _batched(self, stage: str, rows: Sequence[Row]) -> Iterator[None]:
        started = time.perf_counter()
        yield
        elapsed = time.perf_counter() - started
        self.stage_times += [StageTime(stage, elapsed, sid, batch=len(rows)) for sid, _ in rows]
        add_batch_time([st for _, st in rows], stage, elapsed)

    # ---- text -------------------------------------------------------------------------------

    def pick_tokens(self, states: Sequence[SessionState], logits: torch.Tensor, first: bool = False) -> list[int]:
        """The next text token of each reply from the thinker's logits [B, vocab] (float32, not
        written to: a graph's output buffer), as generate()'s thinker picks it: repetition
        penalty over the session's whole context, no end token as the first one (a reply has
        at least one text token), the tool-call grammar of the rows it constrains, then argmax
        or the reply's seeded draw."""
        seen = self.thinker.seen([st.thinker for st in states]) if self.thinker_choice.penalizes else None
        if first:  # (masking before the penalty is the same: a penalized -inf stays -inf)
            logits = logits.index_fill(1, torch.tensor(sorted(self.eos), device=logits.device), float("-inf"))
        matchers = [st.reply.calls.matcher for st in states]
        if any(m is not None and m.constrained for m in matchers):
            logits = apply_masks(logits, matchers)  # one batched fill; unconstrained rows untouched
        banned = [i for i, st in enumerate(states) if st.reply.calls.banned]
        if banned:  # tool choice none: the model knows the tools but may not call one
            rows = torch.tensor(banned, device=logits.device)
            logits = logits.index_put((rows, torch.full_like(rows, self.tool_call)), torch.tensor(float("-inf")))
        seeds, draws = self._draws(states, [len(st.reply.text.tokens) for st in states])
        tokens = self.thinker_choice(logits, seen, seeds, draws).tolist()
        for matcher, token in zip(matchers, tokens):
            if matcher is not None:
                matcher.accept(token)  # free rows too: a <tool_call> the model picks starts the grammar
        return tokens

    def _draws(self, states: Sequence[SessionState], index: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' reply seeds and draw indices, on the device."""
        device = self.loaded.device
        return row_tensor([st.reply.seed for st in states], device), row_tensor(list(index), device)

    def take_token(self, session_id: str, state: SessionState, token: int) -> list[Output]:
        """Record the reply's next token and say what it adds: speech text (TextDelta), a tool
        call's text (CallDelta: never voiced, never in the transcript), or nothing."""
        reply = state.reply
        text, calls = reply.text, reply.calls
        text.tokens.append(token)
        if token in self.eos:
            text.done, text.reason = True, "stop"
            return []
        if calls.open:
            calls.tokens += 1
        if len(text.tokens) - calls.tokens >= self.max_reply_tokens or calls.tokens >= MAX_CALL_TOKENS:
            text.done, text.reason = True, "length"
        if state.thinker.length + 1 >= self.thinker.context_limit:
            # The cache is full (a turn started with room for the reply's reserve, then it went
            # past it): the reply ends here, as at its cap, rather than overflow the slot, which
            # failed the reply and lost the history with it. The next turn starts the history over.
            text.done, text.reason = True, "length"
        if token == self.tool_call and not calls.open and calls.matcher is not None:
            calls.open, calls.tokens = True, calls.tokens + 1
            calls.decoder = IncrementalDecoder(self.loaded.tokenizer)
            calls.count += 1
            if text.voice_end is None:
                # The talker reads no further: what follows is the call, not speech. A reply
                # that opens with a call never starts its talker (FirstAudio._first_tokens).
                text.voice_end = len(text.tokens) - 1
                if not text.voice_end and not reply.text_only:
                    reply.voice.done, reply.voice.reason = True, "stop"
            return []
        if calls.open:
            assert calls.decoder is not None
            if token == self.tool_call_end:
                calls.open = False
                return [CallDelta(session_id, calls.count - 1, calls.decoder.finish(), done=True)]
            delta = calls.decoder.push(token)
            return [CallDelta(session_id, calls.count - 1, delta)] if delta else []
        if text.voice_end is not None:
            return []  # between or after calls (the grammar allows a newline there): not speech
        assert text.decoder is not None
        delta = text.decoder.push(token)  # holds back a character split across tokens
        return [TextDelta(session_id, delta, (token,))] if delta else []

    def _needs_token(self, state: SessionState, first_pass: bool) -> bool:
        reply = state.reply
        if reply.text.done:
            return False
        if reply.text_only or reply.voice.done or reply.text.voice_end is not None:
            return first_pass  # one token per tick (the talker reads no more of them)
        # Talker entry j (= len(codes0) - 1) needs reply token j + 1 (or the end).
        return len(reply.text.tokens) <= len(reply.voice.codes0)

    def _thinker(self, rows: list[Row]) -> list[Output]:
        outputs: list[Output] = []
        first_pass = True
        while need := [(sid, st) for sid, st in rows if self._needs_token(st, first_pass)]:
            states = [st for _, st in need]
            with self._batched("thinker_decode", need):
                logits = self.thinker.decode([st.thinker for st in states], [st.reply.text.tokens[-1] for st in states])
                tokens = self.pick_tokens(states, logits)
            for (sid, st), token in zip(need, tokens):
                st.reply.text.fed += 1
                outputs += self.take_token(sid, st, token)
            first_pass = False
        return outputs

    # ---- codec ------------------------------------------------------------------------------

    def take_code0(self, states: Sequence[SessionState], logits: torch.Tensor) -> None:
        """Pick every row's codebook-0 token from its logits [B, vocab] and record it."""
        slots = torch.tensor([st.slot for st in states], device=logits.device)
        seeds, draws = self._draws(states, [len(st.reply.voice.codes0) for st in states])
        codes = self.talker.pick_code0(logits, self.seen.index_select(0, slots), seeds, draws)
        self.seen[slots, codes] = True
        for st, code in zip(states, codes.tolist()):
            reply = st.reply
            reply.voice.codes0.append(code)
            if code == self.talker.codec_eos:
                reply.voice.done, reply.voice.reason = True, "stop"
            elif len(reply.voice.codes0) >= reply.voice.max_tokens:
                # generate() stops here too: the last codebook-0 token never gets residual codes.
                reply.voice.done, reply.voice.reason = True, "length"
            else:
                reply.voice.pending_frame = True

    def _talker(self, rows: list[Row]) -> None:
        rows = [(sid, st) for sid, st in rows if not (st.reply.text_only or st.reply.voice.done)]
        if not rows:
            return
        states = [st for _, st in rows]
        fed: list[int] = []  # reply token fed on the text side, per row (-1: tts_eos / tts_pad)
        ended: list[bool] = []
        for st in states:
            reply = st.reply
            j = len(reply.voice.codes0) - 1  # generate()'s generation_step
            n, done = reply.text.talker_view()
            use = j + 1 < n and not (done and j + 1 == n - 1)
            fed.append(reply.text.tokens[j + 1] if use else -1)
            reply.voice.read += use
            ended.append(j + 1 > n - 1)
        with self._batched("talker_step", rows):
            ids = [t for t in fed if t >= 0]
            embeds = self.thinker.token_embeds(ids).transpose(0, 1) if ids else None
            rows_embeds, k = [], 0
            for t in fed:
                rows_embeds.append(embeds[k : k + 1] if t >= 0 else None)
                k += t >= 0
            text = self.talker.text_sides(rows_embeds, ended)
            codec = torch.cat([st.reply.voice.next_codec_embed for st in states], dim=0)
            logits, hidden = self.talker.step([st.talker for st in states], codec + text)
            for i, st in enumerate(states):
                st.reply.voice.last_hidden = hidden[i : i + 1]
            self.take_code0(states, logits)

    def decode(self, rows: list[Row]) -> list[Output]:
        """Advance the given replies: thinker token(s), then the talker's next codebook 0."""
        outputs = self._thinker(rows)
        self._talker(rows)
        return outputs

    def render(self, rows: list[Row], clock: float) -> list[Output]:
        """Residual codes and audio for every row with a pending frame; AudioOut in row order."""
        rows = [(sid, st) for sid, st in rows if st.reply.voice.pending_frame]
        if not rows:
            return []
        states = [st for _, st in rows]
        with self._batched("code_predictor", rows):
            hidden = torch.cat([st.reply.voice.last_hidden for st in states], dim=0)
            code0 = torch.tensor([st.reply.voice.codes0[-1] for st in states], device=hidden.device)
            # Frame j of a reply is codes0[j]'s: its residual codes are draws 15j..15j+14.
            seeds, frames = self._draws(states, [len(st.reply.voice.codes0) - 1 for st in states])
            codes, codec_sum = self.predictor.run(hidden, code0, seeds, frames)
            frame_codes = codes.tolist()
        with self._batched("code2wav", rows):
            wavs = self.code2wav.push([st.slot for st in states], codes.unsqueeze(-1))
            pcms = [to_pcm16(w) for w in wavs]
        outputs: list[Output] = []
        for i, ((sid, st), wav, pcm) in enumerate(zip(rows, wavs, pcms)):
            reply = st.reply
            reply.voice.pending_frame = False
            reply.voice.next_codec_embed = codec_sum[i : i + 1]
            reply.voice.frame_codes.append(frame_codes[i])
            if self.record:
                reply.voice.wav.append(wav.detach().float().cpu().numpy())
            reply.voice.samples_out += len(pcm)
            if reply.first_audio is None:
                reply.first_audio = clock - reply.started
            if len(pcm):
                reply.playout.add(clock, len(pcm) / self.loaded.output_rate)
                outputs.append(AudioOut(sid, pcm))
        return outputs
