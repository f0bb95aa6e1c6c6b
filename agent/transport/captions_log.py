"""One call's caption timeline, and its rendering as WebVTT.

The timeline is built from the call's own server events as they go out (the same events the
overlay reads): a user cue per input item (speech_started → speech_stopped, its text from the
input transcription, partials replaced by the completed transcript) and an agent cue per
response (from when its audio starts playing, or its first transcript delta when it has no
audio, to when the audio stops; the text from the reply transcript). Times are seconds on the
server's monotonic clock; the WebVTT is relative to the call's start.

Memory is bounded per call: past `max_chars` of text the oldest cues are dropped (a NOTE in
the file says how many), so a call that runs for days holds about the last few hours.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

USER, AGENT = "user", "agent"
MAX_CHARS = 200_000  # about 30 000 words: hours of talk, both sides
MAX_CUE_CHARS = 4_000  # one turn; a runaway hypothesis is cut, not stored whole
MAX_CUES = 5_000  # turns with no text (speech that transcribed to nothing) count too
_RECENT_IDS = 256  # item and response ids still looked up: later events name recent ones only
MIN_CUE_S = 0.5  # a player hides a cue shorter than this before it can be read

_BLANK_LINES = re.compile(r"\s*\n\s*")


@dataclass
class Cue:
    speaker: str
    start: float
    end: Optional[float] = None  # None: still open (speaking, or the reply still playing)
    text: str = ""
    seq: int = 0  # creation order: ties on start keep it
    audio: bool = False  # an agent cue whose audio started: it ends when the audio stops


@dataclass
class CallCaptions:
    call_id: str
    started: float  # monotonic seconds: the call's start, time zero of the WebVTT
    scope: Optional[str] = None  # who made the call (caption_book.scope_of)
    max_chars: int = MAX_CHARS
    ended: Optional[float] = None
    cues: list[Cue] = field(default_factory=list)
    dropped: int = 0  # cues dropped for the memory bound
    # Item or response id → its cue, for the recent ones (an event may come after the cue ended:
    # a transcript's done after its audio stopped).
    _ids: "OrderedDict[str, Cue]" = field(default_factory=OrderedDict)
    _chars: int = 0
    _seq: int = 0

    # ---- building ---------------------------------------------------------------------------
    def record(self, event: dict[str, Any], at: float) -> None:
        """Take one server event of the call, sent at monotonic time `at`."""
        kind = event.get("type")
        if kind == "input_audio_buffer.speech_started":
            self._cue(USER, event.get("item_id"), at)
        elif kind == "input_audio_buffer.speech_stopped":
            cue = self._cue(USER, event.get("item_id"), at)
            if cue is not None:
                cue.end = at
        elif kind in ("conversation.item.input_audio_transcription.delta", "omni.input_audio_transcription.partial"):
            cue = self._cue(USER, event.get("item_id"), at)
            omni = event.get("omni")
            if cue is not None and isinstance(omni, dict) and isinstance(omni.get("text"), str):
                self._set_text(cue, omni["text"])  # the whole hypothesis, stable part and tail
            elif cue is not None and isinstance(event.get("delta"), str):
                self._set_text(cue, cue.text + event["delta"])
        elif kind == "conversation.item.input_audio_transcription.completed":
            cue = self._cue(USER, event.get("item_id"), at)
            if cue is not None:
                self._set_text(cue, str(event.get("transcript") or ""))
                cue.end = at if cue.end is None else cue.end
        elif kind == "conversation.item.input_audio_transcription.failed":
            cue = self._ids.get(str(event.get("item_id")))
            if cue is not None and cue.end is None:
                cue.end = at
        elif kind in ("response.output_audio_transcript.delta", "response.output_text.delta"):
            cue = self._cue(AGENT, event.get("response_id"), at)
            if cue is not None and isinstance(event.get("delta"), str):
                self._set_text(cue, cue.text + event["delta"])
        elif kind in ("response.output_audio_transcript.done", "response.output_text.done"):
            cue = self._cue(AGENT, event.get("response_id"), at)
            final = event.get("transcript", event.get("text"))
            if cue is not None and isinstance(final, str):
                self._set_text(cue, final)
        elif kind == "output_audio_buffer.started":
            cue = self._cue(AGENT, event.get("response_id"), at)
            if cue is not None and not cue.audio:
                # Heard from now: the transcript runs ahead of the voice.
                cue.audio, cue.start = True, at
        elif kind in ("output_audio_buffer.stopped", "output_audio_buffer.cleared"):
            cue = self._ids.get(str(event.get("response_id")))
            if cue is not None and cue.end is None:
                cue.end = at
        elif kind == "response.done":
            response = event.get("response")
            cue = self._ids.get(str(response.get("id"))) if isinstance(response, dict) else None
            if cue is not None and cue.end is None and not cue.audio:  # no audio played: done is its end
                cue.end = at

    def end(self, at: float) -> None:
        """The call ended: every open cue ends now."""
        self.ended = at
        for cue in self.cues:
            if cue.end is None:
                cue.end = at
        self._ids.clear()

    def _cue(self, speaker: str, key: Any, at: float) -> Optional[Cue]:
        """The cue of an item or response id, made (starting at `at`) on its first event."""
        if not isinstance(key, str) or not key or self.ended is not None:
            return None
        cue = self._ids.get(key)
        if cue is None or cue.speaker != speaker:
            self._seq += 1
            cue = Cue(speaker, at, seq=self._seq)
            self._ids[key] = cue
            while len(self._ids) > _RECENT_IDS:
                self._ids.popitem(last=False)
            self.cues.append(cue)
            self._bound()
        return cue

    def _set_text(self, cue: Cue, text: str) -> None:
        text = text[:MAX_CUE_CHARS]
        self._chars += len(text) - len(cue.text)
        cue.text = text
        self._bound()

    def _bound(self) -> None:
        while (self._chars > self.max_chars or len(self.cues) > MAX_CUES) and len(self.cues) > 1:
            old = self.cues.pop(0)
            self._chars -= len(old.text)
            old.text = ""  # a late event for it changes nothing counted
            self.dropped += 1
            for key in [k for k, c in self._ids.items() if c is old]:
                del self._ids[key]

    # ---- WebVTT -----------------------------------------------------------------------------
    def vtt(self, now: float) -> str:
        """The timeline as a WebVTT file; open cues end at `now` (a running call)."""
        lines = ["WEBVTT", "", f"NOTE call {self.call_id}: times from the call's start", ""]
        if self.dropped:
            lines += [
                f"NOTE {self.dropped} earlier cues were dropped (the agent keeps the last {self.max_chars} characters)",
                "",
            ]
        shown = sorted((c for c in self.cues if c.text.strip()), key=lambda c: (c.start, c.seq))
        for n, cue in enumerate(shown, 1):
            start = max(0.0, cue.start - self.started)
            end = (cue.end if cue.end is not None else (self.ended if self.ended is not None else now)) - self.started
            end = max(end, start + MIN_CUE_S)
            lines += [
                f"{cue.speaker}-{n}",
                f"{timestamp(start)} --> {timestamp(end)}",
                voice(cue.speaker, cue.text),
                "",
            ]
        return "\n".join(lines) + "\n"


def timestamp(seconds: float) -> str:
    """WebVTT's `HH:MM:SS.mmm` (hours grow past 99 rather than wrap)."""
    ms = max(0, round(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}.{ms:03d}"


def escape(text: str) -> str:
    """Cue text as WebVTT wants it: `&`, `<` and `>` as entities (so a said `-->` or `<b>` is
    text, not a timing line or a tag) and no blank line, which would end the cue."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _BLANK_LINES.sub("\n", text.strip())


def voice(speaker: str, text: str) -> str:
    """`<v speaker>text`: the speaker as a WebVTT voice span (the names are ours: user, agent)."""
    return f"<v {speaker}>{escape(text)}"
