"""OpenTelemetry traces of the agent's calls: the exporter (otlp.py) and the spans of one call (call_trace.py)."""
