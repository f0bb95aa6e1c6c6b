"""Output-audio arithmetic shared by the streaming runner and the generate() reference: frames,
the talker's token cap for a reply length, float samples to int16 PCM.
"""

from __future__ import annotations

import numpy as np
import torch

SAMPLES_PER_FRAME = 1920  # one codec frame at 24 kHz (80 ms)


def talker_tokens_for(max_reply_seconds: float, output_rate: int) -> int:
    """talker_max_new_tokens giving at most max_reply_seconds of audio: generate() renders one
    frame per talker token except the last, whose residual codes are never predicted."""
    frames = int(np.ceil(max_reply_seconds * output_rate / SAMPLES_PER_FRAME))
    return frames + 1


def to_pcm16(wav: torch.Tensor | np.ndarray) -> np.ndarray:
    samples = wav.detach().float().cpu().numpy() if isinstance(wav, torch.Tensor) else np.asarray(wav)
    return np.clip(np.round(samples.reshape(-1) * 32767.0), -32768, 32767).astype(np.int16)
