"""Ray Data offline batch inference with the continuous-batching engine, for jobs that outgrow one
machine: ``build_processor`` returns a function that maps a ``ray.data.Dataset`` of prompts to one
with their generations, run by replicas (Ray actors), each owning one engine, fed by ``map_batches``::

    import ray
    from hf_contbatch.integrations.ray import build_processor

    ray.init()                                    # or ray.init(address="auto") on a cluster
    process = build_processor("HuggingFaceTB/SmolLM2-135M", concurrency=4, max_new_tokens=64)
    ds = process(ray.data.read_parquet("s3://bucket/prompts/"))
    ds.write_parquet("s3://bucket/generations/")  # every input column kept, plus generated_text

Each replica runs its batch of ``batch_size`` rows as one pipeline call: all of them in its engine
at once, continuously batched up to ``max_num_seqs``; Ray Data streams the next batches to the
replicas as they free up. ``ray[data]`` is an optional extra (``pip install "hf_contbatch[ray]"``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

GENERATED_COLUMN = "generated_text"


class _Replica:
    """One Ray actor's engine: a ``ContinuousBatchingPipeline`` built once, called per batch.

    Args:
        model: a name or path (each actor loads it), or None for the embedded default model.
        prompt_column: the column holding each row's prompt (text, or a chat).
        pipeline_kwargs: ``ContinuousBatchingPipeline`` arguments (``engine_config``, ``dtype``...).
        generate_kwargs: the pipeline call's generation arguments.
    """

    def __init__(self, model, prompt_column: str, pipeline_kwargs: dict, generate_kwargs: dict) -> None:
        from ..pipeline import pipeline

        self.pipe = pipeline("text-generation", model=model, **pipeline_kwargs)
        self.prompt_column = prompt_column
        self.generate_kwargs = {"return_full_text": False, "progress_bar": False, **generate_kwargs}

    def __call__(self, batch: dict) -> dict:
        """``batch``: Ray Data's numpy format (column name -> array); returns it with a
        ``generated_text`` object column (each row's first returned sequence, new text only).

        Raises:
            ValueError: the prompt column is missing, or a row's prompt is not a string or a chat.
        """
        import numpy as np

        if self.prompt_column not in batch:
            raise ValueError(
                f"the dataset has no column {self.prompt_column!r} (its columns: {', '.join(batch)}); "
                "pass prompt_column= to build_processor"
            )
        prompts = [_as_prompt(value) for value in batch[self.prompt_column]]
        results = self.pipe(prompts, **self.generate_kwargs)
        out = dict(batch)
        out[GENERATED_COLUMN] = np.array([records[0]["generated_text"] for records in results], dtype=object)
        return out


def _as_prompt(value) -> Any:
    """A prompt from a numpy batch: text as ``str``; a chat (Arrow gives arrays of dicts) as a list."""
    if isinstance(value, str):
        return value
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list):
        return [dict(message) for message in value]
    return value


def build_processor(
    model: Optional[str] = None,
    *,
    concurrency: int = 1,
    batch_size: int = 64,
    prompt_column: str = "prompt",
    pipeline_kwargs: Optional[dict] = None,
    num_cpus: float = 1,
    num_gpus: float = 0,
    **generate_kwargs,
) -> Callable:
    """A function mapping a ``ray.data.Dataset`` to one with a ``generated_text`` column.

    Args:
        model: a Hub id or a path every Ray node can read; None for the embedded default model.
        concurrency: replicas: Ray actors, each loading the model and owning one engine.
        batch_size: rows per ``map_batches`` batch, one pipeline call on one replica.
        prompt_column: the column with each row's prompt (text or a chat).
        pipeline_kwargs: more ``ContinuousBatchingPipeline`` arguments (``engine_config``, ``dtype``...).
        num_cpus, num_gpus: Ray resources of each replica.
        **generate_kwargs: the pipeline call's arguments (``max_new_tokens``, ``do_sample``,
            ``temperature``, ``stop_strings``...).

    Returns:
        ``process(ds) -> ds``: lazy, as Ray Data is; every input column kept, ``generated_text``
        added (the new text of each row, without the prompt). Rows may come out in another order
        unless ``ray.data.DataContext.get_current().execution_options.preserve_order`` is set.

    Raises:
        ValueError: ``concurrency`` or ``batch_size`` is not an int >= 1.
        ImportError: Ray Data is not installed.
    """
    for name, value in (("concurrency", concurrency), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be an int >= 1, got {value!r}")
    try:
        import ray.data
    except ImportError as exc:
        raise ImportError('the Ray Data processor needs ray[data]: pip install "hf_contbatch[ray]"') from exc

    constructor = {
        "model": model,
        "prompt_column": prompt_column,
        "pipeline_kwargs": dict(pipeline_kwargs or {}),
        "generate_kwargs": generate_kwargs,
    }

    def process(ds: "ray.data.Dataset") -> "ray.data.Dataset":
        return ds.map_batches(
            _Replica,
            fn_constructor_kwargs=constructor,
            compute=ray.data.ActorPoolStrategy(size=concurrency),
            batch_size=batch_size,
            batch_format="numpy",
            num_cpus=num_cpus,
            num_gpus=num_gpus,
        )

    return process
