"""Batched, bucketed prefill (agent/engine/stages/bucketed_prefill.py) and its use at end of turn.

Pins, on the tiny model:
- three sessions with ragged histories and ragged new tokens, prefilled in ONE thinker forward
  padded to a token bucket, give the same last-token logits (so the same first tokens), the
  same accept-layer hidden states and the same KV contents as three separate exact-length
  prefills; a next decode step after it agrees too (the pad writes past each row's length are
  never seen); a row longer than the largest bucket takes two passes with the same result;
- the talker prefixes of three sessions in one forward equal three separate ones (logits, last
  hidden, KV);
- bucket padding alone (one row, bucketed vs exact) changes nothing;
- in the runner, three turns ending in the same tick make one batched thinker prefill call
  (3 rows) and one talker prefix call (3 rows), not one each.
"""

from __future__ import annotations

import torch
from support.engine_drive import make_audio

from agent.engine.runner.streaming import StreamingRunner
from agent.engine.stages.bucketed_prefill import PREFILL_BUCKETS
from agent.engine.stages.talker import TalkerOps
from agent.engine.stages.thinker import ThinkerOps
from agent.engine.state.kv import KVState

HISTORY = (20, 37, 130)  # tokens already in each session's cache
NEW = (9, 25, 60)  # end-of-turn tokens per session (bucket 64)


def text_ids(loaded, n: int, seed: int) -> list[int]:
    media = {loaded.ids.audio_pad, loaded.ids.image_pad}
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (n * 2,), generator=gen).tolist()
    return [i for i in ids if i not in media][:n]


def thinker_sessions(loaded, buckets):
    ops = ThinkerOps(loaded, 3, 1024)
    ops.prefiller.buckets = tuple(buckets)
    states = [KVState(slot) for slot in (2, 0, 1)]  # slots out of order
    for i, (state, n) in enumerate(zip(states, HISTORY)):
        ops.prefill(state, text_ids(loaded, n, seed=i))
    return ops, states


def assert_same_kv(kv_a, kv_b, states) -> None:
    for layer in range(kv_a.n_layers):
        for state in states:
            for a, b in ((kv_a.keys[layer], kv_b.keys[layer]), (kv_a.values[layer], kv_b.values[layer])):
                live = (state.slot, slice(None), slice(0, state.length))
                torch.testing.assert_close(a[live], b[live], atol=1e-5, rtol=1e-4)


@torch.inference_mode()
def test_three_end_of_turn_prefills_in_one_forward_equal_three_separate(loaded):
    alone, alone_states = thinker_sessions(loaded, buckets=())
    batched, batched_states = thinker_sessions(loaded, buckets=PREFILL_BUCKETS)
    new = [text_ids(loaded, n, seed=10 + i) for i, n in enumerate(NEW)]

    alone_jobs = [alone.start_prefill(s, ids) for s, ids in zip(alone_states, new)]
    for state, job in zip(alone_states, alone_jobs):
        alone.run_prefills([(state, job, None)])
    calls = []
    run = batched.prefiller._forward
    batched.prefiller._forward = lambda rows: calls.append([r.n for r in rows]) or run(rows)
    batched_jobs = [batched.start_prefill(s, ids) for s, ids in zip(batched_states, new)]
    assert batched.run_prefills([(s, j, None) for s, j in zip(batched_states, batched_jobs)]) == list(NEW)
    assert calls == [list(NEW)]  # one forward for all three

    for a, b, sa, sb in zip(alone_jobs, batched_jobs, alone_states, batched_states):
        assert (sa.length, sa.next_pos) == (sb.length, sb.next_pos)
        ra, rb = a.result(), b.result()
        torch.testing.assert_close(rb.last_logits, ra.last_logits, atol=1e-5, rtol=1e-4)
        assert int(rb.last_logits.argmax()) == int(ra.last_logits.argmax())
        torch.testing.assert_close(rb.accept_hidden, ra.accept_hidden, atol=1e-5, rtol=1e-4)
    assert_same_kv(alone.kv, batched.kv, alone_states)
    # The bucket's pad tokens were written past each row's length: a decode step must not see them.
    tokens = [int(j.result().last_logits.argmax()) for j in alone_jobs]
    next_batched, next_alone = batched.decode(batched_states, tokens), alone.decode(alone_states, tokens)
    torch.testing.assert_close(next_batched, next_alone, atol=1e-5, rtol=1e-4)


@torch.inference_mode()
def test_a_row_longer_than_the_largest_bucket_takes_two_passes(loaded):
    alone, alone_states = thinker_sessions(loaded, buckets=())
    batched, batched_states = thinker_sessions(loaded, buckets=(16, 64))
    new = [text_ids(loaded, n, seed=20 + i) for i, n in enumerate((100, 5, 30))]
    calls = []
    run = batched.prefiller._forward
    batched.prefiller._forward = lambda rows: calls.append([r.n for r in rows]) or run(rows)
    jobs_a = [alone.start_prefill(s, ids) for s, ids in zip(alone_states, new)]
    jobs_b = [batched.start_prefill(s, ids) for s, ids in zip(batched_states, new)]
    alone.run_prefills([(s, j, None) for s, j in zip(alone_states, jobs_a)])
    batched.run_prefills([(s, j, None) for s, j in zip(batched_states, jobs_b)])
    assert calls == [[64, 5, 30], [36]]
    for a, b in zip(jobs_a, jobs_b):
        torch.testing.assert_close(b.result().last_logits, a.result().last_logits, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(b.result().accept_hidden, a.result().accept_hidden, atol=1e-5, rtol=1e-4)
    assert_same_kv(alone.kv, batched.kv, alone_states)


@torch.inference_mode()
def test_bucket_padding_alone_changes_nothing(loaded):
    exact, exact_states = thinker_sessions(loaded, buckets=())
    padded, padded_states = thinker_sessions(loaded, buckets=PREFILL_BUCKETS)
    ids = text_ids(loaded, 23, seed=30)  # padded to 32
    out_exact = exact.prefill(exact_states[1], ids)
    out_padded = padded.prefill(padded_states[1], ids)
    torch.testing.assert_close(out_padded.last_logits, out_exact.last_logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out_padded.accept_hidden, out_exact.accept_hidden, atol=1e-5, rtol=1e-4)
    assert_same_kv(exact.kv, padded.kv, exact_states)


@torch.inference_mode()
def test_three_talker_prefixes_in_one_forward_equal_three_separate(loaded):
    hidden = loaded.model.config.talker_config.text_config.hidden_size
    results = {}
    for mode in ("alone", "batched"):
        ops = TalkerOps(loaded, 3, 1024)
        if mode == "alone":
            ops.prefiller.buckets = ()
        states = [KVState(slot) for slot in (1, 2, 0)]
        items = []
        for i, (state, n) in enumerate(zip(states, (12, 40, 9))):
            embeds = torch.randn(1, n, hidden, generator=torch.Generator().manual_seed(40 + i)).to(loaded.dtype)
            items.append((state, embeds, text_ids(loaded, n, seed=50 + i), []))
        if mode == "alone":
            outs = [ops.prefills([item]) for item in items]
            logits, last = torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
        else:
            logits, last = ops.prefills(items)
        results[mode] = (ops, states, logits, last)
    ops_a, states_a, logits_a, last_a = results["alone"]
    ops_b, states_b, logits_b, last_b = results["batched"]
    assert logits_b.shape == logits_a.shape == (3, ops_a.vocab)
    torch.testing.assert_close(logits_b, logits_a, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(last_b, last_a, atol=1e-5, rtol=1e-4)
    assert [(s.length, s.next_pos) for s in states_a] == [(s.length, s.next_pos) for s in states_b]
    assert_same_kv(ops_a.kv, ops_b.kv, states_a)


@torch.inference_mode()
def test_turns_ending_in_one_tick_share_one_prefill_forward(loaded):
    runner = StreamingRunner(
        loaded,
        "You are a helpful voice assistant.",
        max_reply_tokens=4,
        max_reply_seconds=0.4,
        audio_window_s=1.0,
        max_sessions=3,
    )
    sids = ["a", "b", "c"]
    for i, sid in enumerate(sids):
        runner.open_session(sid)
        audio = make_audio(0.9 + 0.3 * i, 200 + 50 * i, i)
        for k in range(0, len(audio), 1280):
            runner.append_audio(sid, audio[k : k + 1280])
    calls: dict[str, list[int]] = {"thinker": [], "talker": []}
    for name, ops in (("thinker", runner.thinker), ("talker", runner.talker)):
        run = ops.prefiller.run
        ops.prefiller.run = lambda rows, run=run, name=name: calls[name].append(len(rows)) or run(rows)
    for sid in sids:
        runner.begin_reply(sid, [])
    runner.step()  # every turn ended before this tick: all three prefills fit the budget
    assert calls == {"thinker": [3], "talker": [3]}
    while runner.has_work():
        runner.step()
    assert calls["thinker"] == [3] and calls["talker"] == [3]
