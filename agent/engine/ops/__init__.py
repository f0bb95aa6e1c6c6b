"""Tensor operations the stages are built from: slot caches, attention, fused MoE and projections, sampling."""
