"""Run the suite (or part of it) several times in a row on a fresh clone while the machine is busy.

The suite must not depend on an idle machine: on a CI runner or a developer's laptop other work
runs beside it. This script makes that load on purpose and keeps it up for the whole series:

- a CPU hog: `--hog-cores` processes spinning in Python (each takes one core);
- a second agent (the tiny model, its own port on 127.0.0.1) carrying `--calls` real WebRTC calls
  that speak a WAV again and again (agent/client/client.py), so the agent's engine, aiortc and
  Opus work the whole time.

Then it clones HEAD into a temporary folder (once; the series runs that clone, as CI does) and
runs `scripts/run_tests.sh [pytest args]` there `--runs` times, each bounded by `--run-timeout-s`.
Prints one row per run (exit status, passed/failed/skipped as pytest reports them, seconds) and
a last line `runs=N green=G load=...`. Every process it started is stopped at the end.

    .venv/bin/python scripts/loaded_series.py --runs 5                       # the whole suite
    .venv/bin/python scripts/loaded_series.py --runs 5 -- tests/integration/test_ray_serve.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.client.client import AgentClient, wait_ready  # noqa: E402
from agent.transport.ice import restrict_ice_hosts  # noqa: E402

SUMMARY = re.compile(r"=+ (.*?) in [\d.]+s")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_hogs(cores: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]


def start_agent(port: int, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "agent", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--ice-host", "127.0.0.1",
    ]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def make_wav(path: Path) -> Path:
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_rtc import make_speech

    return make_speech(path)


async def keep_calls(url: str, wav: Path, calls: int, stop: asyncio.Event) -> int:
    """Keep `calls` calls up until `stop`; a call that fails is replaced (bounded by the stop).
    Returns how many calls were made in all."""
    made = 0

    async def one() -> None:
        nonlocal made
        while not stop.is_set():
            client = AgentClient(url, wav, video=True, repeat_after_s=2.0)
            made += 1
            try:
                await client.connect()
                await asyncio.wait_for(stop.wait(), timeout=120.0)  # a fresh call every 2 minutes
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the load goes on whatever happened
                pass
            finally:
                await client.close()

    await asyncio.gather(*(one() for _ in range(calls)))
    return made


def run_once(clone: Path, args: list[str], timeout_s: float, log: Path) -> tuple[int, str, float]:
    # The checkout's venv, with the clone first on the path (the venv's editable install points here).
    env = dict(os.environ, VENV=str(REPO / ".venv"), PYTHONPATH=str(clone), CI=os.environ.get("CI", "true"))
    start = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["sh", "scripts/run_tests.sh", *args], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    text = log.read_text(errors="replace")
    found = SUMMARY.findall(text)
    return rc, (found[-1] if found else "no pytest summary"), time.monotonic() - start


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--hog-cores", type=int, default=1)
    p.add_argument("--calls", type=int, default=2, help="calls the second agent carries throughout")
    p.add_argument("--run-timeout-s", type=float, default=45 * 60)
    p.add_argument("--out", type=Path, default=None, help="folder for the logs (default: a temporary one)")
    p.add_argument("pytest_args", nargs="*")
    args = p.parse_args()
    assert 1 <= args.runs <= 10, "a bounded series"

    out = args.out or Path(tempfile.mkdtemp(prefix="loaded-series-"))
    out.mkdir(parents=True, exist_ok=True)
    clone = out / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True).stdout

    restrict_ice_hosts(["127.0.0.1"])
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    hogs = start_hogs(args.hog_cores)
    agent = start_agent(port, out / "agent.log")
    stop = asyncio.Event()
    rows = []
    try:
        await wait_ready(url, timeout_s=300, proc=agent)
        load = asyncio.ensure_future(keep_calls(url, make_wav(out / "speech.wav"), args.calls, stop))
        for i in range(1, args.runs + 1):
            rc, summary, seconds = await asyncio.to_thread(
                run_once, clone, args.pytest_args, args.run_timeout_s, out / f"run{i}.log"
            )
            rows.append((i, rc, summary, seconds))
            print(f"| {i} | {rc} | {summary} | {seconds:.0f} |", flush=True)
        stop.set()
        made = await asyncio.wait_for(load, timeout=60)
    finally:
        stop.set()
        agent.terminate()
        for hog in hogs:
            hog.kill()
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
    print()
    print(f"commit {head.strip()}, logs in {out}; load: {args.hog_cores} spinning core(s), a second agent")
    print(
        f"carrying {args.calls} calls ({made} made in all); pytest args: {' '.join(args.pytest_args) or '(whole suite)'}"
    )
    print("| run | exit | pytest | seconds |")
    print("|---|---|---|---|")
    for i, rc, summary, seconds in rows:
        print(f"| {i} | {rc} | {summary} | {seconds:.0f} |")
    green = sum(1 for _, rc, _, _ in rows if rc == 0)
    print(f"runs={len(rows)} green={green} load=hog{args.hog_cores}+agent{args.calls}calls")


if __name__ == "__main__":
    asyncio.run(main())
