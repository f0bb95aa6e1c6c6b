"""Compilation and graph capture: inductor, CUDA graphs, CPU traces, and the wiring that buckets them."""
