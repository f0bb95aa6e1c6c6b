"""CPU time of the agent process by kind of thread, for /metrics.

The agent is one process with a few kinds of threads, and what limits how many calls a machine
carries is which of them runs out of CPU first: the engine thread (torch), the asyncio thread
(the network: ICE, SRTP, RTP, the data channel, voice detection, resampling, pacing), the loop's
default executor (aiortc encodes Opus and VP8 there), aiortc's decoder threads, the decode pool
(client events too heavy for the loop: agent/realtime/inbox.py), and threads Python
does not know (torch's intra-op pool, onnxruntime's, FFmpeg's). Reading each thread's counters from
/proc at scrape time costs nothing between scrapes; `scripts/bench_rtc.py` turns two scrapes into
CPU-seconds per session-second.

With `--engine-process` the engine is a child process (agent/engine/process.py): all of its
threads count as `engine`. Linux only (/proc); elsewhere the metric is absent.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

TASKS = Path("/proc/self/task")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_kind(name: str, main: bool) -> str:
    """The label of a Python thread: what it does in this process, not its numbered name."""
    if main:
        return "asyncio"  # `omni-agent serve` runs its event loop on the main thread
    if name == "engine":
        return "engine"
    if name.startswith("asyncio_"):
        return "executor"  # the loop's default executor: aiortc's Opus and VP8 encoders
    if name in ("audio-decoder", "video-decoder"):
        return "decoder"
    if name.startswith("decode_"):
        return "decode"  # the server's decode pool: client events' images, audio and tool lists
    return "other"


def _task_seconds(tid: int | str, tasks: Path = TASKS) -> float | None:
    try:
        fields = (tasks / str(tid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None  # the thread ended between the listing and the read
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def live_threads() -> dict[int, tuple[str, float]]:
    """Each live thread of this process: native id -> (kind, CPU-seconds used so far)."""
    out: dict[int, tuple[str, float]] = {}
    main = threading.main_thread()
    python = {t.native_id: thread_kind(t.name, t is main) for t in threading.enumerate() if t.native_id}
    for entry in TASKS.iterdir():
        tid = int(entry.name)
        seconds = _task_seconds(tid)
        if seconds is not None:
            out[tid] = (python.get(tid, "native"), seconds)
    for pid in _engine_processes():  # --engine-process: every thread of the child is the engine's
        tasks = Path(f"/proc/{pid}/task")
        try:
            tids = [int(entry.name) for entry in tasks.iterdir()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        for tid in tids:
            seconds = _task_seconds(tid, tasks)
            if seconds is not None:
                out[tid] = ("engine", seconds)
    return out


def _engine_processes() -> list[int]:
    """Child processes started by multiprocessing's spawn (the engine process, agent/engine/
    process.py; not its resource tracker)."""
    pids: list[int] = []
    for entry in TASKS.iterdir():
        try:
            pids += [int(p) for p in (entry / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    engines = []
    for pid in pids:
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                engines.append(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return engines


class ThreadCpu:
    """Per-kind totals that only grow: a thread that ended (a call's decoders, an executor
    worker) keeps the CPU time it had at the last reading in its kind's total."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[str, float]] = {}
        self._retired: dict[str, float] = {}

    def read(self) -> dict[str, float]:
        now = live_threads()
        for tid, (kind, seconds) in self._last.items():
            if tid not in now:
                self._retired[kind] = self._retired.get(kind, 0.0) + seconds
        self._last = now
        out = dict(self._retired)
        for kind, seconds in now.values():
            out[kind] = out.get(kind, 0.0) + seconds
        return out


class ThreadCpuCollector(Collector):
    def __init__(self) -> None:
        self._cpu = ThreadCpu()

    def collect(self) -> Iterator[CounterMetricFamily]:
        if not TASKS.is_dir():
            return
        family = CounterMetricFamily(
            "agent_thread_cpu_seconds",
            "CPU time of this process's threads by kind: engine (torch), asyncio (network), executor "
            "(Opus/VP8 encode), decoder (aiortc's), decode (client events' images, audio, tools), "
            "native (torch/onnxruntime/FFmpeg pools), other",
            labels=["thread"],
        )
        for kind, seconds in sorted(self._cpu.read().items()):
            family.add_metric([kind], seconds)
        yield family
