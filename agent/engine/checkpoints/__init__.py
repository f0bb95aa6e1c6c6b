"""Checkpoints: loading Qwen3-Omni, the tiny model, hub-shaped builds, presets of the real sizes
and random weights at those sizes (random_weights.py)."""
