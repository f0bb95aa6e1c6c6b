// Reconnecting after a dropped call: the peer connection failed (or stayed disconnected past a
// grace period), or the data channel closed under a call that was up, without the user's Stop.
// A new call is tried after 1 s, then 2, 4, 8 … (at most 30 s apart), 6 tries at most; the
// status line counts down to the next. A refusal that a retry cannot cure (401, 403: the key
// is wrong or gone) ends the retries at once, with the server's reason on screen.
import { omni, ui, showError } from "./state.js";

// ICE may come back by itself from "disconnected" (a brief network hiccup): wait this long first.
export const DISCONNECTED_GRACE_MS = 5000;
const FIRST_DELAY_MS = 1000;
const MAX_DELAY_MS = 30_000;
const MAX_ATTEMPTS = 6;

// connect(): start a new call (resolves whether or not it worked: failures come back through
// attemptFailed); setState(state): the page's state line.
export function makeReconnector({ connect, setState }) {
  let attempt = 0; // tries made since the call dropped
  let timer = null;

  function clear() {
    clearInterval(timer);
    timer = null;
    omni.reconnect = null;
  }

  function giveUp(message) {
    clear();
    attempt = 0;
    setState("failed");
    showError(message);
  }

  // Wait out the backoff, counting down on the status line, then try.
  function schedule(reason) {
    if (attempt >= MAX_ATTEMPTS) return giveUp(`Reconnecting gave up after ${MAX_ATTEMPTS} tries: ${reason}`);
    const delay = Math.min(MAX_DELAY_MS, FIRST_DELAY_MS * 2 ** attempt);
    const at = performance.now() + delay;
    attempt += 1;
    omni.reconnect = { attempt, of: MAX_ATTEMPTS, delayMs: delay, reason };
    setState("reconnecting");
    const tick = () => {
      const left = at - performance.now();
      if (left > 0) {
        ui.stateText.textContent = `reconnecting in ${Math.ceil(left / 1000)} s (try ${attempt} of ${MAX_ATTEMPTS})`;
        return;
      }
      clear();
      connect();
    };
    clearInterval(timer);
    timer = setInterval(tick, 250);
    tick();
    showError(`Call dropped (${reason}).`);
  }

  return {
    get active() {
      return attempt > 0;
    },
    // The call that was up has gone; it is already torn down.
    dropped(reason) {
      attempt = 0;
      schedule(reason);
    },
    // A reconnect attempt did not get a call up.
    attemptFailed(err) {
      if (err?.status === 401 || err?.status === 403) return giveUp(`Reconnecting stopped: ${err.message}`);
      schedule(err?.message || "no connection");
    },
    // The new call is up: the next drop starts the backoff over.
    connected() {
      if (attempt > 0) showError("");
      attempt = 0;
      clear();
    },
    // The user's Stop (or Start): no retry is wanted any more.
    cancel() {
      attempt = 0;
      clear();
    },
  };
}
