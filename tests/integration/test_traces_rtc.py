"""A call's OpenTelemetry trace and its turns' timing, over real aiortc peers on loopback, the
spans received by a real OTLP/HTTP receiver on loopback (decoded with opentelemetry-proto).

Pins:
- a spoken turn answered by a function call, then (after its output) a spoken reply the user
  talks over: every span of the call shares the trace id `session.created` and
  `session.updated` carry (omni.trace_id); the root is named by the session's
  tracing.workflow_name and carries its group_id; each turn is a child of the root, each stage
  a child of its turn (vad.speech, turn.endpoint, turn.admission, engine.prefill,
  engine.first_output, transport.first_packet, reply; tool.call for the call, named);
  the stages follow each other in time; the barge-in is an event on the cut reply with what
  was heard; no attribute carries the user's or the model's words or the instructions;
- omni.turn_timing follows each response.done, its stages adding up to its total, and for the
  spoken turn the agent's total (end of speech to first sound out) is within 60 ms of the
  voice-to-voice the client measures (end of its speech to the first sound it hears);
- traces off (no endpoint): no trace id and no span, the turn timing still sent.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from support.loopback import free_port
from support.otlp_receiver import OtlpReceiver
from support.realtime_helpers import long_replies_engine, start_agent

from agent.client.client import AgentClient
from agent.transport.http import TRACING

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
INSTRUCTIONS = "You are the front desk of the Hotel Zebra Quartz."
STAGES = ("vad.speech", "turn.endpoint", "turn.admission", "engine.prefill", "engine.first_output")


async def test_the_span_tree_of_a_call(tiny_model_dir: Path, speech_wav: Path, strict_events) -> None:
    receiver = OtlpReceiver(free_port())
    await receiver.start()
    agent = await start_agent(
        tiny_model_dir,
        engine=long_replies_engine,
        otlp_endpoint=receiver.url,
        max_reply_tokens=48,
        max_reply_seconds=4.0,
        speculative_start=False,
        echo_guard=False,
    )
    session = {
        "type": "realtime",
        "instructions": INSTRUCTIONS,
        "tools": [WEATHER],
        "tool_choice": "required",
        "tracing": {"workflow_name": "front-desk", "group_id": "desk-7"},
    }
    client = AgentClient(agent.url, speech_wav, video=False, session=session)
    try:
        await client.connect()
        created = await client.wait_event("session.created", timeout=30)
        first = await client.wait_event("response.done", timeout=60)
        call = next(o for o in first["response"]["output"] if o["type"] == "function_call")
        await client.wait_event("omni.turn_timing", timeout=10)
        client.send(
            {
                "type": "conversation.item.create",
                "item": {"type": "function_call_output", "call_id": call["call_id"], "output": '{"sky": "clear"}'},
            }
        )
        client.send({"type": "response.create", "response": {"tool_choice": "none"}})
        await client.wait_event("output_audio_buffer.started", timeout=60)
        for _ in range(100):  # some of the reply is heard, far from all of it (4 s)
            if client.result.audible_samples > 0.4 * 48000:
                break
            await asyncio.sleep(0.05)
        client.audio.play()  # talk over it
        await client.wait_event("conversation.item.truncated", timeout=30)
        await asyncio.sleep(0.5)  # (the cancelled response's timing follows its done)
    finally:
        await client.close()
        await asyncio.sleep(0.5)  # the session closes: its root span ends
        tracing = agent.app[TRACING]
        assert tracing is not None
        flushed = await asyncio.get_running_loop().run_in_executor(None, tracing.flush)
        await agent.stop()
        await receiver.stop()
    assert flushed
    r = client.result
    strict_events([e for e in r.events if not e["type"].startswith("omni.")])
    trace_id = created["omni"]["trace_id"]
    assert len(trace_id) == 32
    spans = [s for s in receiver.spans if s.trace_id == trace_id]
    assert spans and all(s.trace_id == trace_id for s in receiver.spans), {s.trace_id for s in receiver.spans}
    (root,) = [s for s in spans if not s.parent_id]
    assert root.name == "front-desk" and root.attributes["tracing.group_id"] == "desk-7"
    assert root.attributes["transport"] == "webrtc" and root.resource["service.name"] == "omni-agent"
    turns = [s for s in spans if s.name == "turn"]
    assert len(turns) >= 2 and all(t.parent_id == root.span_id for t in turns)
    by_response = {t.attributes["response.id"]: t for t in turns}
    dones = r.of_type("response.done")
    spoken_turn = by_response[first["response"]["id"]]
    children = {s.name: s for s in spans if s.parent_id == spoken_turn.span_id}
    assert set(STAGES) <= set(children), sorted(children)
    # The stages follow each other.
    for a, b in zip(STAGES, STAGES[1:]):
        assert children[a].end_ns <= children[b].start_ns + 1_000_000, (a, b)
    assert children["turn.endpoint"].attributes["endpoint.silence_ms"] > 0
    (tool,) = [s for s in spans if s.name == "tool.call" and s.parent_id == spoken_turn.span_id]
    assert tool.attributes["tool.name"] == "get_weather"
    cut = next(d for d in dones if d["response"]["status"] == "cancelled")
    cut_turn = by_response[cut["response"]["id"]]
    (reply,) = [s for s in spans if s.name == "reply" and s.parent_id == cut_turn.span_id]
    barge = [e for e in reply.events if e[0] == "barge_in"]
    assert barge and barge[0][2]["heard_ms"] > 0
    # No words: neither the instructions, nor the reply's transcript, nor the arguments.
    transcripts = [e["transcript"] for e in r.of_type("response.output_audio_transcript.done") if e["transcript"]]
    words = [INSTRUCTIONS, call["arguments"], *transcripts]
    for span in spans:
        for value in span.attributes.values():
            assert not any(isinstance(value, str) and w and w in value for w in words), (span.name, value)
    # The turn timing: after each response.done, its stages adding up.
    timings = r.of_type("omni.turn_timing")
    assert {t["response_id"] for t in timings} >= {
        d["response"]["id"] for d in dones if d["response"]["status"] != "cancelled"
    }
    for t in timings:
        if t["total_ms"] is not None:
            assert abs(sum(v for v in t["stages"].values() if v is not None) - t["total_ms"]) < 0.5


async def test_voice_to_voice_adds_up_and_no_trace_when_off(tiny_model_dir: Path, speech_wav: Path) -> None:
    agent = await start_agent(tiny_model_dir, speculative_start=False)
    client = AgentClient(agent.url, speech_wav, video=False)
    try:
        await client.connect()
        created = await client.wait_event("session.created", timeout=30)
        await client.wait_event("output_audio_buffer.started", timeout=60)
        timing = await client.wait_event("omni.turn_timing", timeout=60)
        for _ in range(100):
            if client.voice_to_voice() is not None:
                break
            await asyncio.sleep(0.05)
    finally:
        await client.close()
        await agent.stop()
    assert "trace_id" not in created.get("omni", {}) and agent.app[TRACING] is None
    v2v = client.voice_to_voice()
    assert v2v is not None and timing["total_ms"] is not None
    assert all(
        timing["stages"][k] is not None for k in ("endpoint", "admission", "prefill", "first_output", "transport")
    )
    print(f"agent total {timing['total_ms']} ms, client v2v {v2v * 1000:.1f} ms, stages {timing['stages']}")
    assert abs(timing["total_ms"] - v2v * 1000) <= 60, (timing, v2v)
