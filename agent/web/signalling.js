// Keys and signalling: GET /v1/omni/config, the ek_ key mint, the raw-SDP offer POST, and the
// hang-up DELETE.
import { omni, ui } from "./state.js";
import { requireRelay } from "./ice.js";

// aiortc does no trickle ICE, so the offer must carry every candidate: wait for gathering
// to finish, but never longer than this (a host with a dead interface can stall it).
const ICE_GATHER_TIMEOUT_MS = 2000;
// Lifetime asked for the ephemeral key (the server's default). The key authorizes the
// signalling POST and, later, the hang-up DELETE; a call that outlives it still ends on the
// server when the peer connection closes.
const EPHEMERAL_KEY_SECONDS = 600;

// GET /v1/omni/config says whether the server wants a key (it needs none itself). If it
// does, the page shows the key field. It also names the model's voices (for the picker).
export async function loadServerConfig() {
  try {
    const res = await fetch("v1/omni/config");
    if (!res.ok) throw new Error(`HTTP ${res.status}`);
    omni.config = await res.json();
    omni.authRequired = Boolean(omni.config.auth_required);
  } catch (err) {
    omni.authRequired = null; // unknown: Start will find out from the call's own answer
    console.warn("GET v1/omni/config failed:", err);
  }
  ui.keyForm.hidden = !omni.authRequired;
}

// A short-lived ek_ key for one call, minted on this origin. With a key typed in, the page
// sends it; with none, it sends no Authorization so that a proxy in front of the agent
// (which knows the real key and authenticates its own users) can add it on this route only.
// `session`: the session the key carries (a key's session type and priority are fixed).
export async function mintEphemeralKey(session) {
  const headers = { "Content-Type": "application/json" };
  const key = ui.key.value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  const res = await fetch("v1/realtime/client_secrets", {
    method: "POST",
    headers,
    body: JSON.stringify({
      expires_after: { anchor: "created_at", seconds: EPHEMERAL_KEY_SECONDS },
      session,
    }),
  });
  if (!res.ok) {
    const hint = res.status === 401 ? (key ? " The API key was not accepted." : " This server needs an API key: enter it above.") : "";
    const message = await httpError(res, "The server refused to mint a key");
    throw httpFailure(res, hint ? `${message.replace(/\.?$/, ".")}${hint}` : message);
  }
  return (await res.json()).value;
}

// The server's JSON error: GA form {"error": {"message": ...}} or a plain {"error": "..."}.
async function httpError(res, what) {
  const body = await res.json().catch(() => ({}));
  const reason = body.error?.message ?? body.error ?? res.statusText;
  const retry = res.headers.get("Retry-After");
  return `${what} (HTTP ${res.status}): ${reason}` + (retry ? `. Try again in ${retry} s.` : "");
}

// The Error thrown for a refused request carries its HTTP status: a reconnect gives up on 401/403.
function httpFailure(res, message) {
  return Object.assign(new Error(message), { status: res.status });
}

// ?relay: a finished gathering without a relay candidate is a failed call (ice.js).
export async function iceGatheringDone(pc) {
  await gathered(pc);
  requireRelay(pc);
}

function gathered(pc) {
  return new Promise((resolve) => {
    if (pc.iceGatheringState === "complete") return resolve();
    const finish = () => {
      clearTimeout(timer);
      pc.removeEventListener("icegatheringstatechange", check);
      resolve();
    };
    const check = () => pc.iceGatheringState === "complete" && finish();
    const timer = setTimeout(finish, ICE_GATHER_TIMEOUT_MS);
    pc.addEventListener("icegatheringstatechange", check);
  });
}

// GA signalling: the raw offer in, 201 with the raw answer and the call's Location out.
// With a `session` (what must be set at creation: a transcription session, the first turn's
// transcription) the offer goes as multipart/form-data, parts `sdp` and `session`; `priority`:
// the session's priority class.
export async function postOffer(sdp, token, { session = null, priority = null } = {}) {
  const headers = { Accept: "application/sdp" };
  if (token) headers.Authorization = `Bearer ${token}`;
  let body = sdp;
  if (session) {
    body = new FormData(); // the browser writes the multipart Content-Type with its boundary
    body.append("sdp", sdp);
    body.append("session", JSON.stringify(session));
  } else {
    headers["Content-Type"] = "application/sdp";
  }
  // Relative URL: works when the page is served under a path prefix, too.
  const url = priority ? `v1/realtime/calls?priority=${encodeURIComponent(priority)}` : "v1/realtime/calls";
  const res = await fetch(url, { method: "POST", headers, body });
  if (res.status !== 201) throw httpFailure(res, await httpError(res, "The server refused the call"));
  const location = res.headers.get("Location");
  return { sdp: await res.text(), callUrl: location ? new URL(location, res.url).href : null };
}

// DELETE on the call's Location ends it on the server at once, as a hang-up (the server logs
// and counts it as one). keepalive lets it outlive a closing page. The promise settles when
// the server has answered (or the request failed): the caller closes the peer after that.
export function hangUp(callUrl, token) {
  if (!callUrl) return Promise.resolve();
  return fetch(callUrl, {
    method: "DELETE", keepalive: true, headers: token ? { Authorization: `Bearer ${token}` } : {},
  }).catch((err) => console.warn("hang-up failed:", err));
}
