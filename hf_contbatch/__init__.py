"""hf_contbatch: continuous batching over a paged KV cache for Hugging Face text generation."""

from .config import CacheConfig, EngineConfig, SchedulerConfig
from .engine import EngineError, EngineStats, LLMEngine, RequestHandle, RequestOutput
from .request import SamplingParams, StructuredOutputsParams

__version__ = "0.2.0"

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "SchedulerConfig",
    "EngineError",
    "EngineStats",
    "LLMEngine",
    "RequestHandle",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]

from .frontends.generation_handle import GenerationHandle  # noqa: E402
from .frontends.pipeline import ContinuousBatchingPipeline, pipeline  # noqa: E402

__all__ += ["ContinuousBatchingPipeline", "GenerationHandle", "pipeline"]

from .integrations import register_pipeline  # noqa: E402  (explicit call; no import side effect)

__all__ += ["register_pipeline"]
