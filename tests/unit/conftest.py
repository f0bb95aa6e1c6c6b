"""Fixtures the unit tests share."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def voices(tmp_path_factory) -> dict[str, np.ndarray]:
    """espeak-ng's reply and interruption for the echo-guard tests (support/echo.py)."""
    from support.echo import make_voices  # here: the GPU machine has no av/aiortc for `-m gpu` runs

    return make_voices(tmp_path_factory.mktemp("echo"))
