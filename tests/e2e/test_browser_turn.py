"""A browser behind a TURN relay: the page uses the ICE servers the agent hands it, with
credentials minted per call from a shared secret (coturn's TURN REST scheme, `--turn-secret`).

Pins, end to end on loopback: Debian's coturn (`turnserver`, `use-auth-secret`) listening and
relaying on 127.0.0.1 only; the agent started with `--ice-server turn:127.0.0.1:PORT` (no
credential) and the same secret; the page opened with `?relay` (iceTransportPolicy "relay").
- the page's RTCPeerConnection is configured with that TURN URL and a minted `<expiry>:omni-page`
  username (never the secret), its offer carries relay candidates only, the call connects, the
  agent's voice arrives and is audible (inbound-rtp packets and energy) and the agent answers
  what the fake mic says (response.done), so audio flows both ways through the relay;
- the selected candidate pair's local candidate (getStats) is of type "relay";
- coturn accepted allocations for both minted users, the page's (`omni-page`) and the agent's
  own (`omni-agent`): one coturn configuration serves both sides;
- credentials coturn refuses (HMAC'd with a wrong secret, or expired) make the relay-only call
  fail within seconds with a visible message naming the TURN refusal (401), not hang in
  "connecting"; so does `?relay` against an agent that names no TURN server.
Without `turnserver` the module skips (fails under CI=true, naming the Debian package).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from support.loopback import free_port
from support.page_watch import watch_call

from e2e.conftest import serve, stop_server, tail

pytestmark = pytest.mark.browser

SECRET = "loopback-turn-secret-" + "5a" * 8
REALM = "omni-agent.test"
TURN_START_TIMEOUT_S = 15
CALL_TIMEOUT_S = 90
FAIL_TIMEOUT_S = 20

SNAPSHOT_JS = """async () => {
  const o = window.omni;
  const text = (id) => document.getElementById(id).innerText.trim();
  const s = {
    state: o.state, errorBox: document.getElementById("error").hidden ? "" : text("error"),
    dones: o.events.filter((e) => e.type === "response.done").length,
    errors: o.events.filter((e) => e.type === "error"),
    audioPackets: 0, audioEnergy: 0, config: null, localSdp: "", local: null, remote: null,
  };
  if (!o.pc) return s;
  const conf = o.pc.getConfiguration();
  s.config = { iceTransportPolicy: conf.iceTransportPolicy, iceServers: conf.iceServers };
  s.localSdp = o.pc.localDescription?.sdp ?? "";
  const stats = await o.pc.getStats();
  const byId = new Map();
  stats.forEach((r) => byId.set(r.id, r));
  let pair = null;
  stats.forEach((r) => {
    if (r.type === "transport" && r.selectedCandidatePairId) pair = byId.get(r.selectedCandidatePairId);
    if (r.type === "inbound-rtp" && r.kind === "audio") {
      s.audioPackets = r.packetsReceived ?? 0;
      s.audioEnergy = r.totalAudioEnergy ?? 0;
    }
  });
  if (pair) {
    const pick = (c) => c && { type: c.candidateType, address: c.address, protocol: c.protocol };
    s.local = pick(byId.get(pair.localCandidateId));
    s.remote = pick(byId.get(pair.remoteCandidateId));
  }
  return s;
}"""


def turn_credential(secret: str, username: str) -> str:
    """base64(HMAC-SHA1(secret, username)): what coturn recomputes for a TURN REST username."""
    return base64.b64encode(hmac.new(secret.encode(), username.encode(), hashlib.sha1).digest()).decode()


def start_turnserver(port: int, workdir: Path) -> subprocess.Popen:
    """coturn on 127.0.0.1 only (listening and relaying), TURN REST auth with SECRET, no TLS,
    no CLI, its log to a file; waits (bounded) until it accepts connections on its port."""
    log_path = workdir / "turnserver.log"
    cmd = [
        "turnserver",
        "-n",  # no configuration file: exactly these options
        "--listening-ip=127.0.0.1",
        "--relay-ip=127.0.0.1",
        f"--listening-port={port}",
        "--use-auth-secret",
        f"--static-auth-secret={SECRET}",
        f"--realm={REALM}",
        "--allow-loopback-peers",  # the agent's candidates are on 127.0.0.1
        "--fingerprint",
        "--no-cli",
        "--no-tls",
        "--no-dtls",
        "--verbose",  # one line per accepted request, with its user: what the test reads
        "--log-file=stdout",
        "--simple-log",
        f"--pidfile={workdir / 'turnserver.pid'}",
        f"--db={workdir / 'turndb'}",
    ]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + TURN_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"turnserver exited with {proc.returncode}:\n{tail(log_path)}")
        try:  # coturn listens on TCP and UDP alike: an accepted connection means it is up
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.1)
    stop_server(proc)
    raise TimeoutError(f"turnserver did not listen on {port} in {TURN_START_TIMEOUT_S} s:\n{tail(log_path)}")


@pytest.fixture(scope="module")
def turn_server(tmp_path_factory):
    if shutil.which("turnserver") is None:
        missing = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
        missing("needs Debian's coturn for its turnserver (make test installs it: apt-get install coturn)")
    workdir = tmp_path_factory.mktemp("turn")
    port = free_port()
    proc = start_turnserver(port, workdir)
    yield {"url": f"turn:127.0.0.1:{port}?transport=udp", "log": workdir / "turnserver.log"}
    stop_server(proc)


@pytest.fixture(scope="module")
def turn_agent_url(turn_server, tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("turn-agent")
    yield from serve(tiny_model_dir, log_dir, "--ice-server", turn_server["url"], "--turn-secret", SECRET)


def relay_call(page, base_url: str, timeout_s: float = CALL_TIMEOUT_S) -> dict:
    """Open the page with ?relay, press Start, wait until the call is connected through the
    relay, the agent's voice was heard and the agent answered the mic (each latched when seen)."""
    page.goto(base_url + "?relay")
    page.get_by_role("button", name="Start the call").click()
    seen, snap = watch_call(
        page,
        SNAPSHOT_JS,
        lambda snap: {
            "connected": snap["state"] == "connected" and snap["local"] is not None,
            "audio packets": snap["audioPackets"] > 0,
            "audio energy": snap["audioEnergy"] > 0,
            "response.done": snap["dones"] > 0,
        },
        timeout_s,
    )
    return {"first_connected": seen["connected"], "last": snap}


def test_relay_only_call_connects_through_turn(page, turn_server, turn_agent_url):
    started = time.time()
    result = relay_call(page, turn_agent_url)
    first, last = result["first_connected"], result["last"]

    assert last["config"]["iceTransportPolicy"] == "relay"
    [server] = last["config"]["iceServers"]
    assert server["urls"] == [turn_server["url"]]
    expiry, user = server["username"].split(":")
    assert user == "omni-page" and int(expiry) > started
    assert server["credential"] == turn_credential(SECRET, server["username"])
    assert SECRET not in repr(last["config"])

    candidates = [line for line in last["localSdp"].splitlines() if line.startswith("a=candidate:")]
    assert candidates and all(" typ relay " in c for c in candidates), candidates
    for snap in (first, last):
        assert snap["local"]["type"] == "relay", snap["local"]
        assert snap["local"]["address"] == "127.0.0.1" and snap["remote"]["address"] == "127.0.0.1"
    assert last["audioPackets"] > 0 and last["audioEnergy"] > 0 and last["dones"] > 0

    log = turn_server["log"].read_text(errors="replace")
    for side in ("omni-page", "omni-agent"):
        assert any(f":{side}>" in line and "ALLOCATE processed, success" in line for line in log.splitlines()), (
            f"coturn never accepted an allocation for {side}:\n{log[-3000:]}"
        )
    print(f"\nrelay call: local {last['local']}, remote {last['remote']}, {last['audioPackets']} audio packets")


@pytest.mark.parametrize("refused", ["wrong secret", "expired"])
def test_refused_turn_credentials_fail_visibly(page, turn_server, turn_agent_url, refused):
    def tamper(route):
        body = route.fetch().json()
        for server in body.get("ice_servers", []):
            if "credential" not in server:
                continue
            if refused == "wrong secret":
                server["credential"] = turn_credential("not-" + SECRET, server["username"])
            else:  # HMAC'd correctly, but its expiry has passed
                server["username"] = f"{int(time.time()) - 60}:omni-page"
                server["credential"] = turn_credential(SECRET, server["username"])
        route.fulfill(json=body)

    page.route("**/v1/omni/config", tamper)
    page.goto(turn_agent_url + "?relay")
    started = time.monotonic()
    page.get_by_role("button", name="Start the call").click()
    page.wait_for_function("window.omni.state === 'failed'", timeout=FAIL_TIMEOUT_S * 1000)
    waited = time.monotonic() - started
    error = page.get_by_role("alert")
    assert error.is_visible()
    message = error.inner_text()
    assert "No TURN relay address" in message and "401" in message, message
    assert page.get_by_role("button", name="Start the call").is_enabled()
    print(f"\n{refused}: failed after {waited:.1f} s: {message}")


def test_relay_without_a_turn_server_says_so(page, agent_url):
    """?relay against an agent that names no TURN server: refused at once, with the reason."""
    page.goto(agent_url + "?relay")
    page.get_by_role("button", name="Start the call").click()
    page.wait_for_function("window.omni.state === 'failed'", timeout=FAIL_TIMEOUT_S * 1000)
    message = page.get_by_role("alert").inner_text()
    assert "offers no TURN server" in message and "--turn-secret" in message, message
