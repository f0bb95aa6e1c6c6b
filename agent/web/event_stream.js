// Server-sent events read with fetch, not EventSource: EventSource can send no key, and it
// retries every error the same way without showing the status, so a refused key (401), a
// call that has ended (410) and a restarting agent (503) would all look alike. Here a non-2xx
// answer is an HttpError carrying its status and the server's JSON reason, and `final` says
// whether asking again could ever help (a 4xx other than 408 and 429 cannot).

export class HttpError extends Error {
  constructor(status, message, final = status >= 400 && status < 500 && status !== 408 && status !== 429) {
    super(message);
    this.status = status;
    this.final = final;
  }
}

async function reasonOf(res) {
  try {
    const body = await res.json();
    if (body && body.error && typeof body.error.message === "string") return body.error.message;
  } catch {
    // not JSON: the status says enough
  }
  return res.statusText || "request failed";
}

// Reads `url` until the stream ends; calls onOpen() once connected and onEvent(object) for each
// `data:` event. Resolves when the server ends the stream; rejects with an HttpError for a
// refusal, or another Error for a lost connection, including `idleMs` with no byte at all (the
// server sends a keep-alive comment every 15 s, so silence that long is a dead connection).
export async function readEvents(url, { key, onOpen, onEvent, idleMs = 45_000 }) {
  const controller = new AbortController();
  let idle;
  const arm = () => {
    clearTimeout(idle);
    idle = setTimeout(() => controller.abort(), idleMs);
  };
  const headers = { Accept: "text/event-stream" };
  if (key) headers.Authorization = `Bearer ${key}`;
  arm();
  try {
    const res = await fetch(url, { headers, signal: controller.signal, cache: "no-store" });
    if (!res.ok) throw new HttpError(res.status, await reasonOf(res));
    if (!(res.headers.get("Content-Type") || "").startsWith("text/event-stream")) {
      throw new HttpError(res.status, "the answer is not an event stream", true);
    }
    onOpen();
    const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      arm();
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block
          .split("\n")
          .filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).trim())
          .join("\n");
        if (!data) continue; // a keep-alive comment
        let event;
        try {
          event = JSON.parse(data);
        } catch (err) {
          console.warn("captions: bad event", err);
          continue;
        }
        try {
          onEvent(event);
        } catch (err) {
          console.error("captions: event not shown", err); // one bad event, not the stream
        }
      }
    }
  } catch (err) {
    if (err instanceof HttpError) throw err;
    throw new Error(controller.signal.aborted ? `no data for ${idleMs / 1000} s` : `connection lost: ${err.message}`);
  } finally {
    clearTimeout(idle);
    controller.abort(); // frees the connection whichever way we left
  }
}
