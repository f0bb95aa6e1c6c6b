"""Tool calls in the streaming engine, on the tiny model (greedy), grammar-constrained.

Pins:
- tool choice `required`: the reply opens with <tool_call>, its talker never starts (no audio,
  no text delta), and its CallDeltas joined are one `{"name", "arguments"}` call of a named
  tool whose arguments validate against its schema; the call stays in the context;
- `function`: every call names that function;
- speech, then a call (auto; the model's <tool_call> forced at its 4th token): the text deltas
  are the tokens before the tag, the talker reads no token from the tag on, and the call after
  it is valid;
- tool choice `none`: <tool_call> is never chosen, even when the model's logits want it most;
- a schema the grammar cannot take is refused when the tools are set, and the session keeps
  the ones it had;
- near the end of the context a turn whose reply may call keeps room for a call (the history
  starts over instead), and a call that still reaches the end is cut there ("length"), never
  overflowing the cache; the next turn starts the history over.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import jsonschema
import numpy as np
import pytest
import torch
from support.engine_drive import SYSTEM

from agent.engine.api import AudioOut, CallDelta, ReplyDone, TextDelta
from agent.engine.runner.streaming import StreamingRunner
from agent.engine.stages import turn_parts
from agent.tools.spec import Tool, ToolChoice, ToolSet

WEATHER = Tool(
    "get_weather",
    "The weather in a city.",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
LIGHT = Tool(
    "set_light",
    "A room's light on or off.",
    {
        "type": "object",
        "properties": {"room": {"enum": ["kitchen", "hall"]}, "on": {"type": "boolean"}},
        "required": ["room", "on"],
    },
)


@pytest.fixture(scope="module")
def runner(loaded) -> StreamingRunner:
    return StreamingRunner(loaded, SYSTEM, max_reply_tokens=16, max_reply_seconds=2.0)


@contextmanager
def _session(runner: StreamingRunner, sid: str) -> Iterator[None]:
    """A session of the shared runner, closed after the test whatever it asserted."""
    runner.open_session(sid)
    try:
        yield
    finally:
        runner.close_session(sid)


def _reply(runner: StreamingRunner, sid: str, watch=None) -> list:
    runner.begin_reply(sid, [])
    outputs = []
    for _ in range(2000):
        if not runner.has_work():
            return outputs
        if watch is not None and runner.sessions[sid].reply is not None:
            watch(runner.sessions[sid].reply)
        outputs += runner.step()
    raise AssertionError("the reply never ended")


def _calls(outputs: list) -> list[dict]:
    texts: dict[int, str] = {}
    for out in outputs:
        if isinstance(out, CallDelta):
            texts[out.index] = texts.get(out.index, "") + out.text
    assert [o.index for o in outputs if isinstance(o, CallDelta) and o.done] == sorted(texts)
    return [json.loads(texts[i]) for i in sorted(texts)]


def _valid(call: dict, tools: tuple[Tool, ...]) -> None:
    tool = next(t for t in tools if t.name == call["name"])
    jsonschema.validate(call["arguments"], tool.schema())


def test_required_call_is_never_spoken(runner: StreamingRunner) -> None:
    with _session(runner, "req"):
        runner.set_tools("req", ToolSet((WEATHER, LIGHT), ToolChoice("required")))
        runner.add_user_text("req", "What is the weather in Paris?")
        outputs = _reply(runner, "req")
        calls = _calls(outputs)
        assert calls, "a required call was made"
        for call in calls:
            _valid(call, (WEATHER, LIGHT))
        assert not [o for o in outputs if isinstance(o, (AudioOut, TextDelta))]
        done = outputs[-1]
        assert isinstance(done, ReplyDone) and done.reason == "stop" and done.stats["audio_frames"] == 0
        # The call is in the model's context, as Qwen's chat template writes an assistant call.
        last = runner.context("req")["last_reply"]
        tokens = last["tokens"]
        assert tokens[0] == runner.loaded.ids.tool_call and runner.loaded.ids.tool_call_end in tokens
        assert done.stats["text_tokens"] == len(tokens)


def test_named_function_only(runner: StreamingRunner) -> None:
    with _session(runner, "named"):
        runner.set_tools("named", ToolSet((WEATHER, LIGHT), ToolChoice("function", "set_light")))
        runner.add_user_text("named", "Lights, please.")
        calls = _calls(_reply(runner, "named"))
        assert calls and all(c["name"] == "set_light" for c in calls)
        for call in calls:
            _valid(call, (LIGHT,))


def _force_tool_call_at(runner: StreamingRunner, monkeypatch, index: int) -> None:
    """Make <tool_call> the model's favourite at the reply's token `index` (the draw index is
    the reply's token count), as a model that decides to call after a few words would."""
    choose = runner.frames.thinker_choice
    tag = runner.loaded.ids.tool_call

    class Forced:
        penalizes = choose.penalizes

        def __call__(self, scores, seen, seeds, draws):
            scores = scores.clone()
            rows = (draws == index).nonzero().flatten()
            top = scores[rows].max(dim=1).values + 100.0
            scores[rows, tag] = torch.where(scores[rows, tag].isinf(), scores[rows, tag], top)  # masked stays masked
            return choose(scores, seen, seeds, draws)

    monkeypatch.setattr(runner.frames, "thinker_choice", Forced())


def test_speech_then_call(runner: StreamingRunner, monkeypatch) -> None:
    _force_tool_call_at(runner, monkeypatch, 3)
    seen: dict[str, int] = {}

    def watch(reply) -> None:
        if reply.text.voice_end is not None:
            seen["voice_end"] = reply.text.voice_end
        seen["read"] = max(seen.get("read", 0), reply.voice.read)

    with _session(runner, "mixed"):
        runner.set_tools("mixed", ToolSet((WEATHER,), ToolChoice("auto")))
        runner.add_user_text("mixed", "Say a word, then check the weather.")
        outputs = _reply(runner, "mixed", watch)
        assert seen["voice_end"] == 3
        assert 0 < seen["read"] <= 3, "the talker read nothing from <tool_call> on"
        tokens = runner.context("mixed")["last_reply"]["tokens"]
        spoken = runner.loaded.tokenizer.decode(tokens[:3], skip_special_tokens=True)
        assert "".join(o.text for o in outputs if isinstance(o, TextDelta)) == spoken
        assert [o for o in outputs if isinstance(o, AudioOut)], "the words before the call are spoken"
        calls = _calls(outputs)
        assert calls and calls[0]["name"] == "get_weather"
        _valid(calls[0], (WEATHER,))


def test_choice_none_never_calls(runner: StreamingRunner, monkeypatch) -> None:
    for index in range(4):
        _force_tool_call_at(runner, monkeypatch, index)
    with _session(runner, "none"):
        runner.set_tools("none", ToolSet((WEATHER,), ToolChoice("none")))
        runner.add_user_text("none", "Weather?")
        outputs = _reply(runner, "none")
        assert not [o for o in outputs if isinstance(o, CallDelta)]
        assert runner.loaded.ids.tool_call not in runner.context("none")["last_reply"]["tokens"]


def test_uncompilable_schema_is_refused(runner: StreamingRunner) -> None:
    from agent.tools.spec import ToolSchemaError

    with _session(runner, "bad"):
        runner.set_tools("bad", ToolSet((WEATHER,), ToolChoice("required")))
        broken = Tool("broken", "", {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}})
        with pytest.raises(ToolSchemaError):
            runner.set_tools("bad", ToolSet((broken,), ToolChoice("auto")))
        assert runner.sessions["bad"].choices.tools.tools == (WEATHER,)


def test_no_tools_no_change(runner: StreamingRunner) -> None:
    """Without tools a reply is what it always was: text deltas and audio."""
    with _session(runner, "plain"):
        runner.add_user_text("plain", "Hello.")
        outputs = _reply(runner, "plain")
        assert [o for o in outputs if isinstance(o, TextDelta)] and [o for o in outputs if isinstance(o, AudioOut)]
        assert not [o for o in outputs if isinstance(o, CallDelta)]
        assert np.all([isinstance(o.pcm, np.ndarray) for o in outputs if isinstance(o, AudioOut)])


def test_truncating_the_speech_keeps_the_call(runner: StreamingRunner, monkeypatch) -> None:
    """A barge-in's truncation cuts the spoken words to what was heard; the call after them
    stays in the context whole (the client has it as an item, the talker never spoke it)."""
    _force_tool_call_at(runner, monkeypatch, 3)
    with _session(runner, "cut"):
        runner.set_tools("cut", ToolSet((WEATHER,), ToolChoice("auto")))
        runner.add_user_text("cut", "Say a word, then check the weather.")
        _reply(runner, "cut")
        tokens = runner.context("cut")["last_reply"]["tokens"]
        assert tokens[3] == runner.loaded.ids.tool_call
        result = runner.truncate_reply("cut", 1)
        assert result["kept_tokens"] == 1 and result["dropped_tokens"] == 2
        context = runner.context("cut")
        assert context["last_reply"]["tokens"] == [tokens[0], *tokens[3:]]
        cached = context["thinker_length"] - context["last_reply"]["start_length"]
        im_end = [runner.loaded.ids.im_end, *runner.loaded.ids.newline]
        assert context["closing"][: len(tokens) - 2 - cached] == [tokens[0], *tokens[3:]][cached:]
        assert context["closing"][len(tokens) - 2 - cached :][: len(im_end)] == im_end
        # The session goes on: the next turn (a result) is answered.
        runner.add_user_text("cut", "<tool_response>\nsunny\n</tool_response>")
        assert isinstance(_reply(runner, "cut")[-1], ReplyDone)


def test_cancel_inside_a_call(runner: StreamingRunner) -> None:
    """A reply cancelled while it writes a call ends at once: no call is closed after the cancel."""
    with _session(runner, "stop"):
        runner.set_tools("stop", ToolSet((WEATHER,), ToolChoice("required")))
        runner.add_user_text("stop", "Weather in Oslo?")
        runner.begin_reply("stop", [])
        outputs: list = []
        for _ in range(500):
            outputs += runner.step()
            if any(isinstance(o, CallDelta) and o.text for o in outputs):
                break
        assert not any(isinstance(o, CallDelta) and o.done for o in outputs), "the call ended before the cancel"
        runner.cancel_reply("stop")
        after = []
        for _ in range(50):
            if not runner.has_work():
                break
            after += runner.step()
        assert not [o for o in after if isinstance(o, CallDelta)]
        assert [o.reason for o in after if isinstance(o, ReplyDone)] == ["cancelled"]


def test_unbounded_arguments_still_end_in_a_valid_call(runner: StreamingRunner) -> None:
    """Numbers, strings without maxLength and arrays have no length bound; the random model,
    greedy, would loop in them to the cap. A call that long is wound down (closing ids preferred
    among those the grammar allows): it ends, and it validates."""
    loose = Tool(
        "log",
        "Log an event.",
        {
            "type": "object",
            "properties": {
                "count": {"type": "integer"},
                "ratio": {"type": "number"},
                "note": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["count", "ratio", "note", "tags"],
        },
    )
    with _session(runner, "loose"):
        runner.set_tools("loose", ToolSet((loose,), ToolChoice("required", None), parallel=False))
        runner.add_user_text("loose", "Log it.")
        outputs = _reply(runner, "loose")
        calls = _calls(outputs)
        assert len(calls) == 1 and calls[0]["name"] == "log"
        _valid(calls[0], (loose,))
        assert outputs[-1].reason == "stop"


NOTE = Tool(
    "note",
    "Write a note down.",
    {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
)


def _near_the_end(loaded, spare: int) -> tuple[StreamingRunner, list]:
    """A session with a call answered, then a user text that leaves the reply `spare` tokens of
    the context (past its text cap and closing, not counting a call's room); the reply's outputs."""
    limit = 1024
    runner = StreamingRunner(loaded, SYSTEM, max_reply_tokens=16, max_reply_seconds=2.0, context_limit=limit)
    runner.open_session("s")
    runner.set_tools("s", ToolSet((NOTE,), ToolChoice("required", None), parallel=False))
    runner.add_user_text("s", "Note this.")
    assert _reply(runner, "s")[-1].reason == "stop"
    state = runner.sessions["s"]
    used = state.thinker.length + len(state.closing) + 5  # + the user header and the turn's end
    word = len(runner.loaded.tokenizer.encode(" word", add_special_tokens=False))
    runner.add_user_text("s", " word" * ((limit - used - 16 - 8 - spare) // word))
    return runner, _reply(runner, "s")


def test_a_turn_that_may_call_keeps_room_for_the_call(loaded) -> None:
    """A soak at a 2,048-token context: a call began near the end and overflowed the slot. A
    turn whose reply may call keeps room for one (the history starts over instead)."""
    runner, outputs = _near_the_end(loaded, spare=40)
    done = outputs[-1]
    assert isinstance(done, ReplyDone) and done.reason == "stop" and done.stats["history_reset"], done
    assert _calls(outputs)[0]["name"] == "note"


def test_a_call_that_reaches_the_end_of_the_context_is_cut_there(loaded, monkeypatch) -> None:
    """More than a call's room (here: none kept) is cut at the context's end: the reply ends
    there ("length", its call incomplete) instead of failing with a slot overflow, and the next
    turn starts the history over, its tools working."""
    monkeypatch.setattr(turn_parts, "CALL_RESERVE_TOKENS", 0)
    runner, outputs = _near_the_end(loaded, spare=40)
    done = outputs[-1]
    assert isinstance(done, ReplyDone) and done.reason == "length" and not done.stats["history_reset"], done
    assert runner.sessions["s"].thinker.length <= 1024
    assert [o.done for o in outputs if isinstance(o, CallDelta)][-1] is False  # cut inside its call
    runner.add_user_text("s", "Again.")
    after = _reply(runner, "s")
    assert after[-1].reason == "stop" and after[-1].stats["history_reset"] and _calls(after)
