"""A peer whose camera track ends and who stops sending audio for 10 s: its session keeps
working, and another session's turns are not affected.

Pins, over real aiortc peers on loopback with the tiny model: client A stops its video sender
(RTCP BYE: the agent's video track ends) and then sends no audio packets for 10 s (its RTP
timestamps then jump 10 s forward); meanwhile client B speaks and is answered; afterwards A
speaks again and is answered too, A got no `error` event, and both sessions are still held.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support.realtime_helpers import start_agent

from agent.client.client import AgentClient
from agent.server import SESSIONS

SILENT_S = 10.0


def _audio_sender(client: AgentClient):
    return next(t.sender for t in client.pc.getTransceivers() if t.sender.track is client.audio)


async def _wait_done(client: AgentClient, n: int, timeout: float = 60) -> dict:
    for _ in range(int(timeout * 10)):
        done = client.result.of_type("response.done")
        if len(done) >= n:
            return done[n - 1]
        await asyncio.sleep(0.1)
    pytest.fail(f"no response.done #{n}: {[e['type'] for e in client.result.events][-15:]}")


async def test_track_end_and_silence_leave_the_session_working(tiny_model_dir: Path, speech_wav: Path) -> None:
    running = await start_agent(tiny_model_dir, max_reply_seconds=1.0, max_reply_tokens=8)
    a = AgentClient(running.url, speech_wav, video=True)
    b = AgentClient(running.url, speech_wav, video=False)
    try:
        await a.connect()
        await b.connect()
        await _wait_done(a, 1)
        await _wait_done(b, 1)
        video = next(t.sender for t in a.pc.getTransceivers() if t.sender.track is a.video)
        await video.stop()  # RTCP BYE: the agent's end of this track ends
        # aiortc reads the track but sends nothing while disabled (test-only switch).
        sender = _audio_sender(a)
        sender._enabled = False
        b.audio.play()  # B talks while A is silent
        b_done = await _wait_done(b, 2)
        await asyncio.sleep(SILENT_S - 2)  # the rest of A's silence (the point of the test)
        sender._enabled = True
        a.audio.play()
        a_done = await _wait_done(a, 2)
        held = {a.result.session_id, b.result.session_id} <= set(running.app[SESSIONS])
        # The agent's reader of A's camera saw the track end (its task returned); audio's still runs.
        readers = running.app[SESSIONS][a.result.session_id]._tasks
        ended = [t.done() for t in readers]
    finally:
        await a.close()
        await b.close()
        await running.stop()
    assert b_done["response"]["status"] in ("completed", "incomplete")
    assert a_done["response"]["status"] in ("completed", "incomplete")
    assert len(a.result.of_type("input_audio_buffer.speech_started")) >= 2
    assert not a.result.of_type("error"), a.result.of_type("error")
    assert held, "a session was dropped"
    assert sorted(ended) == [False, True], f"track readers done: {ended}"
    print(f"\nmedia: A's video ended and A was silent {SILENT_S:.0f} s; B answered meanwhile; A answered after")
