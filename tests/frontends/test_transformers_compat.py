"""transformers integration: our pipeline built by ``transformers.pipeline`` (pipeline_class and a
registered task), generation defaults resolved as transformers resolves them, and the pipeline's
arguments (prefix, stop_sequence, continue_final_message, return_tensors/return_text...) giving the
records transformers' own text-generation pipeline gives for the same embedded model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.pipelines.text_generation import ReturnType

import hf_contbatch
from hf_contbatch import CacheConfig, ContinuousBatchingPipeline, EngineConfig
from hf_contbatch.default_model import default_model_path

PATH = default_model_path()
ENGINE = EngineConfig(cache=CacheConfig(num_blocks=256))
PROMPTS = ["The for statement", "A class is", "Exceptions are"]
CHAT = [
    {"role": "system", "content": "You answer questions about Python."},
    {"role": "user", "content": "What is a class?"},
]
PREFILLED = CHAT + [{"role": "assistant", "content": "A class is"}]


@pytest.fixture(scope="module")
def ours():
    pipe = transformers.pipeline(
        "text-generation",
        model=PATH,
        dtype=torch.float32,
        pipeline_class=ContinuousBatchingPipeline,
        engine_config=ENGINE,
    )
    yield pipe
    pipe.close()


@pytest.fixture(scope="module")
def ref():
    return transformers.pipeline("text-generation", model=PATH, dtype=torch.float32)


def _bare_generation_config_model():
    """The embedded model with a generation config that sets no sampling behaviour, so the
    pipeline's own defaults (do_sample=True, temperature=0.7, max_new_tokens=256) apply."""
    model = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return model


@pytest.mark.timeout(600)
def test_transformers_pipeline_with_pipeline_class_returns_our_pipeline(ours):
    assert isinstance(ours, ContinuousBatchingPipeline)
    assert ours.model.dtype == torch.float32  # transformers loaded it with the dtype it was given


@pytest.mark.timeout(1200)
def test_greedy_outputs_equal_transformers_pipeline_with_the_models_own_defaults(ours, ref):
    # The embedded model's generation_config says do_sample=False, max_new_tokens=64.
    assert ours(PROMPTS) == ref(PROMPTS)
    assert ours(CHAT) == ref(CHAT)


@pytest.mark.timeout(600)
def test_registering_the_task_is_explicit_and_builds_our_pipeline():
    code = (
        "import hf_contbatch\nfrom transformers.pipelines import PIPELINE_REGISTRY\n"
        "print(hf_contbatch.integrations.TASK_NAME in PIPELINE_REGISTRY.get_supported_tasks())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=500, check=True)
    assert out.stdout.strip() == "False"  # importing registers nothing

    task = hf_contbatch.register_pipeline()
    assert hf_contbatch.register_pipeline() == task  # idempotent
    pipe = transformers.pipeline(task, model=PATH, dtype=torch.float32, engine_config=ENGINE)
    try:
        assert isinstance(pipe, ContinuousBatchingPipeline)
        assert pipe.task == task
        assert len(pipe("The with statement", max_new_tokens=4)[0]["generated_text"]) > len("The with statement")
    finally:
        pipe.close()


@pytest.mark.timeout(300)
def test_registering_over_another_pipelines_task_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        hf_contbatch.register_pipeline("text-generation")


@pytest.fixture(scope="module")
def bare_pipelines():
    """transformers' pipeline and ours, each over its own copy of the embedded model with a bare
    generation config (shared by the sampling tests: a seeded call draws the same whatever ran before)."""
    ref = transformers.pipeline("text-generation", model=_bare_generation_config_model(), tokenizer=PATH)
    ours = ContinuousBatchingPipeline(_bare_generation_config_model(), PATH, engine_config=ENGINE)
    yield ref, ours
    ours.close()


@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    "kwargs", [{}, {"max_new_tokens": 30, "temperature": 1.3, "top_p": 0.9}], ids=["defaults", "explicit"]
)
def test_sampling_defaults_and_seeded_samples_equal_transformers_pipeline(kwargs, bare_pipelines):
    # Same seed, same resolved processors (pipeline defaults + transformers' global top_k=50) =>
    # the same multinomial draws => the same text.
    ref, ours = bare_pipelines
    cfg = ours.resolve_generation_config(dict(kwargs))
    assert (cfg.do_sample, cfg.top_k) == (True, 50)
    assert cfg.temperature == kwargs.get("temperature", 0.7)
    assert cfg.max_new_tokens == kwargs.get("max_new_tokens", 256)
    for seed in (0, 1):
        torch.manual_seed(seed)
        expected = ref("The for statement", **kwargs)
        assert ours("The for statement", seed=seed, **kwargs) == expected


CASES = {
    "return_full_text=False": ("The for statement", {"return_full_text": False}),
    "return_text=True": ("The for statement", {"return_text": True}),
    "return_text=False": ("The for statement", {"return_text": False}),  # transformers keeps full text
    "return_tensors=True": ("The for statement", {"return_tensors": True}),
    "return_type=NEW_TEXT": ("The for statement", {"return_type": ReturnType.NEW_TEXT}),
    "prefix": ("the for statement", {"prefix": "Python docs: "}),
    "prefix+max_length": ("the for statement", {"prefix": "Python docs: ", "max_length": 12, "max_new_tokens": None}),
    "max_length": ("The for statement", {"max_length": 12, "max_new_tokens": None}),
    "min_new_tokens": ("The for statement", {"min_new_tokens": 8}),
    "add_special_tokens": ("The for statement", {"add_special_tokens": True}),
    "repetition_penalty": ("The for statement", {"repetition_penalty": 1.3}),
    "chat": (CHAT, {}),
    "chat return_full_text=False": (CHAT, {"return_full_text": False}),
    "chat prefill": (PREFILLED, {}),
    "chat continue_final_message=True": (PREFILLED, {"continue_final_message": True}),
    "chat continue_final_message=False": (PREFILLED, {"continue_final_message": False}),
    "tokenizer_encode_kwargs": ("The for statement", {"tokenizer_encode_kwargs": {"add_special_tokens": False}}),
    "handle_long_generation=hole": (
        "The for statement " * 400,
        {"handle_long_generation": "hole", "max_new_tokens": 8},
    ),
}


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("case", list(CASES))
def test_output_records_equal_transformers_pipeline(ours, ref, case):
    prompt, kwargs = CASES[case]
    kwargs = {"max_new_tokens": 16, **kwargs}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    assert ours(prompt, **kwargs) == ref(prompt, **kwargs)


@pytest.mark.timeout(900)
def test_stop_sequence_records_equal_transformers_pipeline(ours, ref):
    free = ref("The for statement", max_new_tokens=30, return_full_text=False)[0]["generated_text"]
    stops = [free[i : i + 2] for i in range(2, len(free) - 1) if free.find(free[i : i + 2]) == i]
    assert stops, free
    for stop in (stops[0], [stops[0], "zzzz"]):
        expected = ref("The for statement", max_new_tokens=30, stop_sequence=stop)
        assert ours("The for statement", max_new_tokens=30, stop_sequence=stop) == expected
        assert (stops[0] if isinstance(stop, str) else stop[0]) in expected[0]["generated_text"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"return_full_text": True, "return_text": True},
        {"return_full_text": False, "return_tensors": True},
        {"return_tensors": True, "return_text": True},
    ],
)
def test_mutually_exclusive_return_arguments_fail_as_in_transformers(ours, ref, kwargs):
    with pytest.raises(ValueError) as theirs:
        ref("a", max_new_tokens=2, **kwargs)
    with pytest.raises(ValueError) as mine:
        ours("a", max_new_tokens=2, **kwargs)
    assert str(mine.value) == str(theirs.value)


@pytest.mark.timeout(300)
def test_unsupported_generation_settings_are_rejected_by_name_with_reason_and_alternative(ours):
    for kwargs, name, alternative in (
        ({"num_beams": 2}, "num_beams", "num_return_sequences"),
        ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha", "repetition_penalty"),
        ({"dola_layers": "high"}, "dola_layers", "generate"),
        ({"force_words_ids": [[5]]}, "force_words_ids", "prefix_allowed_tokens_fn"),
        ({"output_attentions": True}, "output_attentions", "generate"),
    ):
        with pytest.raises(ValueError, match=rf"{name}.*not supported by hf_contbatch: .*; use .*{alternative}"):
            ours("a", max_new_tokens=2, **kwargs)
    with pytest.raises(ValueError, match="handle_long_generation"):
        ours("a", max_new_tokens=2, handle_long_generation="middle")
    # neutral values of unsupported settings are accepted (code written for transformers passes them)
    assert ours("a", max_new_tokens=2, num_beams=1, use_cache=True)


@pytest.mark.timeout(300)
def test_an_unsupported_setting_from_the_models_generation_config_is_rejected_with_its_source():
    model = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32)
    model.generation_config.penalty_alpha = 0.6
    pipe = ContinuousBatchingPipeline(model, PATH, engine_config=EngineConfig(cache=CacheConfig(num_blocks=16)))
    try:
        with pytest.raises(ValueError, match=r"penalty_alpha.*model's generation_config.*contrastive"):
            pipe("a", max_new_tokens=2)
    finally:
        pipe.close()


@pytest.mark.timeout(600)
def test_a_processor_setting_from_the_models_generation_config_is_applied_as_generate_applies_it():
    model = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(PATH)
    ids = tok(PROMPTS[0], return_tensors="pt")["input_ids"]
    plain = model.generate(ids, do_sample=False, max_new_tokens=24)[0, ids.shape[1] :].tolist()
    model.generation_config.no_repeat_ngram_size = 1
    expected = model.generate(ids, do_sample=False, max_new_tokens=24)[0, ids.shape[1] :].tolist()
    assert expected != plain  # the setting changes the output
    pipe = ContinuousBatchingPipeline(model, PATH, engine_config=EngineConfig(cache=CacheConfig(num_blocks=16)))
    try:
        got = pipe(PROMPTS[0], do_sample=False, max_new_tokens=24, return_tensors=True)[0]["generated_token_ids"]
        assert got[ids.shape[1] :] == expected
    finally:
        pipe.close()
