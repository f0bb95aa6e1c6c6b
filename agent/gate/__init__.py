"""The gate: who may call (keys, origins), how often, at what priority, and the degradation ladder."""
