"""Message items (conversation.item.create): a user message's parts, its `input_image` ones from
the data URL to the model's turn, and a system message's text.

Pins:
- a system message's input_text parts (type given or left out) join with newlines; any other
  part is refused as unsupported, a part with no text or no parts at all as invalid; an
  assistant message's output_text texts and output_audio transcripts join the same way (audio
  with no transcript is refused), text parts typed input_text (Pipecat) or text (beta) too;
- decoding (agent/realtime/message_content.py): a PNG or JPEG data URL becomes RGB uint8 with its
  colours where they were, its longer side brought to the camera frames' side for detail "low"
  and twice that for "high"/"auto" (a smaller image is left as it is); every bad part is refused
  with its own param and the code a client can act on: a URL to fetch (unsupported), bad base64,
  bytes that are no PNG or JPEG (a GIF), more than 4K pixels (before decoding), a 200:1 strip,
  an unknown detail, too many images or parts, a part with no text; an image past the
  session's pixel budget (read from its header) is refused as rate_limited until the bucket
  refills; the item as announced carries no image or audio bytes, and keeps an input_audio
  transcript the client gave (one that is not a string is refused);
- in the engine (tiny model, greedy): an image item is shown at the end of the turn exactly
  where a still handed to the reply is (the same reply, text and codec codes), its vision
  tokens counted in the reply's stats; a dropped turn's audio goes but its image and text items
  stay for the next turn; a reply cancelled before its prefill ends gives its turn back with
  its image, and with the image sent while it was being made; an image item discards a speculative reply; a ninth image in one turn, and an
  array that is not RGB uint8, are refused; a turn the fallback model answered (degradation
  level 2) takes its text and image items with it, where a false start keeps them.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image
from support.engine_drive import SYSTEM, make_audio, run_until_idle, speak
from support.idle_runner import IdleRunner

from agent.engine.api import ReplyDone
from agent.engine.checkpoints.model import encode_images, image_token_counts
from agent.engine.commands import AddUserImage, AddUserText, Context
from agent.engine.loop import Engine
from agent.engine.runner.edits import MAX_TURN_IMAGES
from agent.engine.runner.scheduler import SchedulerConfig
from agent.engine.runner.streaming import StreamingRunner
from agent.gate.token_bucket import TokenBucket
from agent.realtime import message_content
from agent.realtime.message_content import ContentError, ImagePart, TextPart


def data_url(image: np.ndarray, fmt: str = "PNG") -> str:
    out = io.BytesIO()
    Image.fromarray(image).save(out, fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "GIF": "gif"}[fmt]
    return f"data:image/{mime};base64,{base64.b64encode(out.getvalue()).decode()}"


def split(height: int, width: int) -> np.ndarray:
    """Left half red, right half blue."""
    image = np.zeros((height, width, 3), np.uint8)
    image[:, : width // 2, 0] = 255
    image[:, width // 2 :, 2] = 255
    return image


def image_part(url: str, detail: str | None = None) -> dict:
    part = {"type": "input_image", "image_url": url}
    if detail is not None:
        part["detail"] = detail
    return part


def parse(content: list, max_side: int = 448) -> list:
    return message_content.user_parts(content, "audio/pcm", max_side)


# ---- decoding -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_data_url_decodes_to_rgb_with_its_colours_in_place(fmt: str) -> None:
    [part] = parse([image_part(data_url(split(60, 80), fmt))])
    assert isinstance(part, ImagePart) and part.detail == "auto"
    image = part.image
    assert image.dtype == np.uint8 and image.shape == (60, 80, 3)  # small: left as it is
    left, right = image[30, 10].astype(int), image[30, 70].astype(int)
    assert left[0] > 200 and left[2] < 60, left
    assert right[2] > 200 and right[0] < 60, right


@pytest.mark.parametrize("detail, side", [("low", 448), ("high", 896), ("auto", 896), (None, 896)])
def test_the_longer_side_follows_the_detail(detail: str | None, side: int) -> None:
    [wide] = parse([image_part(data_url(split(1080, 1920), "JPEG"), detail)])
    assert max(wide.image.shape[:2]) == side
    assert abs(wide.image.shape[1] / wide.image.shape[0] - 1920 / 1080) < 0.02  # the aspect kept
    [tall] = parse([image_part(data_url(split(1200, 600)), detail)])
    assert tall.image.shape[:2] == (side, side // 2)


def _refusal(content: list) -> tuple[str, str, str]:
    with pytest.raises(ContentError) as caught:
        parse(content)
    return caught.value.code, caught.value.param, str(caught.value)


def test_bad_parts_are_refused_each_with_its_param() -> None:
    good = image_part(data_url(split(8, 8)))
    text = {"type": "input_text", "text": "hi"}
    code, param, message = _refusal([text, image_part("https://example.com/cat.png")])
    assert (code, param) == ("unsupported", "item.content[1].image_url") and "fetches no URL" in message
    assert _refusal([image_part("data:image/png;base64,@@@")])[:2] == ("invalid_value", "item.content[0].image_url")
    assert _refusal([image_part(data_url(split(8, 8), "GIF").replace("image/gif", "image/png"))])[:2] == (
        "invalid_value",
        "item.content[0].image_url",
    )
    assert _refusal([image_part("data:text/plain;base64,aGk=")])[:2] == ("invalid_value", "item.content[0].image_url")
    assert _refusal([{"type": "input_image"}])[:2] == ("invalid_value", "item.content[0].image_url")
    huge = data_url(np.zeros((2200, 4000, 3), np.uint8))  # 8.8 MP of zeros: a small PNG
    assert "pixels" in _refusal([image_part(huge)])[2]
    assert "150:1" in _refusal([image_part(data_url(np.zeros((2, 400, 3), np.uint8)))])[2]
    assert _refusal([{**good, "detail": "ultra"}])[:2] == ("invalid_value", "item.content[0].detail")
    assert _refusal([good] * 5)[:2] == ("invalid_value", "item.content")
    assert _refusal([text] * 17)[:2] == ("invalid_value", "item.content")
    assert _refusal([])[:2] == ("invalid_value", "item.content")
    assert _refusal([text, {"type": "input_text"}])[:2] == ("invalid_value", "item.content[1].text")
    assert _refusal([{"type": "input_audio", "audio": base64.b64encode(b"\x01").decode()}])[:2] == (
        "invalid_value",
        "item.content[0].audio",
    )
    assert _refusal([{"type": "input_file"}])[:2] == ("unsupported", "item.content[0].type")


def test_decoding_is_bounded_by_the_sessions_pixel_budget() -> None:
    now = [0.0]
    bucket = TokenBucket(rate=8 * 8, burst=8 * 8 * 1.5, clock=lambda: now[0])  # 1.5 images of 8x8
    picture = image_part(data_url(split(8, 8)))
    with pytest.raises(ContentError) as caught:
        message_content.user_parts([picture, picture], "audio/pcm", 448, bucket.allow)
    assert (caught.value.code, caught.value.param) == ("rate_limited", "item.content[1].image_url")
    with pytest.raises(ContentError):  # half an image's pixels left: not enough
        message_content.user_parts([picture], "audio/pcm", 448, bucket.allow)
    now[0] += 1.0  # a second's refill
    assert len(message_content.user_parts([picture], "audio/pcm", 448, bucket.allow)) == 1


def test_a_system_message_is_its_text_parts() -> None:
    assert message_content.system_text([{"type": "input_text", "text": "Be brief."}, {"text": "Be kind."}]) == (
        "Be brief.\nBe kind."
    )
    for content, code, param in [
        ([{"type": "input_image", "image_url": "data:,"}], "unsupported", "item.content[0].type"),
        ([{"type": "input_text"}], "invalid_value", "item.content[0].text"),
        ([], "invalid_value", "item.content"),
        ("Be brief.", "invalid_value", "item.content"),
    ]:
        with pytest.raises(ContentError) as caught:
            message_content.system_text(content)
        assert (caught.value.code, caught.value.param) == (code, param), content


def test_an_assistant_message_is_its_text_and_transcripts() -> None:
    content = [{"type": "output_text", "text": "Hello."}, {"type": "output_audio", "transcript": "How are you?"}]
    assert message_content.assistant_text(content) == "Hello.\nHow are you?"
    # Pipecat types an assistant message's text input_text; the beta typed it text.
    lenient = [{"type": "input_text", "text": "Hi."}, {"type": "text", "text": "Bye."}]
    assert message_content.assistant_text(lenient) == "Hi.\nBye."
    for content, code, param in [
        ([{"type": "output_audio", "audio": "AAAA"}], "invalid_value", "item.content[0].transcript"),
        ([{"type": "input_image", "image_url": "data:,"}], "unsupported", "item.content[0].type"),
        ([{"type": "input_text"}], "invalid_value", "item.content[0].text"),
        ([{"type": "output_text"}], "invalid_value", "item.content[0].text"),
        ([], "invalid_value", "item.content"),
    ]:
        with pytest.raises(ContentError) as caught:
            message_content.assistant_text(content)
        assert (caught.value.code, caught.value.param) == (code, param), content


def test_parts_keep_their_order_and_the_item_carries_no_bytes() -> None:
    audio = base64.b64encode(np.zeros(2400, "<i2").tobytes()).decode()  # 100 ms at 24 kHz
    parts = parse(
        [
            {"type": "input_text", "text": "what is this?"},
            image_part(data_url(split(8, 8)), "low"),
            {"type": "input_audio", "audio": audio},
            {"type": "input_audio", "audio": audio, "transcript": "and this"},
        ]
    )
    assert [type(p).__name__ for p in parts] == ["TextPart", "ImagePart", "AudioPart", "AudioPart"]
    assert parts[2].pcm16k.shape == (1600,)  # resampled to 16 kHz
    assert message_content.item_content(parts) == [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "detail": "low", "image_url": None},
        {"type": "input_audio", "transcript": None},
        {"type": "input_audio", "transcript": "and this"},  # a client's own transcript is kept
    ]
    assert isinstance(parts[0], TextPart)
    with pytest.raises(ContentError) as caught:
        parse([{"type": "input_audio", "audio": audio, "transcript": 7}])
    assert (caught.value.code, caught.value.param) == ("invalid_value", "item.content[0].transcript")


# ---- in the engine --------------------------------------------------------------------------


@pytest.fixture
def runner(loaded):
    return StreamingRunner(loaded, SYSTEM, max_reply_tokens=6, max_reply_seconds=0.5, record=True)


def picture(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (64, 96, 3), dtype=np.uint8)


def reply(runner: StreamingRunner, sid: str, images: list[np.ndarray] = ()) -> ReplyDone:
    runner.begin_reply(sid, list(images))
    [done] = [o for o in run_until_idle(runner, 500) if isinstance(o, ReplyDone)]
    assert done.reason != "error", done
    return done


def test_an_image_item_is_shown_where_a_still_of_the_reply_is(runner, loaded) -> None:
    image = picture(1)
    runner.open_session("item")
    speak(runner, "item", make_audio(0.5))
    runner.add_user_text("item", "What is in the picture?")
    assert runner.add_user_image("item", image) == 1
    by_item = reply(runner, "item")
    runner.open_session("still")
    speak(runner, "still", make_audio(0.5))
    runner.add_user_text("still", "What is in the picture?")
    by_still = reply(runner, "still", [image])
    [tokens] = image_token_counts(loaded, encode_images(loaded, [image])["image_grid_thw"])
    assert by_item.stats["input_image_tokens"] == by_still.stats["input_image_tokens"] == tokens > 0
    a, b = runner.records["item"], runner.records["still"]
    assert a.prefill_tokens == b.prefill_tokens and a.text_ids == b.text_ids
    assert np.array_equal(a.codes, b.codes)
    # The next turn shows it no more: the image went into the answered turn.
    speak(runner, "item", make_audio(0.5, seed=3))
    assert reply(runner, "item").stats["input_image_tokens"] == 0


def test_a_dropped_turn_keeps_its_image_and_text_items(runner) -> None:
    runner.open_session("s")
    speak(runner, "s", make_audio(0.5))
    runner.add_user_image("s", picture(2))
    runner.add_user_text("s", "and this?")
    run_until_idle(runner)  # the audio is prefilled while nothing else runs
    runner.discard_turn("s")
    turn = runner.sessions["s"].turn
    assert len(turn.images) == 1 and turn.text_ids and not turn.audio_feats
    done = reply(runner, "s")
    assert done.stats["input_image_tokens"] > 0 and done.stats["input_audio_tokens"] == 0


def test_a_cancel_before_the_prefill_ends_gives_the_image_back(loaded) -> None:
    # 4 tokens a tick: the end of the turn (audio tail, image, header) spans several ticks.
    schedule = SchedulerConfig(prefill_chunk_tokens=4)
    runner = StreamingRunner(loaded, SYSTEM, max_reply_tokens=6, max_reply_seconds=0.5, schedule=schedule)
    runner.open_session("s")
    run_until_idle(runner)  # the system prompt goes in 4 tokens a tick too
    speak(runner, "s", make_audio(0.5))
    runner.add_user_image("s", picture(3))
    runner.begin_reply("s", [])
    runner.step()  # the prefill begins
    runner.add_user_image("s", picture(5))  # the next turn's, sent while the reply is made
    assert runner.sessions["s"].reply.prefill.job is not None and not runner.sessions["s"].reply.prefill.done
    runner.cancel_reply("s")
    run_until_idle(runner)
    assert len(runner.sessions["s"].turn.images) == 2
    assert reply(runner, "s").stats["input_image_tokens"] > 0


def test_an_image_item_discards_a_speculation(runner) -> None:
    runner.open_session("s")
    speak(runner, "s", make_audio(0.5))
    assert runner.speculate("s", [])
    assert runner.sessions["s"].reply is not None
    runner.add_user_image("s", picture(4))
    assert runner.sessions["s"].reply is None  # it answered the turn without the image


def test_a_turn_holds_a_bounded_number_of_rgb_images(runner) -> None:
    runner.open_session("s")
    for n in range(1, MAX_TURN_IMAGES + 1):
        assert runner.add_user_image("s", picture(n)) == n
    with pytest.raises(ValueError, match="at most"):
        runner.add_user_image("s", picture(0))
    runner.open_session("t")
    with pytest.raises(ValueError, match="RGB uint8"):
        runner.add_user_image("t", np.zeros((8, 8), np.uint8))
    with pytest.raises(ValueError, match="RGB uint8"):
        runner.add_user_image("t", np.zeros((8, 8, 3), np.float32))
    assert runner.sessions["t"].turn.images == []


class NoSink:
    def on_text(self, delta) -> None: ...

    def on_audio(self, audio) -> None: ...

    def on_done(self, done) -> None: ...


async def test_a_turn_the_fallback_answered_leaves_no_items_behind(loaded) -> None:
    built: list[StreamingRunner] = []
    fallback = IdleRunner()

    def build() -> StreamingRunner:
        built.append(StreamingRunner(loaded, SYSTEM, max_reply_tokens=6, max_reply_seconds=0.5))
        return built[0]

    engine = Engine(build, fallback_factory=lambda: fallback)
    await engine.start()
    try:
        await engine.open_session("s", NoSink())
        await engine.send("s", AddUserText("hi"))
        await engine.send("s", AddUserImage(picture(6)))
        engine.begin_reply("s", [], mode="fallback", history=(("user", "hi"),))
        await engine.send("s", Context())  # (answered behind the begin: the engine keeps order)
        turn = built[0].sessions["s"].turn
        assert fallback.begun == ["s"] and turn.text_ids == [] and turn.images == []
        # A false start, by contrast, keeps them for the next turn.
        await engine.send("s", AddUserText("again"))
        engine.discard_turn("s")
        await engine.send("s", Context())
        assert built[0].sessions["s"].turn.text_ids
    finally:
        await engine.stop()
