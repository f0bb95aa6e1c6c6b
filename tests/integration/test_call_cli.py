"""`omni-agent call URL`, the headless device client, against a running agent.

Pins, running the real command (`python -m agent call`) as a subprocess with a WAV as the
microphone and a video file as the camera, against the agent (tiny model) on loopback:
- started before the agent is up, it retries with backoff ("reconnecting" on stderr), connects
  once the agent answers, prints the agent's reply text as captions on stdout ("agent: …"),
  writes the agent's voice to the WAV (non-silent), and exits 0 after --max-replies;
- Ctrl-C (SIGINT) mid-call hangs up (the agent is left with no session), closes the WAV so
  it is a valid file, and exits 0 (the looped video, past its first pass, must not flood the
  event loop: a flood once filled its wake-up pipe and the signal was lost);
- an --audio or --video file it cannot play (missing, no video stream) exits 2 at once with
  the reason, without retrying.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import wave
from pathlib import Path

import numpy as np
from support.loopback import free_port
from support.realtime_helpers import start_agent, wait_no_sessions

REPO = Path(__file__).resolve().parents[2]


def make_video(path: Path, width: int = 320, height: int = 240, frames: int = 30) -> Path:
    """A y4m clip (15 fps, 4:2:0) with a white square crossing a gradient."""
    yy, xx = np.mgrid[0:height, 0:width]
    with open(path, "wb") as f:
        f.write(f"YUV4MPEG2 W{width} H{height} F15:1 Ip A1:1 C420jpeg\n".encode())
        for i in range(frames):
            luma = (40 + ((xx + yy + 6 * i) % 160)).astype(np.uint8)
            x0 = int(i * (width - 64) / (frames - 1))
            luma[height // 2 - 32 : height // 2 + 32, x0 : x0 + 64] = 235
            chroma = np.full((height // 2, width // 2), 128, np.uint8)
            f.write(b"FRAME\n" + luma.tobytes() + chroma.tobytes() + chroma.tobytes())
    return path


async def _spawn(url: str, *args: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agent",
        "call",
        url,
        "--ice-host",
        "127.0.0.1",
        *args,
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def _collect(stream: asyncio.StreamReader, lines: list[str]) -> None:
    while line := await stream.readline():
        lines.append(line.decode(errors="replace").rstrip("\n"))


def _wav_rms(path: Path) -> tuple[int, float]:
    with wave.open(str(path)) as w:
        assert w.getsampwidth() == 2
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float64)
    return len(pcm), float(np.sqrt((pcm**2).mean())) if pcm.size else 0.0


async def test_call_reconnects_until_the_agent_answers_then_prints_text_and_writes_audio(
    tiny_model_dir: Path, speech_wav: Path, tmp_path: Path
) -> None:
    port = free_port()
    out_wav = tmp_path / "agent.wav"
    video = make_video(tmp_path / "camera.y4m")
    proc = await _spawn(
        f"http://127.0.0.1:{port}",
        "--audio",
        str(speech_wav),
        "--video",
        str(video),
        "--out",
        str(out_wav),
        "--max-replies",
        "1",
        "--max-seconds",
        "150",
    )
    stdout: list[str] = []
    stderr: list[str] = []
    readers = [
        asyncio.ensure_future(_collect(proc.stdout, stdout)),
        asyncio.ensure_future(_collect(proc.stderr, stderr)),
    ]
    agent = None
    try:
        for _ in range(100):  # nothing listens yet: the client must be retrying
            if any("reconnecting" in line for line in stderr):
                break
            await asyncio.sleep(0.1)
        assert any("reconnecting" in line for line in stderr), stderr
        agent = await start_agent(tiny_model_dir, port=port, max_reply_seconds=2.0)
        rc = await asyncio.wait_for(proc.wait(), 160)
        await asyncio.gather(*readers)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if agent is not None:
            await agent.stop()
    assert rc == 0, "\n".join(stderr[-20:])
    assert any(line.startswith("[omni-agent call] connected") for line in stderr), stderr
    captions = [line.removeprefix("agent: ") for line in stdout if line.startswith("agent: ")]
    assert captions and captions[0].strip(), f"no caption printed: {stdout}"
    samples, rms = _wav_rms(out_wav)
    assert samples > 0 and rms > 30, f"the agent's voice was not written ({samples} samples, rms {rms:.1f})"


async def test_ctrl_c_hangs_up_and_leaves_a_valid_wav(tiny_model_dir: Path, speech_wav: Path, tmp_path: Path) -> None:
    agent = await start_agent(tiny_model_dir, max_reply_seconds=2.0)
    out_wav = tmp_path / "agent.wav"
    proc = await _spawn(
        agent.url,
        "--audio",
        str(speech_wav),
        "--video",
        str(make_video(tmp_path / "camera.y4m")),
        "--out",
        str(out_wav),
        "--max-seconds",
        "150",
    )
    stdout: list[str] = []
    stderr: list[str] = []
    readers = [
        asyncio.ensure_future(_collect(proc.stdout, stdout)),
        asyncio.ensure_future(_collect(proc.stderr, stderr)),
    ]
    try:
        for _ in range(1200):  # bounded: 120 s for the first words of the reply
            if any(line.startswith("agent: ") for line in stdout) or proc.returncode is not None:
                break
            await asyncio.sleep(0.1)
        assert proc.returncode is None, "\n".join(stderr[-20:])
        proc.send_signal(signal.SIGINT)
        try:
            rc = await asyncio.wait_for(proc.wait(), 20)
        except asyncio.TimeoutError:
            raise AssertionError("Ctrl-C did not end the call in 20 s:\n" + "\n".join(stderr[-20:])) from None
        await asyncio.gather(*readers)
        assert rc == 0, "\n".join(stderr[-20:])
        await wait_no_sessions(agent.url, "the client's Ctrl-C did not hang up the call")
        samples, _ = _wav_rms(out_wav)  # wave refuses a file whose header was never finished
        assert samples > 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await agent.stop()


async def test_a_media_file_it_cannot_play_ends_it_at_once_with_the_reason(speech_wav: Path, tmp_path: Path) -> None:
    # Retrying cannot make a missing file or a file with no pictures playable: exit 2 and say
    # why, instead of reconnecting forever. No agent is needed: media open before signalling.
    url = f"http://127.0.0.1:{free_port()}"
    cases = [
        (("--audio", str(tmp_path / "missing.wav")), "as the microphone"),
        (("--audio", str(speech_wav), "--video", str(speech_wav)), "no video stream"),
    ]
    for args, reason in cases:
        proc = await _spawn(url, *args, "--max-seconds", "60")
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        text = err.decode(errors="replace")
        assert proc.returncode == 2, text
        assert "call refused: cannot play" in text and reason in text and "reconnecting" not in text, text
