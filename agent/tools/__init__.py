"""Tools (function calling), torch-free: what a client offers the model (spec.py), Qwen's text
format for tools, calls and results (qwen_format.py), and the parser that turns a call's
streamed text into its name and arguments (call_parser.py). The grammar that constrains calls
is the engine's (agent/engine/stages/tool_grammar.py); docs/tools.md says how it all fits."""
