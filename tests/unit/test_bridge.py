"""FrameRing is bounded (5-10), drops the oldest when full and counts every drop in
agent_ingest_dropped_frames_total{reason="full"}, keeps agent_ingest_buffer_frames equal to
its occupancy."""

from __future__ import annotations

import pytest

from agent.media.rings import FrameRing
from agent.metrics import REGISTRY


def buffered(kind: str) -> float:
    return REGISTRY.get_sample_value("agent_ingest_buffer_frames", {"kind": kind}) or 0.0


def dropped(kind: str) -> float:
    return REGISTRY.get_sample_value("agent_ingest_dropped_frames_total", {"kind": kind, "reason": "full"}) or 0.0


@pytest.mark.parametrize("capacity", [0, 4, 11, 64])
def test_capacity_outside_5_to_10_is_refused(capacity):
    with pytest.raises(AssertionError):
        FrameRing[int](capacity, kind="t-cap")


def test_drop_oldest_when_full_and_count_it():
    kind = "t-drop"
    d0 = dropped(kind)
    ring = FrameRing[int](5, kind=kind)
    results = [ring.put(i) for i in range(8)]
    assert results == [True] * 5 + [False] * 3
    assert len(ring) == 5 and ring.dropped == 3
    assert dropped(kind) - d0 == 3
    assert buffered(kind) == 5
    assert ring.latest(2) == [6, 7]  # newest two, oldest first
    assert ring.latest(10) == [3, 4, 5, 6, 7]
    assert ring.latest(0) == []
    assert len(ring) == 5  # latest() does not remove
    assert ring.drain() == [3, 4, 5, 6, 7]
    assert len(ring) == 0 and buffered(kind) == 0
    ring.put(9)
    assert buffered(kind) == 1
    ring.clear()
    assert len(ring) == 0 and buffered(kind) == 0
    assert dropped(kind) - d0 == 3  # draining and clearing are not drops


def test_gauge_sums_rings_of_one_kind():
    kind = "t-sum"
    a, b = FrameRing[str](5, kind=kind), FrameRing[str](6, kind=kind)
    for i in range(3):
        a.put(f"a{i}")
    for i in range(9):
        b.put(f"b{i}")
    assert buffered(kind) == 3 + 6
    a.clear()
    assert buffered(kind) == 6
    b.drain()
    assert buffered(kind) == 0
