"""What loading a checkpoint costs in host memory, measured in a fresh process.

`measure_load_in_subprocess(path, device, dtype)` runs `agent.engine.checkpoints.model.load_model` exactly as
`--model PATH --device D --dtype T` would, in a new Python process (so nothing an earlier load left
behind counts), and reports from inside it:

- anonymous resident memory (`RssAnon` in /proc/self/status) before the load, at its peak (a
  thread samples it every 2 ms) and after it. Anonymous memory is what a load needs from the
  host: the safetensors shards are memory-mapped, and their pages are page cache (`RssFile`),
  which the kernel drops under pressure and re-reads, so they are reported but not counted;
- `ru_maxrss`, the kernel's exact peak of the whole resident set (anonymous plus file pages): an
  upper bound that no sampling can miss;
- the bytes of the loaded model's parameters and buffers, and where they live;
- on CUDA, `torch.cuda.max_memory_allocated()` after the load.

On the CPU the model itself is host memory, partly anonymous (tensors transformers had to make:
the experts stacked from the checkpoint's per-expert tensors, dtype conversions) and partly the
mapped file (tensors used as they are stored). So a CPU load reports its *staging*: the peak
anonymous memory less the anonymous memory the loaded model still holds, the transient a
device load would also need on the host.

    python -m agent.engine.instruments.load_memory PATH --device cpu --dtype bfloat16   # one JSON line

`measure_quantize_in_subprocess(src, dst, shard_bytes)` measures `omni-agent quantize SRC DST` the
same way (anonymous memory before, at the peak, after; the bytes written): what writing the
4-bit checkpoint needs from the host, which must not grow with the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SAMPLE_S = 0.002


@dataclass(frozen=True)
class LoadMemory:
    device: str  # where the model's tensors ended up
    dtype: str
    seconds: float
    anon_before: int  # bytes of RssAnon after the imports, right before load_model
    anon_peak: int  # sampled peak RssAnon during load_model
    anon_after: int  # RssAnon once load_model returned
    file_peak: int  # sampled peak RssFile (mapped shards, libraries): reclaimable, not counted
    maxrss: int  # the kernel's peak resident set of the process (anonymous + file), bytes
    model_bytes: int  # parameters and buffers of the loaded model
    param_dtypes: str  # the dtypes of its floating-point parameters, comma-separated
    device_peak: int  # torch.cuda.max_memory_allocated() on CUDA, else model_bytes

    @property
    def on_host(self) -> bool:
        return all(d == "cpu" for d in self.device.split(","))

    @property
    def host_peak(self) -> int:
        """Host memory a load onto an accelerator needs: there, the whole anonymous peak (the
        model keeps nothing on the host); on the CPU, the peak less what the loaded model itself
        keeps (the interpreter and libraries plus the load's staging)."""
        return self.anon_peak - self.model_anon if self.on_host else self.anon_peak

    @property
    def model_anon(self) -> int:
        """Anonymous memory the load left held: the model's own on the CPU, ~0 on an accelerator."""
        return max(0, self.anon_after - self.anon_before)

    @property
    def staging(self) -> int:
        """What the load held on the host beyond the process before it and the model after it."""
        return max(0, self.anon_peak - self.anon_before - self.model_anon)


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


class _Sampler:
    """Peak RssAnon / RssFile of this process, sampled on a thread while a block runs."""

    def __init__(self) -> None:
        self.anon = self.file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            status = _status()
            self.anon, self.file = max(self.anon, status["RssAnon"]), max(self.file, status["RssFile"])
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        status = _status()  # a last look: the end of the block may fall between two samples
        self.anon, self.file = max(self.anon, status["RssAnon"]), max(self.file, status["RssFile"])


def measure_load(path: str, device: str, dtype: str) -> LoadMemory:
    """Load `path` in this process with the sampler running (meaningful in a fresh process only)."""
    import torch
    import transformers  # noqa: F401  (imported before the baseline: its import is not the load's)

    from agent.engine.checkpoints.model import load_model

    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.init()  # the CUDA context's host memory is the process's, not the load's
        torch.cuda.reset_peak_memory_stats()
    before = _status()["RssAnon"]
    t0 = time.perf_counter()
    with _Sampler() as sampler:
        loaded = load_model(path, device=device, dtype=dtype)
    seconds = time.perf_counter() - t0
    after = _status()["RssAnon"]
    model = loaded.model
    tensors = [*model.parameters(), *model.buffers()]
    model_bytes = sum(t.numel() * t.element_size() for t in tensors)
    devices = sorted({str(t.device) for t in tensors})
    return LoadMemory(
        device=",".join(devices),
        dtype=str(loaded.dtype).removeprefix("torch."),
        seconds=seconds,
        anon_before=before,
        anon_peak=max(sampler.anon, after),
        anon_after=after,
        file_peak=sampler.file,
        maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        model_bytes=model_bytes,
        param_dtypes=",".join(
            sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()})
        ),
        device_peak=torch.cuda.max_memory_allocated() if cuda else model_bytes,
    )


def _fresh(args: list[str], what: str, timeout_s: float, threads: int) -> dict:
    """This module's `main` in a new interpreter (this one's memory and caches count for
    nothing); its last stdout line, as JSON."""
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-m", "agent.engine.instruments.load_memory", *args, "--threads", str(threads)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_load_in_subprocess(
    path: str | Path, device: str, dtype: str, timeout_s: float = 3600.0, threads: int = 0
) -> LoadMemory:
    """`measure_load` in a fresh interpreter; `threads`: torch's CPU threads there (0: its default)."""
    args = [str(path), "--device", device, "--dtype", dtype]
    return LoadMemory(**_fresh(args, f"load of {path}", timeout_s, threads))


@dataclass(frozen=True)
class QuantizeMemory:
    anon_before: int
    anon_peak: int
    anon_after: int
    source_bytes: int  # the float model's tensors
    written_bytes: int  # the 4-bit checkpoint's tensors
    largest_source_tensor: int  # bytes of the largest tensor in the source shards

    @property
    def staging(self) -> int:
        return self.anon_peak - self.anon_before


def measure_quantize(src: str, dst: str, shard_bytes: int) -> QuantizeMemory:
    import torch
    import transformers  # noqa: F401  (imported before the baseline)
    from safetensors import safe_open

    from agent.engine.quant.convert import quantize_checkpoint

    largest = 0
    for shard in Path(src).glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                shape, dtype = piece.get_shape(), piece.get_dtype()
                size = {"BF16": 2, "F16": 2, "F32": 4}.get(dtype, 1)
                largest = max(largest, size * int(torch.tensor(shape).prod()) if shape else size)
    before = _status()["RssAnon"]
    with _Sampler() as sampler:
        summary = quantize_checkpoint(src, dst, shard_bytes=shard_bytes)
    after = _status()["RssAnon"]
    return QuantizeMemory(before, max(sampler.anon, after), after, summary.source_bytes, summary.written_bytes, largest)


def measure_quantize_in_subprocess(
    src: str | Path, dst: str | Path, shard_bytes: int, timeout_s: float = 3600.0, threads: int = 0
) -> QuantizeMemory:
    """`measure_quantize` in a fresh interpreter; `threads` as for a load."""
    args = [str(src), "--quantize-to", str(dst), "--shard-bytes", str(shard_bytes)]
    return QuantizeMemory(**_fresh(args, f"quantize of {src}", timeout_s, threads))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantize-to", default="", help="measure `omni-agent quantize PATH DST` instead of a load")
    p.add_argument("--shard-bytes", type=int, default=2**31)
    # Memory does not depend on it; time does. On a busy machine two OpenMP threads wait for each
    # other at every op's barrier, spinning while the other is descheduled.
    p.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: its default)")
    args = p.parse_args(argv)
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    if args.quantize_to:
        print(json.dumps(asdict(measure_quantize(args.path, args.quantize_to, args.shard_bytes))), flush=True)
        return
    print(json.dumps(asdict(measure_load(args.path, args.device, args.dtype))), flush=True)


if __name__ == "__main__":
    main()
