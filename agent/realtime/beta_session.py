"""Beta-era session fields read as their GA places.

Clients written for the beta Realtime API (many tutorials, older framework plugins) send a flat
session: `modalities`, `voice`, `input_audio_format`, `turn_detection`, … at the top. GA moved
them under `audio.input`/`audio.output` and renamed some. Dropping them silently would leave
such a client believing, say, that it turned server VAD off while the server goes on answering
every pause; so each one with a GA equivalent is moved there before the update is merged
(and validated: a beta value GA cannot hold is refused like the GA field would be). Where the
same update also sets the GA field, the GA field wins. The session echoed back is GA-shaped.
"""

from __future__ import annotations

from typing import Any

# Beta format names and the GA format objects they mean.
_FORMATS = {
    "pcm16": {"type": "audio/pcm", "rate": 24000},
    "g711_ulaw": {"type": "audio/pcmu"},
    "g711_alaw": {"type": "audio/pcma"},
}
# Beta top-level field -> its GA path (the value moves as it is, formats excepted).
_MOVES: dict[str, tuple[str, ...]] = {
    "voice": ("audio", "output", "voice"),
    "speed": ("audio", "output", "speed"),
    "input_audio_format": ("audio", "input", "format"),
    "output_audio_format": ("audio", "output", "format"),
    "input_audio_transcription": ("audio", "input", "transcription"),
    "input_audio_noise_reduction": ("audio", "input", "noise_reduction"),
    "turn_detection": ("audio", "input", "turn_detection"),
    "max_response_output_tokens": ("max_output_tokens",),
    "modalities": ("output_modalities",),
}
BETA_FIELDS = frozenset(_MOVES)


def _format(value: Any) -> Any:
    # An unknown name becomes a format of that type, so validation names it under its GA param.
    return dict(_FORMATS.get(value, {"type": value})) if isinstance(value, str) else value


def _modalities(value: Any) -> Any:
    # Beta's ["audio", "text"] (the usual spoken reply) is GA's ["audio"]: GA audio replies carry
    # their transcript; ["text"] stays text only.
    if isinstance(value, list) and "audio" in value:
        return ["audio"]
    return value


def _has(tree: dict[str, Any], path: tuple[str, ...]) -> bool:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return False
        tree = tree[key]
    return True


def _put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        child = tree.get(key)
        tree[key] = child = dict(child) if isinstance(child, dict) else {}
        tree = child
    tree[path[-1]] = value


def to_ga(update: dict[str, Any]) -> dict[str, Any]:
    """`update` with its beta fields moved to their GA places (a new dict; `update` is left as
    it was). An update with no beta field comes back unchanged."""
    if not BETA_FIELDS & update.keys():
        return update
    out = {k: v for k, v in update.items() if k not in BETA_FIELDS}
    for field, path in _MOVES.items():
        if field not in update or _has(update, path):
            continue
        value = update[field]
        if field.endswith("_format"):
            value = _format(value)
        elif field == "modalities":
            value = _modalities(value)
        _put(out, path, value)
    return out
