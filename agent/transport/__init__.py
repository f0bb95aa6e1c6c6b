"""Transport: HTTP signalling, WebRTC peers and the WebSocket, and what aiortc is adjusted for."""
