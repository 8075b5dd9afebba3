"""accelerate: two real CPU ranks (gloo) each running an engine on a shard, results gathered in input
order and equal to transformers' own greedy pipeline; ``device_map`` models load and generate."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
import transformers

from hf_contbatch import CacheConfig, ContinuousBatchingPipeline, EngineConfig
from hf_contbatch.default_model import default_model_path
from hf_contbatch.integrations.accelerate import distributed_generate

ROOT = Path(__file__).resolve().parents[2]
PATH = default_model_path()
PROMPTS = ["The for statement", "A class is", "The with statement", "Exceptions are", "The import system"]
GREEDY = dict(max_new_tokens=16, do_sample=False, return_full_text=False)


@pytest.fixture(scope="module")
def reference_texts():
    ref = transformers.pipeline("text-generation", model=PATH, dtype=torch.float32)
    return [r[0]["generated_text"] for r in ref(PROMPTS, **GREEDY)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_cpu_ranks_shard_prompts_and_gather_them_in_input_order(tmp_path, reference_texts):
    launcher = shutil.which("accelerate")
    if launcher is None:
        pytest.skip("the accelerate launcher is not on PATH")
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [
        launcher,
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
        "examples/accelerate_generate.py",
        "--input",
        str(prompts_file),
        "--output",
        str(out),
        "--max-new-tokens",
        "16",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # both ranks ran (the trap: a launch that silently starts one process)
    assert re.search(r"\[rank 0/2\]", proc.stderr) and re.search(r"\[rank 1/2\]", proc.stderr), proc.stderr[-2000:]
    summary = json.loads([line for line in proc.stderr.splitlines() if line.startswith('{"num_processes"')][-1])
    assert summary["num_processes"] == 2 and "MULTI_CPU" in summary["distributed_type"]
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS  # 5 prompts over 2 ranks (3 + 2): each once, in order
    assert [r["generated_text"] for r in rows] == reference_texts


@pytest.mark.timeout(600)
def test_distributed_generate_without_a_launcher_runs_in_one_process(reference_texts):
    results = distributed_generate(
        PROMPTS,
        model=PATH,
        pipeline_kwargs={"dtype": torch.float32, "engine_config": EngineConfig(cache=CacheConfig(num_blocks=64))},
        **GREEDY,
    )
    assert [r[0]["generated_text"] for r in results] == reference_texts


@pytest.mark.timeout(300)
def test_distributed_generate_rejects_a_single_string():
    with pytest.raises(ValueError, match="list of strings or chats"):
        distributed_generate("The for statement", model=PATH)


@pytest.mark.timeout(900)
def test_device_map_auto_loads_and_generates_like_transformers(reference_texts):
    pipe = ContinuousBatchingPipeline(
        PATH, device_map="auto", dtype=torch.float32, engine_config=EngineConfig(cache=CacheConfig(num_blocks=64))
    )
    try:
        # on a CPU-only host everything lands on one device, and transformers records no hf_device_map
        assert getattr(pipe.model, "hf_device_map", None) is None
        assert {t.device for t in pipe.engine.cache.key_cache} == {pipe.model.device}
        assert [r[0]["generated_text"] for r in pipe(PROMPTS, **GREEDY)] == reference_texts
    finally:
        pipe.close()


@pytest.mark.timeout(900)
def test_each_layers_kv_pool_follows_the_models_device_map(reference_texts):
    num_layers = transformers.AutoConfig.from_pretrained(PATH).num_hidden_layers
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "cpu" for i in range(num_layers)})
    model = transformers.AutoModelForCausalLM.from_pretrained(PATH, device_map=device_map, dtype=torch.float32)
    # accelerate records the map only when it spans several devices; record it as it would
    model.hf_device_map = dict(device_map)
    pipe = ContinuousBatchingPipeline(model, PATH, engine_config=EngineConfig(cache=CacheConfig(num_blocks=64)))
    try:
        assert [str(t.device) for t in pipe.engine.cache.key_cache] == [
            device_map[f"model.layers.{i}"] for i in range(num_layers)
        ]
        assert [r[0]["generated_text"] for r in pipe(PROMPTS, **GREEDY)] == reference_texts
    finally:
        pipe.close()


@pytest.mark.timeout(180)
def test_output_streams_to_a_shard_and_a_resumed_run_generates_only_what_the_shard_lacks(tmp_path, reference_texts):
    out = tmp_path / "results.jsonl"
    pipeline_kwargs = {"dtype": torch.float32, "engine_config": EngineConfig(cache=CacheConfig(num_blocks=64))}
    results = distributed_generate(PROMPTS, model=PATH, pipeline_kwargs=pipeline_kwargs, output=str(out), **GREEDY)
    assert [r[0]["generated_text"] for r in results] == reference_texts
    merged = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert merged == [{"index": i, "records": r} for i, r in enumerate(results)]
    assert list(tmp_path.iterdir()) == [out]  # the shard is gone once merged
    # A killed run: its shard holds prompts 3 and 0 (kept as they are, even a text no model wrote)
    # and a torn line; the rerun generates the other three only.
    out.unlink()
    shard = tmp_path / "results.jsonl.rank0-of-1"
    kept = [{"index": 3, "records": [{"generated_text": "kept"}]}, {"index": 0, "records": results[0]}]
    shard.write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"index": 1, "rec', encoding="utf-8")
    calls = []
    original = ContinuousBatchingPipeline.__call__

    def counting(self, inputs, **kwargs):
        calls.append(list(inputs))
        return original(self, inputs, **kwargs)

    ContinuousBatchingPipeline.__call__ = counting
    try:
        resumed = distributed_generate(
            PROMPTS, model=PATH, pipeline_kwargs=pipeline_kwargs, output=str(out), resume=True, **GREEDY
        )
    finally:
        ContinuousBatchingPipeline.__call__ = original
    assert calls == [[PROMPTS[1], PROMPTS[2], PROMPTS[4]]]
    assert [r[0]["generated_text"] for r in resumed] == [
        reference_texts[0],
        *reference_texts[1:3],
        "kept",
        reference_texts[4],
    ]
    # A finished output is read back without loading a model.
    assert distributed_generate(PROMPTS, model="no/such/model", output=str(out), resume=True, **GREEDY) == resumed
