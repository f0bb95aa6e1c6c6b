"""Caption text from the streaming runner: deltas never split a character.

Pins: IncrementalDecoder holds back a multi-byte character whose bytes span tokens until
it is whole, releases what is held at the end, and its deltas join to the full decode;
the streaming runner's TextDeltas join to its ReplyDone text.
"""

from __future__ import annotations

import numpy as np
from transformers import AutoTokenizer

from agent.engine.api import ReplyDone, TextDelta
from agent.engine.codecs.detok import IncrementalDecoder
from agent.engine.runner.streaming import StreamingRunner


def test_split_characters_are_held_until_whole(tiny_model_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = "café → 北京 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span byte-level tokens
    decoder = IncrementalDecoder(tokenizer)
    deltas = [decoder.push(i) for i in ids] + [decoder.finish()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_trailing_broken_bytes_are_released_at_the_end(tiny_model_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = tokenizer.encode("北", add_special_tokens=False)
    decoder = IncrementalDecoder(tokenizer)
    held = [decoder.push(i) for i in ids[:-1]]
    assert held == [""] * len(held)  # nothing printable yet
    tail = decoder.finish()
    assert tail == tokenizer.decode(ids[:-1]) and decoder.text == tail


def test_streaming_deltas_join_to_the_reply_text(loaded) -> None:
    runner = StreamingRunner(loaded, "hi", max_reply_tokens=24, max_reply_seconds=0.5)
    runner.open_session("s")
    runner.append_audio("s", (np.random.default_rng(3).standard_normal(16000) * 0.1).astype(np.float32))
    runner.begin_reply("s", [], text_only=True)
    outputs = []
    for _ in range(100):
        outputs += runner.step()
        if any(isinstance(o, ReplyDone) for o in outputs):
            break
    done = next(o for o in outputs if isinstance(o, ReplyDone))
    assert "".join(o.text for o in outputs if isinstance(o, TextDelta)) == done.text
