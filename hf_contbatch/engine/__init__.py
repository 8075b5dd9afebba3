"""The engine layer: ``LLMEngine`` (the iteration), the thread that drives it, pool sizing, the model
runner, sampling, logits processors, stopping, request handles and stats (see ARCHITECTURE.md)."""

from .handles import EngineError, RequestHandle, RequestOutput
from .llm_engine import SERVED_LAYER_KINDS, LLMEngine
from .stats import EngineStats

__all__ = ["EngineError", "EngineStats", "LLMEngine", "RequestHandle", "RequestOutput", "SERVED_LAYER_KINDS"]
