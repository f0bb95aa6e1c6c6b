"""End-of-turn detection on the session's audio clock (the events it reports: agent/media/turn_events.py).

A voice detector (agent/media/voice.py: Silero by default, or webrtcvad) classifies each 20 ms
sub-frame of an 80 ms AudioChunk. A turn starts once
``min_speech_ms`` of voiced audio has gathered (short clicks and breaths never start one,
so there is no "aborted turn" event to undo), and ends when ``silence_ms`` of unvoiced audio
follow the last voiced sub-frame, or by force after ``max_turn_s``. Every time is read off
the audio clock, never the wall clock: the same audio always gives the same events.

Echo guard: while the agent is speaking (``echo()`` returns the level it plays, see
agent/media/echo.py), a turn, i.e. a barge-in, needs ``barge_in_ms`` of voiced audio with no
unvoiced gap over ``barge_in_gap_ms``, and with ``echo_margin_db`` set only sub-frames louder
than the agent's recent loudest frame plus that margin (negative: under it) count; voiced ones
under it neither count nor break the candidate. The agent's own voice coming back through the
microphone is quieter than what it sent, so it never starts a turn; a person talking over it
has enough syllables above it. Inside a turn nothing changes.

With ``semantic`` set (agent/media/semantic_turn.py), each pause in a turn is judged once for
completeness: a turn judged complete ends after the policy's short silence, one judged unfinished
waits for ``silence_ms`` as before.

With ``pause_ms`` set, a shorter unvoiced run inside a turn is reported as ``SpeechPaused``
(once per pause) and voice after it as ``SpeechResumed``: the session starts a speculative
reply on the first and discards it on the second (agent/engine/state/phase.py).

Barge-in candidates: while the agent plays, the first counted voiced sub-frame (above the echo
level: where the barge_in_ms count starts) is reported as ``BargeInCandidate`` as soon as it is
complete, per 20 ms sub-frame through peek() (not per 80 ms chunk), so the session can pause the
agent's voice at once; ``BargeInDropped`` follows if that candidate dies without becoming a turn
(a gap over barge_in_gap_ms, a discontinuity), ``SpeechStarted`` if it is confirmed.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable, Optional

import numpy as np

from agent.config import INPUT_RATE
from agent.media.echo import threshold_gain
from agent.media.ingest import CHUNK_SECONDS, AudioChunk
from agent.media.pauses import PauseModel
from agent.media.semantic_turn import SemanticEnd
from agent.media.turn_events import (
    BargeInCandidate,
    BargeInDropped,
    SpeechAudio,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
    SpeechStopped,
    TurnEvent,
)
from agent.media.voice import VoiceDetector, make_detector

SUBFRAME_MS = 20
SUBFRAME_SAMPLES = INPUT_RATE * SUBFRAME_MS // 1000  # 320
# webrtcvad calls the first few sub-frames of a stream speech while its noise model
# settles (white noise at -40 dBFS: the first 4-5 are "voiced"); ignore that warm-up.
WARMUP_SUBFRAMES = 5
# Speech has stops and short pauses between syllables and words; a barge-in over the agent's
# voice may have those ("wait, stop, that's not it": 150-250 ms at the commas), but not a longer
# hole (echo bursts are separated by the agent's own pauses). With 100 ms, such an interruption
# was three candidates and the turn kept only the last phrase.
BARGE_IN_GAP_MS = 300


class Endpointer:
    """Turns AudioChunks into SpeechStarted / SpeechAudio... / SpeechStopped events."""

    def __init__(
        self,
        silence_ms: int = 300,
        min_speech_ms: int = 120,
        aggressiveness: int = 2,
        max_turn_s: float = 30.0,
        preroll_ms: int = 300,
        min_level_dbfs: float = -55.0,
        vad: str = "silero",
        threshold: float = 0.5,
        barge_in_ms: int = 600,
        barge_in_gap_ms: int = BARGE_IN_GAP_MS,
        echo_margin_db: Optional[float] = -6.0,
        echo: Optional[Callable[[], Optional[float]]] = None,
        detector: Optional[VoiceDetector] = None,
        pause_ms: int = 0,
        pauses: Optional[PauseModel] = None,
        semantic: Optional[SemanticEnd] = None,
    ) -> None:
        """vad: "silero" or "webrtc" (aggressiveness: webrtcvad's mode; threshold: Silero's
        speech probability); detector overrides both. echo: the level (RMS, 0..1) the agent is
        playing now, None while it is silent; barge_in_ms / echo_margin_db: the guard (above),
        echo_margin_db None leaves the onset threshold alone. pause_ms: report SpeechPaused after
        this much unvoiced audio in a turn (0: never; only meaningful under silence_ms); pauses:
        learn that length from the speaker's own mid-turn pauses instead (agent/media/pauses.py;
        pause_ms is then its floor). semantic: end a turn judged complete sooner (above)."""
        assert silence_ms >= SUBFRAME_MS and min_speech_ms >= SUBFRAME_MS and max_turn_s > 0
        assert barge_in_ms >= SUBFRAME_MS
        self._pause_ms = pause_ms if 0 < pause_ms < silence_ms else 0
        self._paused = False  # a SpeechPaused went out and no voice came since
        self._pauses = pauses if self._pause_ms else None
        self.semantic = semantic
        self._vad = detector or make_detector(vad, aggressiveness, threshold)
        self._barge_in_ms = barge_in_ms
        self._barge_in_gap_ms = barge_in_gap_ms
        self._echo_gain = None if echo_margin_db is None else threshold_gain(echo_margin_db)
        self._echo = echo
        self._silence_ms = silence_ms
        self._min_speech_ms = min_speech_ms
        self._max_turn_s = max_turn_s
        self._preroll_s = preroll_ms / 1000
        # webrtcvad is nearly level-blind: a floor keeps faint hiss and hum out of "speech".
        self._min_rms = 10 ** (min_level_dbfs / 20)
        # Room for the pre-roll plus a slow candidate (voiced sub-frames spread over time).
        self._history: deque[AudioChunk] = deque(maxlen=math.ceil(self._preroll_s / CHUNK_SECONDS) + 16)
        self._subframes = 0
        # Sub-frames already classified by peek(), so push() feeds webrtcvad (which adapts
        # its noise model on every call) each sub-frame exactly once.
        self._peeked: dict[tuple[int, int], bool] = {}
        self._expected_index: Optional[int] = None
        # candidate (before a turn): first voiced time, voiced total, unvoiced run since
        self._onset: Optional[float] = None
        self._voiced_ms = 0
        self._unvoiced_ms = 0
        # A BargeInCandidate went out for the current candidate (peek() may announce a
        # sub-frame before push() counts it) and no BargeInDropped / SpeechStarted since.
        self._announced = False
        # turn
        self._in_turn = False
        self._turn_start = 0.0
        self._last_voiced_end = 0.0

    @property
    def in_turn(self) -> bool:
        return self._in_turn

    def recent(self, seconds: float) -> np.ndarray:
        """The last `seconds` of audio pushed (at most the pre-roll history), 16 kHz float."""
        pcm = [c.pcm for c in self._history]
        return np.concatenate(pcm)[-int(seconds * INPUT_RATE) :] if pcm else np.zeros(0, np.float32)

    def reset(self) -> None:
        """Forget any turn or candidate (the VAD's noise model is kept)."""
        self._history.clear()
        self._peeked.clear()
        self._expected_index = None
        self._reset_candidate()
        self._in_turn = False
        self._paused = False
        self._announced = False  # no BargeInDropped: a pause waiting on it ends by its own bound

    def peek(self, index: int, partial: np.ndarray) -> list[TurnEvent]:
        """Judge the complete 20 ms sub-frames of chunk `index`, still being filled.

        In a turn, only ends it (a voiced sub-frame waits for push()). The chunk that is
        still filling is then not part of the turn: it would only add silence the model
        does not need, and waiting for it would delay the end of turn by up to 60 ms.
        Before a turn, while the agent plays, only announces a barge-in candidate (push()
        still does the counting), so the agent can fall silent 20-60 ms sooner.
        """
        if self._expected_index is not None and index != self._expected_index:
            return []
        if not self._in_turn:
            return self._peek_candidate(index, partial)
        start = index * CHUNK_SECONDS
        pcm16 = np.clip(np.round(partial * 32768.0), -32768, 32767).astype(np.int16)
        events: list[TurnEvent] = []
        for k in range(len(pcm16) // SUBFRAME_SAMPLES):
            voiced = self._peek_voiced(index, k, pcm16)
            if voiced:
                return events
            t_end = start + (k + 1) * SUBFRAME_MS / 1000
            if self._silence_reached(t_end) or self._judged_complete(t_end, partial[: (k + 1) * SUBFRAME_SAMPLES]):
                return [*events, self._stop(at=t_end)]
            events += self._pause(t_end)
        return events

    def _peek_voiced(self, index: int, k: int, pcm16: np.ndarray) -> bool:
        voiced = self._peeked.get((index, k))
        if voiced is None:
            voiced = self._peeked[(index, k)] = self._voiced(pcm16[k * SUBFRAME_SAMPLES : (k + 1) * SUBFRAME_SAMPLES])
        return voiced

    def _peek_candidate(self, index: int, partial: np.ndarray) -> list[TurnEvent]:
        """BargeInCandidate at the first voiced sub-frame above the echo level while the agent
        plays. Counting stays with push(): if push() then judges that sub-frame differently
        (the played level moved), it reports BargeInDropped."""
        playing = None if self._announced or self._echo is None else self._echo()
        if playing is None:
            return []
        pcm16 = np.clip(np.round(partial * 32768.0), -32768, 32767).astype(np.int16)
        for k in range(len(pcm16) // SUBFRAME_SAMPLES):
            sub = pcm16[k * SUBFRAME_SAMPLES : (k + 1) * SUBFRAME_SAMPLES]
            voiced = self._peek_voiced(index, k, pcm16)
            if voiced and not self._under_echo(voiced, sub, playing):
                self._announced = True
                # push()'s arithmetic, so SpeechStarted.onset is the same float
                t_end = index * CHUNK_SECONDS + (k + 1) * SUBFRAME_MS / 1000
                onset = self._onset if self._onset is not None else t_end - SUBFRAME_MS / 1000
                return [BargeInCandidate(onset=onset)]
        return []

    def push(self, chunk: AudioChunk) -> list[TurnEvent]:
        """Classify one chunk; return the events it causes, in order.

        Decisions come at chunk granularity (80 ms): a stop whose silence completes in the
        chunk's first sub-frame is reported when the whole chunk has arrived, with ``at``
        still the exact sub-frame time.
        """
        events: list[TurnEvent] = []
        self._skip_gap(chunk, events)
        self._expected_index = chunk.index + 1

        pcm16 = np.clip(np.round(chunk.pcm * 32768.0), -32768, 32767).astype(np.int16)
        # What the agent plays, read once per chunk: only a turn's start depends on it.
        playing = None if self._in_turn or self._echo is None else self._echo()
        started_here = False
        stopped_here = False
        for k in range(len(pcm16) // SUBFRAME_SAMPLES):
            sub = pcm16[k * SUBFRAME_SAMPLES : (k + 1) * SUBFRAME_SAMPLES]
            t_end = chunk.start + (k + 1) * SUBFRAME_MS / 1000
            voiced = self._peeked.pop((chunk.index, k), None)
            if voiced is None:
                voiced = self._voiced(sub)
            if self._in_turn:
                if voiced:
                    t_start = t_end - SUBFRAME_MS / 1000
                    if self._pauses is not None:
                        self._pauses.resumed_after((t_start - self._last_voiced_end) * 1000)
                    if self._paused:
                        self._paused = False
                        events.append(SpeechResumed(at=t_start))
                    if self.semantic is not None:
                        self.semantic.voiced()
                    self._last_voiced_end = t_end
                elif self._silence_reached(t_end) or self._judged_complete(
                    t_end, chunk.pcm[: (k + 1) * SUBFRAME_SAMPLES]
                ):
                    # The chunk that completes the silence still belongs to the turn.
                    events.append(SpeechAudio(chunk))
                    events.append(self._stop(at=t_end))
                    stopped_here = True
                else:
                    events += self._pause(t_end)
            else:
                counting = self._onset is not None
                if self._candidate(voiced, t_end, playing, self._under_echo(voiced, sub, playing)) and not stopped_here:
                    events += self._start(chunk, t_end)
                    started_here = True
                elif counting and self._onset is None and self._announced:
                    self._announced = False
                    events.append(BargeInDropped(at=t_end))

        self._peeked = {key: v for key, v in self._peeked.items() if key[0] > chunk.index}
        if not self._in_turn:
            events += self._settle_candidate(chunk.end, playing)
        if self._in_turn:
            if not started_here:
                events.append(SpeechAudio(chunk))
                if self.semantic is not None:
                    self.semantic.add(chunk.pcm)
            if chunk.end - self._turn_start >= self._max_turn_s - 1e-9:
                events.append(self._stop(at=chunk.end, forced=True))
                # The speaker goes on: the next turn must not repeat this one's audio as pre-roll.
                self._history.clear()
                return events
        self._history.append(chunk)
        return events

    # -- classification ----------------------------------------------------------------

    def _voiced(self, sub: np.ndarray) -> bool:
        self._subframes += 1
        # Always feed the detector (each sub-frame once, in order): webrtcvad adapts its noise
        # model and Silero carries state from one window to the next, even when we overrule it.
        speech = self._vad.voiced(sub)
        if self._subframes <= WARMUP_SUBFRAMES:
            return False
        rms = math.sqrt(float(np.mean(np.square(sub.astype(np.float64))))) / 32768.0
        return speech and rms >= self._min_rms

    def _under_echo(self, voiced: bool, sub: np.ndarray, playing: Optional[float]) -> bool:
        """A voiced sub-frame no louder than the agent's echo could be, while it plays at level
        `playing` (None: it is silent)."""
        if not voiced or playing is None or self._echo_gain is None:
            return False
        rms = math.sqrt(float(np.mean(np.square(sub.astype(np.float64))))) / 32768.0
        return rms < playing * self._echo_gain

    # -- candidate -> turn ---------------------------------------------------------------

    def _candidate(self, voiced: bool, t_end: float, playing: Optional[float] = None, under_echo: bool = False) -> bool:
        """Track voiced audio before a turn; True once there is enough to start one (while the
        agent speaks: barge_in_ms of it, without an unvoiced gap over barge_in_gap_ms). A voiced
        sub-frame under the echo level neither counts nor breaks a candidate: a person talking
        over the agent has quieter syllables too, and the echo alone never adds anything."""
        barge_in = playing is not None
        if under_echo:
            return False
        if voiced:
            if self._onset is None:
                self._onset = t_end - SUBFRAME_MS / 1000
            self._voiced_ms += SUBFRAME_MS
            self._unvoiced_ms = 0
            need = max(self._barge_in_ms, self._min_speech_ms) if barge_in else self._min_speech_ms
            return self._voiced_ms >= need
        if self._onset is not None:
            self._unvoiced_ms += SUBFRAME_MS
            if self._unvoiced_ms >= (self._barge_in_gap_ms if barge_in else self._silence_ms):
                self._reset_candidate()
        return False

    def _settle_candidate(self, t: float, playing: Optional[float]) -> list[TurnEvent]:
        """After push(): announce a candidate peek() did not (its first voiced sub-frame was the
        chunk's last, or the agent's voice began under it); drop one peek() announced that
        push() did not count (judged under the echo level at the chunk's played level)."""
        if self._onset is not None and not self._announced and playing is not None:
            self._announced = True
            return [BargeInCandidate(onset=self._onset)]
        if self._onset is None and self._announced:
            self._announced = False
            return [BargeInDropped(at=t)]
        return []

    def _start(self, chunk: AudioChunk, t_end: float) -> list[TurnEvent]:
        assert self._onset is not None
        onset = self._onset
        preroll = [c for c in self._history if c.end > onset - self._preroll_s]
        turn_audio = preroll + [chunk]
        self._in_turn = True
        self._paused = False
        self._turn_start = turn_audio[0].start
        self._last_voiced_end = t_end  # the sub-frame that completed min_speech_ms
        self._reset_candidate()
        self._announced = False  # SpeechStarted confirms the candidate
        events: list[TurnEvent] = [SpeechStarted(at=self._turn_start, onset=onset)]
        events += [SpeechAudio(c) for c in turn_audio]
        if self.semantic is not None:
            self.semantic.start_turn()
            for c in turn_audio:
                self.semantic.add(c.pcm)
        return events

    def _reset_candidate(self) -> None:
        self._onset = None
        self._voiced_ms = 0
        self._unvoiced_ms = 0

    # -- turn end --------------------------------------------------------------------------

    def _silence_reached(self, t: float) -> bool:
        # Unvoiced since the last voiced sub-frame, so the silence is simply t - last voiced.
        return (t - self._last_voiced_end) * 1000 >= self._silence_ms - 1e-6

    def _judged_complete(self, t: float, tail: np.ndarray) -> bool:
        """The pause's judgment says the turn is over (semantic end of turn only)."""
        if self.semantic is None:
            return False
        return self.semantic.ends(t, (t - self._last_voiced_end) * 1000, tail)

    def _pause(self, t: float) -> list[TurnEvent]:
        """SpeechPaused, the first time an unvoiced run in the turn reaches pause_ms (or the
        length the pause model learned)."""
        if not self._pause_ms or self._paused:
            return []
        length_ms = self._pause_ms if self._pauses is None else self._pauses.threshold_ms
        if (t - self._last_voiced_end) * 1000 < length_ms - 1e-6:
            return []
        self._paused = True
        return [SpeechPaused(at=t, end_of_speech=self._last_voiced_end)]

    def _stop(self, at: float, forced: bool = False) -> SpeechStopped:
        self._in_turn = False
        self._paused = False
        self._reset_candidate()
        return SpeechStopped(at=at, end_of_speech=self._last_voiced_end, forced=forced)

    def _skip_gap(self, chunk: AudioChunk, events: list[TurnEvent]) -> None:
        """Chunks the audio clock skipped (a long network gap) count as silence."""
        expected = self._expected_index
        if expected is None or chunk.index <= expected:
            return
        gap_start = expected * CHUNK_SECONDS
        # Pre-roll and candidate do not survive a discontinuity.
        self._history.clear()
        self._reset_candidate()
        if self._announced:
            self._announced = False
            events.append(BargeInDropped(at=gap_start))
        if self._in_turn:
            at = self._last_voiced_end + self._silence_ms / 1000
            if at <= chunk.start:
                events.append(SpeechStopped(at=max(at, gap_start), end_of_speech=self._last_voiced_end))
                self._in_turn = False
                self._paused = False
