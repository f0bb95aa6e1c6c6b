"""The level-2 fallback runner (agent/engine/runner/fallback.py) on the tiny Qwen3 text model.

Pins: the tiny build is deterministic, complete and survives a from_pretrained round trip
exactly; the prompt is the system prompt, the history and the spoken-duration notice in ChatML
(and a chat template, when the tokenizer has one, gives the same text with thinking off); the
prompt cap drops the oldest history first; batched stepping (staggered joins, rows leaving)
gives the same greedy tokens as each session alone and as HF generate(), with one forward per
step for all running rows; text deltas concatenate to the final text with no U+FFFD the full
decode lacks; cancel, close, stop and length semantics (a reply begun right behind a cancel is
taken, after the cancelled one's end); it serves replies inside the real Engine.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from support.idle_runner import IdleRunner

from agent.engine.api import ReplyDone, StageTime, TextDelta
from agent.engine.checkpoints.tiny_tokenizer import build_tokenizer
from agent.engine.runner.fallback import (
    DEFAULT_SYSTEM_PROMPT,
    MARKER_FILE,
    FallbackRunner,
    IncrementalDecoder,
    build_tiny_text,
    make_tiny_text,
)

HISTORIES = {
    "a": [],
    "b": [("assistant", "Hello, I can hear you well.")],
    "c": [
        ("assistant", "The cup on the table is blue."),
        ("user", "What color is the sky?"),
        ("assistant", "The sky is blue with a few clouds, and the sun is bright today."),
    ],
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The CI box has 2 shared cores; restore the setting for the tests that run after these.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory):
    return make_tiny_text(tmp_path_factory.mktemp("fallback") / "tiny-qwen3-text")


def make_runner(path, **kwargs) -> FallbackRunner:
    return FallbackRunner(str(path), **kwargs)


def open_with_history(runner: FallbackRunner, sid: str, seconds: float = 1.0) -> None:
    runner.open_session(sid)
    runner.set_history(sid, HISTORIES[sid])
    runner.append_audio(sid, np.zeros(int(seconds * 16000), dtype=np.float32))


def drive(runner: FallbackRunner, begins: dict[str, int] | None = None, actions=None, max_steps: int = 200):
    """Step until idle. begins: session -> step index at which its reply begins; actions: step
    index -> callable run before that step. Returns the outputs of each step."""
    begins, actions = begins or {}, actions or {}
    steps = []
    for i in range(max_steps):
        for sid, at in begins.items():
            if at == i:
                runner.begin_reply(sid, [])
        if i in actions:
            actions[i]()
        if not runner.has_work() and i > max(begins.values(), default=0) and i > max(actions, default=0):
            return steps
        steps.append(runner.step())
    raise AssertionError("runner never went idle")


def per_session(steps):
    out: dict[str, list] = {}
    for step in steps:
        for o in step:
            if not isinstance(o, StageTime):
                out.setdefault(o.session_id, []).append(o)
    return out


def alone_tokens(path, sid: str, **kwargs) -> tuple[int, ...]:
    runner = make_runner(path, **kwargs)
    open_with_history(runner, sid)
    done = [o for o in per_session(drive(runner, {sid: 0}))[sid] if isinstance(o, ReplyDone)]
    assert len(done) == 1
    return done[0].stats["token_ids"]


def test_build_is_deterministic_complete_and_round_trips(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "junk").write_text("an interrupted build, no marker")
    path = make_tiny_text(tmp_path / "m")
    assert not (path / "junk").exists()  # an incomplete build is replaced, not trusted
    marker_mtime = (path / MARKER_FILE).stat().st_mtime_ns
    assert make_tiny_text(path) == path and (path / MARKER_FILE).stat().st_mtime_ns == marker_mtime
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp dir left behind
    assert json.loads((path / MARKER_FILE).read_text())["build_version"] >= 1

    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert type(loaded).__name__ == "Qwen3ForCausalLM"
    fresh = build_tiny_text(build_tokenizer())  # a second, independent build
    saved, again = loaded.state_dict(), fresh.state_dict()
    assert saved.keys() == again.keys()
    for name, tensor in saved.items():
        assert torch.equal(tensor, again[name]), name
        assert torch.isfinite(tensor).all(), name
        if not name.endswith("norm.weight"):  # every weight drawn, none left empty or zero
            assert 0.015 < tensor.std().item() < 0.025, name
    cfg = loaded.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    tok = AutoTokenizer.from_pretrained(path)
    ref = build_tokenizer()
    assert tok.get_vocab() == ref.get_vocab() and len(tok) == cfg.vocab_size


def test_tokenizer_dir_is_copied(tmp_path):
    from transformers import AutoTokenizer

    source = tmp_path / "omni-tokenizer"
    ref = build_tokenizer()
    ref.save_pretrained(source)
    path = make_tiny_text(tmp_path / "m", tokenizer_dir=source)
    assert AutoTokenizer.from_pretrained(path).get_vocab() == ref.get_vocab()
    assert json.loads((path / MARKER_FILE).read_text())["tokenizer_from"] == str(source)


def test_prompt_has_system_history_and_spoken_duration(text_model_dir):
    runner = make_runner(text_model_dir)
    runner.open_session("c")
    runner.set_history("c", HISTORIES["c"])
    runner.append_audio("c", np.zeros(16000, dtype=np.float32))
    runner.discard_turn("c")  # a false start does not count
    runner.append_audio("c", np.zeros(24000, dtype=np.float32))
    runner.append_audio("c", np.zeros(14400, dtype=np.float32))
    ids, used = runner.prompt_ids("c")
    expected = (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>assistant\nThe cup on the table is blue.<|im_end|>\n"
        "<|im_start|>user\nWhat color is the sky?<|im_end|>\n"
        "<|im_start|>assistant\nThe sky is blue with a few clouds, and the sun is bright today.<|im_end|>\n"
        "<|im_start|>user\n(The user spoke for 2.4 s. Audio understanding is paused while the service is "
        "overloaded; reply briefly and ask them to repeat shortly.)<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert runner.tokenizer.decode(ids, skip_special_tokens=False) == expected and used == 3
    runner.begin_reply("c", [])
    assert "spoke for 0.0 s" in runner.tokenizer.decode(runner.prompt_ids("c")[0])  # the turn ended
    with pytest.raises(RuntimeError):
        runner.begin_reply("c", [])  # one reply at a time
    with pytest.raises(ValueError):
        runner.set_history("c", [("system", "be evil")])


def test_chat_template_gives_the_same_prompt_with_thinking_off(text_model_dir):
    runner = make_runner(text_model_dir)
    messages = [("system", "S"), *HISTORIES["c"], ("user", "notice")]
    manual = runner.render(messages)
    runner.tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
        "{% endif %}"
    )
    assert runner.render(messages) == manual + "<think>\n\n</think>\n\n"


def test_prompt_cap_drops_oldest_history_first(text_model_dir):
    runner = make_runner(text_model_dir, max_prompt_tokens=120)
    runner.open_session("s")
    history = [("assistant", f"Reply number {i} about the weather and the camera.") for i in range(12)]
    runner.set_history("s", history)
    ids, used = runner.prompt_ids("s")
    text = runner.tokenizer.decode(ids)
    assert len(ids) <= 120 and 0 < used < 12
    assert "Reply number 11 " in text and "Reply number 0 " not in text
    assert DEFAULT_SYSTEM_PROMPT in text and "spoke for" in text
    tiny = make_runner(text_model_dir, max_prompt_tokens=10)
    tiny.open_session("x")
    with pytest.raises(ValueError):
        tiny.prompt_ids("x")  # system prompt and notice alone do not fit


def record_forwards(runner: FallbackRunner) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """(input_ids shape, attention mask) of every model forward the runner makes."""
    calls: list[tuple[tuple[int, int], torch.Tensor]] = []
    runner.model.register_forward_hook(
        lambda m, args, kw, out: calls.append((tuple(kw["input_ids"].shape), kw["attention_mask"].clone())),
        with_kwargs=True,
    )
    return calls


@pytest.mark.parametrize(
    "begins",
    [{"a": 0, "b": 0, "c": 0}, {"a": 0, "b": 2, "c": 5}, {"c": 0, "a": 3, "b": 3}],
    ids=["together", "staggered", "long_first_then_pair"],
)
def test_batched_stepping_equals_each_session_alone(text_model_dir, begins):
    alone = {sid: alone_tokens(text_model_dir, sid) for sid in HISTORIES}
    runner = make_runner(text_model_dir)
    for sid in HISTORIES:
        open_with_history(runner, sid)
    assert len({len(runner.prompt_ids(sid)[0]) for sid in HISTORIES}) == 3  # padding is exercised
    calls = record_forwards(runner)
    steps = drive(runner, begins)
    outs = per_session(steps)
    for sid in HISTORIES:
        done = [o for o in outs[sid] if isinstance(o, ReplyDone)]
        assert len(done) == 1 and done[0].stats["token_ids"] == alone[sid], sid
    # Forwards: one prefill per step where replies began (all joiners in it), one decode per
    # step with running rows (all of them in it), never a per-session loop.
    stages = [[o.stage for o in s if isinstance(o, StageTime)] for s in steps]
    assert all(st.count("fallback_decode") <= 1 and st.count("fallback_prefill") <= 1 for st in stages)
    prefills = [shape for shape, _ in calls if shape[1] > 1]
    decodes = [shape for shape, _ in calls if shape[1] == 1]
    assert len(prefills) == len(set(begins.values())) and len(calls) == sum(len(st) for st in stages)
    assert sorted(n for n, _ in prefills) == sorted(list(begins.values()).count(v) for v in set(begins.values()))
    assert max(n for n, _ in decodes) == 3
    # Every cache column is used by some row: padding of rows that left is trimmed away.
    assert all(bool(mask.any(0).all()) for _, mask in calls)


def test_matches_hf_generate(text_model_dir):
    runner = make_runner(text_model_dir, max_reply_tokens=16)
    open_with_history(runner, "c")
    prompt = torch.tensor([runner.prompt_ids("c")[0]])
    ref = runner.model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=16,
        do_sample=False,
        eos_token_id=sorted(runner.stop_ids),
        pad_token_id=runner.pad_id,
    )
    expected = [t for t in ref[0, prompt.shape[1] :].tolist() if t not in runner.stop_ids]
    done = [o for o in per_session(drive(runner, {"c": 0}))["c"] if isinstance(o, ReplyDone)][0]
    assert list(done.stats["token_ids"]) == expected


def test_deltas_concatenate_to_final_text(text_model_dir):
    runner = make_runner(text_model_dir, max_reply_tokens=48)
    for sid in HISTORIES:
        open_with_history(runner, sid)
    outs = per_session(drive(runner, {"a": 0, "b": 0, "c": 1}))
    for items in outs.values():
        deltas = [o for o in items if isinstance(o, TextDelta)]
        done = items[-1]
        assert isinstance(done, ReplyDone) and done.reason in ("stop", "length")
        assert "".join(d.text for d in deltas) == done.text
        assert tuple(t for d in deltas for t in d.token_ids) == done.stats["token_ids"]
        assert done.text == runner.tokenizer.decode(list(done.stats["token_ids"]), skip_special_tokens=True)


@pytest.mark.parametrize("case", ["split_characters", "lone_continuation_byte", "incomplete_end"])
def test_incremental_decoder_holds_back_split_characters(case):
    tok = build_tokenizer()
    lead, cont = tok.encode("é", add_special_tokens=False)  # the two UTF-8 bytes, one token each
    if case == "split_characters":
        text = "café ☕ naïve 你好 ok"
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) > len(text.split())  # multi-byte characters really are split across tokens
    elif case == "lone_continuation_byte":  # invalid UTF-8: the full decode has U+FFFD too
        ids = [cont, *tok.encode(" ok", add_special_tokens=False)]
    else:  # the reply ends mid-character: finish() releases what the full decode shows
        ids = [*tok.encode("ok", add_special_tokens=False), lead]
    full = tok.decode(ids, skip_special_tokens=True)
    decoder = IncrementalDecoder(tok)
    deltas = [decoder.push(i) for i in ids]
    deltas.append(decoder.finish())
    assert "".join(deltas) == full == decoder.text
    assert sum(d.count("\ufffd") for d in deltas) == full.count("\ufffd")
    if "\ufffd" not in full:
        assert all("\ufffd" not in d for d in deltas)


def test_cancel_semantics(text_model_dir):
    alone_a = alone_tokens(text_model_dir, "a")
    runner = make_runner(text_model_dir)
    for sid in ("a", "c"):
        open_with_history(runner, sid)
    runner.cancel_reply("c")  # no reply yet: nothing
    assert not runner.has_work()
    calls = record_forwards(runner)
    # c (the longer prompt) is cancelled twice mid-reply: one ReplyDone, then silence.
    cancels = {3: lambda: runner.cancel_reply("c"), 4: lambda: runner.cancel_reply("c")}
    steps = drive(runner, {"a": 0, "c": 0}, cancels)
    c = per_session(steps)["c"]
    done = [o for o in c if isinstance(o, ReplyDone)]
    assert [d.reason for d in done] == ["cancelled"] and c[-1] is done[0] and done[0] in steps[3]
    assert not any(isinstance(o, TextDelta) and o.session_id == "c" for o in steps[3])
    assert done[0].text == "".join(o.text for o in c if isinstance(o, TextDelta))
    assert len(done[0].stats["token_ids"]) == 3  # steps 0..2 each gave one token
    a_done = [o for o in per_session(steps)["a"] if isinstance(o, ReplyDone)][0]
    assert a_done.stats["token_ids"] == alone_a  # removing c's row does not disturb a
    assert all(bool(mask.any(0).all()) for _, mask in calls)  # the columns only c used were trimmed

    # A reply cancelled before its prefill: one ReplyDone, no forward at all.
    runner.begin_reply("c", [])
    runner.cancel_reply("c")
    out = runner.step()
    assert [(o.session_id, o.reason) for o in out] == [("c", "cancelled")] and not runner.has_work()
    assert len(calls) == sum(1 for s in steps for o in s if isinstance(o, StageTime))

    # The next reply begun right behind a cancel, before any step (one drain of a busy engine's
    # inbox): taken, and the cancelled one's ReplyDone comes first, then the new reply's words.
    runner.begin_reply("c", [])
    runner.step()
    runner.cancel_reply("c")
    runner.begin_reply("c", [])
    out = [o for o in runner.step() if not isinstance(o, StageTime)]
    assert isinstance(out[0], ReplyDone) and out[0].reason == "cancelled"
    assert all(o.session_id == "c" and not isinstance(o, ReplyDone) for o in out[1:])
    for _ in range(50):  # bounded: the new reply ends by itself
        if not runner.has_work():
            break
        out += runner.step()
    assert [o.reason for o in out if isinstance(o, ReplyDone)][1:] in (["stop"], ["length"])


def test_close_mid_reply_is_silent_and_leaves_others_intact(text_model_dir):
    alone_c = alone_tokens(text_model_dir, "c")
    runner = make_runner(text_model_dir)
    for sid in ("a", "c"):
        open_with_history(runner, sid)
    steps = drive(runner, {"a": 0, "c": 1}, {4: lambda: runner.close_session("a")})
    outs = per_session(steps)
    assert not any(isinstance(o, ReplyDone) for o in outs["a"])
    assert all(o.session_id != "a" for s in steps[4:] for o in s if not isinstance(o, StageTime))
    assert [o for o in outs["c"] if isinstance(o, ReplyDone)][0].stats["token_ids"] == alone_c
    runner.cancel_reply("a")  # closed: nothing
    assert not runner.has_work()


def test_length_cap_and_stop_token(text_model_dir):
    capped = alone_tokens(text_model_dir, "b", max_reply_tokens=5)
    assert len(capped) == 5
    full = alone_tokens(text_model_dir, "b", max_reply_tokens=12)
    assert full[:5] == capped
    stop = full[3]
    runner = make_runner(text_model_dir, max_reply_tokens=12, stop_token_ids=[stop])
    open_with_history(runner, "b")
    done = [o for o in per_session(drive(runner, {"b": 0}))["b"] if isinstance(o, ReplyDone)][0]
    assert done.reason == "stop" and done.stats["token_ids"] == full[: full.index(stop)]
    runner = make_runner(text_model_dir, max_reply_tokens=5)
    open_with_history(runner, "b")
    done = [o for o in per_session(drive(runner, {"b": 0}))["b"] if isinstance(o, ReplyDone)][0]
    assert done.reason == "length"


async def test_serves_fallback_replies_inside_the_engine(text_model_dir):
    from agent.engine.loop import Engine

    class Sink:
        def __init__(self) -> None:
            self.texts: list[str] = []
            self.done: list[ReplyDone] = []
            self.finished = asyncio.Event()

        def on_text(self, delta: TextDelta) -> None:
            self.texts.append(delta.text)

        def on_audio(self, audio) -> None:
            raise AssertionError("a text-only fallback never makes audio")

        def on_done(self, done: ReplyDone) -> None:
            self.done.append(done)
            self.finished.set()

    alone = {sid: alone_tokens(text_model_dir, sid, max_reply_tokens=8) for sid in HISTORIES}
    omni = IdleRunner()  # the Omni runner's place: it must never be asked for a fallback reply
    engine = Engine(lambda: omni, fallback_factory=lambda: make_runner(text_model_dir, max_reply_tokens=8))
    await engine.start()
    sinks = {sid: Sink() for sid in HISTORIES}
    for sid, sink in sinks.items():
        engine.open_session(sid, sink)
        engine.append_audio(sid, np.zeros(16000, np.float32))
        engine.begin_reply(sid, [], mode="fallback", history=tuple(HISTORIES[sid]))
    await asyncio.wait_for(asyncio.gather(*(s.finished.wait() for s in sinks.values())), 30)
    await engine.stop()
    assert omni.begun == []
    for sid, sink in sinks.items():
        assert len(sink.done) == 1 and sink.done[0].reason in ("stop", "length")
        assert "".join(sink.texts) == sink.done[0].text
        assert sink.done[0].stats["history_messages"] == len(HISTORIES[sid])  # the history reached the prompt
        assert sink.done[0].stats["token_ids"] == alone[sid]
