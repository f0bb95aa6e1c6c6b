"""One response and the GA events that describe it, from response.created to response.done.

A response's output items: an assistant message with one content part (spoken replies carry
`output_audio`, the transcript streaming as response.output_audio_transcript.*; text replies
`output_text`, response.output_text.*), and the function calls the model made
(agent/realtime/function_calls.py), in the order they began. Without tools the message is
announced with the response (what clients without tools have always seen); a response that may
call tools announces its message with its first words, so a response that only calls has no
empty message. Every event carries the ids strict clients check (response_id, item_id,
output_index, content_index).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from agent.realtime.events import PCM_FORMAT, assistant_item, new_id
from agent.realtime.function_calls import FunctionCall

STATUS_BY_REASON = {"stop": "completed", "length": "incomplete", "cancelled": "cancelled", "error": "failed"}


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else round(seconds * 1000, 1)


@dataclass
class Response:
    audio: bool  # a spoken reply (the talker runs) rather than text only
    mode: str  # audio | text | fallback (the degradation ladder's view)
    end_of_turn: float  # time.monotonic() the reply was asked for
    conversation_id: str
    voice: str
    max_tokens: Optional[int] = None
    metadata: Optional[dict[str, str]] = None
    id: str = field(default_factory=lambda: new_id("resp"))
    item_id: str = field(default_factory=lambda: new_id("item"))
    text: str = ""
    tokens: int = 0
    deltas: list[tuple[int, str]] = field(default_factory=list)  # (tokens so far, text so far) per delta
    samples: int = 0  # 24 kHz samples produced
    ttft: Optional[float] = None
    ttfa: Optional[float] = None
    prefilled: Optional[float] = None  # seconds from its creation to the engine's end of its prefill (ReplyInput)
    heard_ms: Optional[float] = None  # a barge-in: how much of its audio the user heard
    engine_open: bool = True  # the engine has not ended this reply yet
    status: str = "in_progress"
    tools: bool = False  # it may call tools: its message is announced with its first words
    message_index: Optional[int] = None  # the message's output_index, once announced
    calls: list[FunctionCall] = field(default_factory=list)
    # What its prefill put in the model (the engine's ReplyInput, once the prefill is done): the
    # input usage of a response that ends before the engine's own count comes back (a cancel).
    input: dict[str, int] = field(default_factory=dict)

    # ---- ids and shapes -------------------------------------------------------------------
    def _ids(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item_id, "output_index": self.message_index, "content_index": 0}

    @property
    def outputs(self) -> int:
        """Output items announced so far."""
        return (self.message_index is not None) + len(self.calls)

    def call(self, index: int) -> FunctionCall:
        """The response's call `index` (the engine's count), made when it begins."""
        while len(self.calls) <= index:
            self.calls.append(FunctionCall(self.id, self.outputs))
        return self.calls[index]

    def item(self, status: str, content: Optional[str]) -> dict[str, Any]:
        return assistant_item(self.item_id, self.audio, status, content)

    def _part(self) -> dict[str, Any]:
        return {"type": "audio", "transcript": self.text} if self.audio else {"type": "text", "text": self.text}

    def body(
        self,
        output: list[dict[str, Any]],
        usage: Optional[dict[str, Any]] = None,
        status_details: Optional[dict[str, Any]] = None,
    ) -> dict[str, Any]:
        return {
            "object": "realtime.response",
            "id": self.id,
            "status": self.status,
            "status_details": status_details,
            "output": output,
            "conversation_id": self.conversation_id,
            "output_modalities": ["audio"] if self.audio else ["text"],
            "audio": {"output": {"format": dict(PCM_FORMAT), "voice": self.voice}},
            "max_output_tokens": "inf" if self.max_tokens is None else self.max_tokens,
            "usage": usage,
            "metadata": self.metadata,
        }

    # ---- events ---------------------------------------------------------------------------
    def started(self) -> list[dict[str, Any]]:
        return [{"type": "response.created", "response": self.body([]), "omni": {"mode": self.mode}}]

    def message_started(self, previous_item_id: Optional[str]) -> list[dict[str, Any]]:
        """The message item's announcement (its conversation.item.added too)."""
        self.message_index = self.outputs
        item = self.item("in_progress", None)
        return [
            {
                "type": "response.output_item.added",
                "response_id": self.id,
                "output_index": self.message_index,
                "item": item,
            },
            {"type": "conversation.item.added", "previous_item_id": previous_item_id, "item": item},
            {"type": "response.content_part.added", **self._ids(), "part": self._part()},
        ]

    def text_delta(self, text: str, n_tokens: int) -> dict[str, Any]:
        self.text += text
        self.tokens += n_tokens
        self.deltas.append((self.tokens, self.text))
        kind = "response.output_audio_transcript.delta" if self.audio else "response.output_text.delta"
        return {"type": kind, **self._ids(), "delta": text}

    def audio_delta(self, pcm: np.ndarray) -> dict[str, Any]:
        self.samples += len(pcm)
        data = base64.b64encode(pcm.astype("<i2").tobytes()).decode("ascii")
        return {"type": "response.output_audio.delta", **self._ids(), "delta": data}

    def text_upto(self, tokens: int) -> str:
        """The text of the first `tokens` tokens (a truncation's transcript)."""
        text = ""
        for count, upto in self.deltas:
            if count > tokens:
                break
            text = upto
        return text

    def finished(
        self,
        status: str,
        reason: Optional[str],
        stats: dict[str, Any],
        error: Optional[str] = None,
        error_code: str = "engine_error",
    ) -> list[dict[str, Any]]:
        """The closing events; status: completed | incomplete | cancelled | failed. A call the
        model had not finished is incomplete."""
        self.status = status
        item_status = "completed" if status == "completed" else "incomplete"
        events: list[dict[str, Any]] = []
        outputs: list[tuple[int, dict[str, Any]]] = []
        if self.message_index is not None:
            if self.audio:
                events.append({"type": "response.output_audio.done", **self._ids()})
                events.append({"type": "response.output_audio_transcript.done", **self._ids(), "transcript": self.text})
            else:
                events.append({"type": "response.output_text.done", **self._ids(), "text": self.text})
            item = self.item(item_status, self.text)
            events += [
                {"type": "response.content_part.done", **self._ids(), "part": self._part()},
                {
                    "type": "response.output_item.done",
                    "response_id": self.id,
                    "output_index": self.message_index,
                    "item": item,
                },
                {"type": "conversation.item.done", "item": item},
            ]
            outputs.append((self.message_index, item))
        for call in self.calls:
            if call.status == "in_progress":
                call.status = "incomplete"
                if call.announced:
                    events += call.done()
                    events.append({"type": "conversation.item.done", "item": call.item()})
            if call.announced:
                outputs.append((call.output_index, call.item()))
        details: Optional[dict[str, Any]] = None
        if status != "completed":
            details = {"type": status, "reason": reason}
            if status == "failed":
                details = {
                    "type": "failed",
                    "error": {"type": "server_error", "code": error_code, "message": error},
                }
        body = self.body(
            [item for _, item in sorted(outputs, key=lambda o: o[0])], usage({**self.input, **stats}), details
        )
        body["omni"] = {
            "ttft_ms": _ms(self.ttft),
            "ttfa_ms": _ms(self.ttfa),
            "prefill_ms": _ms(self.prefilled),
            "mode": self.mode,
            "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool))},
        }
        if isinstance(stats.get("stage_seconds"), dict):  # the engine thread's time per stage
            body["omni"]["stage_seconds"] = {k: round(v, 4) for k, v in stats["stage_seconds"].items()}
        if self.heard_ms is not None:
            body["omni"]["heard_ms"] = self.heard_ms
        events.append({"type": "response.done", "response": body})
        return events

    def message_item(self) -> Optional[dict[str, Any]]:
        """The message item as it ended (None: the response had none)."""
        if self.message_index is None:
            return None
        return self.item("completed" if self.status == "completed" else "incomplete", self.text)


def usage(stats: dict[str, Any]) -> dict[str, Any]:
    """Token counts of one reply: the turn's prefill in, text tokens and codec frames out."""
    n_in = int(stats.get("prefill_tokens", 0))
    audio_in = int(stats.get("input_audio_tokens", 0))
    # The camera's video tokens count as image tokens: the API has no video field.
    image_in = int(stats.get("input_image_tokens", 0)) + int(stats.get("input_video_tokens", 0))
    text_out, audio_out = int(stats.get("text_tokens", 0)), int(stats.get("audio_frames", 0))
    return {
        "total_tokens": n_in + text_out + audio_out,
        "input_tokens": n_in,
        "output_tokens": text_out + audio_out,
        "input_token_details": {
            "text_tokens": max(0, n_in - audio_in - image_in),
            "audio_tokens": audio_in,
            "image_tokens": image_in,
            "cached_tokens": 0,
        },
        "output_token_details": {"text_tokens": text_out, "audio_tokens": audio_out},
    }
