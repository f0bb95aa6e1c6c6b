"""Build the tiny random Qwen3-Omni checkpoint: python scripts/make_tiny_checkpoint.py DIR"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.engine.checkpoints.tiny import make_tiny  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dir", type=Path, help="output folder (kept as is if it already holds a complete build)")
    args = parser.parse_args()
    print(make_tiny(args.dir))


if __name__ == "__main__":
    main()
