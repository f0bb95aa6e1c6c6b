"""Tool-call grammar cost on this machine: compile time per tool set, mask time per token.

For each realistic tool set (flat, mixed, nested, eight tools together) one valid call is decoded
token by token with the real Qwen tokenizer (agent/engine/checkpoints/qwen_vocab.py: 151k BPE
ids plus the added ones, logits width 152064 like the real thinker) and the tiny model's own
(1057 ids). Rows:

- llguidance, "tool grammar": what the engine ships (agent/engine/stages/tool_grammar.py), the
  whole `<tool_call>` ... `</tool_call>` span; compile = ToolGrammars.compile on an empty cache.
- llguidance / xgrammar, "json body": the same constraint on the call's JSON alone
  ({"name": const, "arguments": schema} for each tool, layout ", " / ": ", closed objects), so
  the two libraries meet on equal terms. xgrammar runs only when importable (it is not a
  dependency: `pip install --target DIR --no-deps xgrammar apache-tvm-ffi`, then PYTHONPATH=DIR).

mask = fill one row's bitmask before a token (µs, p50/p95 over every token of every
repetition); accept = advancing past it; first call = compile + every mask of one call (the
cost of a tool set's first reply: llguidance compiles lazily, xgrammar up front). The last line is `tool_mask_us_per_token=N`: the
shipped grammar's p50 with the real tokenizer.

    PYTHONPATH=. .venv/bin/python scripts/bench_tool_mask.py [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from agent.engine.checkpoints.qwen_vocab import make_qwen_tokenizer
from agent.engine.stages.tool_grammar import ToolGrammars, apply_masks, arguments_schema
from agent.tools.spec import Tool, ToolChoice, ToolSet

QWEN_WIDTH = 152064  # the real thinker's lm_head width (past the tokenizer's 151,676 ids)
CACHE = Path.home() / ".cache" / "omni-agent"

WEATHER = Tool(
    "get_weather",
    "Current weather for a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
    },
)
SEARCH = Tool(
    "search_flights",
    "Search flights",
    {
        "type": "object",
        "properties": {
            "origin": {"type": "string", "minLength": 3, "maxLength": 3},
            "destination": {"type": "string", "minLength": 3, "maxLength": 3},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 50},
            "nonstop": {"type": "boolean"},
            "max_price": {"type": "number", "minimum": 0},
            "cabins": {"type": "array", "items": {"enum": ["economy", "premium", "business", "first"]}, "maxItems": 4},
        },
        "required": ["origin", "destination"],
    },
)
EVENT = Tool(
    "create_event",
    "Add a calendar event",
    {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "start": {
                "type": "object",
                "properties": {"date": {"type": "string"}, "time": {"type": "string"}},
                "required": ["date"],
            },
            "attendees": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "email": {"type": "string"},
                        "optional": {"type": "boolean"},
                    },
                    "required": ["name"],
                },
            },
            "reminders_min": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "priority": {"enum": ["low", "normal", "high"]},
        },
        "required": ["title", "start"],
    },
)


def _simple(name: str, props: dict[str, Any]) -> Tool:
    return Tool(name, name, {"type": "object", "properties": props, "required": list(props)[:1]})


EXTRA = (
    _simple("set_timer", {"seconds": {"type": "integer", "minimum": 1}, "label": {"type": "string"}}),
    _simple("play_music", {"query": {"type": "string"}, "shuffle": {"type": "boolean"}}),
    _simple("send_message", {"to": {"type": "string"}, "text": {"type": "string"}}),
    _simple("set_light", {"room": {"enum": ["kitchen", "living", "bedroom"]}, "level": {"type": "number"}}),
    _simple("lookup_contact", {"name": {"type": "string"}}),
)
ARGS = {
    "get_weather": {"city": "Paris", "unit": "celsius"},
    "search_flights": {
        "origin": "CDG",
        "destination": "JFK",
        "max_results": 10,
        "nonstop": True,
        "max_price": 850.5,
        "cabins": ["economy", "premium"],
    },
    "create_event": {
        "title": "Team sync about the Q3 roadmap",
        "start": {"date": "2025-06-03", "time": "10:30"},
        "attendees": [{"name": "Ana", "email": "ana@example.com"}, {"name": "Bo", "optional": True}],
        "reminders_min": [10, 60],
        "priority": "high",
    },
}
# (schema kind, the tool set, the tool whose call is decoded)
CASES = (
    ("flat", (WEATHER,), "get_weather"),
    ("mixed", (SEARCH,), "search_flights"),
    ("nested", (EVENT,), "create_event"),
    ("8 tools", (WEATHER, SEARCH, EVENT, *EXTRA), "create_event"),
)


def call_json(name: str) -> str:
    return json.dumps({"name": name, "arguments": ARGS[name]}, ensure_ascii=False)


def body_schema(tools: tuple[Tool, ...]) -> dict[str, Any]:
    """The call's JSON alone: {"name": const, "arguments": schema}, one branch per tool."""
    branches = []
    for tool in tools:
        args = arguments_schema(tool)
        args.pop("x-guidance")
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": args},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return {"anyOf": branches} if len(branches) > 1 else branches[0]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def decode(
    make: Callable[[], Any], fill: Callable[[Any], None], accept: Callable[[Any, int], bool], ids: list[int], reps: int
):
    """Time fill (mask) and accept for every token, over `reps` fresh matchers."""
    masks, accepts = [], []
    for _ in range(reps):
        m = make()
        for token in ids:
            t0 = time.perf_counter()
            fill(m)
            t1 = time.perf_counter()
            if not accept(m, token):
                raise RuntimeError(f"token {token} rejected")
            t2 = time.perf_counter()
            masks.append((t1 - t0) * 1e6)
            accepts.append((t2 - t1) * 1e6)
    return masks, accepts


def bench_shipped(tokenizer: Any, width: int, eos: list[int], reps: int, rows: list) -> None:
    grammars = ToolGrammars(tokenizer, width, eos)
    bitmask = torch.empty((1, (width + 31) // 32), dtype=torch.int32)
    for kind, tools, name in CASES:
        toolset = ToolSet(tools, ToolChoice("required"), parallel=False)
        compile_s = []
        for _ in range(reps):
            grammars._cache.clear()  # a miss every time
            compile_s.append(timed(lambda ts=toolset: grammars.compile(ts))[0])
        ids = tokenizer.encode(f"<tool_call>\n{call_json(name)}\n</tool_call>", add_special_tokens=False) + eos[:1]

        def fill(m):
            m.fill(bitmask, 0)

        def accept(m, token):
            m.accept(token)
            return True

        masks, accepts = decode(lambda ts=toolset: grammars.start(ts), fill, accept, ids, reps)
        rows.append(("llguidance", "tool grammar", kind, compile_s, masks, accepts))


def bench_apply(tokenizer: Any, width: int, eos: list[int], reps: int) -> str:
    """apply_masks over a batch of 8 float32 rows (CPU), 1 or 8 of them inside a call's string."""
    grammars = ToolGrammars(tokenizer, width, eos)
    toolset = ToolSet((WEATHER,), ToolChoice("required"))
    prefix = tokenizer.encode(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', add_special_tokens=False
    )
    logits = torch.randn(8, width)
    out = []
    for constrained in (1, 8):
        times = []
        for _ in range(reps * 10):
            matchers = [grammars.start(toolset) if row < constrained else None for row in range(8)]
            for m in matchers:
                for token in prefix if m is not None else ():
                    m.accept(token)
            times.append(timed(lambda ms=matchers: apply_masks(logits, ms))[0] * 1e6)
        out.append(f"{constrained} constrained {statistics.median(times):.0f} us")
    return "apply_masks [8, width]: " + ", ".join(out) + " (p50)"


def bench_body_llguidance(tokenizer: Any, width: int, eos: list[int], reps: int, rows: list) -> None:
    import llguidance
    import llguidance.hf
    from llguidance.torch import fill_next_token_bitmask

    tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=width, eos_token=eos)
    bitmask = torch.empty((1, (width + 31) // 32), dtype=torch.int32)
    for kind, tools, name in CASES:
        schema = body_schema(tools)
        schema["x-guidance"] = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        compile_s = [timed(lambda g=grammar: llguidance.LLMatcher(tok, g, log_level=0))[0] for _ in range(reps)]
        template = llguidance.LLMatcher(tok, grammar, log_level=0)
        assert not template.is_error(), template.get_error()
        ids = tokenizer.encode(call_json(name), add_special_tokens=False)
        masks, accepts = decode(
            lambda t=template: t.deep_copy(),
            lambda m: fill_next_token_bitmask(m, bitmask, 0),
            lambda m, token: m.consume_token(token),
            ids,
            reps,
        )
        rows.append(("llguidance", "json body", kind, compile_s, masks, accepts))


def bench_body_xgrammar(tokenizer: Any, width: int, eos: list[int], reps: int, rows: list) -> bool:
    try:
        import xgrammar
    except ImportError:
        return False
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=width, stop_token_ids=eos)
    bitmask = xgrammar.allocate_token_bitmask(1, width)
    layout: dict[str, Any] = {"any_whitespace": False, "separators": (", ", ": ")}
    for kind, tools, name in CASES:
        schema = body_schema(tools)
        compile_s = []
        for _ in range(reps):
            compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
            compile_s.append(timed(lambda c=compiler, s=schema: c.compile_json_schema(s, **layout))[0])
        compiled = compiler.compile_json_schema(schema, **layout)
        ids = tokenizer.encode(call_json(name), add_special_tokens=False)
        masks, accepts = decode(
            lambda c=compiled: xgrammar.GrammarMatcher(c),
            lambda m: m.fill_next_token_bitmask(bitmask, 0),
            lambda m, token: m.accept_token(token),
            ids,
            reps,
        )
        rows.append(("xgrammar", "json body", kind, compile_s, masks, accepts))
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="compiles and decodes per case (bounded)")
    args = parser.parse_args()
    reps = max(1, min(args.reps, 50))
    torch.set_num_threads(1)

    from transformers import AutoTokenizer

    from agent.engine.checkpoints.tiny import make_tiny

    vocabs = {
        "qwen": (AutoTokenizer.from_pretrained(make_qwen_tokenizer(CACHE / "qwen-tokenizer")), QWEN_WIDTH),
        "tiny": (AutoTokenizer.from_pretrained(make_tiny(CACHE / "tiny-qwen3-omni")), None),
    }
    results: dict[str, list] = {}
    xgrammar_ran = False
    for label, (tokenizer, width) in vocabs.items():
        width = width or len(tokenizer)
        eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
        rows: list = []
        setup_s, _ = timed(lambda t=tokenizer, w=width, e=eos: ToolGrammars(t, w, e))
        print(f"# {label}: {len(tokenizer)} ids, width {width}; ToolGrammars() (token trie) {setup_s * 1e3:.0f} ms")
        bench_shipped(tokenizer, width, eos, reps, rows)
        print(f"# {label}: {bench_apply(tokenizer, width, eos, reps)}")
        bench_body_llguidance(tokenizer, width, eos, reps, rows)
        xgrammar_ran = bench_body_xgrammar(tokenizer, width, eos, reps, rows) or xgrammar_ran
        results[label] = rows

    head = f"{'library':<11} {'grammar':<13} {'tokenizer':<9} {'schema':<8} {'compile ms':>10} {'mask p50 us':>11} {'mask p95 us':>11} {'accept p50 us':>13} {'first call ms':>13} {'tokens':>6}"
    print(head)
    print("-" * len(head))
    for label, rows in results.items():
        for lib, grammar, kind, compile_s, masks, accepts in rows:
            print(
                f"{lib:<11} {grammar:<13} {label:<9} {kind:<8} {statistics.median(compile_s) * 1e3:>10.2f} "
                f"{statistics.median(masks):>11.1f} {pct(masks, 0.95):>11.1f} {statistics.median(accepts):>13.1f} "
                f"{(compile_s[0] * 1e6 + sum(masks[: len(masks) // reps])) / 1e3:>13.2f} {len(masks) // reps:>6}"
            )
    if not xgrammar_ran:
        print("# xgrammar not importable: its rows are missing")
    shipped = [m for lib, grammar, _, _, masks, _ in results["qwen"] if grammar == "tool grammar" for m in masks]
    print(f"tool_mask_us_per_token={statistics.median(shipped):.0f}")


if __name__ == "__main__":
    main()
