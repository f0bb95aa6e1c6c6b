"""Which replies an engine tick advances: first-audio deadlines first, then playout buffers.

Pure policy on plain data (no torch): the runner describes each reply in flight as a
`ReplyView` and gets back a `Plan`. The rules, in priority order:

1. First audio. A reply that has not produced its first output yet (end-of-turn prefill pending
   or in progress) is prefilled, earliest `begin_reply` first, within a token budget per tick
   (`prefill_chunk_tokens`, so a long prefill is split and other sessions' frames get out
   between its chunks); the tick in which its prefill completes also renders its first frame.
   Such a tick serves *only* the sessions that cannot wait: other speaking sessions join it only
   when their playout buffer is under the low-water mark; the rest get their next frame in the
   next tick, i.e. after the new reply's first frame.
2. Playout. Speaking sessions are ordered by their estimated playout buffer (least first), and
   at most `max_batch` rows go into one batched step (first-audio rows included). A tick is due
   once some session's buffer is at or under the high-water mark; it then also fills its rows
   with every other speaking session under the fill ceiling (`batch_fill_s`): a row costs far
   less than a step (a step's cost is per call: kernel launches, weight reads, Python), so the
   speaking sessions move together, one batched step per 80 ms of audio, instead of each in its
   own small step. A session over the ceiling skips the tick whenever anything else is to be
   done. A tick that is not due for playout (it runs for a speculation, for microphone audio to
   prefill: `other_work`) steps no speaking session; one asked for with nothing at all to do
   steps every speaking session (a caller driving the runner by hand always makes progress).
   The engine loop does not ask while no one is due (`idle_s`): audio that is not needed yet
   waits, instead of taking the CPU (and, on CPU, the GIL) from the network and from sessions
   that do need it. Text-only replies have no playout buffer and rank as if at the low-water
   mark.
Priority classes (agent/gate/priority.py): `ReplyView.priority`, higher first. First-audio replies are
ordered by priority, then deadline, for rows and for the prefill budget; speaking sessions under
the low-water mark come first (by priority, then least buffered), then the rest (by priority,
then least buffered). So when a tick has fewer rows than candidates a high-priority reply is
started or kept from underrunning before a normal one, while a high-priority session with audio
to spare never takes the row of a normal one about to run dry.
3. Audio prefill of users still speaking (encoding and prefilling their microphone audio) runs
   only in ticks with no first-audio work and no speaking session under the low-water mark.
   Speculative replies (a reply started on a short pause of the user, its output held until
   the turn ends) are the lowest priority: they are prefilled only in those same ticks, after
   everything else, so a speculation never delays anyone's audio by more than the tick it shares.

The playout buffer is estimated on the engine side (`PlayoutClock`, a reply's state in
agent/engine/state/reply.py): the outbound track plays
the audio it gets back to back and plays silence when it runs dry, so the buffer is the time
at which the audio sent so far ends playing, minus now. Until the first underrun that is
"audio produced - wall time since the first audio"; after one, the track resumes with the late
frame and so does the estimate. A negative value is how long the session has been silent.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SchedulerConfig:
    low_water_s: float = 0.16  # under this a speaking session steps first, even in first-audio ticks
    high_water_s: float = 1.0  # a tick is due once a speaking session is at or under this
    batch_fill_s: float = 3.0  # a due tick also steps every speaking session under this
    max_batch: int = 0  # rows per batched step (first-audio rows included); 0: no cap
    prefill_chunk_tokens: int = 256  # thinker prefill tokens per tick and per kind of prefill


@dataclass(frozen=True)
class PlayoutEstimate:
    """One reply's standing, exported for metrics (StreamingRunner.playout())."""

    session_id: str
    phase: str  # "first_audio" (prefill / first frame pending) | "speaking" | "text"
    buffer_s: float | None  # estimated audio buffered at the client; None before the first audio
    produced_s: float  # audio handed out in this reply
    waiting_s: float  # since begin_reply (first_audio phase) or since the first audio


@dataclass(frozen=True)
class ReplyView:
    session_id: str
    started: float  # runner clock at begin_reply: the first-audio deadline order
    awaiting_first: bool  # its end-of-turn prefill has not finished
    buffer_s: float | None  # None for text-only replies
    priority: int = 0  # the session's class (agent/gate/priority.py RANK): higher is served first
    speculative: bool = False  # a speculative start: served last (Plan.speculate)


@dataclass
class Plan:
    first: list[str] = field(default_factory=list)  # replies to prefill (and start), earliest first
    decode: list[str] = field(default_factory=list)  # replies to advance one frame, most urgent first
    audio_prefill: bool = False  # microphone audio of speaking users may be prefilled this tick
    speculate: list[str] = field(default_factory=list)  # speculative replies to prefill, earliest first


def idle_s(replies: list[ReplyView], config: SchedulerConfig) -> float:
    """How long a tick can wait before it is of use to these replies: 0 when any is due now
    (awaiting its first audio, text-only, at or under the high-water mark), else until the
    least buffered speaking session reaches the mark. A speculative reply in the making is due
    too: it is there to be ready when the user's pause ends."""
    wait = float("inf")
    for r in replies:
        if r.awaiting_first or r.buffer_s is None or r.speculative:
            return 0.0
        wait = min(wait, r.buffer_s - config.high_water_s)
    return max(0.0, wait)


def plan_tick(replies: list[ReplyView], config: SchedulerConfig, other_work: bool = False) -> Plan:
    """other_work: the runner has work besides these replies (microphone audio to prefill,
    transcription), which an undue tick is for."""
    speculative = sorted((r for r in replies if r.speculative), key=lambda r: r.started)
    replies = [r for r in replies if not r.speculative]
    cap = config.max_batch if config.max_batch > 0 else len(replies) + 1
    first = sorted((r for r in replies if r.awaiting_first), key=lambda r: (-r.priority, r.started))[:cap]
    ongoing = [r for r in replies if not r.awaiting_first]

    def urgency(r: ReplyView) -> float:
        return config.low_water_s if r.buffer_s is None else r.buffer_s

    ongoing.sort(key=lambda r: (urgency(r) >= config.low_water_s, -r.priority, urgency(r)))
    room = cap - len(first)
    if first:
        decode = [r for r in ongoing if urgency(r) < config.low_water_s][:room]
    elif any(urgency(r) <= config.high_water_s for r in ongoing):
        decode = [r for r in ongoing if urgency(r) <= max(config.batch_fill_s, config.high_water_s)][:room]
    elif speculative or other_work:  # not due for playout: the tick is for that work
        decode = []
    else:  # asked for with nothing to do: progress for whoever drives the runner
        decode = ongoing[:room]
    starving = any(urgency(r) < config.low_water_s for r in ongoing)
    idle = not first and not starving
    return Plan(
        first=[r.session_id for r in first],
        decode=[r.session_id for r in decode],
        audio_prefill=idle,
        speculate=[r.session_id for r in speculative][: max(0, room - len(decode))] if idle else [],
    )
