"""Tool calling: what a client offers the model (spec.py, torch-free)."""
