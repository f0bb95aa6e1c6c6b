"""The compiled steps' persistent cache: one file of compile artifacts per (software, card, shapes).

A cold start compiles every per-frame step (minutes on a GPU at real size). Inductor's own
on-disk caches (FX graphs, AOT autograd, Triton kernels) live under `TORCHINDUCTOR_CACHE_DIR`
and make a second start on the *same* machine skip code generation, but they are a directory
tree of thousands of files keyed by hashes of the traced graph. torch's "mega-cache"
(`torch.compiler.save_cache_artifacts` / `load_cache_artifacts`) packs every artifact a process
compiled into one byte string that a fresh machine loads into those caches before compiling:
what a KubeRay init container or a job per GPU type writes into a shared volume
(`omni-agent precompile`, docs/ray-serve.md).

The file's name is a key of everything that makes an artifact unusable elsewhere: torch's and
Triton's versions, the device (GPU name, or the CPU's vector ISA that inductor's C++ targets),
this project's version and the compiled shapes (the model's configuration, dtype, slots and KV
capacities, batch buckets, attention kernel, compile options). A different key is a miss and a
cold compile, never a wrong kernel: inductor still checks each artifact's own hash and guards
before it uses one, so a stale file costs time, not correctness.

Dynamo is not in the file: it traces each step again at every start (seconds with layers as
nested regions, since it traces one layer and reuses it); what the cache saves is AOT autograd,
inductor's code generation and the C++/Triton builds.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

log = logging.getLogger(__name__)

CacheState = Literal["hit", "miss", "off"]


def software_key(device: torch.device) -> dict[str, str]:
    """What the artifacts were built with and for, besides the shapes."""
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "none"
    try:
        project = importlib.metadata.version("omni-agent")
    except importlib.metadata.PackageNotFoundError:
        project = "source"
    if device.type == "cuda":
        target = (
            torch.cuda.get_device_name(device) + f" sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
        )
    else:
        target = f"cpu {torch.backends.cpu.get_cpu_capability()}"
    return {"torch": torch.__version__, "triton": triton, "project": project, "target": target}


@dataclass(frozen=True)
class ArtifactFile:
    """One start-up's compile artifacts: `<root>/<name>-<hash of key>.bin`, beside a JSON of its key."""

    root: Path
    key: Mapping[str, Any]

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dict(self.key), sort_keys=True, default=str).encode()).hexdigest()[:20]

    @property
    def path(self) -> Path:
        return self.root / f"steps-{self.digest}.bin"

    def load(self) -> CacheState:
        """Load the artifacts into torch's caches before the first compile: "hit" when the file
        was there and loaded, "miss" when there is none (or it could not be read)."""
        if not self.path.is_file():
            log.info("compile cache: miss (%s not found)", self.path.name)
            return "miss"
        started = time.perf_counter()
        try:
            info = torch.compiler.load_cache_artifacts(self.path.read_bytes())
        except Exception as exc:  # a torn or foreign file: compile cold, never fail the start
            log.warning("compile cache: %s unreadable (%s: %s), compiling cold", self.path, type(exc).__name__, exc)
            return "miss"
        if info is None:
            log.warning("compile cache: %s held no artifacts, compiling cold", self.path)
            return "miss"
        kinds = {k: len(v) for k, v in info.artifacts.items() if v}
        log.info("compile cache: hit, %s loaded in %.1f s (%s)", self.path.name, time.perf_counter() - started, kinds)
        return "hit"

    def save(self) -> int:
        """Write every artifact this process compiled (atomically: a reader never sees half a
        file); 0 when it compiled nothing new."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None or not saved[0]:
            return 0
        data, _ = saved
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".steps-", suffix=".tmp")
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, self.path)
        self.path.with_suffix(".json").write_text(json.dumps(dict(self.key), indent=1, sort_keys=True, default=str))
        log.info("compile cache: wrote %s (%.1f MiB)", self.path, len(data) / 2**20)
        return len(data)


_PATH_KEYS = ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash")


def compiled_shapes(model_config: Any, dtype: torch.dtype, slots: int, caches: Mapping[str, Any]) -> dict[str, Any]:
    """The shapes part of the key: the model's configuration (its dimensions, depth and heads;
    not where it was loaded from), the dtype, the sessions' slots and each slot cache's capacity
    and attention kernel (`caches`: name -> agent.engine.ops.slots.SlotKV)."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in _PATH_KEYS}
        return value

    config = json.dumps(strip(model_config.to_dict()), sort_keys=True, default=str)
    return {
        "model": hashlib.sha256(config.encode()).hexdigest()[:20],
        "dtype": str(dtype),
        "slots": slots,
        "caches": {name: (kv.capacity, kv.backend) for name, kv in sorted(caches.items())},
    }
