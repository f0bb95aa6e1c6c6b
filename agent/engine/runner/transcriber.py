"""Live transcription of the user's speech by the Thinker itself, on the audio tokens the
incremental prefill already made (no second audio encode, no second model).

Each transcribing session has a transcript KV row (`Transcript.kv`): a row of the thinker's own
slot cache holding `[system: transcribe][user: <|audio_start|> audio tokens so far]`. The audio
tokens are read from the turn being spoken (`TurnState.audio_feats + pending_audio`, in order)
and appended to that row as they become final (one 13-token chunk per second of speech with
the default 1 s audio window). A partial is then one short run on top of it: the prompt's end
(`<|audio_end|>` + the instruction + the assistant header + the text already stable), a few
greedy decode steps, and a crop back to the audio, so the audio is prefilled once per turn.

Cadence: final tokens come once per 1 s chunk, so partials on them alone come once a second.
A partial also runs every `PARTIAL_EVERY_FRAMES` (0.5 s) of speech in between, on the
*provisional* tokens of the open chunk (`AudioBlockEncoder.provisional_batch`: the encoder's pass
over the not-yet-final frames, zero-padded as the end of a turn would pad them, for every
partial of the tick in one call). That is the one extra
encode: at most one pass over the open chunk per 0.5 s (half a chunk of frames), never over
audio whose tokens are final, and its tokens stay in the row only for that run (cropped with the
decode). They are not kept: the chunk's final tokens replace them once it is full.

Stable prefix (LocalAgreement-2): the tokens a run adds after the stable text are compared
with the previous run's; their common prefix becomes stable, and every later run is forced to
start with the stable tokens (they are prefilled, not decoded). So a stable prefix never
changes, only the tail after it may; the end of the turn makes one last, longer run. A turn
answered by a committed speculation is answered on a fork of it (TurnState.origin names the
turn it was copied from): the same turn here, so its final run keeps the stable prefix.

A conversation session transcribes in a row of its own (a second slot of the pool); a
transcription-only session has no conversation and uses its own slot's row (one slot, no
talker, no replies: the cheapest session there is); the slots come from the runner's sessions
table (agent/engine/runner/sessions.py), the commands that open and close transcripts from
agent/engine/runner/transcription.py. Scheduling: transcription runs after
everything else in a tick (StreamingRunner.step), so under load partials slow down first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from agent.engine.api import Output, TranscriptOut
from agent.engine.checkpoints.model import LoadedModel, assistant_start_ids, system_turn_ids
from agent.engine.stages.audio_stream import AudioBlockEncoder
from agent.engine.stages.thinker import ThinkerOps
from agent.engine.state.kv import KVState
from agent.engine.state.session import SessionState, TurnState

TRANSCRIBE_SYSTEM = "You are a speech recognizer. Write down exactly what the user says, nothing else."
TRANSCRIBE_ASK = "Transcribe the audio."
PARTIAL_TOKENS = 8  # new tokens a partial decodes past the stable text
PARTIAL_EVERY_FRAMES = 50  # mel frames (10 ms each) of speech between partials: 0.5 s (a divisor of a chunk)
FINAL_TOKENS = 48  # new tokens the end-of-turn run may decode


@dataclass
class Transcript:
    """One session's transcription state, owned by the Transcriber."""

    kv: KVState
    own_slot: int | None  # a slot taken for this (conversation sessions), given back at the end
    system_end: tuple[int, int] = (0, 0)  # the kv after the system prompt
    item_id: str | None = None  # the user item of the turn being spoken (set by the session)
    turn: TurnState | None = None  # the turn being transcribed
    turn_item: str | None = None  # its item id
    # Ended turns (and their items) waiting for their final run, oldest first: a turn held behind
    # a reply (interpreter pipelining) may end before the previous one's final has run. The end:
    # None for the whole turn, else its audio tokens up to where a user item ended inside it.
    finishing: list[tuple[TurnState, str | None, int | None]] = field(default_factory=list)
    # (turn, n): the turn's first n audio tokens are earlier user items' (item_ended), transcribed.
    skip: tuple[TurnState | None, int] = (None, 0)
    opened: bool = False  # the user header and <|audio_start|> are in the kv
    fed: int = 0  # final audio tokens of `turn` in the kv
    audio_end: tuple[int, int] = (0, 0)  # the kv after the audio fed so far
    stable: list[int] = field(default_factory=list)  # stable tokens
    tail: list[int] = field(default_factory=list)  # the previous run's tokens after them
    stable_text: str = ""
    runs_at: int = -1  # final audio tokens at the last partial
    frames_at: int = 0  # mel frames of the turn at the last partial


def _audio(turn: TurnState, start: int = 0, end: int | None = None) -> torch.Tensor | None:
    parts = [*turn.audio_feats, *turn.pending_audio]
    audio = torch.cat(parts, dim=0)[start:end] if parts else None
    return audio if audio is not None and audio.shape[0] else None


def _skip(tr: Transcript, turn: TurnState) -> int:
    """The audio tokens of `turn` (or of a speculation's fork of it) that earlier items took."""
    skipped, n = tr.skip
    return n if skipped is not None and (turn is skipped or turn.origin is skipped) else 0


class Transcriber:
    def __init__(self, loaded: LoadedModel, thinker: ThinkerOps) -> None:
        self.loaded, self.thinker = loaded, thinker
        self.ids = loaded.ids
        self.eos = set(loaded.thinker_eos_ids)
        self.system_ids = system_turn_ids(self.ids, loaded.tokenizer, TRANSCRIBE_SYSTEM)
        ask = loaded.tokenizer.encode(TRANSCRIBE_ASK, add_special_tokens=False)
        # After the audio: the instruction closes the user turn, then the assistant speaks.
        self.suffix_ids = [self.ids.audio_end, *ask, self.ids.im_end, *self.ids.newline, *assistant_start_ids(self.ids)]
        self.sessions: dict[str, Transcript] = {}

    # ---- lifecycle -------------------------------------------------------------------------

    @torch.inference_mode()
    def open(self, session_id: str, slot: int, own: bool) -> None:
        tr = Transcript(KVState(slot), slot if own else None)
        self.thinker.prefill(tr.kv, self.system_ids)
        tr.system_end = tr.audio_end = (tr.kv.length, tr.kv.next_pos)
        self.sessions[session_id] = tr

    def close(self, session_id: str) -> int | None:
        """Stop transcribing; returns the slot it had taken (None: it used the session's own)."""
        tr = self.sessions.pop(session_id, None)
        return None if tr is None else tr.own_slot

    def set_item(self, session_id: str, item_id: str) -> None:
        """The item id of the user turn about to be spoken."""
        tr = self.sessions.get(session_id)
        if tr is not None:
            tr.item_id = item_id

    def ended(self, session_id: str, turn: TurnState) -> None:
        """The turn being spoken has ended (answered, or committed in a transcription session):
        its final run comes once `turn`'s audio is complete."""
        tr = self.sessions.get(session_id)
        if tr is None:
            return
        if not turn.queued_seconds and not turn.audio_token_count:
            # No audio at all (a turn of text items): no item to transcribe. Its final run would
            # have transcribed nothing as the last spoken item, whose transcript it replaced.
            return
        # After an item ended inside the turn (its final run done or to come), what is left is
        # the item spoken since, if any.
        cut = _skip(tr, turn) or any(end is not None and _same_turn(t, turn) for t, _, end in tr.finishing)
        item = tr.item_id if cut else tr.turn_item if _same_turn(tr.turn, turn) else tr.item_id
        if item is None and cut:
            return  # its items were all transcribed as they ended (item_ended): no speech since
        if tr.turn is None:  # no partial yet (a short turn, or a busy engine)
            tr.turn, tr.turn_item = turn, item
        tr.finishing.append((turn, item, None))

    def item_ended(self, session_id: str, turn: TurnState) -> None:
        """A user item ended inside the turn being spoken (committed with no reply asked; its
        audio is encoded to the end: TurnPrefill.cut_audio): its final run comes now, over the
        turn's audio tokens so far, and the turn's later speech is the next item's."""
        tr = self.sessions.get(session_id)
        if tr is None:
            return
        item = tr.turn_item if _same_turn(tr.turn, turn) else tr.item_id
        if tr.turn is None:
            tr.turn, tr.turn_item = turn, item
        tr.finishing.append((turn, item, turn.audio_token_count))
        tr.item_id = None  # (the next item's speech names it: set_item)

    def discard(self, session_id: str) -> None:
        """The turn was dropped (a false start, input_audio_buffer.clear): no transcript."""
        tr = self.sessions.get(session_id)
        if tr is not None and not any(_same_turn(tr.turn, turn) for turn, *_ in tr.finishing):
            self._reset(tr)  # (an ended turn in the row is not the one dropped: it stays)

    def _reset(self, tr: Transcript) -> None:
        """The row back to the system prompt, for the next turn (ended turns stay queued)."""
        tr.kv.crop(*tr.system_end)
        tr.audio_end = tr.system_end
        tr.turn = None
        tr.turn_item, tr.fed, tr.runs_at, tr.frames_at, tr.opened = None, 0, -1, 0, False
        tr.stable, tr.tail, tr.stable_text = [], [], ""

    # ---- work ----------------------------------------------------------------------------------

    def _due(self, state: SessionState, tr: Transcript) -> str | None:
        """'final', 'partial' or None: what this session's transcript needs now."""
        while tr.finishing:
            turn, item, end = tr.finishing[0]
            if end is None and turn is state.turn:  # its reply was abandoned: the turn goes on
                tr.finishing.pop(0)
                continue
            waits = state.reply is not None and state.reply.turn is turn and not state.reply.prefill.done
            if end is None and waits:
                return None  # the audio tail is encoded by the reply's prefill
            if tr.turn is not turn and _same_turn(tr.turn, turn):
                # A committed speculation answered a fork of the row's turn (Replies.speculate):
                # the same turn, so its transcript goes on from the row's stable text, not over.
                # The row's audio stays: it holds final tokens of full chunks only, and the fork
                # makes the same ones (a copy of the same encoder on the same audio: audio that
                # reaches the turn after a fork discards the fork); its final run feeds the rest.
                tr.turn = turn
            elif tr.turn is not turn:  # the row holds no partial of it: start it over
                self._reset(tr)
                tr.turn, tr.turn_item = turn, item
            return "final"
        new_tokens = state.turn.audio_token_count - _skip(tr, state.turn)  # (the current item's)
        if tr.turn is None:
            if not new_tokens and state.turn.audio.encoder.open_frames < PARTIAL_EVERY_FRAMES:
                return None  # no speech to show yet
            tr.turn, tr.turn_item = state.turn, tr.item_id
        if tr.turn is not state.turn:
            return None
        if new_tokens > max(tr.runs_at, 0):
            return "partial"  # new final tokens
        encoder = state.turn.audio.encoder
        # The speech crossed a half-second mark since the last run (marks, not "0.5 s after the
        # last run": a run that came late does not push the next one later): the open chunk's
        # provisional tokens.
        if encoder.open_frames and encoder.frames_in // PARTIAL_EVERY_FRAMES > tr.frames_at // PARTIAL_EVERY_FRAMES:
            return "partial"
        return None

    def has_work(self, states: dict[str, SessionState]) -> bool:
        return any(sid in states and self._due(states[sid], tr) for sid, tr in self.sessions.items())

    @torch.inference_mode()
    def step(self, states: dict[str, SessionState]) -> list[Output]:
        """One run for every transcript that has new audio or whose turn ended, batched."""
        work = []
        for sid, tr in self.sessions.items():
            state = states.get(sid)
            due = self._due(state, tr) if state is not None else None
            if due is not None:
                work.append((sid, tr, tr.turn, due == "final"))
        # A final ends where its item ended (None: the turn's end); every run starts after the
        # tokens of the items before (`skip`).
        spans = [(_skip(tr, turn), tr.finishing[0][2] if final else None) for _, tr, turn, final in work]
        if not work:
            return []
        # A partial's provisional tokens: the open chunks of all partials in one encoder pass.
        partial = [(i, turn.audio.encoder) for i, (_, _, turn, final) in enumerate(work) if not final]
        tails: list[torch.Tensor | None] = [None] * len(work)
        for (i, _), tail in zip(partial, AudioBlockEncoder.provisional_batch([e for _, e in partial])):
            tails[i] = tail
        # One prefill per row, all rows in one forward: the new final audio tokens (they stay in
        # the row), then the provisional tokens, the prompt's end and the stable text (cropped
        # off after the run), then greedy decoding past it.
        jobs = []
        for (_, tr, turn, _), tail, (start, end) in zip(work, tails, spans):
            audio = _audio(turn, start, end)
            n = 0 if audio is None else int(audio.shape[0])
            tr.kv.crop(*tr.audio_end)
            kept = [] if tr.opened else [self.ids.im_start, *self.ids.user, *self.ids.newline, self.ids.audio_start]
            tr.opened = True
            feats = [audio[tr.fed :]] if n > tr.fed else []
            kept += [self.ids.audio_pad] * (n - tr.fed if n > tr.fed else 0)
            pads = [] if tail is None else [self.ids.audio_pad] * int(tail.shape[0])
            feats += [] if tail is None else [tail]
            job = self.thinker.start_prefill(
                tr.kv, kept + pads + self.suffix_ids + tr.stable, audio=torch.cat(feats) if feats else None
            )
            # Where the kept part ends: the row is cropped back to here after the run (text and
            # plain audio tokens take one position each).
            tr.audio_end = (tr.kv.length + len(kept), tr.kv.next_pos + len(kept))
            tr.fed, tr.runs_at, tr.frames_at = n, n, turn.audio.encoder.frames_in
            jobs.append((tr.kv, job, None))
        self.thinker.run_prefills(jobs)
        logits = torch.stack([job.result().last_logits for _, job, _ in jobs])
        limits = [FINAL_TOKENS if final else PARTIAL_TOKENS for *_, final in work]
        new: list[list[int]] = [[] for _ in work]
        live = list(range(len(work)))
        while live:
            tokens = logits.argmax(-1).tolist()
            still = []
            for row, token in zip(live, tokens):
                if token in self.eos:
                    continue
                new[row].append(token)
                if len(new[row]) < limits[row]:
                    still.append((row, token))
            live = [row for row, _ in still]
            if live:
                logits = self.thinker.decode([work[row][1].kv for row in live], [t for _, t in still])
        outputs: list[Output] = []
        for (sid, tr, turn, final), tail, (_, end) in zip(work, new, spans):
            outputs.append(self._publish(sid, tr, tail, final))
            if final:
                tr.finishing.pop(0)
                self._reset(tr)
                if end is not None:  # an item ended inside the turn: the rest is the next one's
                    tr.skip = (turn, end)
            else:
                tr.kv.crop(*tr.audio_end)
        return outputs

    def _publish(self, session_id: str, tr: Transcript, tail: Sequence[int], final: bool) -> TranscriptOut:
        decode = self.loaded.tokenizer.decode
        if final:
            tr.stable = tr.stable + list(tail)
            tr.tail = []
        else:
            agree = 0
            while agree < min(len(tail), len(tr.tail)) and tail[agree] == tr.tail[agree]:
                agree += 1
            tr.stable, tr.tail = tr.stable + list(tail[:agree]), list(tail[agree:])
        text = decode(tr.stable + tr.tail, skip_special_tokens=True)
        # A character split across tokens is not stable until its last byte is.
        stable = decode(tr.stable, skip_special_tokens=True).rstrip("\ufffd")
        if final:
            text = stable = text.rstrip("\ufffd")
        if len(stable) < len(tr.stable_text) or not stable.startswith(tr.stable_text):
            stable = tr.stable_text  # never take back stable text
        if not text.startswith(stable):
            text = stable + text[len(_common(stable, text)) :]
        tr.stable_text = stable
        return TranscriptOut(session_id, tr.turn_item, text, len(stable), final)


def _same_turn(row_turn: TurnState | None, turn: TurnState) -> bool:
    """`turn` is the row's turn, or a speculation's fork of it."""
    return row_turn is not None and (turn is row_turn or turn.origin is row_turn)


def _common(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]
