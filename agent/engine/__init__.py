"""The engine: one thread owning the model and every torch object, fed by sessions, stepping replies.

api.py        what crosses the thread boundary (outputs out; the Runner and its capability Protocols)
commands.py   the commands in: typed messages, dispatched by type (Engine.send for session commands)
loop.py       Engine: the asyncio side's handle on the engine thread (inbox, lifecycle)
core.py       EngineCore: the thread's side (runners, sinks, dispatch by command type)
factory.py    the runners a Config asks for, built inside that thread
memory_plan.py  sessions x context that fit the device, planned before the load
runner/       the runners: streaming Qwen3-Omni, generate() reference, text fallback
state/        per-session and per-reply state, and the reply's phase table
stages/       the model work of a turn (prefill) and of a frame (thinker, talker, predictor)
ops/          slot caches, attention, fused MoE and projections, sampling
compile/      inductor, CUDA graphs, CPU traces and the bucket wiring
codecs/       code2wav over slots, detokenization, PCM
checkpoints/  loading, the tiny model, hub-shaped builds, presets of the real sizes
instruments/  benchmarks' and tests' tools; serving never imports them
"""
