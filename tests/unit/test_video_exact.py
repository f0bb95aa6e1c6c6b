"""The camera as video on the audio clock equals transformers' audio-in-video path (tiny model).

Pins:
- our frame-pair patches equal the image processor's on a still frame (the pair (f, f)), and
  a grid encoded alone equals the same grid encoded as part of the whole clip;
- the block layout equals the processor's own `replace_video_with_audio_token` (called on a
  stand-in for the processor: its video processor needs torchvision), and our positions equal
  `get_rope_index(use_audio_in_video=True)` on a whole prompt;
- greedy streaming with audio + camera frames fed as they arrive (frames at 4 fps, audio in
  80 ms pieces, a 1 s audio window so both are prefilled while the user speaks) gives the same
  text ids and the same 16 codec codes per frame as `generate(use_audio_in_video=True)` on the
  processor's layout of the same frames and audio;
- so does a turn whose reply was speculated on a pause and committed, or speculated and
  dropped because the user went on (the speculation works on its own copy of the turn's grids);
- the end of that turn encodes at most one grid (the last half second) and prefills only the
  grids whose time came after the last audio flush;
- a discard after a committed user item (end_user_item) drops the later speech and the grids of
  its time only: what follows is answered as if that speech had never come (same text, codes
  and video grids).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import engine_drive
from support.engine_drive import SYSTEM, generate_speaking
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

from agent.engine.checkpoints.model import (
    assistant_start_ids,
    audio_token_count,
    closing_ids,
    encode_audio,
    system_turn_ids,
)
from agent.engine.runner.streaming import StreamingRunner
from agent.engine.stages.video_clock import VideoPolicy
from agent.engine.stages.video_grid import (
    GridPlace,
    PatchSpec,
    TokenKinds,
    av_positions,
    grid_threshold,
    interleave,
    patch_frames,
    resize,
)

TOKENS = 6
FRAMES = 12


def make_audio(seconds: float, seed: int) -> np.ndarray:
    # Loudest first: the streamed log-mel equals the extractor's (audio_stream.py).
    return engine_drive.make_audio(seconds, 220, seed, onset_s=0.2)


def marker_frame(i: int, height: int = 96, width: int = 128) -> np.ndarray:
    """A dark frame with a bright square that moves right by 8 px per frame."""
    frame = np.full((height, width, 3), 30, dtype=np.uint8)
    x = (8 * i) % (width - 16)
    frame[40:56, x : x + 16] = (250, 200, 40)
    return frame


class _ProcessorStandIn:
    """What replace_video_with_audio_token reads from the processor (its tokens, merge size)."""

    audio_bos_token, audio_eos_token = "<|audio_start|>", "<|audio_end|>"
    audio_token, video_token = "<|audio_pad|>", "<|video_pad|>"

    class video_processor:  # noqa: N801 - the attribute name the method reads
        merge_size = 2


def processor_block(n_audio: int, grid_thw: tuple[int, int, int], pps: float) -> str:
    return Qwen3OmniMoeProcessor.replace_video_with_audio_token(
        _ProcessorStandIn(),
        {"video_grid_thw": torch.tensor([grid_thw]), "video_second_per_grid": [0.5]},
        0,
        {"num_audio_tokens": [n_audio]},
        0,
        position_id_per_seconds=pps,
    )


def kinds_of(loaded) -> TokenKinds:
    ids = loaded.ids
    return TokenKinds(
        ids.vision_start,
        ids.vision_end,
        ids.audio_start,
        ids.audio_end,
        ids.audio_pad,
        ids.image_pad,
        loaded.model.config.thinker_config.video_token_id,
    )


def test_pair_patches_equal_the_image_processor_on_a_still_frame(loaded):
    spec = PatchSpec.from_processor(loaded.image_processor)
    frame = resize(marker_frame(3, 100, 130), (96, 128))
    ours, grid = patch_frames([frame, frame], spec)
    theirs = loaded.image_processor(images=[frame], return_tensors="pt")
    assert grid == tuple(theirs["image_grid_thw"][0].tolist())
    torch.testing.assert_close(ours, theirs["pixel_values"], rtol=0, atol=1e-6)
    # A pair of two different frames keeps each in its own temporal half.
    other = resize(marker_frame(4, 100, 130), (96, 128))
    pair, _ = patch_frames([frame, other], spec)
    half = pair.view(pair.shape[0], 3, 2, spec.patch, spec.patch)
    torch.testing.assert_close(half[:, :, 0], ours.view_as(half)[:, :, 0])
    torch.testing.assert_close(half[:, :, 1], patch_frames([other, other], spec)[0].view_as(half)[:, :, 1])


def test_a_grid_encoded_alone_equals_the_grid_in_the_clip(loaded):
    runner_thinker = StreamingRunner(loaded, SYSTEM, max_sessions=1).thinker
    spec = PatchSpec.from_processor(loaded.image_processor)
    frames = [resize(marker_frame(i), (64, 96)) for i in range(6)]
    clip, thw = patch_frames(frames, spec)
    whole = runner_thinker.encode_video(clip, thw)
    alone = [runner_thinker.encode_video(*patch_frames(frames[2 * j : 2 * j + 2], spec)) for j in range(3)]
    torch.testing.assert_close(torch.cat([a.embeds for a in alone]), whole.embeds, rtol=1e-5, atol=1e-5)
    for layer, feats in enumerate(whole.deepstack):
        torch.testing.assert_close(torch.cat([a.deepstack[layer] for a in alone]), feats, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_audio,grids,pps", [(26, 3, 25), (40, 6, 13), (7, 4, 25), (13, 1, 13)])
def test_layout_equals_the_processors(loaded, n_audio, grids, pps):
    tok = loaded.tokenizer
    expected = tok.encode(processor_block(n_audio, (grids, 4, 6), pps), add_special_tokens=False)
    ids, video = loaded.ids, loaded.model.config.thinker_config.video_token_id
    starts = [0.5 * j for j in range(grids)]
    ours = [ids.audio_start, *interleave(n_audio, starts, 6, pps, ids.audio_pad, video), ids.audio_end]
    assert ours == expected


def test_positions_equal_get_rope_index(loaded):
    thinker = loaded.model.thinker
    ids, kinds = loaded.ids, kinds_of(loaded)
    pps = loaded.model.config.thinker_config.position_id_per_seconds
    n_audio, grids, (gh, gw) = 40, 3, (2, 3)  # every grid before the last audio token
    assert grid_threshold(0.5 * (grids - 1), pps) < n_audio
    block = interleave(n_audio, [0.5 * j for j in range(grids)], gh * gw, pps, ids.audio_pad, kinds.video_pad)
    prompt = [
        *system_turn_ids(ids, loaded.tokenizer, SYSTEM),
        ids.im_start,
        *ids.user,
        *ids.newline,
        ids.vision_start,
        ids.audio_start,
        *block,
        ids.audio_end,
        ids.vision_end,
        ids.im_end,
        *ids.newline,
        *assistant_start_ids(ids),
    ]
    frames = n_audio * 100 // 13 + 1
    while audio_token_count(frames, 50) != n_audio:
        frames += 1
    expected, _ = thinker.get_rope_index(
        torch.tensor([prompt]),
        None,
        torch.tensor([[grids, 2 * gh, 2 * gw]]),
        torch.ones(1, len(prompt)),
        use_audio_in_video=True,
        audio_seqlens=torch.tensor([frames]),
        second_per_grids=torch.tensor([0.5]),
    )
    places = [GridPlace(0.5 * j, gh, gw) for j in range(grids)]
    # Whole, and in three parts carrying the open block (as the turn is prefilled).
    ours, end, _ = av_positions(prompt, 0, kinds, (), places, 2, pps, None)
    torch.testing.assert_close(ours, expected[:, 0].float())
    assert end == int(expected.max()) + 1
    cut1, cut2 = prompt.index(ids.audio_start) + 9, prompt.index(ids.audio_end) - 3
    pos, blk, parts, used = 0, None, [], 0
    for piece in (prompt[:cut1], prompt[cut1:cut2], prompt[cut2:]):
        n_grids = sum(1 for i, t in enumerate(piece) if t == kinds.video_pad and (i == 0 or piece[i - 1] != t))
        rope, pos, blk = av_positions(piece, pos, kinds, (), places[used : used + n_grids], 2, pps, blk)
        used += n_grids
        parts.append(rope)
    torch.testing.assert_close(torch.cat(parts, dim=1), expected[:, 0].float())


def reference(loaded, turns):
    """generate(use_audio_in_video=True) on the processor's layout of the same frames and audio.
    turns: (audio, frame pairs, grids used, the reply ids of an earlier turn or None for the last)."""
    spec = PatchSpec.from_processor(loaded.image_processor)
    feats = encode_audio(loaded, [audio for audio, _, _, _ in turns])
    n_window = loaded.model.config.thinker_config.audio_config.n_window
    pps = loaded.model.config.thinker_config.position_id_per_seconds
    ids = loaded.ids
    prompt = system_turn_ids(ids, loaded.tokenizer, SYSTEM)
    pixels, grids, n_audios = [], [], []
    for (_, pairs, n_grids, reply), frames in zip(turns, feats["feature_attention_mask"].sum(-1).tolist()):
        pv, thw = patch_frames([f for pair in pairs[:n_grids] for f in pair], spec)
        pixels.append(pv)
        grids.append(list(thw))
        n_audios.append(audio_token_count(int(frames), n_window))
        block = loaded.tokenizer.encode(processor_block(n_audios[-1], thw, pps), add_special_tokens=False)
        prompt += [
            ids.im_start,
            *ids.user,
            *ids.newline,
            ids.vision_start,
            *block,
            ids.vision_end,
            ids.im_end,
            *ids.newline,
            *assistant_start_ids(ids),
        ]
        if reply is not None:
            prompt += closing_ids(ids, reply)
    input_ids = torch.tensor([prompt])
    tower = loaded.model.thinker.model.audio_tower
    saved, tower.n_window_infer = tower.n_window_infer, 100  # the streamed turn's 1 s window
    try:
        sequences, _, codes = generate_speaking(
            loaded,
            TOKENS,
            FRAMES,
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            **feats,
            pixel_values_videos=torch.cat(pixels),
            video_grid_thw=torch.tensor(grids),
            video_second_per_grid=torch.tensor([0.5] * len(turns)),
            use_audio_in_video=True,
        )
    finally:
        tower.n_window_infer = saved
    generated = sequences[0, len(prompt) :].tolist()
    text = [t for t in generated if t not in loaded.thinker_eos_ids]
    return text, codes, n_audios[-1], grids[-1][1] * grids[-1][2] // 4


def stream_with_camera(runner, sid, audio, frames, fps=4.0, speculation=""):
    """Audio in 80 ms pieces; frame i handed over once the turn's audio reaches i / fps seconds.
    speculation "discard": a reply speculated at 1.6 s and dropped (the user went on);
    "commit": one speculated on the last piece and committed by the end of the turn."""
    fed = 0
    for start in range(0, len(audio), 1280):
        while fed < len(frames) and fed / fps <= start / 16000:
            runner.append_video(sid, frames[fed], 0.0)
            fed += 1
        runner.append_audio(sid, audio[start : start + 1280])
        if speculation == "discard" and start == 20 * 1280:
            assert runner.speculate(sid, [])
            runner.step()
            assert runner.drop_speculation(sid)
    if speculation == "commit":
        assert runner.speculate(sid, [])
        runner.step()
    runner.begin_reply(sid, [])
    while runner.has_work():
        done = runner.step()
    return done[-1]


def frame_pairs(frames: list[np.ndarray], size: tuple[int, int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The turn's frames as the grids' pairs: an odd last frame pairs with itself (the engine
    pads a grid that has one frame by repeating it, agent/engine/stages/video_clock.py)."""
    sized = [resize(f, size) for f in frames]
    return [(sized[i], sized[min(i + 1, len(sized) - 1)]) for i in range(0, len(sized), 2)]


@pytest.mark.parametrize("speculation", ["", "commit", "discard"])
def test_streaming_with_camera_equals_generate_and_leaves_only_the_last_grid(loaded, speculation):
    seconds = 2.4
    audio = make_audio(seconds, 1)
    frames = [marker_frame(i) for i in range(int(seconds * 4))]
    policy = VideoPolicy(fps=4.0, window_s=2.0, max_tokens=768)
    runner = StreamingRunner(
        loaded,
        SYSTEM,
        max_reply_tokens=TOKENS,
        max_reply_seconds=FRAMES * 0.08,
        audio_window_s=1.0,
        record=True,
        video=policy,
    )
    runner.open_session("s")
    done = stream_with_camera(runner, "s", audio, frames, speculation=speculation)
    assert done.stats["speculative"] == (speculation == "commit")
    stats = done.stats
    spec = PatchSpec.from_processor(loaded.image_processor)
    size = (96, 128)  # 12 tokens a grid: far under the cap, so not scaled down
    pairs = frame_pairs(frames, size)
    pps = loaded.model.config.thinker_config.position_id_per_seconds
    text, codes, n_audio, per_grid = reference(loaded, [(audio, pairs, stats["video_grids"], None)])
    # Every grid whose time falls before the turn's last audio token is in (the odd last frame's
    # too, padded into a grid of its own).
    assert stats["video_grids"] == sum(grid_threshold(0.5 * j, pps) < n_audio for j in range(len(pairs)))
    assert stats["video_grids"] >= 2
    assert stats["input_video_tokens"] == stats["video_grids"] * per_grid
    record = runner.records["s"]
    assert list(record.text_ids) == text
    assert record.codes.shape == codes.shape and codes.shape[1] > 0
    np.testing.assert_array_equal(record.codes, codes)
    # The end of the turn: at most the grid still open (the last 0.5 s), not the turn's grids.
    assert stats["video_grids_encoded_at_end_of_turn"] <= 1
    assert stats["frames_encoded_at_end_of_turn"] <= 2
    assert stats["video_grids_prefilled_at_end_of_turn"] <= 1
    assert spec.temporal == 2


def test_a_second_camera_turn_reuses_the_cache_and_equals_generate(loaded):
    """Two turns with the camera: the second prefills only its own tokens and still equals
    generate() on the two-turn prompt (two audio-in-video blocks, the first reply between)."""
    runner = StreamingRunner(
        loaded,
        SYSTEM,
        max_reply_tokens=TOKENS,
        max_reply_seconds=FRAMES * 0.08,
        audio_window_s=1.0,
        record=True,
        video=VideoPolicy(),
    )
    runner.open_session("s")
    size = (96, 128)
    turns = []
    for n, (seconds, shift) in enumerate([(2.4, 0), (1.6, 20)]):
        audio = make_audio(seconds, 5 + n)
        frames = [marker_frame(shift + i) for i in range(int(seconds * 4))]
        done = stream_with_camera(runner, "s", audio, frames)
        pairs = frame_pairs(frames, size)
        turns.append((audio, pairs, done.stats["video_grids"], list(runner.records["s"].text_ids)))
    assert all(t[2] >= 1 for t in turns)
    text, codes, _, _ = reference(loaded, [*turns[:-1], (*turns[-1][:3], None)])
    record = runner.records["s"]
    assert list(record.text_ids) == text
    np.testing.assert_array_equal(record.codes, codes)
    assert done.stats["prefill_tokens"] < done.stats["context_tokens"] / 2  # the first turn stayed cached


def test_a_discard_after_a_committed_item_drops_only_the_later_grids(loaded):
    item, dropped, after = make_audio(1.5, 31), make_audio(1.0, 32), make_audio(1.0, 33)

    def feed(runner, audio, shift):
        frames, fed = [marker_frame(shift + i) for i in range(int(len(audio) / 16000 * 4))], 0
        for start in range(0, len(audio), 1280):
            while fed < len(frames) and fed / 4.0 <= start / 16000:
                runner.append_video("s", frames[fed], 0.0)
                fed += 1
            runner.append_audio("s", audio[start : start + 1280])

    def answer(discard: bool):
        runner = StreamingRunner(
            loaded,
            SYSTEM,
            max_reply_tokens=TOKENS,
            max_reply_seconds=FRAMES * 0.08,
            audio_window_s=1.0,
            record=True,
            video=VideoPolicy(fps=4.0, window_s=2.0, max_tokens=768),
        )
        runner.open_session("s")
        feed(runner, item, 0)
        runner.end_user_item("s")
        if discard:
            feed(runner, dropped, 10)
            while runner.has_work():
                runner.step()
            turn = runner.sessions["s"].turn
            assert turn.video.grids.placed() > 0  # some of the item's grids were in the cache
            runner.discard_turn("s")
            assert all(g.threshold < turn.kept_tokens for g in turn.video.grids.grids)
            assert turn.video.grids.placed() == 0 and turn.video.grids.budget.count == len(turn.video.grids.grids)
        feed(runner, after, 20)
        runner.begin_reply("s", [])
        while runner.has_work():
            done = runner.step()
        return runner.records["s"], done[-1].stats

    kept, kept_stats = answer(False)
    cleared, cleared_stats = answer(True)
    assert kept_stats["video_grids"] >= 3 and cleared_stats["video_grids"] == kept_stats["video_grids"]
    assert list(cleared.text_ids) == list(kept.text_ids) and cleared.prefill_tokens == kept.prefill_tokens
    np.testing.assert_array_equal(cleared.codes, kept.codes)
