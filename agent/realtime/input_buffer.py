"""The session's input audio buffer: microphone audio onto the session clock, then either the
endpointer (server VAD: turns found in the audio) or, with turn_detection null, a bounded buffer
of uncommitted audio that input_audio_buffer.commit hands to the model at once."""

from __future__ import annotations

from typing import Callable, Optional

import av
import numpy as np

from agent.config import Config
from agent.media.ingest import CHUNK_SECONDS, AudioIn
from agent.media.pauses import pause_model
from agent.media.semantic_turn import CompletenessJudge, SemanticEnd
from agent.media.turn_events import TurnEvent
from agent.media.vad import Endpointer
from agent.realtime.session_config import TurnDetection


class InputBuffer:
    def __init__(
        self,
        config: Config,
        turn_detection: Optional[TurnDetection],
        echo: Optional[Callable[[], Optional[float]]] = None,
        judge: Optional[CompletenessJudge] = None,
    ) -> None:
        """echo: the level the agent is playing now (None: silent), for the echo guard; judge: the
        agent's end-of-turn judge (semantic_vad), None when it has none."""
        self.config = config
        self._echo = echo
        self._judge = judge
        self.audio_in = AudioIn()
        self.turn_detection = turn_detection
        self.endpointer = self._endpointer()
        self._manual: list[np.ndarray] = []  # 80 ms chunks, 16 kHz float
        self._max_chunks = int(config.max_turn_seconds / CHUNK_SECONDS)

    def _endpointer(self) -> Endpointer:
        td, c = self.turn_detection, self.config
        silence_ms = td.silence_ms if td else c.vad_silence_ms
        semantic = None
        if td is not None and td.semantic is not None:
            if self._judge is not None:
                semantic = SemanticEnd(self._judge, td.semantic)
            else:
                silence_ms = td.unjudged_silence_ms
        return Endpointer(
            silence_ms=silence_ms,
            min_speech_ms=c.vad_min_speech_ms,
            aggressiveness=c.vad_aggressiveness,
            max_turn_s=c.max_turn_seconds,
            preroll_ms=td.prefix_padding_ms if td else 300,
            vad=c.vad,
            threshold=c.vad_threshold,
            barge_in_ms=c.barge_in_ms,
            barge_in_gap_ms=c.barge_in_gap_ms,
            echo_margin_db=c.echo_margin_db if c.echo_guard else None,
            echo=self._echo,
            pause_ms=c.speculation_pause_ms,
            pauses=pause_model(c.speculation_pause_ms, silence_ms) if c.speculation_adaptive else None,
            semantic=semantic,
        )

    @property
    def manual(self) -> bool:
        return self.turn_detection is None

    @property
    def in_turn(self) -> bool:
        return not self.manual and self.endpointer.in_turn

    def push(self, frame: av.AudioFrame) -> list[TurnEvent]:
        """Feed one frame (any rate/layout); the endpointer's events (none in manual mode)."""
        events: list[TurnEvent] = []
        for chunk in self.audio_in.push(frame):
            if self.manual:
                if len(self._manual) < self._max_chunks:
                    self._manual.append(chunk.pcm)
            else:
                events += self.endpointer.push(chunk)
        if not self.manual:
            events += self.endpointer.peek(*self.audio_in.partial)
        return events

    def recent(self, seconds: float) -> np.ndarray:
        """The last `seconds` of microphone audio under turn detection (at most the pre-roll kept)."""
        return self.endpointer.recent(seconds)

    def buffered_ms(self) -> int:
        return int(len(self._manual) * CHUNK_SECONDS * 1000)

    def take(self) -> list[np.ndarray]:
        """The uncommitted audio (manual mode), emptying the buffer."""
        chunks, self._manual = self._manual, []
        return chunks

    def reset(self) -> None:
        """Forget the turn or the uncommitted audio."""
        self._manual = []
        self.endpointer.reset()

    def set_turn_detection(self, td: Optional[TurnDetection]) -> None:
        self.turn_detection = td
        self._manual = []
        self.endpointer = self._endpointer()
