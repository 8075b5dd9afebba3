"""lm-eval model type ``hf-contbatch``: the same numbers as lm-eval's own ``hf`` model on the same
model, for local offline tasks (generate_until, multiple choice, rolling perplexity); the prompt
log-prob engine feature against a plain forward; the ``hf-contbatch eval`` command."""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.default_model import default_model_path

from conftest import LM_EVAL_TASKS, LM_EVAL_TASKS_DIR, build_model, local_task_manager, random_prompts

lm_eval = pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[2]
TASKS_DIR = LM_EVAL_TASKS_DIR  # the task YAMLs name their jsonl files relative to the repo root
TASKS = LM_EVAL_TASKS
MODEL_ARGS = f"pretrained={default_model_path()},dtype=float32,device=cpu"  # as conftest's lm_eval_hf_results


@pytest.fixture(scope="module")
def in_repo_root():
    cwd = os.getcwd()
    os.chdir(ROOT)
    yield
    os.chdir(cwd)


def _evaluate(model: str) -> dict:
    import hf_contbatch.integrations.lm_eval  # noqa: F401  (registers hf-contbatch)

    return lm_eval.simple_evaluate(
        model=model,
        model_args=MODEL_ARGS,
        tasks=TASKS,
        task_manager=local_task_manager(),
        log_samples=True,
        bootstrap_iters=0,
    )


@pytest.fixture(scope="module")
def hf_results(lm_eval_hf_results):
    """lm-eval's own ``hf`` model, the reference (conftest: evaluated once per session, also the
    base-model reference of test_lora_frontends.py)."""
    return lm_eval_hf_results


@pytest.fixture(scope="module")
def our_results(in_repo_root):
    return _evaluate("hf-contbatch")


def _by_doc(results, task):
    return {s["doc_id"]: s for s in results["samples"][task]}


@pytest.mark.timeout(3000)
def test_generate_until_outputs_and_exact_match_equal_hf(hf_results, our_results):
    task = "hfcb_pydoc_gen"
    ours, theirs = _by_doc(our_results, task), _by_doc(hf_results, task)
    assert ours.keys() == theirs.keys() and len(ours) == 8
    for doc_id in theirs:
        assert ours[doc_id]["filtered_resps"] == theirs[doc_id]["filtered_resps"], doc_id
    assert our_results["results"][task]["exact_match,none"] == hf_results["results"][task]["exact_match,none"]


@pytest.mark.timeout(3000)
def test_multiple_choice_loglikelihoods_and_accuracy_equal_hf(hf_results, our_results):
    task = "hfcb_pydoc_choice"
    ours, theirs = _by_doc(our_results, task), _by_doc(hf_results, task)
    assert ours.keys() == theirs.keys() and len(ours) == 8
    for doc_id in theirs:
        for (lp, greedy), (ref_lp, ref_greedy) in zip(
            ours[doc_id]["filtered_resps"], theirs[doc_id]["filtered_resps"], strict=True
        ):
            assert lp == pytest.approx(ref_lp, abs=1e-4)
            assert greedy == ref_greedy
    for metric in ("acc,none", "acc_norm,none"):
        assert our_results["results"][task][metric] == hf_results["results"][task][metric]


@pytest.mark.timeout(3000)
def test_rolling_loglikelihood_and_perplexities_equal_hf(hf_results, our_results):
    # The long document spans two windows, the first filling the model's whole 1024-token context.
    task = "hfcb_pydoc_text"
    ours, theirs = _by_doc(our_results, task), _by_doc(hf_results, task)
    for doc_id in theirs:
        assert ours[doc_id]["filtered_resps"][0] == pytest.approx(theirs[doc_id]["filtered_resps"][0], rel=1e-5)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert our_results["results"][task][metric] == pytest.approx(hf_results["results"][task][metric], rel=1e-5)


@pytest.mark.timeout(1500)
def test_loglikelihoods_with_prefix_caching_of_shared_contexts_equal_hf(hf_results, in_repo_root):
    from hf_contbatch.integrations.lm_eval import ContinuousBatchingLM

    # a few sequences at a time, so later requests of a question find its context's blocks cached
    lm = ContinuousBatchingLM(
        default_model_path(), dtype="float32", device="cpu", enable_prefix_caching=True, block_size=4, max_num_seqs=4
    )
    try:
        task = "hfcb_pydoc_choice"
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=[task],
            task_manager=local_task_manager(),
            log_samples=True,
            bootstrap_iters=0,
        )
        assert lm.engine.block_manager.num_prefix_hit_tokens > 0
        ours, theirs = _by_doc(results, task), _by_doc(hf_results, task)
        for doc_id in theirs:
            for (lp, greedy), (ref_lp, ref_greedy) in zip(
                ours[doc_id]["filtered_resps"], theirs[doc_id]["filtered_resps"], strict=True
            ):
                assert lp == pytest.approx(ref_lp, abs=1e-4) and greedy == ref_greedy
    finally:
        lm.close()


@pytest.mark.timeout(600)
def test_prompt_logprobs_equal_a_plain_forward_with_chunked_prefill_and_a_full_context():
    model = build_model("llama", max_position_embeddings=48)
    prompts = random_prompts([6, 48, 48, 20], seed=3)
    with torch.no_grad():
        refs = [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1) for p in prompts]
    engine = LLMEngine(
        model,
        EngineConfig(
            cache=CacheConfig(block_size=4, num_blocks=64),
            scheduler=SchedulerConfig(max_num_batched_tokens=16),
        ),
    )
    try:
        starts = [1, 30, 1, True]
        # prompts of 48 tokens + 1 scored token: 48 fed, the model's whole context
        handles = [
            engine.submit(p[:-1], SamplingParams(max_new_tokens=1, prompt_logprobs=k, score_token_id=p[-1]))
            for p, k in zip(prompts, starts)
        ]
        for h, p, ref, k in zip(handles, prompts, refs, starts):
            h.result(300)
            got = h.request.prompt_logprobs
            assert all(x is None for x in got[: int(k)])
            for t in range(int(k), len(p)):
                lp, is_argmax = got[t]
                assert lp == pytest.approx(ref[t - 1, p[t]].item(), abs=1e-4)
                assert is_argmax == (ref[t - 1].argmax().item() == p[t])
        with pytest.raises(ValueError, match="context"):  # generation still needs room for its token
            engine.submit(prompts[1], SamplingParams(max_new_tokens=1))
        assert engine.wait_idle(30) and engine.block_manager.num_free_blocks == 64
    finally:
        engine.close()


@pytest.mark.timeout(600)
def test_default_model_and_generation_driven_in_the_callers_thread():
    """No ``pretrained`` (``hf-contbatch eval`` without --model_args) loads the embedded model, and
    ``generate_until`` runs the engine's iterations in the calling thread, as the pipeline does."""
    import threading

    from lm_eval.api.instance import Instance

    from hf_contbatch.integrations.lm_eval import ContinuousBatchingLM

    lm = ContinuousBatchingLM(dtype="float32", device="cpu", num_blocks=64)
    try:
        assert Path(lm.model.name_or_path) == Path(default_model_path())
        stepping_threads = []
        step = lm.engine.step

        def recording_step():
            stepping_threads.append(threading.get_ident())
            return step()

        lm.engine.step = recording_step
        requests = [
            Instance(
                request_type="generate_until",
                doc={},
                idx=0,
                arguments=(prompt, {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}),
            )
            for prompt in ("def add(a, b):", "The for statement", "A class is")
        ]
        texts = lm.generate_until(requests, disable_tqdm=True)
        assert len(texts) == 3 and all(isinstance(t, str) for t in texts)
        # The background thread, started by the first submit, may run an iteration or, on a loaded
        # machine, two before the caller takes over; from the caller's first iteration on, every
        # one is the caller's, and the caller runs most of them.
        me = threading.get_ident()
        assert me in stepping_threads, "generate_until should drive the engine in the caller"
        first = stepping_threads.index(me)
        assert set(stepping_threads[first:]) == {me}, stepping_threads
        assert len(stepping_threads) >= 8 and len(stepping_threads) - first >= len(stepping_threads) // 2
    finally:
        lm.close()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_eval_command_runs_lm_eval_with_our_model_type(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "hf_contbatch.cli",
        "eval",
        "--tasks",
        "hfcb_pydoc_choice",
        "--include_path",
        TASKS_DIR,
        "--model_args",
        f"pretrained={default_model_path()},dtype=float32",
        "--device",
        "cpu",
        "--limit",
        "3",
        "--output_path",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    assert files, proc.stderr[-2000:]
    results = json.loads(Path(files[0]).read_text())
    assert results["config"]["model"] == "hf-contbatch"  # --model defaulted to our type
    acc = results["results"]["hfcb_pydoc_choice"]["acc,none"]
    assert 0.0 <= acc <= 1.0 and not math.isnan(acc)


@pytest.mark.timeout(1500)
def test_a_bad_sampling_value_gets_one_message_from_one_place_through_pipeline_submit_and_lm_eval():
    """``top_p=1.5`` through the pipeline, ``LLMEngine.submit`` and lm-eval's ``generate_until``:
    the same message, raised by the one check of sampling values (``request.check_sampling_values``)."""
    import traceback

    from lm_eval.api.instance import Instance

    from hf_contbatch import ContinuousBatchingPipeline
    from hf_contbatch.integrations.lm_eval import ContinuousBatchingLM

    def failure(call) -> tuple[str, str]:
        with pytest.raises(ValueError) as info:
            call()
        last = traceback.extract_tb(info.value.__traceback__)[-1]
        return str(info.value), f"{Path(last.filename).name}:{last.name}"

    lm = ContinuousBatchingLM(dtype="float32", device="cpu", num_blocks=64)
    pipe = ContinuousBatchingPipeline(
        default_model_path(), engine_config=EngineConfig(cache=CacheConfig(num_blocks=64))
    )
    try:
        request = Instance(
            request_type="generate_until",
            doc={},
            idx=0,
            arguments=(
                "def add(a, b):",
                {"until": ["\n\n"], "max_gen_toks": 4, "do_sample": True, "temperature": 0.8, "top_p": 1.5},
            ),
        )
        got = [
            failure(lambda: pipe("def add(a, b):", do_sample=True, top_p=1.5, max_new_tokens=4)),
            failure(lambda: pipe.engine.submit([1, 2, 3], SamplingParams(max_new_tokens=4, do_sample=True, top_p=1.5))),
            failure(lambda: lm.generate_until([request], disable_tqdm=True)),
        ]
        assert got == [("`top_p` must be None or a number in (0, 1], got 1.5", "request.py:check_sampling_values")] * 3
        assert not lm.engine.driver.has_work() and not pipe.engine.driver.has_work()
    finally:
        pipe.close()
        lm.close()


class _KilledAfter(Exception):
    """Stands for a kill: raised by the cache hook after some results were stored."""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("request_type", ["generate_until", "loglikelihood", "loglikelihood_rolling"])
def test_results_reach_the_cache_as_they_finish_and_a_rerun_computes_only_the_missing(tmp_path, request_type):
    """With lm-eval's ``--use_cache`` (``CachingLM``), each result is stored as its request finishes:
    a run stopped after 4 results keeps those 4, and the rerun sends only the others to the model,
    and returns what an uninterrupted run returns."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import CacheHook, CachingLM

    from hf_contbatch.integrations.lm_eval import ContinuousBatchingLM

    texts = [f"{w} number {i} is" for i, w in enumerate(["The for statement", "A class", "import x"] * 3)]
    arguments = {
        "generate_until": [
            (t, {"until": ["\n\n"], "max_gen_toks": 6 + i, "do_sample": False}) for i, t in enumerate(texts)
        ],
        "loglikelihood": [(t, " a value") for t in texts],
        "loglikelihood_rolling": [(t * (1 + i % 3),) for i, t in enumerate(texts)],
    }[request_type]
    requests = [Instance(request_type=request_type, doc={}, idx=i, arguments=a) for i, a in enumerate(arguments)]
    lm = ContinuousBatchingLM(dtype="float32", device="cpu", num_blocks=128, max_num_seqs=2)
    try:
        reference = getattr(lm, request_type)(requests, disable_tqdm=True)
        db = str(tmp_path / "cache.db")
        cached = CachingLM(lm, db)
        hook = lm.cache_hook
        stored = []

        class StopAfterFour(CacheHook):
            def __init__(self):
                self.dbdict = hook.dbdict

            def add_partial(self, attr, req, res):
                hook.add_partial(attr, req, res)
                stored.append(req)
                if len(stored) == 4:
                    raise _KilledAfter

        lm.set_cache_hook(StopAfterFour())
        with pytest.raises(_KilledAfter):
            getattr(cached, request_type)(requests)
        assert lm.engine.wait_idle(30)  # the others were cancelled, their blocks freed
        assert lm.engine.block_manager.num_free_blocks == lm.engine.block_manager.num_blocks
        cached.dbdict.close()  # what the killed process had committed

        rerun = CachingLM(lm, db)
        sent = []
        method = getattr(lm, request_type)

        def recording(reqs, *args, **kwargs):
            sent.extend(reqs)
            return method(reqs, *args, **kwargs)

        setattr(lm, request_type, recording)
        assert getattr(rerun, request_type)(requests) == reference
        assert len(sent) == len(requests) - 4
        assert {repr(r.args) for r in sent}.isdisjoint(repr(tuple(s)) for s in stored)
        rerun.dbdict.close()
    finally:
        lm.close()


@pytest.mark.timeout(600)
def test_generate_until_matches_stop_sequences_in_the_new_tokens_only_as_hf():
    """lm-eval's ``hf`` backend stops on a stop sequence found in the new tokens only
    (``MultiTokenEOSCriteria`` looks past the prompt), unlike transformers' ``StopStringCriteria``:
    a stop sequence made of the prompt's last character and the first new token's text does not stop
    the generation, which runs its full length (expected: the free greedy continuation from
    ``generate`` called as ``hf`` calls it, in which the stop sequence does not occur)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.utils_hf import MultiTokenEOSCriteria
    from transformers import AutoModelForCausalLM

    from hf_contbatch.integrations.lm_eval import ContinuousBatchingLM

    prompt, new = "A class is a", 8
    lm = ContinuousBatchingLM(dtype="float32", device="cpu", num_blocks=64)
    try:
        tok = lm.tokenizer
        ids = tok(prompt, return_tensors="pt")
        model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
        # hf's call (HFLM._model_generate): max_length; the model's generation_config sets max_new_tokens,
        # which generate's length resolution prefers, as for our engine.
        n = ids["input_ids"].shape[1]
        full = model.generate(**ids, do_sample=False, max_length=n + new)[0]
        free = full[n:]
        stop = prompt[-1] + tok.decode(free[:1])
        text = tok.decode(free)
        assert stop not in text
        hf_stops = MultiTokenEOSCriteria(stop, tok, n, 1)
        assert not any(hf_stops(full[None, : n + k], None) for k in range(1, len(free) + 1))
        request = Instance(
            request_type="generate_until",
            doc={},
            idx=0,
            arguments=(prompt, {"until": [stop], "max_gen_toks": new, "do_sample": False}),
        )
        assert lm.generate_until([request], disable_tqdm=True) == [text]
    finally:
        lm.close()
