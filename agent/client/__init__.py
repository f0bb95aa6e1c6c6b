"""The agent's own clients: a WebRTC/WebSocket peer for tests and benchmarks, and `omni-agent call`."""
