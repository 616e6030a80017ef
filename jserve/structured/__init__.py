"""Structured outputs: grammars that constrain what a request may generate, and tool calls.

`grammar.py` compiles a request's `StructuredOutputsParams` (JSON schema, regex, choice, Lark /
GBNF grammar) with llguidance into a matcher per sequence and fills the sampler's token bitmask;
`tool_parsers.py` reads tool calls out of a model's text, `reasoning.py` its thinking. Host-side
(numpy, llguidance); no JAX.
"""
