"""Priority classes at the front door, over the real app and engine (tiny model), WebSocket transport.

Pins, with max_sessions=2 and one slot kept for high priority: a normal session is admitted and
session.created carries session.omni.priority "normal"; a second normal one gets 503 (code
capacity, Retry-After) and agent_offers_rejected_total{reason="reserved"} moves; a high one
(?priority=high) is admitted into the kept slot; a third of either class gets 503. /metrics
counts sessions per class (agent_sessions_active{priority}). session.update cannot change the
priority (error with param session.omni.priority); an unknown ?priority= is a 400 naming
`priority`, on WebSocket and on POST /v1/realtime/calls.
"""

from __future__ import annotations

import json

import aiohttp
import pytest
from support.realtime_helpers import RunningAgent, metric, module_agent, refused_upgrade, wait_no_sessions

pytestmark = pytest.mark.asyncio(loop_scope="module")


agent = module_agent(max_sessions=2, high_priority_slots=1)


async def first_event(ws: aiohttp.ClientWebSocketResponse) -> dict:
    msg = await ws.receive(timeout=15)
    return json.loads(msg.data)


async def test_reserved_slot_and_per_class_metrics(agent: RunningAgent) -> None:
    url = agent.url
    ws_url = url.replace("http", "ws") + "/v1/realtime?model=x"
    async with aiohttp.ClientSession() as http:
        reserved_before = await metric(http, url, 'agent_offers_rejected_total{reason="reserved"}')
        normal = await http.ws_connect(ws_url)
        created = await first_event(normal)
        assert created["type"] == "session.created" and created["session"]["omni"]["priority"] == "normal"

        assert (await refused_upgrade(http, ws_url))["code"] == "capacity"  # a plain GET is refused before the upgrade
        assert await metric(http, url, 'agent_offers_rejected_total{reason="reserved"}') == reserved_before + 1

        high = await http.ws_connect(ws_url + "&priority=high")
        created = await first_event(high)
        assert created["session"]["omni"]["priority"] == "high"
        assert await metric(http, url, 'agent_sessions_active{priority="high"}') == 1
        assert await metric(http, url, 'agent_sessions_active{priority="normal"}') == 1

        async with http.get(ws_url + "&priority=high") as full:
            assert full.status == 503

        await high.send_str(
            json.dumps(
                {
                    "type": "session.update",
                    "event_id": "e1",
                    "session": {"type": "realtime", "omni": {"priority": "normal"}},
                }
            )
        )
        error = await first_event(high)
        assert error["type"] == "error" and error["error"]["param"] == "session.omni.priority"

        await normal.close()
        await high.close()
    await wait_no_sessions(url, "sessions were not closed")
    async with aiohttp.ClientSession() as http:
        assert await metric(http, url, "agent_sessions_active{") == 0


async def test_bad_priority_is_a_400(agent: RunningAgent) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(agent.url + "/v1/realtime?model=x&priority=urgent") as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "priority"
        async with http.post(
            agent.url + "/v1/realtime/calls?priority=urgent",
            data="v=0\r\n",
            headers={"Content-Type": "application/sdp"},
        ) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "priority"
