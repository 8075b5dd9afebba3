"""Ray Data (frontends/integrations/ray.py): two replicas on a local Ray cluster, each owning one
engine, map a dataset to its generations; every input column is kept and ``generated_text`` equals
transformers' greedy text-generation pipeline (float32)."""

from __future__ import annotations

import pytest
import ray
import torch
import transformers

from hf_contbatch import CacheConfig, EngineConfig
from hf_contbatch.default_model import default_model_path
from hf_contbatch.integrations.ray import _Replica, build_processor

PROMPTS = ["The for statement", "A class is", "Exceptions are", "The import system", "A dictionary", "Lambda"]
PIPELINE_KWARGS = {"dtype": torch.float32, "engine_config": EngineConfig(cache=CacheConfig(num_blocks=64))}


@pytest.fixture(scope="module")
def hf_pipe():
    return transformers.pipeline("text-generation", model=default_model_path(), dtype=torch.float32)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_replicas_generate_what_transformers_generates_and_keep_every_column(local_ray, hf_pipe):
    rows = [{"id": i, "text": PROMPTS[i % len(PROMPTS)], "label": f"l{i}"} for i in range(12)]
    process = build_processor(
        None,
        concurrency=2,
        batch_size=3,
        prompt_column="text",
        pipeline_kwargs=PIPELINE_KWARGS,
        max_new_tokens=8,
        do_sample=False,
    )
    out = sorted(process(ray.data.from_items(rows)).take_all(), key=lambda r: r["id"])
    expected = [
        hf_pipe(r["text"], max_new_tokens=8, do_sample=False, return_full_text=False)[0]["generated_text"] for r in rows
    ]
    assert [{k: r[k] for k in ("id", "text", "label")} for r in out] == rows
    assert [r["generated_text"] for r in out] == expected


@pytest.mark.timeout(120)
def test_a_replica_takes_chats_from_arrow_batches_and_names_a_missing_column(local_ray, hf_pipe):
    chats = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    batch = ray.data.from_items([{"messages": c} for c in chats]).take_batch(2, batch_format="numpy")
    replica = _Replica(None, "messages", PIPELINE_KWARGS, {"max_new_tokens": 6, "do_sample": False})
    try:
        got = list(replica(batch)["generated_text"])
        assert got == [
            hf_pipe(c, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"] for c in chats
        ]
        with pytest.raises(ValueError, match="no column 'messages' \\(its columns: prompt\\); pass prompt_column="):
            replica({"prompt": batch["messages"]})
    finally:
        replica.pipe.close()


def test_build_processor_checks_its_sizes():
    with pytest.raises(ValueError, match="`concurrency` must be an int >= 1, got 0"):
        build_processor(concurrency=0)
    with pytest.raises(ValueError, match="`batch_size` must be an int >= 1, got 2.5"):
        build_processor(batch_size=2.5)
