"""Where one turn's time went, read from the session's own server events as they go out (an
Outbox tap): from the end of the user's speech to the reply's first sound leaving the agent.

Each response ends in a `TurnRecord` (monotonic marks, and the engine's own timings from the
response's `omni` fields), sent to the client as `omni.turn_timing` right after its
`response.done`, and handed to the call's trace (agent/telemetry/call_trace.py) when tracing is
on. The stages follow each other, so they add up to the agent's voice-to-voice:

- `endpoint`: the silence the endpointer waited after the speech ended (speech_stopped's
  `omni.silence_ms`; 0 for a turn ended by a commit or a text message);
- `admission`: the end of the turn to the response's creation (commit, admission, the plan);
- `prefill`: to the engine's end of the turn's prefill (its ReplyInput on the loop);
- `first_output`: to the first audio (a text reply: the first text) handed to the transport;
- `transport`: to the first sound leaving the agent (WebRTC: the track's first frame of the
  reply, output_audio_buffer.started; a WebSocket sends the delta itself: 0).

Nothing here reads the user's words or audio: marks, ids and counts only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

STAGES = ("endpoint", "admission", "prefill", "first_output", "transport")


@dataclass
class TurnRecord:
    """One response's turn. Times are time.monotonic() seconds; None: did not happen."""

    response_id: str
    created: float
    done: float
    item_id: Optional[str] = None  # the user item it answers (a spoken turn)
    speech_started: Optional[float] = None
    speech_ended: Optional[float] = None  # the end of the speech (speech_stopped less the silence)
    speech_stopped: Optional[float] = None  # the endpointer's decision
    silence_ms: float = 0.0
    speculated: bool = False  # a speculative reply was ready at the decision
    prefilled: Optional[float] = None
    first_output: Optional[float] = None  # at the transport (audio, else text)
    first_sent: Optional[float] = None  # left the agent
    status: str = ""
    reason: Optional[str] = None
    mode: str = ""
    audio: bool = False
    stats: dict[str, Any] = field(default_factory=dict)  # the engine's (response.done omni.stats)
    stage_seconds: dict[str, float] = field(default_factory=dict)  # engine thread time per stage
    calls: list[dict[str, Any]] = field(default_factory=list)  # tool and MCP calls: name, kind, times
    barge_in_ms: Optional[int] = None  # a barge-in's truncation point (audio heard), if any

    @property
    def start(self) -> float:
        return self.speech_ended if self.speech_ended is not None else self.created

    def stages_ms(self) -> dict[str, Optional[float]]:
        """Each stage's length (ms); None for a stage the turn did not reach."""
        marks = [
            self.speech_ended,
            self.speech_stopped,
            self.created,
            self.prefilled,
            self.first_output,
            self.first_sent,
        ]
        if self.speech_ended is None:  # no speech: the turn begins at the response
            marks[0] = marks[1] = self.created
        out: dict[str, Optional[float]] = {}
        for name, a, b in zip(STAGES, marks, marks[1:]):
            out[name] = None if a is None or b is None else round(max(0.0, b - a) * 1000, 1)
        return out

    def event(self) -> dict[str, Any]:
        stages = self.stages_ms()
        reached = [v for v in stages.values() if v is not None]
        return {
            "type": "omni.turn_timing",
            "response_id": self.response_id,
            "item_id": self.item_id,
            "stages": stages,
            "total_ms": round(sum(reached), 1) if stages["transport"] is not None else None,
            "speculated": self.speculated,
            "engine": {
                "prefill_ms": _ms(self.stats.get("prefill_seconds")),
                "first_audio_ms": _ms(self.stats.get("first_audio_seconds")),
                "reply_ms": _ms(self.stats.get("reply_seconds")),
                "prefill_tokens": self.stats.get("prefill_tokens"),
            },
        }


def _ms(seconds: Any) -> Optional[float]:
    return round(seconds * 1000, 1) if isinstance(seconds, (int, float)) else None


class TurnTiming:
    """The tap: `see(event, text)` for every server event of one session. `emit` sends the
    timing event; `on_turn` (tracing) gets each record once its response has ended (a spoken
    WebRTC reply's: once its first sound has left too), `on_call` each MCP call that ends after."""

    def __init__(
        self,
        emit: Callable[[dict[str, Any]], None],
        webrtc: bool,
        on_turn: Optional[Callable[[TurnRecord], None]] = None,
        on_call: Optional[Callable[[dict[str, Any]], None]] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._emit, self._on_turn, self._on_call, self._clock = emit, on_turn, on_call, clock
        self._webrtc = webrtc  # a spoken reply leaves on the track (output_audio_buffer.started)
        self._speech: dict[str, Any] = {}  # the latest spoken turn's marks, until a response takes them
        self._open: dict[str, TurnRecord] = {}  # responses not ended yet
        self._waiting: dict[str, TurnRecord] = {}  # ended, their first sound not yet out (WebRTC)
        self._sounded: dict[str, float] = {}  # response id -> its first sound out (WebRTC)
        self._calls: dict[str, dict[str, Any]] = {}  # call item id -> its call, until it ends

    def see(self, event: dict[str, Any], _text: str = "") -> None:
        handler = _HANDLERS.get(event.get("type", ""))
        if handler is not None:
            handler(self, event, self._clock())

    def close(self) -> None:
        self._on_turn = self._on_call = None

    # ---- the handlers -----------------------------------------------------------------------
    def _speech_started(self, event: dict[str, Any], now: float) -> None:
        self._speech = {"item_id": event.get("item_id"), "started": now}

    def _speech_stopped(self, event: dict[str, Any], now: float) -> None:
        omni = event.get("omni") or {}
        silence = float(omni.get("silence_ms") or 0)
        self._speech.update(
            item_id=event.get("item_id"),
            stopped=now,
            ended=now - silence / 1000,
            silence_ms=silence,
            speculated=bool(omni.get("speculated")),
        )

    def _created(self, event: dict[str, Any], now: float) -> None:
        response = event.get("response") or {}
        mode = (event.get("omni") or {}).get("mode", "")
        record = TurnRecord(response.get("id", ""), created=now, done=now, mode=mode)
        record.audio = response.get("output_modalities") == ["audio"]
        speech, self._speech = self._speech, {}
        if "stopped" in speech:  # the spoken turn this response answers
            record.item_id = speech.get("item_id")
            record.speech_started, record.speech_stopped = speech.get("started"), speech["stopped"]
            record.speech_ended, record.silence_ms = speech["ended"], speech["silence_ms"]
            record.speculated = speech["speculated"]
        self._open[record.response_id] = record

    def _sound_out(self, event: dict[str, Any], now: float) -> None:
        response_id = event.get("response_id", "")
        record = self._waiting.pop(response_id, None)
        if record is not None:  # its response.done came first: it is reported now
            record.first_sent = now
            self._report(record)
        elif response_id in self._open:
            self._sounded[response_id] = now

    def _call_added(self, event: dict[str, Any], now: float) -> None:
        item = event.get("item") or {}
        if item.get("type") in ("function_call", "mcp_call", "mcp_approval_request"):
            self._calls[item.get("id", "")] = {
                "kind": item["type"],
                "name": item.get("name", ""),
                "server_label": item.get("server_label"),
                "response_id": event.get("response_id"),
                "begun": now,
            }

    def _args_done(self, event: dict[str, Any], now: float) -> None:
        call = self._calls.get(event.get("item_id", ""))
        if call is not None:
            call["arguments_done"] = now

    def _mcp_state(self, event: dict[str, Any], now: float) -> None:
        call = self._calls.get(event.get("item_id", ""))
        if call is None:
            return
        if event["type"] == "response.mcp_call.in_progress":
            call["run_started"] = now
            return
        call["run_ended"], call["outcome"] = now, event["type"].rsplit(".", 1)[-1]
        if call.get("reported"):  # its response has ended: the call is told on its own
            self._calls.pop(event.get("item_id", ""), None)
            if self._on_call is not None:
                self._on_call(call)

    def _done(self, event: dict[str, Any], now: float) -> None:
        response = event.get("response") or {}
        record = self._open.pop(response.get("id", ""), None)
        if record is None:
            return
        record.done = now
        record.status = response.get("status", "")
        record.reason = (response.get("status_details") or {}).get("reason")
        omni = response.get("omni") or {}
        record.stats = dict(omni.get("stats") or {})
        record.stage_seconds = dict(omni.get("stage_seconds") or {})
        if omni.get("prefill_ms") is not None:
            record.prefilled = record.created + omni["prefill_ms"] / 1000
        first = omni.get("ttfa_ms") if record.audio and omni.get("ttfa_ms") is not None else omni.get("ttft_ms")
        if first is not None:
            record.first_output = record.created + first / 1000
        record.barge_in_ms = omni.get("heard_ms") if record.reason == "turn_detected" else None
        record.calls = [c for c in self._calls.values() if c["response_id"] == record.response_id]
        sounded = self._sounded.pop(record.response_id, None)
        if not (self._webrtc and record.audio and omni.get("ttfa_ms") is not None):
            record.first_sent = record.first_output  # (a WebSocket's delta is the send itself)
        elif sounded is not None:
            record.first_sent = sounded
        elif record.status == "completed" or record.status == "incomplete":
            self._waiting[record.response_id] = record  # its first sound is still queued
            while len(self._waiting) > 8:
                self._report(self._waiting.pop(next(iter(self._waiting))))
            return
        self._report(record)

    def _report(self, record: TurnRecord) -> None:
        self._emit(record.event())
        if self._on_turn is not None:
            self._on_turn(record)
        for call in record.calls:  # a call still running is told when it ends (on_call)
            call["reported"] = True
            if "run_started" not in call or "run_ended" in call:
                self._calls = {k: v for k, v in self._calls.items() if v is not call}


_HANDLERS: dict[str, Callable[[TurnTiming, dict[str, Any], float], None]] = {
    "input_audio_buffer.speech_started": TurnTiming._speech_started,
    "input_audio_buffer.speech_stopped": TurnTiming._speech_stopped,
    "response.created": TurnTiming._created,
    "output_audio_buffer.started": TurnTiming._sound_out,
    "response.output_item.added": TurnTiming._call_added,
    "response.function_call_arguments.done": TurnTiming._args_done,
    "response.mcp_call_arguments.done": TurnTiming._args_done,
    "response.mcp_call.in_progress": TurnTiming._mcp_state,
    "response.mcp_call.completed": TurnTiming._mcp_state,
    "response.mcp_call.failed": TurnTiming._mcp_state,
    "response.done": TurnTiming._done,
}
