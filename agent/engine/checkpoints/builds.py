"""Build a checkpoint folder once, atomically: what every locally made model shares.

The files are written into a sibling temp dir with a marker file last, and the dir is
renamed into place in one step, so a racing or interrupted build never leaves a half
checkpoint behind, and a finished one is never rebuilt (until its build version changes).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable


def is_complete(path: Path, marker_file: str, build_version: int) -> bool:
    try:
        return json.loads((Path(path) / marker_file).read_text()).get("build_version") == build_version
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return False


def build_once(path: Path, marker_file: str, build_version: int, build_into: Callable[[Path], dict[str, Any]]) -> Path:
    """Run `build_into(tmp_dir)` (it writes the files, returns extra marker fields) unless
    `path` already holds a complete build of this version; return `path`."""
    path = Path(path)
    if is_complete(path, marker_file, build_version):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        extras = build_into(tmp)
        (tmp / marker_file).write_text(json.dumps({"build_version": build_version, **extras}, indent=2))
        if path.exists():
            # An incomplete or stale build is replaced; a complete one (a racing builder
            # finished first) is kept and ours discarded.
            if is_complete(path, marker_file, build_version):
                return path
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return path
