"""The tiny checkpoint's tokenizer: a byte-level BPE trained here on a fixed corpus.

Qwen2's pre-tokenizer and the real checkpoint's added tokens in the real order, after a
~1024-entry vocabulary (so their ids differ from the real ones). The fallback runner builds
it too when it is given no tokenizer folder.
"""

from __future__ import annotations

import json

BPE_VOCAB_SIZE = 1024
SEED = 1234  # draws the training text's random sentences: the vocabulary depends on it

# The real checkpoint's added tokens, in its order (ids 151643..151675 there).
# (token, special): Qwen3 marks the tool/think tags as non-special added tokens.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)

# Fixed training text: enough English for a ~1024-entry BPE, with the chat roles repeated so
# that "system", "user" and "assistant" each become one token (the talker finds user turns by
# the token after <|im_start|>).
_CORPUS = """\
You are a helpful voice assistant. You can see the camera and hear the user.
Answer briefly and clearly, in a friendly voice. Describe what you see when asked.
Hello agent, what do you see? I see a person sitting at a desk in front of a window.
The weather is nice today. It is sunny and warm, with a few clouds in the sky.
Can you hear me? Yes, I can hear you well. What would you like to talk about?
Please tell me the time. It is half past three in the afternoon.
What color is the cup on the table? The cup is blue and the table is made of wood.
Thank you very much. You are welcome, I am happy to help with anything else.
One two three four five six seven eight nine ten. 0123456789 + - * / = ( ) [ ] { }
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
"""
_ROLES = "system\nuser\nassistant\n"
_WORDS = (
    "the a an and or but if then when where what who why how which this that these those here there "
    "i you he she it we they me him her us them my your his its our their mine yours is are was were be "
    "been being have has had do does did will would can could shall should may might must not no yes "
    "hello hi thanks please sorry okay good great nice bad big small long short new old high low left right "
    "up down in out on off over under above below near far into onto from to of for with without about "
    "see look hear listen say tell speak talk ask answer know think feel want need like love help try "
    "make take give get go come move turn stop start open close read write play work run walk sit stand "
    "person people man woman child friend camera picture image video sound voice music word sentence "
    "room desk table chair window door wall floor light lamp screen phone computer keyboard book paper "
    "cup glass bottle water coffee tea food apple bread plant flower tree sky cloud sun rain wind snow "
    "red orange yellow green blue purple black white gray brown color shape round square bright dark "
    "one two three four five six seven eight nine ten hundred thousand first second third last next "
    "time day night morning evening today tomorrow yesterday minute hour week month year now soon later "
    "city street car bus train road home house school office shop park river sea mountain world country "
    "question problem idea reason example number part place thing way life hand eye face head name"
).split()


def build_tokenizer():
    """Byte-level BPE with Qwen2's pre-tokenizer, trained on the fixed corpus above."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    bpe.train_from_iterator(_training_text(), trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    # Give the added tokens their ids in the vocab itself, in the real order: Qwen2Tokenizer
    # registers its named specials (eos, pad, image_token, ...) first, and add_tokens keeps an
    # id the vocab already has, so this is what fixes the order.
    bpe_size = len(model["vocab"])
    vocab = dict(model["vocab"])
    vocab.update({tok: bpe_size + i for i, (tok, _) in enumerate(ADDED_TOKENS)})
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        model_max_length=32768,
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "audio_token": "<|audio_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
        },
    )
    # One call, in order, so the ids follow the real checkpoint's order after the BPE vocab.
    tokenizer.add_tokens([AddedToken(tok, special=special, normalized=False) for tok, special in ADDED_TOKENS])
    for i, (tok, _) in enumerate(ADDED_TOKENS):
        if tokenizer.convert_tokens_to_ids(tok) != bpe_size + i:
            raise RuntimeError(f"special token {tok} is not at its place in the real order")
    return tokenizer


def _training_text() -> list[str]:
    """The fixed corpus plus seeded random sentences over a word list, enough for ~1024 merges."""
    import random

    rng = random.Random(SEED)
    sentences = []
    for _ in range(400):
        words = rng.choices(_WORDS, k=rng.randint(4, 12))
        sentences.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return [_CORPUS] * 4 + [_ROLES] * 64 + sentences


def single_token_id(tokenizer, word: str) -> int:
    """The id of `word`, which must be one token (the chat roles are: the talker reads them)."""
    ids = tokenizer.encode(word, add_special_tokens=False)
    if len(ids) != 1:
        raise RuntimeError(f"tokenizer splits {word!r} into {ids}: the chat roles must be single tokens")
    return ids[0]
