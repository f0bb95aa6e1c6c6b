"""A real model's replies end when the model ends them, not at the tiny model's caps.

The tiny checkpoint is copied without its build marker, so the agent treats it as any real
checkpoint without a generation config (agent/decoding.py): Qwen's sampling and voice prompt,
1024 tokens / 60 s caps, no random fallback model. The thinker is forced to a 60-token reply
and then <|im_end|>, the talker to codec EOS once that text is spoken. Pins, over the Realtime
WebSocket: the reply completes (`response.done` status `completed`, the engine's reason
`stop`, not `length`) with all 60 text tokens and more audio than the tiny model's 4 s cap;
the session's default instructions are Qwen's voice prompt; the engine has no fallback runner.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.realtime_helpers import start_agent

from agent.decoding import QWEN_VOICE_SYSTEM_PROMPT, TINY_MARKER, TINY_MAX_REPLY_SECONDS
from agent.engine.factory import build_engine

pytestmark = pytest.mark.asyncio

TEXT_TOKENS = 60


def forced_reply(runner: Any) -> Any:
    """Hooks: the thinker says TEXT_TOKENS tokens then <|im_end|>; the talker never ends before
    its text is spoken (tts_eos fed) and ends right after."""
    loaded = runner.loaded
    word = loaded.tokenizer.encode(" hello", add_special_tokens=False)[0]

    def reply() -> Any:
        replies = [s.reply for s in runner.sessions.values() if s.reply is not None]
        return replies[0] if replies else None

    def thinker(module: Any, args: Any, logits: Any) -> Any:
        current = reply()
        if current is None:
            return logits
        logits = logits.clone()
        logits[..., word if len(current.text.tokens) < TEXT_TOKENS else loaded.ids.im_end] += 1e4
        return logits

    def talker(module: Any, args: Any, logits: Any) -> Any:
        current = reply()
        if current is None:
            return logits
        logits = logits.clone()
        eos = runner.talker.codec_eos
        spoken = current.text.done and len(current.voice.codes0) > len(current.text.tokens)
        logits[..., eos] = 1e4 if spoken else float("-inf")
        return logits

    loaded.model.thinker.lm_head.register_forward_hook(thinker)
    loaded.model.talker.codec_head.register_forward_hook(talker)
    return runner


async def test_a_forced_60_token_reply_completes(tiny_model_dir: Path, tmp_path: Path) -> None:
    real = tmp_path / "not-tiny"
    shutil.copytree(tiny_model_dir, real)
    (real / TINY_MARKER).unlink()
    agent = await start_agent(real, engine=lambda config: build_engine(config, wrap=forced_reply))
    try:
        assert agent.config.max_reply_tokens > TEXT_TOKENS + 1 and agent.config.max_reply_seconds > 30
        assert agent.config.sampling.talker.do_sample and not agent.engine.has_fallback
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(f"{agent.url}/v1/realtime?model=qwen3-omni", protocols=("realtime",))
            events: list[dict[str, Any]] = []

            async def until(kind: str) -> dict[str, Any]:
                while True:
                    msg = await asyncio.wait_for(ws.receive(), 60)
                    assert msg.type == aiohttp.WSMsgType.TEXT, msg
                    event = json.loads(msg.data)
                    events.append(event)
                    if event["type"] == kind:
                        return event

            created = await until("session.created")
            assert created["session"]["instructions"] == QWEN_VOICE_SYSTEM_PROMPT
            await ws.send_json(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "Say hello."}],
                    },
                }
            )
            await ws.send_json({"type": "response.create"})
            done = (await until("response.done"))["response"]
            await ws.close()
        audio = sum(len(base64.b64decode(e["delta"])) for e in events if e["type"] == "response.output_audio.delta")
        assert done["status"] == "completed", done.get("status_details")
        assert done["usage"]["output_token_details"]["text_tokens"] == TEXT_TOKENS, done["usage"]
        assert audio / 2 / 24_000 > TINY_MAX_REPLY_SECONDS  # past the tiny model's cap
    finally:
        await agent.stop()
