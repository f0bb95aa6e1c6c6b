"""Degradation level 2: replies from a small text-only model while the service is overloaded.

The fallback cannot hear: the Omni runner does the listening, this one only counts how long the
user spoke. Its prompt is the system prompt, the session's conversation text so far, then a user
message saying audio understanding is paused. Every active reply advances together: one batched
forward per step over left-padded rows of one shared DynamicCache, so N sessions cost one model
call per token, not N.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from agent.engine.api import Output, ReplyDone, StageTime, TextDelta
from agent.engine.checkpoints.builds import build_once
from agent.engine.codecs.detok import IncrementalDecoder

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

BUILD_VERSION = 1  # bump when the build below changes: a stale build is then rebuilt
MARKER_FILE = "omni_agent_tiny_text.json"
SEED = 4321
INPUT_RATE = 16000  # append_audio's PCM rate (api.Runner)
DEFAULT_SYSTEM_PROMPT = "You are a helpful real-time voice assistant. Answer briefly."
DEFAULT_NOTICE = (
    "(The user spoke for {seconds:.1f} s. Audio understanding is paused while the service is overloaded; "
    "reply briefly and ask them to repeat shortly.)"
)


def make_tiny_text(path: Path, tokenizer_dir: Path | None = None) -> Path:
    """Build the tiny Qwen3 text checkpoint into `path` unless a complete build is there.

    Atomic and idempotent like tiny.make_tiny (builds.build_once).
    """
    from transformers import AutoTokenizer

    from agent.engine.checkpoints.tiny_tokenizer import build_tokenizer

    def build_into(out: Path) -> dict:
        # The tiny Omni's own tokenizer when given, so ids match the Omni model's.
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir)) if tokenizer_dir else build_tokenizer()
        model = build_tiny_text(tokenizer)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        return {
            "seed": SEED,
            "params": model.num_parameters(),
            "tokenizer_from": str(tokenizer_dir) if tokenizer_dir else "tiny_tokenizer.build_tokenizer",
        }

    return build_once(path, MARKER_FILE, BUILD_VERSION, build_into)


def build_tiny_text(tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A tiny random Qwen3ForCausalLM over `tokenizer`, in memory (what make_tiny_text saves)."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    im_start, im_end, eot = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=im_start,
        eos_token_id=[im_end, eot],
        pad_token_id=eot,
    )
    with torch.random.fork_rng(devices=[]):  # construction draws from the global RNG: leave the caller's alone
        model = Qwen3ForCausalLM(config).eval()
    # Every parameter redrawn from our own generator: the result does not depend on which tensors
    # transformers' _init_weights happens to cover (5.24 leaves some as torch.empty elsewhere).
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * config.initializer_range)
    model.generation_config = GenerationConfig(eos_token_id=[im_end, eot], pad_token_id=eot, bos_token_id=im_start)
    return model


@dataclass
class _Reply:
    session_id: str
    prompt: list[int]
    decoder: IncrementalDecoder
    history_used: int
    started: float
    unsent: list[int] = field(default_factory=list)  # token ids no TextDelta has carried yet
    cancelled: bool = False
    done: bool = False


@dataclass
class _Session:
    samples: int = 0
    history: list[tuple[str, str]] = field(default_factory=list)
    reply: _Reply | None = None


@dataclass
class _Batch:
    """One row per prefilled reply. Left padding keeps every row's newest token in the last
    column, so one forward extends all rows; `mask` says which columns are a row's real tokens."""

    rows: list[_Reply]
    cache: DynamicCache
    mask: torch.Tensor  # [B, L] long
    next_pos: torch.Tensor  # [B] RoPE position of each row's next token (its real length)
    last: torch.Tensor  # [B] each row's newest token: the next forward's input


class FallbackRunner:
    """api.Runner for a text-only causal LM loaded with from_pretrained; greedy decoding."""

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        max_reply_tokens: int = 32,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        notice: str = DEFAULT_NOTICE,
        max_prompt_tokens: int = 1024,
        stop_token_ids: Sequence[int] | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if max_reply_tokens < 1 or max_prompt_tokens < 1:
            raise ValueError("max_reply_tokens and max_prompt_tokens must be positive")
        self.device = torch.device(device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        layer_types = getattr(self.model.config.get_text_config(decoder=True), "layer_types", None) or ()
        if any(t != "full_attention" for t in layer_types):
            # Rows merged by left padding would slide out of a window at different times.
            raise ValueError(f"{model_path}: sliding-window layers are not supported by the fallback batcher")
        self.max_reply_tokens, self.max_prompt_tokens = max_reply_tokens, max_prompt_tokens
        self.system_prompt, self.notice = system_prompt, notice
        self.stop_ids = frozenset(stop_token_ids) if stop_token_ids is not None else self._default_stop_ids()
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else min(self.stop_ids)  # always masked: any id will do
        self._sessions: dict[str, _Session] = {}
        self._queue: list[_Reply] = []  # begun, not prefilled yet
        self._batch: _Batch | None = None

    def _default_stop_ids(self) -> frozenset[int]:
        eos = self.model.generation_config.eos_token_id
        ids = {*(eos if isinstance(eos, list) else [eos]), self.tokenizer.eos_token_id}
        # <|im_end|> closes a ChatML turn, which is what the manual prompt format asks for.
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids |= {im_end} if im_end != self.tokenizer.unk_token_id else set()
        ids.discard(None)
        if not ids:
            raise ValueError("the fallback model names no end-of-sequence token")
        return frozenset(int(i) for i in ids)

    def render(self, messages: Sequence[tuple[str, str]]) -> str:
        """The prompt text for (role, text) messages, ending with the assistant's turn opened."""
        if getattr(self.tokenizer, "chat_template", None):
            # enable_thinking=False: Qwen3's template then closes an empty <think> block, so the
            # fallback answers at once instead of reasoning first; other templates ignore it.
            return self.tokenizer.apply_chat_template(
                [{"role": r, "content": c} for r, c in messages],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=False,
            )
        return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in messages) + "<|im_start|>assistant\n"

    def prompt_ids(self, session_id: str) -> tuple[list[int], int]:
        """The prompt a reply begun now would get, and how many history messages it keeps: the
        oldest go until it fits max_prompt_tokens (the system prompt and the notice always stay)."""
        session = self._sessions[session_id]
        notice = ("user", self.notice.format(seconds=session.samples / INPUT_RATE))
        history = session.history
        for start in range(len(history) + 1):
            text = self.render([("system", self.system_prompt), *history[start:], notice])
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) <= self.max_prompt_tokens:
                return ids, len(history) - start
        raise ValueError(f"system prompt and notice alone exceed max_prompt_tokens={self.max_prompt_tokens}")

    # ---- Runner protocol (engine thread only) --------------------------------------------------

    def open_session(self, session_id: str) -> None:
        self._sessions[session_id] = _Session()

    def close_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        for reply in [*self._queue, *(self._batch.rows if self._batch else ())]:
            if reply.session_id == session_id:  # its reply, and one cancelled not yet ended
                reply.done = True  # its row goes at the next step, with no output

    def append_audio(self, session_id: str, pcm: np.ndarray) -> None:
        self._sessions[session_id].samples += int(np.asarray(pcm).size)

    def discard_turn(self, session_id: str) -> None:
        self._sessions[session_id].samples = 0

    def set_history(self, session_id: str, history: Sequence[tuple[str, str]]) -> None:
        """The conversation text so far, oldest first, as (role, text) with role user|assistant."""
        if any(role not in ("user", "assistant") for role, _ in history):  # the system turn is ours
            raise ValueError(f"history roles must be user or assistant: {[r for r, _ in history]}")
        self._sessions[session_id].history = [(role, str(text)) for role, text in history]

    def begin_reply(self, session_id: str, images: list[np.ndarray], text_only: bool = True) -> None:
        """Queue a reply. images and text_only are the protocol's; a text-only model uses neither."""
        session = self._sessions[session_id]
        if session.reply is not None:
            raise RuntimeError(f"{session_id}: a reply is already active; cancel it first")
        prompt, used = self.prompt_ids(session_id)
        session.samples = 0  # the turn has ended
        session.reply = _Reply(session_id, prompt, IncrementalDecoder(self.tokenizer), used, time.perf_counter())
        self._queue.append(session.reply)

    def cancel_reply(self, session_id: str) -> None:
        session = self._sessions.get(session_id)
        if session is not None and session.reply is not None:
            # Detached now, ended (its ReplyDone) at the start of the next step: the next reply's
            # begin may come before that step (one drain of a busy engine's inbox) and must not
            # find this one still active.
            session.reply.cancelled = True
            session.reply = None

    def has_work(self) -> bool:
        return bool(self._queue) or self._batch is not None

    def idle_s(self) -> float:
        return 0.0  # no playout pacing: work that is there is due

    @torch.no_grad()
    def step(self) -> list[Output]:
        """Every active reply gains one token: running rows from one batched decode forward,
        newly begun replies from one batched prefill forward (its logits give their first token)."""
        outputs: list[Output] = []
        for reply in [*self._queue, *(self._batch.rows if self._batch else ())]:
            if reply.cancelled and not reply.done:
                outputs += self._finish(reply, "cancelled")
        self._queue = [r for r in self._queue if not r.done]
        self._compact()
        if self._batch is not None:
            outputs += self._decode(self._batch)
        if self._queue:
            joined, made = self._prefill(self._queue)
            self._queue, outputs = [], outputs + made
            self._batch = joined if self._batch is None else _concat(self._batch, joined, self.model.config)
        self._compact()
        return outputs

    def _prefill(self, replies: list[_Reply]) -> tuple[_Batch, list[Output]]:
        from transformers import DynamicCache

        started = time.perf_counter()
        width = max(len(r.prompt) for r in replies)
        ids = torch.full((len(replies), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(replies), width), dtype=torch.long)
        for i, reply in enumerate(replies):
            ids[i, width - len(reply.prompt) :] = torch.tensor(reply.prompt)
            mask[i, width - len(reply.prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        # Explicit positions: a row's real tokens start at 0 however much padding precedes them.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
        )
        tokens = out.logits[:, -1].argmax(-1)
        made = [StageTime("fallback_prefill", time.perf_counter() - started), *self._take(replies, tokens.tolist())]
        return _Batch(replies, cache, mask, mask.sum(-1), tokens), made

    def _decode(self, batch: _Batch) -> list[Output]:
        started = time.perf_counter()
        mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=1)
        out = self.model(
            input_ids=batch.last[:, None],
            attention_mask=mask,
            position_ids=batch.next_pos[:, None],
            cache=batch.cache,
            use_cache=True,
        )
        # Only once the forward succeeded: mask and cache keep the same width if it raises.
        batch.mask, batch.next_pos = mask, batch.next_pos + 1
        batch.last = out.logits[:, -1].argmax(-1)
        tokens = batch.last.tolist()
        return [StageTime("fallback_decode", time.perf_counter() - started), *self._take(batch.rows, tokens)]

    def _take(self, replies: list[_Reply], tokens: list[int]) -> list[Output]:
        outputs: list[Output] = []
        for reply, token in zip(replies, tokens):
            if token in self.stop_ids:
                outputs += self._finish(reply, "stop")
                continue
            reply.unsent.append(token)
            delta = reply.decoder.push(token)
            if delta:
                outputs.append(TextDelta(reply.session_id, delta, tuple(reply.unsent)))
                reply.unsent = []
            if len(reply.decoder.ids) >= self.max_reply_tokens:
                outputs += self._finish(reply, "length")
        return outputs

    def _finish(self, reply: _Reply, reason: str) -> list[Output]:
        reply.done = True
        session = self._sessions.get(reply.session_id)
        if session is not None and session.reply is reply:
            session.reply = None
        # A cancelled reply keeps only what was sent (what the user saw); others release the rest.
        tail = reply.decoder.finish() if reason != "cancelled" else ""
        outputs: list[Output] = [TextDelta(reply.session_id, tail, tuple(reply.unsent))] if tail else []
        stats = {
            "prompt_tokens": len(reply.prompt),
            "text_tokens": len(reply.decoder.ids),
            "token_ids": tuple(reply.decoder.ids),
            "history_messages": reply.history_used,
            "reply_seconds": time.perf_counter() - reply.started,
        }
        return [*outputs, ReplyDone(reply.session_id, reason, text=reply.decoder.text, stats=stats)]

    def _compact(self) -> None:
        """Drop finished rows, then the leading columns no remaining row uses (bounded cache)."""
        from transformers import DynamicCache

        batch = self._batch
        if batch is None or not any(r.done for r in batch.rows):
            return
        keep = [i for i, r in enumerate(batch.rows) if not r.done]
        if not keep:
            self._batch = None
            return
        index = torch.tensor(keep, device=self.device)
        mask = batch.mask[index]
        start = int(mask.any(0).nonzero()[0])
        cache = DynamicCache(
            ddp_cache_data=[(k[index, :, start:], v[index, :, start:]) for k, v, _ in batch.cache],
            config=self.model.config,
        )
        self._batch = _Batch(
            [batch.rows[i] for i in keep], cache, mask[:, start:], batch.next_pos[index], batch.last[index]
        )


def _concat(a: _Batch, b: _Batch, config: Any) -> _Batch:
    """Stack two batches, the narrower left-padded with masked zero columns to the other's width."""
    from transformers import DynamicCache

    width = max(a.mask.shape[1], b.mask.shape[1])

    def pad(t: torch.Tensor, seq_dim_from_end: int) -> torch.Tensor:  # left-pad the sequence dim
        n = width - t.shape[-seq_dim_from_end]
        return torch.nn.functional.pad(t, (0, 0) * (seq_dim_from_end - 1) + (n, 0)) if n else t

    layers = [
        (torch.cat([pad(ka, 2), pad(kb, 2)]), torch.cat([pad(va, 2), pad(vb, 2)]))
        for (ka, va, _), (kb, vb, _) in zip(a.cache, b.cache)
    ]
    return _Batch(
        a.rows + b.rows,
        DynamicCache(ddp_cache_data=layers, config=config),
        torch.cat([pad(a.mask, 1), pad(b.mask, 1)]),
        torch.cat([a.next_pos, b.next_pos]),
        torch.cat([a.last, b.last]),
    )
