"""Shared fixtures: loopback-only ICE, a spoken WAV made with espeak-ng, the tiny checkpoint."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from agent.ice import restrict_ice_hosts


@pytest.fixture(scope="session", autouse=True)
def loopback_ice():
    # Every test peer gathers 127.0.0.1 only: no packet may leave loopback.
    restrict_ice_hosts(["127.0.0.1"])
    yield


@pytest.fixture(scope="session")
def speech_wav(tmp_path_factory) -> Path:
    """About 1.5 s of English speech, 16 kHz mono, with 0.3 s of lead-in silence."""
    if shutil.which("espeak-ng") is None:
        pytest.fail("espeak-ng is missing: `make test` installs it (apt-get install espeak-ng)")
    out = tmp_path_factory.mktemp("speech") / "hello.wav"
    raw = out.with_name("raw.wav")
    subprocess.run(
        ["espeak-ng", "-v", "en-us", "-s", "170", "-w", str(raw), "Hello agent, what do you see?"],
        check=True,
    )
    import wave

    import numpy as np

    with wave.open(str(raw)) as w:
        rate = w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32)
    # espeak-ng speaks at 22.05 kHz: linear resample to 16 kHz is plenty for VAD and the tiny model.
    n_out = int(len(pcm) * 16000 / rate)
    pcm16 = np.interp(np.linspace(0, len(pcm) - 1, n_out), np.arange(len(pcm)), pcm)
    lead = np.zeros(int(0.3 * 16000), dtype=np.float32)
    pcm16 = np.concatenate([lead, pcm16]).astype(np.int16)
    with wave.open(str(out), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm16.tobytes())
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3-Omni written with save_pretrained, built once per test session."""
    from agent.engine.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("model") / "tiny-qwen3-omni")
