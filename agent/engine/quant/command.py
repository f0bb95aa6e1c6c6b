"""`omni-agent quantize SRC DST`: write a 4-bit copy of a float checkpoint, layer by layer."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def add_arguments(quant: argparse.ArgumentParser) -> None:
    quant.add_argument("src", type=Path)
    quant.add_argument("dst", type=Path)
    quant.add_argument("--method", default="int4", choices=["int4"])
    quant.add_argument("--group", type=int, default=128, help="inputs per scale and offset (default %(default)s)")
    quant.add_argument(
        "--keep-heads", action="store_true", help="keep the thinker's and talker's output heads in the model's dtype"
    )
    quant.add_argument(
        "--keep-embeddings",
        action="store_true",
        help="keep the thinker's token table in the model's dtype (0.42 GiB more at real size; "
        "its rows then carry no quantization error into the first layer)",
    )
    quant.add_argument(
        "--device", default="cpu", help="where each tensor is quantized (cpu or cuda; default %(default)s)"
    )


def run(ns: argparse.Namespace) -> int:
    from agent.engine.quant.apply import QuantScheme
    from agent.engine.quant.convert import quantize_checkpoint

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (ns.src / "config.json").exists():
        print(f"omni-agent: {ns.src} is not a checkpoint folder (no config.json)", file=sys.stderr)
        return 2
    try:
        scheme = QuantScheme(
            method=ns.method, group=ns.group, heads=not ns.keep_heads, embeddings=not ns.keep_embeddings
        )
        summary = quantize_checkpoint(ns.src, ns.dst, scheme, device=ns.device)
    except (ValueError, KeyError) as exc:
        print(f"omni-agent: {exc}", file=sys.stderr)
        return 2
    for name, why in summary.report.kept:
        print(f"kept in the model's dtype: {name} ({why})")
    gib = 2**30
    print(
        f"{ns.dst}: {len(summary.report.quantized)} modules quantized, "
        f"{summary.source_bytes / gib:.2f} GiB -> {summary.written_bytes / gib:.2f} GiB in {summary.shards} shards"
    )
    return 0
