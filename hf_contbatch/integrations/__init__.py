"""The integrations' former home, kept so that ``hf_contbatch.integrations.*`` imports keep working.

They live in ``hf_contbatch.frontends.integrations``; each module here is that module itself
(same object: patching one patches the other).
"""

from ..frontends.integrations import TASK_NAME, register_pipeline

__all__ = ["TASK_NAME", "register_pipeline"]
