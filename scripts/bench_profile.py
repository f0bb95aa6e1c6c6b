"""The device's own kernel count per steady engine tick, read by torch.profiler (CUPTI on CUDA).

bench_kernels.py counts the kernels a tick *schedules* on the CPU (its launches, CUDA graphs
faked); this reads what the GPU actually ran, kernels inside CUDA graph replays included, so the
two can be set side by side (the GPU issue's target: within 1.5x). A tick here is one
`runner.step()` once every session's first audio frame is out: thinker decode, talker, code
predictor and code2wav for the batch, the steady state of a reply.

    scripts/bench_engine.py ... --device cuda --profile-ticks 8
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from bench_kernels import speak, until_first_audio

from agent.engine.api import ReplyDone


def tick_kernels(runner, audio: np.ndarray, image: np.ndarray, sessions: int, ticks: int, tag: str) -> dict:
    """Kernels per steady tick for `sessions` replies ending together: speak, end the turns, step
    (unprofiled) to the first audio of every session, profile up to `ticks` steps, finish."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_cuda = torch.cuda.is_available()
    sids = [f"{tag}{i}" for i in range(sessions)]
    speak(runner, sids, audio)
    for sid in sids:
        runner.begin_reply(sid, [image])
    until_first_audio(runner, sids)
    open_ = set(sids)
    steps = 0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        while steps < ticks and open_:
            for out in runner.step():
                if isinstance(out, ReplyDone):
                    open_.discard(out.session_id)
            steps += 1
        if on_cuda:
            torch.cuda.synchronize()
    while open_:  # the rest of the replies, unprofiled
        for out in runner.step():
            if isinstance(out, ReplyDone):
                open_.discard(out.session_id)
    for sid in sids:
        runner.close_session(sid)
    kinds: Counter[str] = Counter()
    launches = graph_launches = 0
    for evt in prof.events():
        if on_cuda and evt.device_type == torch.autograd.DeviceType.CUDA:
            kinds[evt.name] += 1
        elif evt.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
            launches += 1
        elif evt.name == "cudaGraphLaunch":
            graph_launches += 1
    # Memcpy/memset rows are device work too, but not kernels: counted apart.
    kernels = sum(n for name, n in kinds.items() if not name.startswith(("Memcpy", "Memset")))
    per_tick = lambda n: n / steps if steps else float("nan")  # noqa: E731
    return {
        "sessions": sessions,
        "steps": steps,
        "kernels_per_tick": per_tick(kernels),
        "copies_per_tick": per_tick(sum(kinds.values()) - kernels),
        "host_launches_per_tick": per_tick(launches),
        "graph_launches_per_tick": per_tick(graph_launches),
        "top": kinds.most_common(8),
    }


def short(kernel: str, width: int = 110) -> str:
    """A kernel's name without the namespace noise that every ATen kernel repeats (what tells two
    elementwise kernels apart is the functor deep in the template arguments)."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "c10::"):
        kernel = kernel.replace(noise, "")
    return kernel[:width]


def report(rows: list[dict]) -> None:
    print("\nkernels the device ran per steady tick (torch.profiler; CUDA graph replays included)")
    print(
        f"{'sessions':>8} {'steps':>5} {'kernels/tick':>12} {'copies/tick':>11} {'host launches':>13} {'graph launches':>14}"
    )
    for r in rows:
        print(
            f"{r['sessions']:>8} {r['steps']:>5} {r['kernels_per_tick']:>12.1f} {r['copies_per_tick']:>11.1f} "
            f"{r['host_launches_per_tick']:>13.1f} {r['graph_launches_per_tick']:>14.1f}"
        )
    for r in rows:
        top = ", ".join(f"{short(name)} x{n}" for name, n in r["top"])
        print(f"top kernels at {r['sessions']} session(s): {top or '(none: no CUDA device)'}")
    print(" ".join(f"gpu_kernels_per_tick_b{r['sessions']}={r['kernels_per_tick']:.0f}" for r in rows), flush=True)
