"""Data-parallel generation under ``accelerate launch`` or ``torchrun``: one engine per process.

Each process loads the model on its own device, takes a contiguous shard of the prompts, runs it
through its own ``ContinuousBatchingPipeline``, and the shards are gathered back in input order::

    # accelerate launch --num_processes 2 my_script.py   (on CPU: ACCELERATE_USE_CPU=1 ... --multi_gpu)
    from hf_contbatch.frontends.integrations.accelerate import distributed_generate
    results = distributed_generate(prompts, model="path/or/hub-id", max_new_tokens=64)
    if results is not None:   # the main process
        ...

With ``output="results.jsonl"`` each process writes its records as they come (input order within
its shard, flushed line by line) to a shard beside it, ``results.jsonl.rank0-of-2`` ...; at the end
the main process merges the shards into ``results.jsonl`` (one line per prompt, input order) and
removes them. A killed process loses only the prompts it had in flight: rerun the script with
``resume=True`` and each process skips the prompts its shard already holds (the shards must be on a
file system every process sees, as on one machine).

Traps handled here: a bare ``PartialState()`` ignores ``ACCELERATE_USE_CPU`` (so we pass ``cpu=``);
shards are tagged with their input positions, so the gather neither depends on shard sizes nor keeps
the duplicates that ``split_between_processes(apply_padding=True)`` would add.
"""

from __future__ import annotations

import json
import os
from collections import UserList
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
    output: Optional[str] = None,
    resume: bool = False,
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
        output: a ``.jsonl`` path: each process streams its records to a shard beside it, merged
            into ``output`` at the end (``{"index": i, "records": [...]}`` per prompt, input order).
        resume: with ``output``, keep the records already in this process's shard (a torn last
            line cut off) and generate only the other prompts; a finished ``output`` is read back.
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
    if output is not None and resume:
        finished = _read_records(output)
        if len(finished) == len(prompts) and set(finished) == set(range(len(prompts))):
            state.wait_for_everyone()  # every rank reads it before any later call may rewrite it
            return [finished[i] for i in range(len(prompts))] if state.is_main_process or return_on_all_ranks else None
    local: list[tuple[int, list]] = []
    with state.split_between_processes(indexed) as shard:
        shard = list(shard)
        done: dict[int, list] = {}
        shard_path = None if output is None else f"{output}.rank{state.process_index}-of-{state.num_processes}"
        if shard_path is not None:
            done = _read_records(shard_path, repair=True) if resume else {}
            if not resume and os.path.exists(shard_path):
                os.remove(shard_path)
        todo = [(i, p) for i, p in shard if i not in done]
        local = [(i, done[i]) for i, _ in shard if i in done]
        if todo:
            pipe = ContinuousBatchingPipeline(model, tokenizer, **kwargs)
            sink = open(shard_path, "ab") if shard_path is not None else None
            try:
                # A UserList is no list: the pipeline streams it (records as they come, a bounded
                # number in flight) and, as it has a length, its progress bar shows an ETA.
                for (i, _), out in zip(todo, pipe(UserList(p for _, p in todo), **generate_kwargs)):
                    local.append((i, out))
                    if sink is not None:  # this prompt survives a kill from here on
                        sink.write((json.dumps({"index": i, "records": out}, ensure_ascii=False) + "\n").encode())
                        sink.flush()
            finally:
                if sink is not None:
                    sink.close()
                pipe.close()
    gathered = gather_object([(state.process_index, local)])
    by_index: dict[int, list] = {}
    for _rank, items in gathered:
        for i, out in items:
            by_index.setdefault(i, out)  # first copy wins: padding duplicates are dropped
    missing = [i for i in range(len(prompts)) if i not in by_index]
    if missing:
        raise RuntimeError(
            f"results missing for prompts {missing[:10]} after gathering from {state.num_processes} processes"
        )
    results = [by_index[i] for i in range(len(prompts))]
    if output is not None:
        if state.is_main_process:
            tmp = f"{output}.merging"
            with open(tmp, "w", encoding="utf-8") as f:
                for i, out in enumerate(results):
                    f.write(json.dumps({"index": i, "records": out}, ensure_ascii=False) + "\n")
            os.replace(tmp, output)
        state.wait_for_everyone()  # the merged file is whole before any shard goes
        if shard_path is not None and os.path.exists(shard_path):
            os.remove(shard_path)
    if not (state.is_main_process or return_on_all_ranks):
        return None
    return results


def _read_records(path: str, repair: bool = False) -> dict[int, list]:
    """``{index: records}`` of a shard or merged file (empty when there is none); with ``repair``, a
    torn last line (a kill mid-write) is cut off the file."""
    if not os.path.exists(path):
        return {}
    found: dict[int, list] = {}
    good_end = 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                row = json.loads(raw) if raw.endswith(b"\n") else None
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict) or "index" not in row:
                break
            found[row["index"]] = row["records"]
            good_end += len(raw)
    if repair and good_end < os.path.getsize(path):
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return found


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
