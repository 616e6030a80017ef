"""The engine: continuous batching over the runtime.

`config` (`EngineConfig`, the one list of settings), `llm_engine` (`LLMEngine`: requests in,
outputs out, a step at a time), `build` (`build_engine`: the runner and engine for a config),
`async_engine` (the engine on its own thread for asyncio callers) and `stream_output` (what a
stream yields).
"""

from jserve.engine.build import build_engine, resolve_max_model_len
from jserve.engine.config import EngineConfig
from jserve.engine.llm_engine import LLMEngine

__all__ = ["EngineConfig", "LLMEngine", "build_engine", "resolve_max_model_len"]
