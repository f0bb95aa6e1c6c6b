"""Instruments for benchmarks and tests (kernel counts, roofline, fake graph capture). Serving code never imports this package."""
