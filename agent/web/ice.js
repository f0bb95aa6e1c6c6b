// ICE for the call: the STUN/TURN servers the agent hands out, and ?relay, which forces TURN.
//
// The list comes from GET /v1/omni/config on every Start, not once at page load: TURN
// credentials in it are minted for one call and expire (the agent's --turn-ttl), and a page
// can sit open far longer than that. When the agent wants a key, the call's ek_ key goes
// along, since the agent hands out TURN credentials only to key holders.
// ?relay (in the page's URL) sets iceTransportPolicy "relay": the browser offers relay
// candidates only, so the call works through the TURN server or not at all; the way to test
// a TURN setup from a machine that could also connect directly.

const relayForced = () => new URLSearchParams(window.location.search).has("relay");
const isTurn = (server) => [server.urls].flat().some((url) => /^turns?:/.test(url));
const candidateErrors = new WeakMap(); // pc -> what the STUN/TURN servers answered, for messages

async function iceServers(token) {
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  try {
    const res = await fetch("v1/omni/config", { headers, cache: "no-store" });
    if (!res.ok) throw new Error(`HTTP ${res.status}`);
    return (await res.json()).ice_servers ?? [];
  } catch (err) {
    // Host candidates alone still reach an agent on this machine or LAN: try without.
    console.warn("GET v1/omni/config for ICE servers failed:", err);
    return [];
  }
}

// The call's RTCPeerConnection, configured with the agent's STUN/TURN servers.
export async function newPeerConnection(token) {
  const servers = await iceServers(token);
  const relay = relayForced();
  if (relay && !servers.some(isTurn)) {
    throw new Error(
      "?relay allows TURN relays only, but the agent offers no TURN server " +
        "(start it with --ice-server turn:… and --turn-secret).",
    );
  }
  const pc = new RTCPeerConnection(relay ? { iceServers: servers, iceTransportPolicy: "relay" } : { iceServers: servers });
  const errors = [];
  candidateErrors.set(pc, errors);
  pc.addEventListener("icecandidateerror", (e) => {
    errors.push(`${e.url}: ${e.errorCode} ${e.errorText.replace(/\.$/, "")}`.trim());
  });
  return pc;
}

// Once gathering is over: with ?relay, an offer without a relay candidate can never connect
// (the TURN server refused the credentials or could not be reached), so say so now instead
// of waiting for ICE to give up.
export function requireRelay(pc) {
  if (pc.getConfiguration().iceTransportPolicy !== "relay") return;
  if (/ typ relay/.test(pc.localDescription?.sdp ?? "")) return;
  const why = candidateErrors.get(pc) ?? [];
  throw new Error(
    "No TURN relay address (?relay allows relays only): the TURN server refused the credentials " +
      `or could not be reached${why.length ? ` (${[...new Set(why)].join("; ")})` : ""}.`,
  );
}
