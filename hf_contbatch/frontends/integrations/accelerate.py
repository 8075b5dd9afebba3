"""Data-parallel generation under ``accelerate launch`` or ``torchrun``: one engine per process.

Each process loads the model on its own device, takes a contiguous shard of the prompts, runs it
through its own ``ContinuousBatchingPipeline``, and the shards are gathered back in input order::

    # accelerate launch --num_processes 2 my_script.py   (on CPU: ACCELERATE_USE_CPU=1 ... --multi_gpu)
    from hf_contbatch.frontends.integrations.accelerate import distributed_generate
    results = distributed_generate(prompts, model="path/or/hub-id", max_new_tokens=64)
    if results is not None:   # the main process
        ...

Traps handled here: a bare ``PartialState()`` ignores ``ACCELERATE_USE_CPU`` (so we pass ``cpu=``);
shards are tagged with their input positions, so the gather neither depends on shard sizes nor keeps
the duplicates that ``split_between_processes(apply_padding=True)`` would add.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import torch


def _state():
    from accelerate import PartialState

    # ACCELERATE_USE_CPU=1 (or no accelerator) => gloo on CPU; a bare PartialState() would ignore it.
    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not torch.cuda.is_available()
    return PartialState(cpu=use_cpu)


def distributed_generate(
    prompts: Sequence,
    model: Any = None,
    *,
    tokenizer: Any = None,
    pipeline_kwargs: Optional[dict] = None,
    return_on_all_ranks: bool = False,
    **generate_kwargs,
) -> Optional[list]:
    """Generate for ``prompts`` with one continuous-batching engine per process; gather in input order.

    Call it on every process with the same ``prompts``. Works unlaunched too (one process).

    Args:
        prompts: strings and/or chats (lists of role/content dicts), identical on every rank.
        model: a Hub id or local path (loaded on each process's device), or a loaded model already on
            this process's device; None for the embedded default model.
        tokenizer: a tokenizer or name; defaults to the model's.
        pipeline_kwargs: more ``ContinuousBatchingPipeline`` arguments (``engine_config``, ``dtype``...).
        return_on_all_ranks: also return the results on the other processes (they are gathered to
            every process anyway).
        **generate_kwargs: call arguments of the pipeline (``max_new_tokens``, ``do_sample``,
            ``stop_strings``, ``return_full_text``...).

    Returns:
        On the main process (or everywhere with ``return_on_all_ranks``), one entry per prompt in input
        order, each the pipeline's list of ``{"generated_text": ...}`` records; None elsewhere.

    Raises:
        ValueError: ``prompts`` is empty or not a sequence.
    """
    from accelerate.utils import gather_object

    from ..pipeline import ContinuousBatchingPipeline

    if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("`prompts` must be a non-empty list of strings or chats, identical on every process")
    state = _state()
    kwargs = dict(pipeline_kwargs or {})
    if model is None:
        from ...default_model import default_model_path

        model = default_model_path()
    if isinstance(model, str):
        kwargs.setdefault("device", state.device)
    generate_kwargs.setdefault("progress_bar", state.is_main_process and len(prompts) > 1)
    indexed = list(enumerate(prompts))
    local: list[tuple[int, list]] = []
    with state.split_between_processes(indexed) as shard:
        shard = list(shard)
        if shard:
            pipe = ContinuousBatchingPipeline(model, tokenizer, **kwargs)
            try:
                outputs = pipe([p for _, p in shard], **generate_kwargs)
            finally:
                pipe.close()
            local = [(i, out) for (i, _), out in zip(shard, outputs)]
    gathered = gather_object([(state.process_index, local)])
    if not (state.is_main_process or return_on_all_ranks):
        return None
    by_index: dict[int, list] = {}
    for _rank, items in gathered:
        for i, out in items:
            by_index.setdefault(i, out)  # first copy wins: padding duplicates are dropped
    missing = [i for i in range(len(prompts)) if i not in by_index]
    if missing:
        raise RuntimeError(
            f"results missing for prompts {missing[:10]} after gathering from {state.num_processes} processes"
        )
    return [by_index[i] for i in range(len(prompts))]


def process_info() -> dict:
    """This process's rank, the number of processes, the backend and the device (for logs and tests)."""
    state = _state()
    return {
        "process_index": state.process_index,
        "num_processes": state.num_processes,
        "distributed_type": str(state.distributed_type),
        "device": str(state.device),
        "backend": getattr(state, "backend", None),
    }
