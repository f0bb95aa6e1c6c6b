"""How replies are decoded and capped, per model: the defaults a checkpoint brings with it.

A random tiny model rarely ends a reply and has nothing to say, so it is decoded greedily and
capped short (48 tokens, 4 s). Any other checkpoint is decoded as Qwen3-Omni's own code does,
with caps long enough never to cut a real reply (docs/decoding.md):

- the thinker: the checkpoint's `generation_config.json` (do_sample, temperature, top_k, top_p,
  repetition_penalty, max_new_tokens) where it says, else Qwen's demo settings (sampled at
  temperature 0.6, top-k 20, top-p 0.95);
- the talker: transformers' `generate()` defaults (sampled at temperature 0.9, top-k 50,
  repetition penalty 1.05), overridable in the same file as `talker_<name>` keys;
- the code predictor: what `generate()` hard-codes when the talker samples (top-k 50, top-p
  0.8), `code_predictor_<name>` keys in the same file;
- the system prompt: Qwen's recommended voice-assistant prompt (stable, speakable output).

Torch-free: the network side reads these through agent.config.Config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

TINY_MARKER = "omni_agent_tiny.json"  # written by agent.engine.checkpoints.tiny into the checkpoints it builds

TINY_SYSTEM_PROMPT = "You are a helpful real-time voice assistant. Answer briefly."
# Qwen3-Omni's recommended system prompt for spoken replies (its web demo's default when audio is
# generated): short, plain, speakable sentences, no stage directions the talker would read out.
QWEN_VOICE_SYSTEM_PROMPT = (
    "You are a virtual voice assistant with no gender or age.\n"
    "You are communicating with the user.\n"
    "In user messages, \u201cI/me/my/we/our\u201d refer to the user and \u201cyou/your\u201d refer to the "
    "assistant. In your replies, address the user as \u201cyou/your\u201d and yourself as \u201cI/me/my\u201d; "
    "never mirror the user\u2019s pronouns\u2014always shift perspective. Keep original pronouns only in "
    "direct quotes; if a reference is unclear, ask a brief clarifying question.\n"
    "Interact with users using short(no more than 50 words), brief, straightforward language, "
    "maintaining a natural tone.\n"
    "Never use formal phrasing, mechanical expressions, bullet points, overly structured language. \n"
    "Your output must consist only of the spoken content you want the user to hear. \n"
    "Do not include any descriptions of actions, emotions, sounds, or voice changes. \n"
    "Do not use asterisks, brackets, parentheses, or any other symbols to indicate tone or actions. \n"
    "You must answer users' audio or text questions, do not directly describe the video content. \n"
    "You should communicate in the same language strictly as the user unless they request otherwise.\n"
    "When you are uncertain (e.g., you can't see/hear clearly, don't understand, or the user makes a "
    "comment rather than asking a question), use appropriate questions to guide the user to continue "
    "the conversation.\n"
    "Keep replies concise and conversational, as if talking face-to-face."
)

# Caps for a real model: a reply ends when the model ends it; these only stop a runaway.
REAL_MAX_REPLY_TOKENS = 1024
REAL_MAX_REPLY_SECONDS = 60.0
TINY_MAX_REPLY_TOKENS = 48
TINY_MAX_REPLY_SECONDS = 4.0
CODEC_FRAME_SECONDS = 0.08  # one talker token is one 80 ms codec frame


@dataclass(frozen=True)
class Sampling:
    """One stage's decoding, with generate()'s parameter names and meanings. Greedy
    (do_sample False) still applies the repetition penalty, as generate() does."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> "Sampling":
        return replace(self, do_sample=False)


GREEDY = Sampling()
QWEN_THINKER = Sampling(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)
QWEN_TALKER = Sampling(do_sample=True, temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)
QWEN_CODE_PREDICTOR = Sampling(do_sample=True, top_k=50, top_p=0.8)


@dataclass(frozen=True)
class Decoding:
    """The three stages' decoding and where reply seeds come from (None: fresh per reply)."""

    thinker: Sampling = GREEDY
    talker: Sampling = replace(GREEDY, repetition_penalty=1.05)
    code_predictor: Sampling = GREEDY
    seed: int | None = None

    @classmethod
    def greedy(cls, seed: int | None = None) -> "Decoding":
        """generate(thinker_do_sample=False, talker_do_sample=False): argmax everywhere, the
        talker's repetition penalty kept (what the streaming engine has always matched)."""
        return cls(seed=seed)

    def all_greedy(self) -> "Decoding":
        return replace(
            self, thinker=self.thinker.greedy, talker=self.talker.greedy, code_predictor=self.code_predictor.greedy
        )

    @property
    def samples(self) -> bool:
        return any(s.do_sample for s in (self.thinker, self.talker, self.code_predictor))


@dataclass(frozen=True)
class ModelDefaults:
    """What a model's replies get unless the command line says otherwise."""

    max_reply_tokens: int
    max_reply_seconds: float
    system_prompt: str
    decoding: Decoding
    tiny: bool  # the random tiny checkpoint (short caps, greedy, a tiny fallback model)


def is_tiny(model: str) -> bool:
    """The default tiny checkpoint ("") or a folder agent.engine.checkpoints.tiny built (its marker file)."""
    return not model or (Path(model) / TINY_MARKER).is_file()


def defaults_for(model: str, decoding: str = "auto", seed: int | None = None) -> ModelDefaults:
    """The defaults for `model` (a path, a hub id, or "" for the tiny checkpoint). `decoding`:
    auto (the model's own), greedy (argmax in every stage) or sample (the model's own, with
    every stage sampled even where its file says greedy)."""
    if decoding not in ("auto", "greedy", "sample"):
        raise ValueError(f"decoding must be auto, greedy or sample, got {decoding!r}")
    tiny = is_tiny(model)
    file = _generation_config(model)
    if tiny:
        base = Decoding(seed=seed)
        tokens, seconds, prompt = TINY_MAX_REPLY_TOKENS, TINY_MAX_REPLY_SECONDS, TINY_SYSTEM_PROMPT
    else:
        base = Decoding(QWEN_THINKER, QWEN_TALKER, QWEN_CODE_PREDICTOR, seed)
        tokens, seconds, prompt = REAL_MAX_REPLY_TOKENS, REAL_MAX_REPLY_SECONDS, QWEN_VOICE_SYSTEM_PROMPT
    chosen = Decoding(
        thinker=_stage(base.thinker, file, ""),
        talker=_stage(base.talker, file, "talker_"),
        code_predictor=_stage(base.code_predictor, file, "code_predictor_"),
        seed=seed,
    )
    if decoding == "greedy":
        chosen = chosen.all_greedy()
    elif decoding == "sample":
        chosen = replace(
            chosen,
            thinker=replace(chosen.thinker, do_sample=True),
            talker=replace(chosen.talker, do_sample=True),
            code_predictor=replace(chosen.code_predictor, do_sample=True),
        )
    if isinstance(file.get("max_new_tokens"), int) and file["max_new_tokens"] >= 2:
        tokens = file["max_new_tokens"]
    if isinstance(file.get("talker_max_new_tokens"), int) and file["talker_max_new_tokens"] >= 2:
        # generate() renders one frame per talker token but the last one.
        seconds = (file["talker_max_new_tokens"] - 1) * CODEC_FRAME_SECONDS
    return ModelDefaults(tokens, seconds, prompt, chosen, tiny)


def _stage(base: Sampling, file: dict[str, Any], prefix: str) -> Sampling:
    """`base` with whatever the generation config sets under `prefix` + generate()'s names."""
    kinds = {
        "do_sample": bool,
        "temperature": (int, float),
        "top_k": int,
        "top_p": (int, float),
        "repetition_penalty": (int, float),
    }
    found = {}
    for name, kind in kinds.items():
        value = file.get(prefix + name)
        if value is not None and isinstance(value, kind) and not (name != "do_sample" and isinstance(value, bool)):
            found[name] = type(getattr(base, name))(value)
    if "top_k" in found and found["top_k"] < 0:
        found["top_k"] = 0  # generate() treats top_k <= 0 as no filter
    return replace(base, **found)


def _generation_config(model: str) -> dict[str, Any]:
    """The model's generation_config.json as a dict ({} when it has none or it cannot be read):
    a local folder's own file, else the hub's (cached; fetched when online)."""
    if not model:
        return {}
    path = Path(model) / "generation_config.json"
    if not Path(model).is_dir():
        try:
            from transformers.utils import cached_file

            found = cached_file(
                model,
                "generation_config.json",
                _raise_exceptions_for_missing_entries=False,
                _raise_exceptions_for_connection_errors=False,
            )
        except Exception:  # no hub, no cache, a gated repo: the model's defaults are ours then
            found = None
        if found is None:
            return {}
        path = Path(found)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
