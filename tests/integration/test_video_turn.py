"""A turn with the camera on, over a real call: what the model is shown and what it cost.

Pins, with the aiortc client sending speech and a 640x480 camera at 4 fps to the agent (tiny
model, streaming engine) on loopback: the camera enters the turn as video grids
(`omni.stats.video_grids` > 0), `response.done` reports their tokens as image tokens
(usage.input_token_details.image_tokens > 0, and 0 for a call without a camera), and the vision
encoder's work left for the end of the turn is at most the last half second (one grid, two
frames at 4 fps), counted in grids and frames (`omni.stats.video_grids_encoded_at_end_of_turn`,
`frames_encoded_at_end_of_turn`), not in milliseconds.
"""

from __future__ import annotations

from pathlib import Path

from support.realtime_helpers import start_agent

from agent.client.client import AgentClient, PatternVideoTrack


async def _one_turn(url: str, speech_wav: Path, camera: bool) -> dict:
    source = PatternVideoTrack(640, 480, fps=4) if camera else None
    client = AgentClient(url, speech_wav, video=camera, video_source=source)
    try:
        await client.connect()
        return await client.wait_event("response.done", 90)
    finally:
        await client.close()


async def test_camera_turn_is_video_reports_its_tokens_and_encodes_little_at_the_end(
    tiny_model_dir: Path, speech_wav: Path
) -> None:
    agent = await start_agent(tiny_model_dir, max_reply_seconds=1.0)
    try:
        with_camera = await _one_turn(agent.url, speech_wav, camera=True)
        without = await _one_turn(agent.url, speech_wav, camera=False)
    finally:
        await agent.stop()
    usage = with_camera["response"]["usage"]
    assert usage["input_token_details"]["image_tokens"] > 0
    assert usage["input_tokens"] > usage["input_token_details"]["image_tokens"]
    stats = with_camera["response"]["omni"]["stats"]
    assert stats["video_grids"] > 0 and stats["input_video_tokens"] == usage["input_token_details"]["image_tokens"]
    assert stats["video_grids_encoded_at_end_of_turn"] <= 1
    assert stats["frames_encoded_at_end_of_turn"] <= 2
    assert without["response"]["usage"]["input_token_details"]["image_tokens"] == 0
