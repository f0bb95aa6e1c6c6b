"""A finished call leaves nothing behind in the agent process (issue 14).

Pins: after many calls against a real agent (real aiortc peers over loopback, the tiny
model), for each way a call can end (the client vanishes mid-reply, the client closes, the server hangs up (DELETE),
the offer is answered but ICE never runs so the server ends it at its connect timeout),
the process's native thread count is back within 2 of where it was after the first
round of calls, no peer connection, transceiver, transport, track or Session object is
still alive, no asyncio task is left, agent_sessions_active is 0, and memory still in use
has not grown: native heap (every malloc arena, glibc's count of live bytes) at most 20 KB a
call in the median round of calls (one-off steps allowed, under 16 MB in all), Python's
allocator blocks at most 20 a call past a one-off 1,000, and resident memory, a coarse guard,
under 96 MB. Abrupt drops mid-reply run 200 times, polite closes and hang-ups 56,
never-connecting calls 32. A call whose reply has not begun after 30 s (an engine thread starved
by other work on the machine) is ended its way all the same, before its reply; at most a
quarter may end before their reply, counting those the agent gave up on a stalled loop.

The calls run in rounds with the cycle collector switched off, and each round's objects
and threads are counted before anything is collected: in a real agent the loaded model
makes the long-lived heap so large that full collections are rare, so whatever a call
leaves in a reference cycle (with the native threads its FFmpeg objects own) stays for
hours. Memory is read after a warm-up. When a round leaves objects, the failure names what
held each one (three levels of referrers) and whether the cycle collector then freed it.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import statistics
import sys
import threading
import time
import types
import wave
import weakref
from collections import Counter
from pathlib import Path

import aioice.ice
import pytest
import pytest_asyncio
from aiohttp import web
from aiortc import (
    RTCDataChannel,
    RTCDtlsTransport,
    RTCIceTransport,
    RTCPeerConnection,
    RTCRtpReceiver,
    RTCRtpSender,
    RTCRtpTransceiver,
    RTCSctpTransport,
)
from aiortc.rtcrtpreceiver import RemoteStreamTrack
from support.realtime_helpers import start_agent

from agent import metrics
from agent.client.client import AgentClient, PatternVideoTrack, WavTrack
from agent.media.playout import AgentAudioTrack
from agent.realtime.session import Session
from agent.server import SESSIONS
from agent.transport.rtc import RtcCall

# One agent (one event loop) serves every test here.
pytestmark = pytest.mark.asyncio(loop_scope="module")

# Calls per way of ending, in rounds (ROUND, below). Abrupt drops mid-reply are the hostile
# case (issue 12 asks for 200 connect/drop cycles): 200 of them. A round of never-connecting
# calls is the connect timeout (10 s) with nothing flowing: 32.
CALLS = {"abrupt": 200, "polite": 56, "hangup": 56, "never_connects": 32}
# Calls in a round, all in flight at once. Both ends of every call run in this one process and
# loop (16 peers with Opus and VP8 at 8 calls), so the round's size is the CPU rate the test
# demands: at 8, with a CPU hog, a second agent and the suite's compiling worker beside it,
# 62 of 200 abrupt calls lost ICE consent and 24 of 56 polite calls had no reply after 30 s
# (loaded series, 2026-12-04); the loop was four times behind (805 s for 200 calls). 4 halves
# that rate; what is counted (per call, per round) does not depend on it.
CONCURRENCY = 4
# A never-connecting call costs the agent one SDP answer, then waits out the connect timeout with
# no ICE and no media: a round of 8 demands next to no CPU, and 4 rounds of 8 wait the timeout
# half as often as 8 rounds of 4 (the rounds are 10 s each).
ROUND = {"abrupt": CONCURRENCY, "polite": CONCURRENCY, "hangup": CONCURRENCY, "never_connects": 8}
CALL_TIMEOUT_S = 60.0
# A fresh agent's resident memory climbs over its first few dozen calls (allocator arenas
# of the threads that serve them, the engine's working buffers) and then holds: measured
# 585, 602, 601, 606 MB after 25, 50, 75, 100 calls. Growth is judged after that.
WARMUP_CALLS = 40
# Native threads a process may add for good after its first round (a pool growing by one).
THREAD_ALLOWANCE = 2
ENDED_EARLY: Counter = Counter()  # calls the agent ended before their reply began, per ending
# Calls ended (their way) before their reply began: on a machine whose cores are taken by other
# work (a compile, a CPU hog, a second agent) the engine thread can fall 30 s behind. Such a call
# is still a call that ended and must leave nothing; with ENDED_EARLY at most a quarter of them,
# so that the mid-reply ending stays what this file mostly exercises.
NOT_MID_REPLY: Counter = Counter()
# What a call creates and must not outlive it, on either end of the loopback. Matched by
# exact type: isinstance() against ABCs over every object would grow the ABC caches.
PER_CALL = {
    RTCPeerConnection,
    RTCRtpTransceiver,
    RTCRtpReceiver,
    RTCRtpSender,
    RTCDtlsTransport,
    RTCIceTransport,
    RTCSctpTransport,
    RTCDataChannel,
    RemoteStreamTrack,
    AgentAudioTrack,
    WavTrack,
    PatternVideoTrack,
    Session,
    RtcCall,
    AgentClient,
}


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rss_mb() -> float:
    """Resident memory once the free pages glibc can hand back are returned (malloc_trim(0)).
    Not all are: the free top of each thread's arena stays resident (glibc trims only the main
    arena's top), and it grows in steps of a few MB as arenas serve bigger requests."""
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_in_use_mb() -> float:
    """MB the process holds in live malloc blocks, over every arena plus the mmapped ones
    (glibc's mallinfo2 sums all arenas): what native code (codecs, SRTP, torch's CPU tensors,
    Python's objects over 512 bytes) has allocated and not freed, blind to how much free memory
    the arenas keep resident."""
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def _left() -> list[object]:
    """Objects of the per-call classes still reachable or in uncollected cycles."""
    return [o for o in gc.get_objects() if type(o) in PER_CALL]


_OWN_FRAMES = {"_why_alive", "_referrers", "_walk", "test_calls_leave_no_threads_objects_or_memory"}


def _referrers(obj: object, skip: set[int]) -> list[object]:
    """What refers to `obj`, less this module's bookkeeping (the lists and frames looking at it)."""
    return [
        r
        for r in gc.get_referrers(obj)
        if id(r) not in skip and not (isinstance(r, types.FrameType) and r.f_code.co_name in _OWN_FRAMES)
    ]


def _describe(ref: object) -> str:
    if isinstance(ref, types.FrameType):
        return f"frame {ref.f_code.co_name} ({Path(ref.f_code.co_filename).name}:{ref.f_lineno})"
    if isinstance(ref, (types.CoroutineType, asyncio.Future)):
        return repr(ref)[:200]
    if isinstance(ref, types.MethodType):
        return f"bound method {ref.__qualname__}"
    if isinstance(ref, dict):
        return f"dict {[k for k in list(ref)[:8] if isinstance(k, str)]}"
    return type(ref).__name__


def _why_alive(found: list[object]) -> str:
    """For the failure message: who holds each per-call object a round left (three levels of
    referrers), and whether the cycle collector then frees it (a reference cycle) or not
    (something live holds it: a pending task, a registry). Empties `found`."""
    skip = {id(found)}
    lines: list[str] = []

    def _walk(obj: object, level: int) -> None:
        held = _referrers(obj, skip)[:4]
        skip.add(id(held))
        for i in range(len(held)):  # by index: an iterator over `held` would refer to its items
            ref = held[i]
            lines.append("    " + "  " * level + _describe(ref))
            if level < 2 and not isinstance(ref, type):
                _walk(ref, level + 1)

    shown = found[:4]  # a few are enough to see the pattern, and keep the message short
    skip.add(id(shown))
    for i in range(len(shown)):
        lines.append(f"  {type(shown[i]).__name__} held by:")
        _walk(shown[i], 0)
    shown.clear()
    refs = [weakref.ref(o) for o in found]
    found.clear()
    gc.collect()
    survivors = Counter(type(r()).__name__ for r in refs if r() is not None)
    verdict = (
        f"still alive after gc.collect(): {dict(survivors)}" if survivors else "all freed by gc.collect() (a cycle)"
    )
    return "\n".join([f"left by a round, {verdict}", *lines])


@pytest.fixture(scope="module")
def short_wav(speech_wav: Path, tmp_path_factory) -> Path:
    """The first second of the spoken WAV (0.3 s lead-in, then speech): a short utterance."""
    out = tmp_path_factory.mktemp("short") / "short.wav"
    with wave.open(str(speech_wav)) as src, wave.open(str(out), "wb") as dst:
        dst.setparams(src.getparams())
        dst.writeframes(src.readframes(src.getframerate()))
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def agent(tiny_model_dir: Path, short_wav: Path):
    # pytest keeps every log record of a test, and asyncio logs a failed task (aiortc's SCTP
    # sends after the far end vanished) with its traceback, whose frames hold that peer:
    # report such errors in one line instead, so the test does not keep what it counts.
    asyncio.get_running_loop().set_exception_handler(
        lambda loop, context: print(f"asyncio: {context['message']}: {context.get('exception')!r}")
    )
    # The connect timeout ends the never-connecting calls; 10 s, since on a loaded machine a
    # round's peers at once may need several seconds for ICE and DTLS.
    running = await start_agent(tiny_model_dir, max_sessions=10, connect_timeout_s=10.0, max_turns_per_s=1000.0)
    url, app = running.url, running.app
    with pytest.MonkeyPatch.context() as mp:
        _quick_consent(mp)
        for ending in ("polite", "abrupt"):
            await _calls(url, app, short_wav, ending, WARMUP_CALLS // 2)
    yield url, app
    await running.stop()


def _quick_consent(monkeypatch: pytest.MonkeyPatch) -> None:
    # Consent is checked every 5 s and expires once no check was answered for 5 s x 6 = 30 s
    # (agent/transport/consent.py), so the agent notices a vanished client after ~30 s.
    # Checking every 0.5 s takes the same path (consent expires, ICE closes, the session
    # closes) in about 3 s, long enough that a loaded machine that stalls a loop for a second
    # or two does not end live calls.
    monkeypatch.setattr(aioice.ice, "CONSENT_INTERVAL", 0.5)
    monkeypatch.setattr(aioice.ice, "CONSENT_FAILURES", 6)


def _vanish(client: AgentClient) -> None:
    """The client's machine drops off the network: its sockets neither send nor read."""
    for transceiver in client.pc.getTransceivers():
        connection = transceiver.sender.transport.transport.iceGatherer._connection
        for protocol in connection._protocols:
            protocol.transport.pause_reading()
            protocol.transport.sendto = lambda *args, **kwargs: None


async def _call(url: str, app: web.Application, wav: Path, ending: str, index: int) -> None:
    client = AgentClient(url, wav, video=index % 2 == 0, video_fps=5)
    try:
        if ending == "never_connects":
            await client.offer()  # answered, never applied: no ICE ever reaches the agent
        else:
            await client.connect()
            try:
                await client.wait_event("response.created", timeout=CALL_TIMEOUT_S / 2)  # mid-reply
            except asyncio.TimeoutError:
                if client.result.session_id not in app[SESSIONS]:
                    # The agent already ended it: on a machine so loaded that no consent check
                    # was answered for 3 s (the shortened timeout here) the call is given up.
                    # It still must leave nothing.
                    ENDED_EARLY[ending] += 1
                    return
                NOT_MID_REPLY[ending] += 1  # ended below all the same, before its reply
            if ending == "abrupt":
                _vanish(client)
            elif ending == "hangup":  # the server ends it: DELETE /v1/realtime/calls/{id}
                assert await client.hangup() == 204
                await client.close()
            else:
                await client.close()
        # The call is over once the agent has let go of it (abrupt: consent expired;
        # never_connects: the connect timeout); that also bounds the sessions in flight.
        while client.result.session_id in app[SESSIONS]:
            await asyncio.sleep(0.1)
    finally:
        await client.close()


async def _calls(url: str, app: web.Application, wav: Path, ending: str, count: int) -> None:
    gate = asyncio.Semaphore(ROUND[ending])

    async def one(i: int) -> None:
        async with gate:
            await asyncio.wait_for(_call(url, app, wav, ending, i), CALL_TIMEOUT_S)

    # Every call of the round runs to its end (each bounded) before a failure is raised: a call
    # left running would hold a session into the next test and fail it for capacity instead.
    results = await asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


async def _settle(app: web.Application, threads_at_most: int) -> None:
    """Wait, bounded, until the agent holds no session and the per-call objects are gone.

    A round of 4 calls has ~55 more native threads at its peak than at rest (codec threads on
    both ends; 74 against 19, 2026-12-07); they end with the call's objects. Threads that stay
    are what the count below catches: on CI (2026-12-07, PyAV 18.1.1) 32 stayed after each round,
    the filter-graph threads of the calls' AudioResamplers, which 18.1.1 keeps in a reference
    cycle until a full collection (pyproject.toml excludes it)."""
    for _ in range(40):
        if not app[SESSIONS] and _native_threads() <= threads_at_most and not _left():
            return
        await asyncio.sleep(0.25)


@pytest.mark.parametrize("ending", ["abrupt", "polite", "hangup", "never_connects"])
async def test_calls_leave_no_threads_objects_or_memory(
    agent, short_wav: Path, ending: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, app = agent
    if ending == "abrupt":
        _quick_consent(monkeypatch)
    started = time.monotonic()
    threads_at_start = _native_threads()
    # The first round starts what the process keeps for good: the loop's bounded executor
    # (aiortc encodes in it), codec libraries' lazy state.
    size = ROUND[ending]
    await _calls(url, app, short_wav, ending, size)
    await _settle(app, threads_at_start)
    gc.collect()
    threads_first, rss_first, heap_first = _native_threads(), _rss_mb(), _heap_in_use_mb()
    blocks_first = sys.getallocatedblocks()  # Python's small-object allocator, in use
    tasks_first = len(asyncio.all_tasks())
    rss_rounds: list[float] = []
    heap_rounds: list[float] = []
    alive: Counter = Counter()
    why: list[str] = []  # what held them, for the failure message
    threads_after = threads_first
    gc.disable()
    try:
        for _ in range(CALLS[ending] // size - 1):
            await _calls(url, app, short_wav, ending, size)
            # Within the allowance, so that a pool's one-off thread does not hold every round.
            await _settle(app, threads_first + THREAD_ALLOWANCE)
            # Counted before any collection: a round's calls must be gone already.
            left = _left()
            if left:
                alive += Counter(type(o).__name__ for o in left)
                if len(why) < 3:
                    why.append(_why_alive(left))
                left.clear()
            threads_after = max(threads_after, _native_threads())
            # Now drop what a round leaves in cycles that own no thread and no call object
            # (aioice's connection and its protocols, exceptions' frames): the collector
            # reclaims those in a running agent, and letting them pile up here would only
            # fragment the heap that the memory check measures.
            gc.collect()
            rss_rounds.append(_rss_mb())
            heap_rounds.append(_heap_in_use_mb())
    finally:
        gc.enable()
    rss_after, heap_after, blocks_after = _rss_mb(), heap_rounds[-1], sys.getallocatedblocks()
    measured = CALLS[ending] - size  # calls after the first round
    tasks_after = len(asyncio.all_tasks())
    print(
        f"\nleaks: {CALLS[ending]} {ending} calls in {time.monotonic() - started:.0f} s, "
        f"threads {threads_at_start}→{threads_first}→{threads_after} "
        f"({sorted(Counter(t.name.rstrip('0123456789_') for t in threading.enumerate()).items())}), "
        f"RSS {rss_first:.1f}→{rss_after:.1f} MB, asyncio tasks {tasks_first}→{tasks_after}, "
        f"ended early (consent lost under load): {ENDED_EARLY[ending]}, "
        f"ended before their reply began: {NOT_MID_REPLY[ending]}, "
        f"alive after a round: {dict(alive) or 'none'}; RSS per round {[round(r) for r in rss_rounds]}; "
        f"native heap in use {heap_first:.1f}→{heap_after:.1f} MB, per round {[round(h, 1) for h in heap_rounds]}; "
        f"Python blocks {blocks_first}→{blocks_after}"
    )
    assert not app[SESSIONS], "the agent still holds sessions"
    # Calls that ended before their reply began (the agent gave them up when consent checks went
    # unanswered on a stalled loop, or no reply had begun after 30 s) left nothing either (the
    # checks below); they are bounded together so that mid-reply endings stay the common case.
    # Under a CPU hog, a second agent's calls and a compile beside it: 28 of 220 abrupt calls
    # were given up early (2026-12-04), all else held.
    early = ENDED_EARLY[ending] + NOT_MID_REPLY[ending]
    assert early <= CALLS[ending] // 4, (
        f"{early} calls ended before their reply began: {ENDED_EARLY[ending]} given up by the agent, "
        f"{NOT_MID_REPLY[ending]} with no reply after 30 s"
    )
    active = [metrics.REGISTRY.get_sample_value("agent_sessions_active", {"priority": p}) for p in ("high", "normal")]
    assert active == [0, 0], f"agent_sessions_active by priority (high, normal): {active}"
    assert tasks_after <= tasks_first, f"asyncio tasks {tasks_first} -> {tasks_after}"
    assert not alive, f"objects of finished calls still alive: {dict(alive)}\n" + "\n".join(why)
    assert threads_after <= threads_first + THREAD_ALLOWANCE, f"threads {threads_first} -> {threads_after}"
    # Memory: what a call leaves behind in Python is caught above, object by object; these bound
    # the rest by what is still in use.
    # - Native heap, by its median round: a leak grows it every round, while a buffer the agent
    #   allocates once is one step (+2.5 MB in one round of polite calls on an agent with no
    #   warm-up, then flat). Measured: +0.2 MB over 192 abrupt calls, flat over 48 of each other
    #   ending. A leak of 30 KB a call is 120 KB a round of 4, over the 80 KB allowed.
    # - Python's allocator blocks: +98 to +1,059 (one-offs), hence an allowance next to 20 a call.
    # - Resident memory, coarsely: it rose 26 MB over 192 abrupt calls, all of it in the thread
    #   arenas' mappings (Python's arenas and the main heap stayed flat): free memory glibc keeps,
    #   in steps, at different rounds in different runs (+0.1 to +33 MB over 200 calls).
    steps = [after - before for before, after in zip([heap_first] + heap_rounds, heap_rounds)]
    median_kb, heap_growth = statistics.median(steps) * 1024, heap_after - heap_first
    block_growth = blocks_after - blocks_first
    assert median_kb < size * 20, (
        f"native heap in use grew {median_kb:.0f} KB in the median round; per round (MB) {[round(x, 2) for x in steps]}"
    )
    assert heap_growth < 16.0, f"native heap in use grew {heap_growth:.1f} MB in {measured} calls"
    assert block_growth < 1000 + measured * 20, f"Python allocator blocks grew by {block_growth} in {measured} calls"
    assert rss_after - rss_first < 96.0, (
        f"resident memory grew {rss_after - rss_first:.1f} MB; per round {[round(r, 1) for r in rss_rounds]}"
    )
