"""Integrations with the Hugging Face ecosystem; each imports its third-party package only when used.

- ``transformers``: ``register_pipeline()`` adds a ``transformers.pipeline`` task for our pipeline.
- ``accelerate``: ``distributed_generate()`` for scripts started with ``accelerate launch``/``torchrun``.
- ``ray``: ``build_processor()``, Ray Data batch inference with one engine per replica (actor).
- ``lm_eval``: the ``hf-contbatch`` lm-eval model type (``import hf_contbatch.frontends.integrations.lm_eval``);
  ``lm_eval_args``: its name and engine settings, readable without torch (``hf-contbatch eval --help``).

``TASK_NAME`` and ``register_pipeline`` load the pipeline (torch) on first use, so that
``lm_eval_args`` can be imported alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["TASK_NAME", "register_pipeline"]

if TYPE_CHECKING:
    from .transformers import TASK_NAME, register_pipeline


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import transformers

    value = getattr(transformers, name)
    globals()[name] = value
    return value
