"""The agent as Ray Serve replicas: each replica a whole agent, each call pinned to its owner.

Only `options.py` and `ownership.py` import without Ray; the rest needs `ray[serve]` (the `serve`
extra). docs/ray-serve.md says how the pieces fit.
"""
