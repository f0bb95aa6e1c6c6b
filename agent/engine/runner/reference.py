"""GenerateRunner: the Runner protocol on top of transformers' own non-streaming generate().

It is the reference the streaming engine is measured against (same text, same codes) and a
working fallback: correct, simple, and slow to first audio (the whole reply is made before
any of it is sent).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from agent.decoding import Decoding, Sampling
from agent.engine.api import AudioOut, Output, ReplyDone, StageTime, TextDelta
from agent.engine.checkpoints.model import LoadedModel, build_inputs
from agent.engine.codecs.output_audio import SAMPLES_PER_FRAME, talker_tokens_for, to_pcm16


@dataclass
class _Session:
    audio: list[np.ndarray] = field(default_factory=list)
    pending: "_Request | None" = None


@dataclass
class _Request:
    audio: np.ndarray
    images: list[np.ndarray]
    text_only: bool
    cancelled: bool = False


class GenerateRunner:
    """One generate() call per reply, run by step(); the reply's outputs all come at once."""

    def __init__(
        self,
        loaded: LoadedModel,
        system_prompt: str,
        max_reply_tokens: int = 48,
        max_reply_seconds: float = 4.0,
        decoding: Decoding = Decoding.greedy(),
    ) -> None:
        """decoding: generate()'s thinker and talker settings (its code predictor samples with
        the talker, at the top-k/top-p generate() fixes); a sampled reply seeds torch's RNG
        from decoding.seed, else from the OS."""
        if max_reply_tokens < 2:
            raise ValueError("max_reply_tokens must be >= 2 (a reply is one text token plus its end)")
        self.loaded = loaded
        self.system_prompt = system_prompt
        self.max_reply_tokens = max_reply_tokens
        self.max_reply_seconds = max_reply_seconds
        self.decoding = decoding
        self._seeds = random.Random(decoding.seed) if decoding.seed is not None else random.SystemRandom()
        self._sessions: dict[str, _Session] = {}
        self._queue: deque[str] = deque()  # sessions with a pending reply, oldest first

    def open_session(self, session_id: str) -> None:
        self._sessions[session_id] = _Session()

    def close_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        if session_id in self._queue:
            self._queue.remove(session_id)

    def append_audio(self, session_id: str, pcm: np.ndarray) -> None:
        self._sessions[session_id].audio.append(np.asarray(pcm, dtype=np.float32).reshape(-1))

    def discard_turn(self, session_id: str) -> None:
        self._sessions[session_id].audio.clear()

    def begin_reply(self, session_id: str, images: list[np.ndarray], text_only: bool = False) -> None:
        session = self._sessions[session_id]
        audio = np.concatenate(session.audio) if session.audio else np.zeros(0, dtype=np.float32)
        session.audio.clear()
        session.pending = _Request(audio=audio, images=list(images), text_only=text_only)
        if session_id not in self._queue:
            self._queue.append(session_id)

    def cancel_reply(self, session_id: str) -> None:
        session = self._sessions.get(session_id)
        if session is not None and session.pending is not None:
            session.pending.cancelled = True

    def has_work(self) -> bool:
        return bool(self._queue)

    def idle_s(self) -> float:
        return 0.0  # no playout pacing: work that is there is due

    def step(self) -> list[Output]:
        if not self._queue:
            return []
        session_id = self._queue.popleft()
        request = self._sessions[session_id].pending
        self._sessions[session_id].pending = None
        if request is None:
            return []
        if request.cancelled:
            return [ReplyDone(session_id, "cancelled")]
        return self._generate(session_id, request)

    @torch.no_grad()
    def _generate(self, session_id: str, request: _Request) -> list[Output]:
        loaded = self.loaded
        started = time.perf_counter()
        inputs = build_inputs(loaded, request.audio, request.images, self.system_prompt)
        prompt_len = inputs["input_ids"].shape[1]
        talker_tokens = talker_tokens_for(self.max_reply_seconds, loaded.output_rate)
        seed = self._seeds.getrandbits(32)
        if self.decoding.samples:
            torch.manual_seed(seed)  # generate() draws from torch's global RNG
        result = loaded.model.generate(
            **inputs,
            speaker=loaded.speaker,
            return_audio=not request.text_only,
            **generate_kwargs("thinker", self.decoding.thinker),
            **generate_kwargs("talker", self.decoding.talker),
            thinker_max_new_tokens=self.max_reply_tokens,
            thinker_eos_token_id=loaded.thinker_eos_ids,
            # A reply has at least one text token before its end: generate()'s talker needs two
            # generated tokens (its prefix takes the first one and ends at the last one fed), and
            # crashes on an immediate <|im_end|>. StreamingRunner applies the same rule.
            thinker_min_new_tokens=1,
            talker_max_new_tokens=talker_tokens,
        )
        if request.text_only:
            sequences, wav = result, None
        else:
            sequences, wav = result
        elapsed = time.perf_counter() - started

        generated = sequences[0, prompt_len:].tolist()
        eos = set(loaded.thinker_eos_ids)
        ended = next((i for i, t in enumerate(generated) if t in eos), None)
        text_ids = generated if ended is None else generated[:ended]
        text = loaded.tokenizer.decode(text_ids, skip_special_tokens=True)

        outputs: list[Output] = [StageTime("generate", elapsed, session_id)]
        if text_ids:
            outputs.append(TextDelta(session_id, text, tuple(text_ids)))
        n_samples = 0
        audio_capped = False
        if wav is not None:
            pcm = to_pcm16(wav)
            n_samples = len(pcm)
            # At the cap, generate() renders talker_tokens - 1 frames (less the decoder's tail).
            audio_capped = n_samples >= (talker_tokens - 1) * SAMPLES_PER_FRAME - SAMPLES_PER_FRAME
            outputs.extend(
                AudioOut(session_id, pcm[i : i + SAMPLES_PER_FRAME]) for i in range(0, n_samples, SAMPLES_PER_FRAME)
            )
        reason = "length" if ended is None or audio_capped else "stop"
        stats = {
            "prompt_tokens": prompt_len,
            "text_tokens": len(text_ids),
            "audio_samples": n_samples,
            "generate_seconds": elapsed,
            "seed": seed,
        }
        outputs.append(ReplyDone(session_id, reason, text=text, stats=stats))
        return outputs


def generate_kwargs(stage: str, sampling: Sampling) -> dict[str, object]:
    """generate()'s `<stage>_*` arguments for one stage (the warpers only when it samples:
    generate() warns about them otherwise)."""
    kwargs: dict[str, object] = {
        f"{stage}_do_sample": sampling.do_sample,
        f"{stage}_repetition_penalty": sampling.repetition_penalty,
    }
    if sampling.do_sample:
        kwargs.update(
            {
                f"{stage}_temperature": sampling.temperature,
                f"{stage}_top_k": sampling.top_k,
                f"{stage}_top_p": sampling.top_p,
            }
        )
    return kwargs
