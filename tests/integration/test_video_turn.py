"""A turn with the camera on, over a real call: what the model is shown and what it cost.

Pins, with the aiortc client sending speech and a 640x480 camera at 4 fps to the agent (tiny
model, streaming engine) on loopback: `response.done` reports the image tokens the turn used
(usage.input_token_details.image_tokens > 0, and 0 for a call without a camera), and the vision
encoder's work left for the end of the turn is at most the last half second's frames (two at
4 fps), counted in frames (`omni.stats.frames_encoded_at_end_of_turn`), not in milliseconds.
"""

from __future__ import annotations

from pathlib import Path

from agent.client import AgentClient, PatternVideoTrack
from realtime_helpers import start_agent


async def _one_turn(url: str, speech_wav: Path, camera: bool) -> dict:
    source = PatternVideoTrack(640, 480, fps=4) if camera else None
    client = AgentClient(url, speech_wav, video=camera, video_source=source)
    try:
        await client.connect()
        return await client.wait_event("response.done", 90)
    finally:
        await client.close()


async def test_camera_turn_reports_image_tokens_and_encodes_little_at_the_end(tiny_model_dir: Path,
                                                                              speech_wav: Path) -> None:
    agent = await start_agent(tiny_model_dir, max_reply_seconds=1.0)
    try:
        with_camera = await _one_turn(agent.url, speech_wav, camera=True)
        without = await _one_turn(agent.url, speech_wav, camera=False)
    finally:
        await agent.stop()
    usage = with_camera["response"]["usage"]
    assert usage["input_token_details"]["image_tokens"] > 0
    assert usage["input_tokens"] > usage["input_token_details"]["image_tokens"]
    assert with_camera["response"]["omni"]["stats"]["frames_encoded_at_end_of_turn"] <= 2
    assert without["response"]["usage"]["input_token_details"]["image_tokens"] == 0
