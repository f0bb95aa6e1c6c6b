"""Where a turn's time went (agent/realtime/turn_timing.py) and how its spans leave the agent
(agent/telemetry/otlp.py BoundedExport), from synthetic events on a fake clock:

- a spoken turn's stages follow each other from the end of speech (speech_stopped less the
  silence the endpointer waited) through the decision, the response's creation, its prefill
  and first output (response.done's omni) to the first sound out, and add up to the total;
- on a WebSocket the first delta is the send (transport 0); on WebRTC the first sound is the
  track's output_audio_buffer.started, which may come after response.done (the timing then
  waits for it); a text turn without speech starts at its response;
- a cancelled reply reports at once, with what was heard; an MCP call that ends after its
  response is told on its own;
- the exporter's queue is bounded: spans past it are dropped and counted, a failed export's
  spans are counted as dropped, the rest as exported; a flush sends what waits;
- a collector that stays down is logged once a minute, not at every retry.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from agent import metrics
from agent.realtime.turn_timing import TurnTiming


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _drive(webrtc: bool, after_done: bool = False) -> tuple[list[dict], list[Any]]:
    clock, sent, records = Clock(), [], []
    timing = TurnTiming(sent.append, webrtc, on_turn=records.append, clock=clock)

    def at(t: float, event: dict) -> None:
        clock.t = t
        timing.see(event)

    at(100.0, {"type": "input_audio_buffer.speech_started", "item_id": "item_1"})
    at(
        101.5,
        {
            "type": "input_audio_buffer.speech_stopped",
            "item_id": "item_1",
            "omni": {"silence_ms": 300, "speculated": True},
        },
    )
    at(101.51, {"type": "response.created", "response": {"id": "resp_1", "output_modalities": ["audio"]}})
    if not after_done:
        at(101.70, {"type": "output_audio_buffer.started", "response_id": "resp_1"})
    done = {
        "type": "response.done",
        "response": {
            "id": "resp_1",
            "status": "completed",
            "omni": {"prefill_ms": 90.0, "ttfa_ms": 150.0, "ttft_ms": 120.0, "stats": {"prefill_seconds": 0.08}},
        },
    }
    at(103.0, done)
    if after_done:
        assert not sent  # the first sound has not left yet
        at(103.1, {"type": "output_audio_buffer.started", "response_id": "resp_1"})
    return sent, records


def test_a_spoken_turns_stages_add_up() -> None:
    sent, records = _drive(webrtc=True)
    (event,) = sent
    assert event["type"] == "omni.turn_timing" and event["response_id"] == "resp_1" and event["item_id"] == "item_1"
    stages = event["stages"]
    assert stages == {"endpoint": 300.0, "admission": 10.0, "prefill": 90.0, "first_output": 60.0, "transport": 40.0}
    assert event["total_ms"] == sum(stages.values()) == 500.0
    assert event["speculated"] is True and event["engine"]["prefill_ms"] == 80.0
    assert records[0].speech_started == 100.0 and records[0].speech_ended == 101.2


def test_websocket_and_late_first_sound() -> None:
    sent, _ = _drive(webrtc=False)
    assert sent[0]["stages"]["transport"] == 0.0  # the delta is the send
    sent, _ = _drive(webrtc=True, after_done=True)
    assert sent[0]["stages"]["transport"] == round((103.1 - 101.66) * 1000, 1)


def test_text_turn_cancel_and_a_late_mcp_call() -> None:
    clock, sent, calls = Clock(), [], []
    timing = TurnTiming(sent.append, True, on_call=calls.append, clock=clock)
    timing.see({"type": "response.created", "response": {"id": "resp_t", "output_modalities": ["text"]}})
    item = {"type": "mcp_call", "id": "item_m", "name": "forecast", "server_label": "desk"}
    timing.see({"type": "response.output_item.added", "response_id": "resp_t", "item": item})
    timing.see({"type": "response.mcp_call.in_progress", "item_id": "item_m"})
    clock.t = 100.2
    timing.see(
        {
            "type": "response.done",
            "response": {"id": "resp_t", "status": "completed", "omni": {"ttft_ms": 50.0, "prefill_ms": 20.0}},
        }
    )
    assert sent[0]["stages"]["endpoint"] == 0.0 and sent[0]["stages"]["first_output"] == 30.0
    assert not calls
    clock.t = 100.9
    timing.see({"type": "response.mcp_call.completed", "item_id": "item_m"})
    assert calls and calls[0]["outcome"] == "completed" and calls[0]["run_ended"] == 100.9
    timing.see({"type": "response.created", "response": {"id": "resp_c", "output_modalities": ["audio"]}})
    done = {
        "id": "resp_c",
        "status": "cancelled",
        "status_details": {"reason": "turn_detected"},
        "omni": {"heard_ms": 640},
    }
    timing.see({"type": "response.done", "response": done})
    assert sent[-1]["response_id"] == "resp_c" and sent[-1]["total_ms"] is None  # reported at once


class _Exporter(SpanExporter):
    def __init__(self, ok: bool) -> None:
        self.ok, self.got = ok, 0

    def export(self, spans: Any) -> SpanExportResult:
        self.got += len(spans)
        return SpanExportResult.SUCCESS if self.ok else SpanExportResult.FAILURE


def _count(outcome: str) -> float:
    return metrics.TRACE_SPANS.labels(outcome=outcome)._value.get()


def test_the_export_queue_is_bounded_and_counted() -> None:
    from agent.telemetry.otlp import BoundedExport

    for ok, outcome in ((True, "exported"), (False, "dropped_export_failed")):
        before = {k: _count(k) for k in ("exported", "dropped_export_failed", "dropped_queue_full")}
        exporter = _Exporter(ok)
        processor = BoundedExport(exporter, max_queue=5, delay_s=60.0)  # (only a flush sends)
        provider = TracerProvider()
        provider.add_span_processor(processor)
        tracer = provider.get_tracer("t")
        for i in range(8):
            tracer.start_span(f"s{i}").end()
        assert processor.force_flush(5000)
        assert exporter.got == 5
        assert _count(outcome) - before[outcome] == 5
        assert _count("dropped_queue_full") - before["dropped_queue_full"] == 3
        provider.shutdown()


def test_a_dead_collector_is_logged_once_a_minute() -> None:
    from agent.telemetry.otlp import OncePerInterval

    clock = Clock()
    quiet = OncePerInterval(60.0, clock)
    passed = []
    for t in (0.0, 1.0, 30.0, 59.9, 60.0, 61.0, 125.0):
        clock.t = 100.0 + t
        passed.append(quiet.filter(None))  # type: ignore[arg-type]  (the record is not read)
    assert passed == [True, False, False, False, True, False, True]
