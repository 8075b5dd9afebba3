"""hf_contbatch: continuous batching over a paged KV cache for Hugging Face text generation.

The configs load with the package; the engine, the pipeline and the integrations (torch,
transformers) load on first use of their names, so that ``hf-contbatch --help`` and argument errors
answer without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .config import CacheConfig, EngineConfig, SchedulerConfig
from .frontends.quiet_imports import quiet_known_import_notices
from .request import SamplingParams, StructuredOutputsParams

# Before any model loads (a notebook's first cell): torchao's known harmless loader notices, which
# transformers' import of torchao prints on a CPU machine, are dropped (frontends.quiet_imports).
quiet_known_import_notices()

__version__ = "0.2.0"

# name -> the module that defines it (imported on first access, PEP 562)
_LAZY = {
    "EngineError": ".engine",
    "EngineStats": ".engine",
    "LLMEngine": ".engine",
    "RequestHandle": ".engine",
    "RequestOutput": ".engine",
    "GenerationHandle": ".frontends.generation_handle",
    "ContinuousBatchingPipeline": ".frontends.pipeline",
    "pipeline": ".frontends.pipeline",
    "register_pipeline": ".integrations",  # an explicit call; importing it registers nothing
    "quality_report": ".engine.quality",
}

# Subpackages that ``import hf_contbatch`` used to load: ``hf_contbatch.integrations.TASK_NAME`` works
# after a plain ``import hf_contbatch``.
_SUBPACKAGES = ("core", "kernels", "engine", "frontends", "integrations")

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
    "ContinuousBatchingPipeline",
    "GenerationHandle",
    "pipeline",
    "register_pipeline",
    "quality_report",
]

if TYPE_CHECKING:
    from .engine import EngineError, EngineStats, LLMEngine, RequestHandle, RequestOutput
    from .engine.quality import quality_report
    from .frontends.generation_handle import GenerationHandle
    from .frontends.pipeline import ContinuousBatchingPipeline, pipeline
    from .integrations import register_pipeline


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)  # the import sets it as an attribute
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBPACKAGES))
