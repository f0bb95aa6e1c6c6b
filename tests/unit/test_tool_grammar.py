"""Grammar-constrained tool calls (agent/engine/stages/tool_grammar.py, agent/tools/spec.py).

Pinned behaviour: driven by the tiny model's real thinker, a constrained reply is always a valid
call in Qwen's layout (`<tool_call>` and `</tool_call>` as their single added ids, a JSON object
whose name is an offered tool and whose arguments validate against its schema) for 200 seeded
random schemas; "auto" is free until the model picks `<tool_call>`; a named choice names that
function only; after `</tool_call>` only "\\n" + `<tool_call>` or an end id may follow; a
disallowed token raises; a schema the library cannot compile raises ToolSchemaError naming its
tool; apply_masks never writes into its input and leaves unconstrained rows as they were. The
real Qwen tokenizer (151k ids, wider logits) gets the layout and tag checks too.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, Sequence

import jsonschema
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from agent.engine.stages.tool_grammar import ToolGrammarError, ToolGrammars, ToolMatcher, apply_masks
from agent.tools.spec import Tool, ToolChoice, ToolSchemaError, ToolSet

WORDS = ("city", "unit", "query", "limit", "mode", "tags", "when", "room", "level", "name", "note", "flag")
CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)
PROMPT = "<|im_start|>user\nPlease call the tool.<|im_end|>\n<|im_start|>assistant\n"
WEATHER = Tool(
    "get_weather",
    "Current weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
    },
)


def value_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum", "const"] + (["array", "object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        schema: dict[str, Any] = {"type": "string", "maxLength": rng.randint(1, 10)}
        if rng.random() < 0.3:
            schema["minLength"] = 1
        return schema
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": rng.choice([1, 10, 1000])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4)) + ([rng.randint(0, 9)] if rng.random() < 0.3 else [])}
    if kind == "const":
        return {"const": rng.choice(WORDS)}
    if kind == "array":
        schema = {"type": "array", "items": value_schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
        if rng.random() < 0.5:
            schema["minItems"] = 1
        return schema
    return object_schema(rng, depth + 1)


def object_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    names = [
        f"{w}_{i}" for i, w in enumerate(rng.sample(WORDS, rng.randint(1 if depth else 0, 4 if depth == 0 else 3)))
    ]
    schema: dict[str, Any] = {"type": "object", "properties": {n: value_schema(rng, depth) for n in names}}
    if names and rng.random() < 0.8:
        # At the top, at least one: otherwise the model may answer {} and prove little.
        schema["required"] = rng.sample(names, rng.randint(0 if depth else 1, len(names)))
    return schema


class Constrain(LogitsProcessor):
    """generate()'s hook: accept each row's last token, then mask the next one's logits."""

    def __init__(self, matchers: Sequence[ToolMatcher | None], prompt_len: int) -> None:
        self.matchers, self.prompt_len = matchers, prompt_len
        self.steps = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:
            for row, m in enumerate(self.matchers):
                if m is not None and not m.ended:
                    m.accept(int(input_ids[row, -1]))
        self.steps += 1
        return self.edit(apply_masks(scores.float(), self.matchers))

    def edit(self, scores: torch.Tensor) -> torch.Tensor:
        return scores


def generate(loaded, processor: Constrain, rows: int, max_new: int, seed: int = 0) -> list[list[int]]:
    """The tiny thinker's replies to PROMPT, each cut after its first end id. Sampled (seeded),
    not greedy: greedy, the random weights repeat one digit of a number forever, and sampling
    reaches more of each grammar."""
    prompt = loaded.tokenizer.encode(PROMPT)
    processor.prompt_len = len(prompt)
    ids = torch.tensor([prompt] * rows)
    eos = loaded.thinker_eos_ids
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = loaded.model.thinker.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            logits_processor=LogitsProcessorList([processor]),
            max_new_tokens=max_new,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            eos_token_id=eos,
            pad_token_id=eos[1],
        )
    replies = []
    for row in out[:, len(prompt) :].tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)
        assert end is not None, f"no end within {max_new} tokens: {loaded.tokenizer.decode(row)!r}"
        replies.append(row[: end + 1])
    return replies


def calls_of(loaded, grammars: ToolGrammars, reply: list[int]) -> list[dict[str, Any]]:
    """The calls in a reply, after checking the layout: each tag a single added id, the JSON
    between them on its own line, the blocks joined by "\\n", an end id last."""
    text = loaded.tokenizer.decode(reply[:-1])
    assert reply[-1] in grammars.eos_ids
    assert reply.count(grammars.open_id) == text.count("<tool_call>")
    assert reply.count(grammars.close_id) == text.count("</tool_call>")
    bodies = CALL.findall(text)
    assert "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in bodies) == text[text.index("<tool_call>") :]
    calls = [json.loads(b) for b in bodies]
    for body, call in zip(bodies, calls):
        assert list(call) == ["name", "arguments"]
        assert body.startswith(f'{{"name": "{call["name"]}", "arguments": ')
    return calls


@pytest.fixture(scope="module")
def grammars(loaded) -> ToolGrammars:
    return ToolGrammars.for_model(loaded)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> tuple[Any, ToolGrammars]:
    """The real Qwen tokenizer, its grammars at the real thinker's logits width (152064)."""
    from transformers import AutoTokenizer

    from agent.engine.checkpoints.qwen_vocab import make_qwen_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_qwen_tokenizer(tmp_path_factory.mktemp("qwen") / "tok"))
    eos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    return tokenizer, ToolGrammars(tokenizer, 152064, eos)


def allowed(matcher: ToolMatcher) -> set[int]:
    scores = apply_masks(torch.zeros(1, matcher.vocab), [matcher])
    return set(torch.isfinite(scores[0]).nonzero().flatten().tolist())


def test_random_schemas_give_valid_calls(loaded, grammars):
    rng = random.Random(20250603)
    schemas = [object_schema(rng) for _ in range(200)]
    valid = 0
    lengths: list[int] = []
    for start in range(0, len(schemas), 50):
        batch = schemas[start : start + 50]
        sets = [
            ToolSet((Tool(f"tool_{start + i}", "", s),), ToolChoice("required"), parallel=False)
            for i, s in enumerate(batch)
        ]
        matchers = [grammars.start(ts) for ts in sets]
        replies = generate(loaded, Constrain(matchers, 0), len(batch), 400, seed=start)
        lengths.extend(len(r) for r in replies)
        for reply, schema, ts in zip(replies, batch, sets):
            (call,) = calls_of(loaded, grammars, reply)
            assert call["name"] == ts.tools[0].name
            jsonschema.validate(call["arguments"], schema)
            assert reply[0] == grammars.open_id and reply[-2] == grammars.close_id
            valid += 1
    assert valid == 200
    assert max(lengths) < 400


def test_auto_is_free_until_the_model_opens_a_call(loaded, grammars):
    """Free text first (the open tag and the end ids held back by the test), then the test
    forces <tool_call>: from there on the reply is a constrained call, then the end."""
    toolset = ToolSet((WEATHER, Tool("noop")), ToolChoice("auto"), parallel=False)
    matcher = grammars.start(toolset)
    free = 6
    seen: list[bool] = []

    class Force(Constrain):
        def edit(self, scores: torch.Tensor) -> torch.Tensor:
            seen.append(matcher.constrained)
            if self.steps <= free:
                scores[:, [grammars.open_id, grammars.close_id, *grammars.eos_ids]] = float("-inf")
            elif self.steps == free + 1:
                scores = torch.full_like(scores, float("-inf"))
                scores[:, grammars.open_id] = 0.0
            return scores

    (reply,) = generate(loaded, Force([matcher], 0), 1, 200)
    assert seen[: free + 1] == [False] * (free + 1) and all(seen[free + 1 :])
    assert reply[free] == grammars.open_id and grammars.open_id not in reply[:free]
    (call,) = calls_of(loaded, grammars, reply)
    assert call["name"] in ("get_weather", "noop")
    jsonschema.validate(call["arguments"], next(t for t in toolset.tools if t.name == call["name"]).parameters)


def test_named_choice_calls_only_that_function(loaded, grammars):
    tools = (
        WEATHER,
        Tool("noop"),
        Tool("set_light", "", {"type": "object", "properties": {"on": {"type": "boolean"}}}),
    )
    toolset = ToolSet(tools, ToolChoice.parse({"type": "function", "name": "set_light"}), parallel=False)
    matchers = [grammars.start(toolset) for _ in range(3)]
    for reply in generate(loaded, Constrain(matchers, 0), 3, 200):
        (call,) = calls_of(loaded, grammars, reply)
        assert call["name"] == "set_light"
        jsonschema.validate(call["arguments"], tools[2].parameters)
    # Another of the set's functions is refused at its name.
    text = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    with pytest.raises(ToolGrammarError, match="not allowed"):
        accept_all(grammars.start(toolset), loaded.tokenizer.encode(text))


def feed(matcher: ToolMatcher, ids: Sequence[int]) -> None:
    """Accept `ids`, each after checking that the mask allows it."""
    for token in ids:
        assert token in allowed(matcher), token
        matcher.accept(token)


def accept_all(matcher: ToolMatcher, ids: Sequence[int]) -> None:
    for token in ids:
        matcher.accept(token)


def test_after_a_call_only_another_or_the_end(loaded, grammars):
    tokenizer = loaded.tokenizer
    newline = tokenizer.encode("\n")
    (nl,) = newline
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    matcher = grammars.start(ToolSet((WEATHER,), ToolChoice("required")))
    assert matcher.constrained and not matcher.in_call
    feed(matcher, tokenizer.encode(call)[:3])
    assert matcher.in_call and not matcher.done
    feed(matcher, tokenizer.encode(call)[3:])
    assert not matcher.in_call and not matcher.done and matcher.calls == 1
    assert allowed(matcher) == {nl, *grammars.eos_ids}
    feed(matcher, [nl])
    assert allowed(matcher) == {grammars.open_id}
    feed(matcher, tokenizer.encode(call))
    assert allowed(matcher) == {nl, *grammars.eos_ids}
    feed(matcher, [grammars.eos_ids[0]])
    assert matcher.ended and not matcher.constrained and matcher.calls == 2
    # One call only: the end is all that may follow.
    single = grammars.start(ToolSet((WEATHER,), ToolChoice("required"), parallel=False))
    feed(single, tokenizer.encode(call))
    assert single.done and allowed(single) == set(grammars.eos_ids)


def test_a_disallowed_token_raises(loaded, grammars):
    tokenizer = loaded.tokenizer
    required = grammars.start(ToolSet((WEATHER,), ToolChoice("required")))
    with pytest.raises(ToolGrammarError):
        required.accept(tokenizer.encode("Hi")[0])  # text where the call must open
    matcher = grammars.start(ToolSet((WEATHER,), ToolChoice("required")))
    feed(matcher, tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "'))
    with pytest.raises(ToolGrammarError):
        matcher.accept(grammars.close_id)  # the close tag inside a string
    auto = grammars.start(ToolSet((WEATHER,), ToolChoice("auto")))
    feed(auto, tokenizer.encode("Sure.") + [grammars.eos_ids[0]])
    with pytest.raises(ToolGrammarError):
        auto.accept(tokenizer.encode("x")[0])  # after the end


def test_schemas_that_do_not_compile_raise(grammars):
    bad = [
        {"type": "object", "properties": {"a": {"type": "strin"}}},
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-z"}}},
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]},
    ]
    for schema in bad:
        toolset = ToolSet((WEATHER, Tool("broken", "", schema)), ToolChoice("required"))
        with pytest.raises(ToolSchemaError) as err:
            grammars.start(toolset)
        assert err.value.tool_name == "broken", err.value
    for make in (
        lambda: Tool("bad name"),
        lambda: Tool("f", "", {"type": "string"}),
        lambda: ToolSet((WEATHER, WEATHER)),
        lambda: ToolSet((WEATHER,), ToolChoice("function", "other")),
        lambda: ToolChoice.parse("sometimes"),
    ):
        with pytest.raises(ToolSchemaError):
            make()


def test_apply_masks_leaves_the_input_and_free_rows_alone(loaded, grammars):
    vocab = grammars.vocab
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    auto = grammars.start(ToolSet((WEATHER,), ToolChoice("auto")))
    required = grammars.start(ToolSet((WEATHER,), ToolChoice("required")))
    assert apply_masks(logits, [None, auto, None, None]) is logits  # nothing constrained: no copy
    out = apply_masks(logits, [None, auto, required, None])
    torch.testing.assert_close(logits, before, rtol=0, atol=0)
    torch.testing.assert_close(out[[0, 1, 3]], before[[0, 1, 3]], rtol=0, atol=0)
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [grammars.open_id]
    assert out[2, grammars.open_id] == before[2, grammars.open_id]
    torch.testing.assert_close(apply_masks(logits[2:3], [required]), out[2:3], rtol=0, atol=0)  # every row constrained
    with pytest.raises(ValueError):
        apply_masks(torch.zeros(2, vocab + 1), [required, None])


def test_ids_past_the_tokenizer_are_never_allowed(loaded):
    wide = ToolGrammars(loaded.tokenizer, len(loaded.tokenizer) + 40, loaded.thinker_eos_ids)
    matcher = wide.start(ToolSet((WEATHER,), ToolChoice("required")))
    feed(matcher, loaded.tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "'))
    ids = allowed(matcher)
    assert len(ids) > 100 and max(ids) < len(loaded.tokenizer)
    assert not ids & {wide.open_id, wide.close_id, *wide.eos_ids}  # no added token inside a string


def test_toolsets_are_values_and_compile_once(loaded, grammars):
    a = ToolSet((WEATHER, Tool("noop", "does nothing", {})), ToolChoice("required"))
    b = ToolSet(
        (Tool("get_weather", "Current weather", dict(WEATHER.parameters)), Tool("noop", "does nothing")),
        ToolChoice.parse("required"),
    )
    assert a == b and hash(a) == hash(b) and a.key() == b.key()
    assert json.loads(a.key())["tools"][1]["parameters"] == {"type": "object", "properties": {}}
    assert grammars.compile(a) is grammars.compile(b)
    assert grammars.start(ToolSet((WEATHER,), ToolChoice("none"))) is None
    assert grammars.start(ToolSet((), ToolChoice("auto"))) is None and grammars.start(None) is None
    assert ToolChoice.parse({"type": "function", "function": {"name": "noop"}}) == ToolChoice("function", "noop")
    # Objects are closed: an argument the schema does not list is refused.
    matcher = grammars.start(ToolSet((WEATHER,), ToolChoice("required")))
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "zz": 1}}\n</tool_call>'
    with pytest.raises(ToolGrammarError, match="not allowed"):
        accept_all(matcher, loaded.tokenizer.encode(text))


def test_real_qwen_vocabulary(qwen):
    """The real vocabulary: the canonical tokenization of a rendered call is what the grammar
    allows, step by step; the tags are Qwen's ids; ids past the tokenizer never appear."""
    tokenizer, grammars = qwen
    assert (grammars.open_id, grammars.close_id) == (151657, 151658)
    toolset = ToolSet((WEATHER, Tool("noop")), ToolChoice("required"))
    rendered = "\n".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
        for n, a in (("get_weather", {"city": "Zürich", "unit": "c"}), ("noop", {}))
    )
    matcher = grammars.start(toolset)
    feed(matcher, tokenizer.encode(rendered))
    assert allowed(matcher) == {198, *grammars.eos_ids}
    inside = grammars.start(toolset)
    feed(inside, tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "'))
    ids = allowed(inside)
    assert len(ids) > 100_000 and max(ids) < len(tokenizer)
    assert not ids & set(range(151643, 152064))  # no added token, nothing past the tokenizer
