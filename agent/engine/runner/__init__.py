"""The runners the engine thread steps: streaming (Qwen3-Omni frame by frame), generate() reference, text fallback."""
