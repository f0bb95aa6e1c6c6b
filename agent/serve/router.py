"""OwnerPinnedRouter: a call's follow-ups go to the replica that owns it, new calls to the least busy.

Serve's consistent-hash router keeps a session on one replica only while the replica set
does not change, and its multiplexing falls back to other replicas after a second; a WebRTC
call cannot move at all (its peer lives in one process). So the owner is not hashed but
read: the call id names it (agent/serve/ownership.py). The id is found in Serve's session header
(`x-session-id`, also set by `handle.options(session_id=…)`) or in the request itself: the
proxy hands the router the ASGI scope it will send, pickled, and the path carries the id
(`/v1/realtime/calls/{id}/events`: EventSource cannot send headers).

- Owner alive: only the owner is offered (if it is saturated, the request waits for it).
- Owner gone: the least busy live replica takes the request and answers 410 at once, since
  the call ended with its replica; a client never waits for a replica that will not return.
- No owner (offers, /healthz, /livez, /readyz, the page): the replica with the fewest active
  calls, as each replica reports in its routing stats, plus the offers this router sent it
  since that report. Draining replicas come last, full ones (calls at the capacity the
  replica reports) just before them; equal loads are ordered at random (each
  router its own draw), so two routers, or a router with no report yet, do not all pick the
  same replica.

An offer counts against the replica ranked first the moment it is ranked, not when Serve has
placed it: the offers of a burst are ranked one after another before any placement resolves,
and counted only at placement they all saw the same loads and went to one replica. When the
placement resolves, the count moves to the replica that took the offer (a saturated first
choice), or is released (the placement failed or was cancelled). A replica also refuses offers
past its own capacity (503 + Retry-After, the agent's admission), so a stale view in another
router cannot overload it.
"""

from __future__ import annotations

import pickle
import random
from collections import Counter
from typing import Any, List, Optional

from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from agent.serve.ownership import is_offer, owner_from_request, owner_of


def request_scope(pending: Optional[PendingRequest]) -> Optional[dict[str, Any]]:
    """The ASGI scope of an HTTP request from Serve's proxy, else None (a handle call)."""
    if pending is None or not pending.args:
        return None
    arg = pending.args[0]
    if isinstance(arg, (bytes, bytearray)):
        # The proxy sends its StreamingHTTPRequest as raw pickled bytes (ray 2.60, pinned).
        try:
            arg = pickle.loads(arg)
        except Exception:  # not a request the proxy made: no scope to read
            return None
    scope = getattr(arg, "_asgi_scope", None)
    return scope if isinstance(scope, dict) else None


def request_owner(pending: Optional[PendingRequest], scope: Optional[dict[str, Any]] = None) -> Optional[str]:
    """The replica id that must serve this request, or None when any may (scope: already read)."""
    if pending is None:
        return None
    if pending.metadata.session_id:
        owner = owner_of(pending.metadata.session_id)
        if owner is not None:
            return owner
    scope = scope if scope is not None else request_scope(pending)
    if scope is None:
        return None
    return owner_from_request(scope.get("path", ""), scope.get("query_string", b""), scope.get("headers", []))


class OwnerPinnedRouter(ConsistentHashRouter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._routed_offers: Counter[str] = Counter()  # replica unique id -> offers this router sent
        self._placing: dict[str, str] = {}  # offer being placed -> the replica it is counted against
        self._rng = random.Random()

    def _load(self, replica: RunningReplica) -> tuple[int, int, float]:
        stats = replica.routing_stats or {}
        rid = replica.replica_id.unique_id
        # Offers sent since the replica last reported: its count lags by up to one stats period.
        unreported = max(0, self._routed_offers[rid] - int(stats.get("offers", 0)))
        calls = float(stats.get("active_calls", 0)) + unreported
        # A full replica would refuse (503): it comes after every replica with room, whatever the
        # loads (replicas may differ in capacity: their GPUs' memory plans differ).
        capacity = int(stats.get("capacity", 0))
        full = 1 if capacity and calls >= capacity else 0
        return (1 if stats.get("draining") else 0, full, calls)

    def by_load(self, replicas: List[RunningReplica]) -> List[RunningReplica]:
        shuffled = list(replicas)
        self._rng.shuffle(shuffled)  # equal loads in a random order (sorted() is stable)
        return sorted(shuffled, key=self._load)

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        scope = request_scope(pending_request)  # unpickled once per routing attempt
        owner = request_owner(pending_request, scope)
        ranked = self.by_load(candidate_replicas)
        if owner is None:
            if (
                pending_request is not None
                and scope is not None
                and is_offer(scope.get("method", ""), scope.get("path", ""))
            ):
                self._count_offer(pending_request, ranked[0])
            return [[r] for r in ranked]
        for replica in candidate_replicas:
            if replica.replica_id.unique_id == owner:
                return [[replica]]
        return [ranked[:1]]  # the owner is gone: a live replica answers 410 at once

    def _count_offer(self, pending: PendingRequest, first: RunningReplica) -> None:
        """Count the offer against `first` now; at placement move it to the replica that took it,
        or release it if none did. A retry of the same request (Serve calls again while it backs
        off) keeps its first count. (Serve's on_request_routed hook runs only with strict
        max_ongoing_requests, so the request's future is what says where it went.)"""
        key = pending.metadata.internal_request_id
        if key in self._placing:
            return
        counted = first.replica_id.unique_id
        self._placing[key] = counted
        self._routed_offers[counted] += 1

        def placed(future: Any) -> None:
            self._placing.pop(key, None)
            self._release(counted)
            if not future.cancelled() and future.exception() is None:
                self._routed_offers[future.result().replica_id.unique_id] += 1

        pending.future.add_done_callback(placed)

    def _release(self, rid: str) -> None:
        self._routed_offers[rid] -= 1
        if self._routed_offers[rid] <= 0:
            del self._routed_offers[rid]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._routed_offers.pop(replica_id.unique_id, None)
