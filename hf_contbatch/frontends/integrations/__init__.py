"""Integrations with the Hugging Face ecosystem; each imports its third-party package only when used.

- ``transformers``: ``register_pipeline()`` adds a ``transformers.pipeline`` task for our pipeline.
- ``accelerate``: ``distributed_generate()`` for scripts started with ``accelerate launch``/``torchrun``.
- ``lm_eval``: the ``hf-contbatch`` lm-eval model type (``import hf_contbatch.frontends.integrations.lm_eval``).
"""

from .transformers import TASK_NAME, register_pipeline

__all__ = ["TASK_NAME", "register_pipeline"]
