"""omni-agent: a WebRTC real-time media agent answering with Qwen3-Omni speech and captions."""
