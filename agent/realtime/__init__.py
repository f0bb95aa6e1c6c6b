"""The OpenAI Realtime API (GA) spoken by the agent: session config, items, events, keys and
the two transports (WebRTC calls with an `oai-events` data channel, and WebSocket)."""
