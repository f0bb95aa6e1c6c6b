"""The agent's trace export: an OpenTelemetry TracerProvider of its own (never the global one:
no globals but the metrics registry), OTLP over HTTP, behind a bounded queue.

A call never waits on the collector: a span's end puts it on a deque (at most MAX_QUEUE spans;
past that it is dropped and counted) and one daemon thread sends batches. A collector that is
slow or absent costs its export thread time and the spans it could not take, counted on
/metrics (agent_trace_spans{outcome=...}), never a session's time. Off (no endpoint) there is
no provider at all and the sessions trace nothing.

The endpoint is `--otlp-endpoint` (a base URL: /v1/traces is added), else the standard
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT; the service is
OTEL_SERVICE_NAME (default omni-agent); each replica names itself in the resource
(`service.instance.id`: its Ray replica id, else host:pid), all under one service. The engine exports nothing itself:
its timings travel with each reply's stats to the replica that makes the spans.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from typing import Callable, Optional

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Tracer

from agent import metrics

log = logging.getLogger(__name__)

MAX_QUEUE = 4096  # spans waiting for export
BATCH = 512
DELAY_S = 1.0  # between exports while the queue is short
EXPORT_TIMEOUT_S = 5.0


class BoundedExport(SpanProcessor):
    """Ended spans to `exporter` from one thread, through a bounded queue, every loss counted."""

    def __init__(self, exporter: SpanExporter, max_queue: int = MAX_QUEUE, delay_s: float = DELAY_S) -> None:
        self._exporter, self._max, self._delay = exporter, max_queue, delay_s
        self._queue: deque[ReadableSpan] = deque()
        self._wake = threading.Event()
        self._flushed = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self._thread.start()

    def on_end(self, span: ReadableSpan) -> None:
        if self._stopping:
            return
        if len(self._queue) >= self._max:
            metrics.TRACE_SPANS.labels(outcome="dropped_queue_full").inc()
            return
        self._queue.append(span)  # (a deque's append is atomic: the loop never takes a lock here)
        if len(self._queue) >= BATCH:
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self._delay)
            self._wake.clear()
            self._send_all()
        self._send_all()

    def _send_all(self) -> None:
        while self._queue:
            batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
            try:
                ok = self._exporter.export(batch) is SpanExportResult.SUCCESS
            except Exception:  # an exporter's bug must not end the thread
                log.exception("trace export failed")
                ok = False
            metrics.TRACE_SPANS.labels(outcome="exported" if ok else "dropped_export_failed").inc(len(batch))
        with self._flushed:
            self._flushed.notify_all()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._flushed:
            self._wake.set()
            return self._flushed.wait(timeout_millis / 1000)

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(EXPORT_TIMEOUT_S + 1)
        self._exporter.shutdown()


# The OTLP exporter logs every failed try (a warning a retry, an error a batch): with the
# collector down that is a line a second for as long as it is down. One a minute is enough;
# the losses themselves are counted on /metrics.
EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
LOG_EVERY_S = 60.0


class OncePerInterval(logging.Filter):
    """Lets one record through per `interval_s` (the rest are dropped)."""

    def __init__(self, interval_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._interval, self._clock = interval_s, clock
        self._last = -interval_s

    def filter(self, record: logging.LogRecord) -> bool:
        now = self._clock()
        if now - self._last < self._interval:
            return False
        self._last = now
        return True


class Tracing:
    """The provider and the tracer the sessions use; `close()` sends what is left."""

    def __init__(self, exporter: SpanExporter, service: str, instance: str) -> None:
        resource = Resource.create({"service.name": service, "service.instance.id": instance})
        self.provider = TracerProvider(resource=resource)
        self.processor = BoundedExport(exporter)
        self.provider.add_span_processor(self.processor)
        self.tracer: Tracer = self.provider.get_tracer("omni-agent")
        self._quiet = OncePerInterval()
        logging.getLogger(EXPORTER_LOGGER).addFilter(self._quiet)

    def flush(self, timeout_s: float = 10.0) -> bool:
        return self.processor.force_flush(int(timeout_s * 1000))

    def close(self) -> None:
        self.provider.shutdown()
        logging.getLogger(EXPORTER_LOGGER).removeFilter(self._quiet)


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP base URL made the traces URL (one ending in /v1/traces is kept)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def from_settings(endpoint: str, instance: Optional[str] = None, env: Optional[dict] = None) -> Optional[Tracing]:
    """The agent's Tracing, or None when no endpoint is set (flag, then the OTEL_ variables)."""
    env = dict(os.environ) if env is None else env
    url = traces_url(endpoint) if endpoint else env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or ""
    if not url and env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        url = traces_url(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    if not url:
        return None
    service = env.get("OTEL_SERVICE_NAME") or "omni-agent"
    instance = instance or f"{socket.gethostname()}:{os.getpid()}"
    log.info("traces: OTLP/HTTP to %s as %s (%s)", url, service, instance)
    return Tracing(OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S), service, instance)
