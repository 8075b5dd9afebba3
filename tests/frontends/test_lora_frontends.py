"""LoRA adapters through the front ends, on the embedded model with two saved PEFT adapters: the
pipeline's ``adapter_names`` (one per prompt, one for all, the active adapter by default) equal to
transformers' own text-generation pipeline over the PeftModel with that adapter active; bad names
refused with nothing queued; ``hf-contbatch generate --adapter NAME=PATH``; lm-eval's ``peft=``
with the ``hf-contbatch`` model type, in one process and in two data-parallel CPU ranks, equal to
lm-eval's own ``hf`` model with the same adapter."""

from __future__ import annotations

import glob
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
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_contbatch
from hf_contbatch import CacheConfig
from hf_contbatch.cli import main
from hf_contbatch.default_model import default_model_path

from conftest import local_task_manager

peft = pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
PATH = default_model_path()
PROMPTS = ["The for statement", "A class is a", "Exceptions are raised when"]
GREEDY = dict(do_sample=False, max_new_tokens=10, return_full_text=False)


def _base():
    return AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    """Two LoRA adapters of the embedded model, random non-zero weights, saved as PEFT saves them."""
    dirs = {}
    for i, (name, cfg) in enumerate(
        {
            "sql": peft.LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"]),
            "chat": peft.LoraConfig(r=4, lora_alpha=16, target_modules=["k_proj", "o_proj", "up_proj", "gate_proj"]),
        }.items()
    ):
        torch.manual_seed(10 + i)
        cfg.init_lora_weights = False
        pm = peft.get_peft_model(_base(), cfg)
        dirs[name] = tmp_path_factory.mktemp(name)
        pm.save_pretrained(dirs[name])
    return dirs


def _peft_model(adapter_dirs):
    pm = peft.PeftModel.from_pretrained(_base(), adapter_dirs["sql"], adapter_name="sql")
    pm.load_adapter(adapter_dirs["chat"], adapter_name="chat")
    return pm.eval()


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(PATH)


@pytest.fixture(scope="module")
def expected(adapter_dirs, tok):
    """{adapter: [text per prompt]} from transformers' pipeline over the PeftModel, adapter active."""
    ref = _peft_model(adapter_dirs)
    hf = transformers.pipeline("text-generation", model=ref, tokenizer=tok)
    texts = {}
    for name in ("sql", "chat"):
        ref.set_adapter(name)
        texts[name] = [r[0]["generated_text"] for r in hf(PROMPTS, **GREEDY)]
    with ref.disable_adapter():
        texts["__base__"] = [r[0]["generated_text"] for r in hf(PROMPTS, **GREEDY)]
    assert texts["sql"] != texts["__base__"] and texts["chat"] != texts["__base__"]
    return texts


@pytest.mark.timeout(900)
def test_pipeline_adapter_names_per_prompt_for_all_and_by_default(adapter_dirs, tok, expected):
    pipe = hf_contbatch.pipeline(
        model=_peft_model(adapter_dirs), tokenizer=tok, cache_config=CacheConfig(num_blocks=128)
    )
    try:
        names = ["chat", "__base__", "sql"]
        got = [r[0]["generated_text"] for r in pipe(PROMPTS, adapter_names=names, **GREEDY)]
        assert got == [expected[n][i] for i, n in enumerate(names)]
        assert [r[0]["generated_text"] for r in pipe(PROMPTS, adapter_names="chat", **GREEDY)] == expected["chat"]
        assert [r[0]["generated_text"] for r in pipe(PROMPTS, **GREEDY)] == expected["sql"]  # the active adapter
        with pytest.raises(ValueError, match="`adapter_names` has 2 entries for 3 prompts"):
            pipe(PROMPTS, adapter_names=["sql", "chat"], **GREEDY)
        with pytest.raises(ValueError, match="unknown adapter 'code'.*'sql', 'chat', '__base__'"):
            pipe(PROMPTS, adapter_names=["sql", "code", "chat"], **GREEDY)
        assert pipe.stats().num_waiting == 0  # a call with one bad name queued nothing
        assert pipe(PROMPTS[0], adapter_names="sql", **GREEDY)[0]["generated_text"] == expected["sql"][0]
    finally:
        pipe.close()


@pytest.mark.timeout(900)
def test_generate_command_loads_adapters_and_runs_each_prompt_on_its_own(adapter_dirs, expected, tmp_path):
    inp = tmp_path / "prompts.jsonl"
    rows_in = [
        {"prompt": PROMPTS[0], "adapter": "chat"},
        {"prompt": PROMPTS[1]},
        {"prompt": PROMPTS[2], "adapter": "__base__"},
    ]
    inp.write_text("\n".join(json.dumps(r) for r in rows_in) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    args = ["generate", "--adapter", f"sql={adapter_dirs['sql']}", "--adapter", f"chat={adapter_dirs['chat']}"]
    args += ["--input", str(inp), "--output", str(out), "--max-new-tokens", "10", "--quiet"]
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["adapter"] for r in rows] == ["chat", "sql", "__base__"]  # no "adapter": the first one given
    assert [r["generated_text"] for r in rows] == [expected["chat"][0], expected["sql"][1], expected["__base__"][2]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec, message", [("sql", "NAME=PATH"), ("__base__=x", "base model"), ("=x", "NAME=PATH")])
def test_bad_adapter_arguments_fail_with_a_message_naming_them(spec, message, capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--adapter", spec, "--max-new-tokens", "2"])
    assert message in capsys.readouterr().err


# --- lm-eval ---------------------------------------------------------------------------------------
TASKS_DIR = "tests/data/lm_eval_tasks"
TASK = "hfcb_pydoc_gen"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _responses(results) -> dict:
    return {s["doc_id"]: s["filtered_resps"] for s in results["samples"][TASK]}


def _evaluate(model: str, model_args: str) -> dict:
    """``lm_eval.simple_evaluate`` of the generation task, run from the repository root."""
    import lm_eval

    import hf_contbatch.integrations.lm_eval  # noqa: F401  (registers hf-contbatch)

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        results = lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=[TASK],
            task_manager=local_task_manager(),
            log_samples=True,
            bootstrap_iters=0,
        )
    finally:
        os.chdir(cwd)
    return _responses(results)


@pytest.fixture(scope="module")
def hf_peft_responses(adapter_dirs, lm_eval_hf_results):
    """lm-eval's own ``hf`` model with ``peft=`` (the reference)."""
    pytest.importorskip("lm_eval")
    with_adapter = _evaluate("hf", f"pretrained={PATH},dtype=float32,device=cpu,peft={adapter_dirs['sql']}")
    base = _responses(lm_eval_hf_results)  # the same model without the adapter (conftest: once per session)
    assert with_adapter != base  # the adapter changes the answers: an ignored adapter would show
    return with_adapter


@pytest.mark.timeout(1500)
def test_lm_eval_peft_argument_serves_the_adapter(adapter_dirs, hf_peft_responses):
    args = f"pretrained={PATH},dtype=float32,device=cpu,peft={adapter_dirs['sql']},num_blocks=128"
    assert _evaluate("hf-contbatch", args) == hf_peft_responses


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_lm_eval_peft_argument_with_two_data_parallel_cpu_ranks(adapter_dirs, hf_peft_responses, tmp_path):
    launcher = shutil.which("accelerate")
    if launcher is None:
        pytest.skip("the accelerate launcher is not on PATH")
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port())]
    cmd += ["-m", "hf_contbatch.cli", "eval", *_eval_args(adapter_dirs, tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = _written_results(tmp_path)
    assert results["config"]["model"] == "hf-contbatch"
    assert _written_responses(tmp_path) == hf_peft_responses  # every document once, the adapter applied
    # lm-eval builds each rank's share of the contexts; without sharding both would be rank 0 of 1
    ranks = re.findall(r"Building contexts for \S+ on rank (\d+)", proc.stderr)
    assert sorted(ranks) == ["0", "1"], proc.stderr[-2000:]


def _eval_args(adapter_dirs, out_dir) -> list[str]:
    return [
        "--tasks",
        TASK,
        "--include_path",
        TASKS_DIR,
        "--model_args",
        f"pretrained={PATH},dtype=float32,peft={adapter_dirs['sql']},num_blocks=128",
        "--device",
        "cpu",
        "--log_samples",
        "--output_path",
        str(out_dir / "out"),
    ]


def _written_results(out_dir) -> dict:
    files = glob.glob(str(out_dir / "out" / "**" / "results_*.json"), recursive=True)
    assert len(files) == 1, files
    return json.loads(Path(files[0]).read_text())


def _written_responses(out_dir) -> dict:
    files = glob.glob(str(out_dir / "out" / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
    assert len(files) == 1, files
    rows = [json.loads(line) for line in Path(files[0]).read_text().splitlines()]
    return {r["doc_id"]: r["filtered_resps"] for r in rows}
