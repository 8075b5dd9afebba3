"""``transformers.pipeline`` integration: a task name that builds ``ContinuousBatchingPipeline``.

Without registering anything, ``transformers.pipeline("text-generation", model=...,
pipeline_class=ContinuousBatchingPipeline)`` already works; ``register_pipeline()`` adds a task so
that ``transformers.pipeline("continuous-batching-text-generation", model=...)`` does too. Registering
is an explicit call (it changes transformers' global task registry), never an import side effect.
"""

from __future__ import annotations

from ..pipeline import TASK_NAME, ContinuousBatchingPipeline

__all__ = ["TASK_NAME", "register_pipeline"]


def register_pipeline(task: str = TASK_NAME) -> str:
    """Register ``ContinuousBatchingPipeline`` in ``transformers.pipelines.PIPELINE_REGISTRY``.

    Args:
        task: the task name to register (default ``"continuous-batching-text-generation"``).

    Returns:
        The task name, for ``transformers.pipeline(task, model=...)``. Calling again is a no-op.

    Raises:
        ValueError: ``task`` is a task transformers already defines for another pipeline.
    """
    from transformers import AutoModelForCausalLM
    from transformers.pipelines import PIPELINE_REGISTRY

    if not isinstance(task, str) or not task:
        raise ValueError(f"`task` must be a non-empty string, got {task!r}")
    current = PIPELINE_REGISTRY.supported_tasks.get(task)
    if current is not None:
        if current.get("impl") is ContinuousBatchingPipeline:
            return task
        raise ValueError(f"task {task!r} is already registered for {current.get('impl')}; choose another name")
    PIPELINE_REGISTRY.register_pipeline(
        task, pipeline_class=ContinuousBatchingPipeline, pt_model=AutoModelForCausalLM, type="text"
    )
    return task
