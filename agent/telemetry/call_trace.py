"""One call's trace: a root span for the call, a span per turn, and under it a span per stage, made
from the session's TurnRecords (agent/realtime/turn_timing.py) after each response, with the
times they were measured at (the engine's own timings ride as attributes of its spans).

    realtime.call (or the session's tracing.workflow_name)
      turn                                  end of speech -> response.done
        vad.speech                          speech_started -> end of speech
        turn.endpoint                       the silence waited (silence_ms, speculated)
        turn.admission                      end of turn -> response.created (ladder mode)
        engine.prefill                      -> the turn in the model (tokens; engine-timed ms)
        engine.first_output                 -> first audio (text) handed to the transport
        transport.first_packet              -> first sound out (WebRTC track; 0 on a WebSocket)
        reply                               -> response.done (status; a barge-in event)
        tool.call / mcp.call                a call's writing / an MCP call's run

Attributes carry ids, counts, names of tools and durations; never the user's words, the
model's text or any audio. Spans are made on the loop after the response has ended (ending a
span only queues it: agent/telemetry/otlp.py), so tracing never sits in a reply's path.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Optional

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from agent.realtime.turn_timing import TurnRecord

MAX_TURNS_KEPT = 16  # turns whose span a late MCP call may still join


class CallTrace:
    def __init__(self, tracer: Tracer, session_id: str, transport: str, model: str, tracing: Any = None) -> None:
        self._tracer = tracer
        self._offset_ns = time.time_ns() - time.monotonic_ns()  # monotonic -> epoch
        self._root = tracer.start_span(
            "realtime.call", attributes={"session.id": session_id, "transport": transport, "model": model}
        )
        self._session_id = session_id
        self._turns: OrderedDict[str, Span] = OrderedDict()
        self.name(tracing)

    @property
    def trace_id(self) -> str:
        return format(self._root.get_span_context().trace_id, "032x")

    def name(self, tracing: Any) -> None:
        """The session's `tracing` field: "auto" (the default name) or {workflow_name, group_id,
        metadata} naming and grouping the call's trace."""
        if not isinstance(tracing, dict):
            return
        if isinstance(tracing.get("workflow_name"), str) and tracing["workflow_name"]:
            self._root.update_name(tracing["workflow_name"])
        if isinstance(tracing.get("group_id"), str):
            self._root.set_attribute("tracing.group_id", tracing["group_id"])
        for key, value in (tracing.get("metadata") or {}).items():
            if isinstance(value, (str, int, float, bool)):
                self._root.set_attribute(f"tracing.metadata.{key}", value)

    def close(self) -> None:
        self._turns.clear()  # (each ended as it was made)
        self._root.end()

    # ---- from the turn timing ---------------------------------------------------------------
    def turn(self, record: TurnRecord) -> None:
        attributes: dict[str, Any] = {
            "session.id": self._session_id,
            "response.id": record.response_id,
            "response.status": record.status,
            "response.mode": record.mode,
            "response.audio": record.audio,
            "turn.speculated": record.speculated,
        }
        if record.item_id:
            attributes["item.id"] = record.item_id
        if record.reason:
            attributes["response.reason"] = record.reason
        for key in ("prefill_tokens", "context_tokens", "text_tokens", "audio_frames", "history_reset"):
            if isinstance(record.stats.get(key), (int, float, bool)):
                attributes[f"engine.{key}"] = record.stats[key]
        start = record.speech_started if record.speech_started is not None else record.start
        span = self._span("turn", start, max(record.done, record.first_sent or 0.0), self._root, attributes)
        self._turns[record.response_id] = span
        while len(self._turns) > MAX_TURNS_KEPT:
            self._turns.popitem(last=False)
        self._stages(record, span)
        for call in record.calls:
            self.call(call, span)

    def call(self, call: dict[str, Any], parent: Optional[Span] = None) -> None:
        """A tool call's span: the model writing it; an MCP call's run, when the agent ran it."""
        parent = parent or self._turns.get(call.get("response_id") or "") or self._root
        attributes = {"tool.name": call.get("name", ""), "tool.kind": call.get("kind", "")}
        if call.get("server_label"):
            attributes["mcp.server_label"] = call["server_label"]
        if "arguments_done" in call:
            self._span("tool.call", call["begun"], call["arguments_done"], parent, attributes)
        if "run_started" in call and "run_ended" in call:
            run = self._span("mcp.call", call["run_started"], call["run_ended"], parent, attributes, end=False)
            run.set_attribute("mcp.outcome", call.get("outcome", ""))
            if call.get("outcome") == "failed":
                run.set_status(Status(StatusCode.ERROR, "the MCP call failed"))
            run.end(end_time=self._ns(call["run_ended"]))

    # ---- spans ------------------------------------------------------------------------------
    def _stages(self, record: TurnRecord, turn: Span) -> None:
        if record.speech_started is not None and record.speech_ended is not None:
            self._span("vad.speech", record.speech_started, record.speech_ended, turn, {})
        if record.speech_ended is not None and record.speech_stopped is not None:
            attributes = {"endpoint.silence_ms": record.silence_ms, "endpoint.speculated": record.speculated}
            self._span("turn.endpoint", record.speech_ended, record.speech_stopped, turn, attributes)
        admitted_from = record.speech_stopped if record.speech_stopped is not None else record.created
        self._span("turn.admission", admitted_from, record.created, turn, {"ladder.mode": record.mode})
        if record.prefilled is not None:
            engine: dict[str, Any] = {}
            for key in ("prefill_seconds", "first_audio_seconds", "reply_seconds"):
                if isinstance(record.stats.get(key), (int, float)):
                    engine[f"engine.{key[:-8]}_ms"] = round(record.stats[key] * 1000, 1)
            for stage, seconds in record.stage_seconds.items():
                engine[f"engine.stage.{stage}_ms"] = round(seconds * 1000, 1)
            if "engine.prefill_ms" in engine:  # the rest of the span: the wait before the engine began it
                span_ms = (record.prefilled - record.created) * 1000
                engine["engine.queue_ms"] = round(max(0.0, span_ms - engine["engine.prefill_ms"]), 1)
            self._span("engine.prefill", record.created, record.prefilled, turn, engine)
        if record.prefilled is not None and record.first_output is not None:
            self._span("engine.first_output", record.prefilled, record.first_output, turn, {})
        if record.first_output is not None and record.first_sent is not None:
            self._span("transport.first_packet", record.first_output, record.first_sent, turn, {})
        reply_from = record.first_sent or record.first_output or record.created
        reply = self._span("reply", reply_from, max(record.done, reply_from), turn, {}, end=False)
        if record.barge_in_ms is not None:
            reply.add_event("barge_in", {"heard_ms": record.barge_in_ms}, timestamp=self._ns(record.done))
        reply.end(end_time=self._ns(max(record.done, reply_from)))

    def _span(
        self, name: str, start: float, stop: float, parent: Span, attributes: dict[str, Any], end: bool = True
    ) -> Span:
        """A span from `start` to `stop` (monotonic seconds) under `parent`; ended unless `end` is False."""
        span = self._tracer.start_span(
            name, context=trace.set_span_in_context(parent), start_time=self._ns(start), attributes=attributes
        )
        if end:
            span.end(end_time=self._ns(max(start, stop)))
        return span

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns
