"""Grammar-constrained tool calls in Qwen's format, one matcher per reply (engine thread only).

Qwen3(-Omni)'s chat template writes an assistant's calls as blocks joined by "\\n":

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`<tool_call>` and `</tool_call>` are single added tokens, and the engine finds call spans by
those ids, so the grammar names them by id (`<[id]>`): the model can never spell them out in
pieces, nor write them inside a JSON string (llguidance keeps added tokens out of text). The JSON
is the layout the template's `tojson` renders (separators ", " and ": ", no other whitespace,
properties in schema order): one canonical text per call. After a `</tool_call>` the grammar
allows "\\n" + another call (when the set allows parallel calls) or an end id, nothing else.

Library: llguidance (docs/tools.md "Constrained decoding": its masks measured within reach of
xgrammar's on this vocabulary, without xgrammar's triton and tvm-ffi dependencies). Its own
`apply_token_bitmask_inplace` is a torch.compile'd in-place kernel; here the bitmask is applied
out of place (the logits may be a CUDA graph's output buffer) by one batched `minimum` over the
constrained rows.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Sequence

import llguidance
import llguidance.hf
import torch
from llguidance.torch import fill_next_token_bitmask

from agent.tools.spec import Tool, ToolSchemaError, ToolSet

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
# Qwen's template renders arguments with `tojson` (json.dumps' default separators, raw UTF-8);
# whitespace_flexible=False forbids every other space and newline inside the JSON.
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
# Schema keys whose values are schemas (one, a list of them, or a name -> schema map) that
# closed_objects walks; not, if/then/else and contains are left alone (closing there flips
# their meaning).
_ONE = ("items", "additionalProperties")
_MANY = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties")

# Tokens a reply may spend inside tool calls (its text cap counts the rest): a call's arguments
# can be long, and the grammar ends every call.
MAX_CALL_TOKENS = 1024


# A call that runs this long (a model looping on a digit or inside a string, as the random tiny
# one does greedily) is wound down: from here each step prefers, among the ids its grammar
# allows, those that close something (`"`, then `}` and `]`: _WIND_DOWN), then those that move on
# (`,`), so the call ends in a few tokens and still validates. A real model's calls end long before.
WIND_DOWN_TOKENS = 256
# Room a turn whose reply may call a tool keeps in the context besides its text's (TurnParts):
# one call, wound down at WIND_DOWN_TOKENS and closed within a few more. More calls than that may
# reach the context's end: the reply then ends there, cut (FrameBatcher.take_token).
CALL_RESERVE_TOKENS = WIND_DOWN_TOKENS + 32
# The wind-down's preferences, in order: a quote first (inside a string, "}" and "]" are only
# characters: a model that kept choosing "}" there never closed its call), then what closes an
# object or array, then what moves on.
_WIND_DOWN = (('"',), ("}", "]"), (",",))


class ToolGrammarError(RuntimeError):
    """A constrained reply got a token its grammar does not allow (a sampler bug, not the model's)."""


def closed_objects(schema: Any) -> Any:
    """The schema with every object that lists its properties closed (additionalProperties:
    false) unless it says otherwise. JSON schema leaves such objects open, and the grammar would
    then let the model invent arguments; a call with the declared ones only still validates
    against the original schema. Objects under allOf stay as they are (closing each part of a
    conjunction would reject the other parts' properties)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), (dict, list)):
            out[key] = closed_objects(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    opens = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")
    if "properties" in out and not any(k in out for k in opens):
        out["additionalProperties"] = False
    return out


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """The JSON schema the grammar compiles for a tool's `arguments`, with the canonical layout."""
    schema = closed_objects(tool.schema())
    schema["x-guidance"] = dict(JSON_LAYOUT)  # the top level's options rule the whole schema
    return schema


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a JSON string literal is a valid Lark one


class ToolGrammars:
    """The engine's grammar compiler: built once from the thinker's tokenizer; compiles and
    caches (LRU) one grammar per tool set; `start` hands each reply its own matcher."""

    def __init__(self, tokenizer: Any, vocab: int, eos_ids: Sequence[int], cache_size: int = 32) -> None:
        """tokenizer: a transformers fast tokenizer; vocab: the thinker's logits width (ids from
        the tokenizer's size up to it are never allowed); eos_ids: what may end a reply."""
        if vocab < len(tokenizer):
            raise ValueError(f"logits width {vocab} is below the tokenizer's {len(tokenizer)} ids")
        self.open_id = _single_id(tokenizer, OPEN_TAG)
        self.close_id = _single_id(tokenizer, CLOSE_TAG)
        self.vocab = vocab
        self.eos_ids = tuple(int(i) for i in eos_ids)
        if not self.eos_ids:
            raise ValueError("a reply needs at least one end id")
        # ~1-3 s for Qwen's 151k tokens (the token trie): once per engine.
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(self.eos_ids))
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self.wind_down = _wind_down_masks(tokenizer, vocab)

    @classmethod
    def for_model(cls, loaded: Any, cache_size: int = 32) -> ToolGrammars:
        """For a LoadedModel (agent/engine/checkpoints/model.py): its tokenizer, the thinker's
        lm_head width, its end ids."""
        width = int(loaded.model.thinker.lm_head.out_features)
        return cls(loaded.tokenizer, width, loaded.thinker_eos_ids, cache_size)

    def grammar(self, toolset: ToolSet) -> str:
        """The Lark grammar (llguidance's dialect) of a reply's calls: the cache's key."""
        tools = toolset.offered
        more = ' ("\\n" call)*' if toolset.parallel else ""
        lines = [
            f"start: call{more}",
            f'call: <[{self.open_id}]> "\\n" body "\\n" <[{self.close_id}]>',
            "body: " + " | ".join(f"tool_{i}" for i in range(len(tools))),
        ]
        for i, tool in enumerate(tools):
            head = _lark_string(f'{{"name": "{tool.name}", "arguments": ')
            lines.append(f'tool_{i}: {head} args_{i} "}}"')
            lines.append(f"args_{i}: %json {json.dumps(arguments_schema(tool), ensure_ascii=False)}")
        return "\n".join(lines) + "\n"

    def compile(self, toolset: ToolSet) -> llguidance.LLMatcher:
        """The set's compiled grammar (a matcher in its start state, to copy), from the cache or
        compiled now. Raises ToolSchemaError, naming the tool, when a schema does not compile."""
        if not toolset.calls:
            raise ToolSchemaError("the tool set allows no call")
        text = self.grammar(toolset)
        template = self._cache.get(text)
        if template is not None:
            self._cache.move_to_end(text)
            return template
        template = llguidance.LLMatcher(self._tokenizer, text, log_level=0)
        if template.is_error():
            for tool in toolset.offered:  # one by one, so that the error names its tool
                self._check(tool)
            raise ToolSchemaError(template.get_error())
        self._cache[text] = template
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return template

    def start(self, toolset: ToolSet | None) -> ToolMatcher | None:
        """A new reply's matcher; None when the reply may not call (no tools, or choice "none")."""
        if toolset is None or not toolset.calls:
            return None
        template = self.compile(toolset)
        # "auto": free text until the model itself picks <tool_call>; otherwise a call at once.
        return ToolMatcher(self, template, free_start=toolset.choice.mode == "auto")

    def _check(self, tool: Tool) -> None:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(arguments_schema(tool))
        except ValueError as exc:
            raise ToolSchemaError(str(exc), tool.name) from exc
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise ToolSchemaError(messages[0] if messages else "the schema does not compile", tool.name)


class ToolMatcher:
    """One reply's state against its tool grammar. Per step: `apply_masks` (or `fill`) before the
    choice, `accept` after it."""

    def __init__(self, grammars: ToolGrammars, template: llguidance.LLMatcher, free_start: bool) -> None:
        self._grammars = grammars
        self._template = template
        # deep_copy of a compiled matcher is ~10 µs: no per-reply compile.
        self._matcher: llguidance.LLMatcher | None = None if free_start else template.deep_copy()
        self._in_call = False
        self._ended = False
        self.calls = 0  # complete calls so far
        self._call_tokens = 0  # tokens in the call being written

    @property
    def vocab(self) -> int:
        return self._grammars.vocab

    @property
    def constrained(self) -> bool:
        """Whether the next token is constrained (from the reply's first token on unless the
        choice is "auto"; there, from the model's own <tool_call> on). False once ended."""
        return self._matcher is not None and not self._ended

    @property
    def in_call(self) -> bool:
        """Inside <tool_call> ... </tool_call> (the open tag accepted, the close tag not yet)."""
        return self._in_call

    @property
    def done(self) -> bool:
        """Only an end id is allowed next (the last possible call is complete)."""
        m = self._matcher
        return m is not None and not self._ended and m.is_stopped() and not m.is_error()

    @property
    def ended(self) -> bool:
        """An end id was accepted: the reply is over."""
        return self._ended

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed ids into bitmask[row] ([B, ceil(vocab / 32)] int32 on the CPU, bit
        t % 32 of word t // 32 set = id t allowed); an unconstrained row gets every bit."""
        if not self.constrained:
            bitmask[row].fill_(-1)
            return
        assert self._matcher is not None
        fill_next_token_bitmask(self._matcher, bitmask, row)
        if self._matcher.is_error():
            raise ToolGrammarError(f"tool grammar failed: {self._matcher.get_error()}")
        if self._in_call and self._call_tokens >= WIND_DOWN_TOKENS:
            for preferred in self._grammars.wind_down:
                narrowed = bitmask[row] & preferred
                if bool(narrowed.any()):
                    bitmask[row] = narrowed
                    break

    def accept(self, token: int) -> None:
        """Advance past the chosen token. Raises ToolGrammarError when a constrained reply gets a
        token its grammar does not allow (or any token after its end)."""
        token = int(token)
        if self._ended:
            raise ToolGrammarError(f"token {token} after the reply's end")
        if self._matcher is None:
            if token != self._grammars.open_id:
                self._ended = token in self._grammars.eos_ids
                return
            self._matcher = self._template.deep_copy()
        if not self._matcher.consume_token(token):
            raise ToolGrammarError(f"token {token} is not allowed by the tool grammar: {self._matcher.get_error()}")
        self._call_tokens += 1
        if token == self._grammars.open_id:
            self._in_call, self._call_tokens = True, 0
        elif token == self._grammars.close_id:
            self._in_call = False
            self.calls += 1
        elif token in self._grammars.eos_ids:
            self._ended = True


def apply_masks(logits: torch.Tensor, matchers: Sequence[ToolMatcher | None]) -> torch.Tensor:
    """logits [B, V] with the ids each constrained row's grammar forbids at -inf; other rows as
    they were. Never writes into `logits` (it may be a CUDA graph's output buffer): the result is
    a new tensor, or `logits` itself when no row is constrained."""
    if logits.dim() != 2 or logits.shape[0] != len(matchers):
        raise ValueError(f"logits {tuple(logits.shape)} against {len(matchers)} matchers")
    rows = [(i, m) for i, m in enumerate(matchers) if m is not None and m.constrained]
    if not rows:
        return logits
    batch, vocab = logits.shape
    bitmask = torch.empty((len(rows), (vocab + 31) // 32), dtype=torch.int32)  # the constrained rows only
    for k, (_, m) in enumerate(rows):
        if m.vocab != vocab:
            raise ValueError(f"logits width {vocab} against a grammar built for {m.vocab}")
        m.fill(bitmask, k)
    bias = mask_bias(bitmask.to(logits.device), vocab, logits.dtype)
    if len(rows) == batch:
        return torch.minimum(logits, bias)
    index = torch.tensor([i for i, _ in rows], device=logits.device)
    out = logits.clone()
    out[index] = torch.minimum(logits[index], bias)
    return out


def mask_bias(bitmask: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """[R, words] int32 bitmask (id t = bit t % 32 of word t // 32, llguidance's layout) -> [R,
    vocab] of +inf (allowed) and -inf (forbidden), to take the minimum with: min(x, +inf) is x
    exactly. Elementwise float arithmetic only; on the CPU a `where` or `masked_fill` over a
    bool mask of 152k ids per row ran 4-5x slower."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: bit 31 of a negative word is 1 too
    bits = bits.view(bitmask.shape[0], -1)[:, :vocab]
    return bits.to(dtype).mul_(2).sub_(1).mul_(float("inf"))


def _wind_down_masks(tokenizer: Any, vocab: int) -> tuple[torch.Tensor, ...]:
    """For the wind-down, in one pass over the vocabulary: a [ceil(vocab / 32)] int32 bitmask
    (llguidance's layout) per group of starts (_WIND_DOWN), the ids whose token text starts
    with one of them (byte-level BPE keeps these ASCII characters as they are)."""
    groups = _WIND_DOWN
    bits = torch.zeros(len(groups), ((vocab + 31) // 32) * 32, dtype=torch.bool)
    for token_id, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if token is not None:
            for g, starts in enumerate(groups):
                if token.startswith(starts):
                    bits[g, token_id] = True
    weights = torch.ones(32, dtype=torch.int64) << torch.arange(32)
    words = (bits.view(len(groups), -1, 32).to(torch.int64) * weights).sum(dim=2)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return tuple(words)


def _single_id(tokenizer: Any, tag: str) -> int:
    """The id of an added tag, which must encode as that one token."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the tokenizer has no single token for {tag} (encodes as {ids})")
    return int(ids[0])
