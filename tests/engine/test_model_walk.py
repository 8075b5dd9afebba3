"""Every decoder-only text type in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: served
exactly, or refused in one line before any weight is touched.

The walk decides nothing from a list of ours: for each type a tiny model of its own config class
(``scripts/family_sweep.py``'s ``tiny_config``, seed 0) is first built on the meta device and given
to ``LLMEngine``. A refusal there is a one-line ``ValueError`` that came before any weight was read
(reading a meta weight fails) and within a second. Any other outcome means the engine serves the
type, and one real float32 model is then checked against transformers' own ``generate``:

- greedy tokens for two prompts (5 and 23 tokens), under forced recompute preemption and again one
  request per step;
- seeded sampling: ``SamplingParams(seed=s)`` equal to ``torch.manual_seed(s)`` +
  ``generate(do_sample=True)``, in the same engine as the greedy requests, a seeded request among
  the preempted ones (the engine draws a seeded request's tokens with a generator of its own, kept
  across preemption, one ``multinomial`` over the full softmax per token: the draw ``generate``
  makes from the global generator, so equality is exact whatever the batch);
- ``quantization="int8"``: greedy tokens equal ``generate`` on a copy whose int8 linears hold the
  weights quantized and dequantized in plain torch (per output channel, absmax / 127), the closeness
  README documents; the linears the engine leaves float stay float in the copy.

A type the engine accepts at construction may still be refused at the first step by its attention
function (a model's own mask, K/V changed after ``cache.update``): one line, never a token.
Multimodal types, encoders run as decoders and seq2seq decoder halves are not walked
(``family_sweep.skip_reason``); types transformers itself cannot build or run from the shrunken
config are listed in ``TRANSFORMERS_FAILS_TINY`` with what transformers raises, and checked to fail
that way in transformers itself, not in the engine.
"""

from __future__ import annotations

import pytest

from hf_contbatch.engine.llm_engine import EngineError

from conftest import load_family_sweep

family_sweep = load_family_sweep("family_sweep_walk")

# Types transformers 5.24 cannot build from the sweep's shrunken config, or whose own generate fails
# on it (from `scripts/family_sweep.py`'s "skip" rows): {type: the start of what transformers raises}.
# A type that builds and runs here (the sweep's shrinking improved, transformers fixed) is walked
# like any other, listed or not.
TRANSFORMERS_FAILS_TINY = {
    "bamba": "AttributeError: property 'layers_block_type'",
    "cohere_compass_text": "KeyError: 'full_attention'",
    "dbrx": "AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta'",
    "dory": "RuntimeError: The size of tensor a",
    "dots3_note_text": "StrictDataclassClassValidationError",
    "falcon_h1": "AttributeError: property 'layers_block_type'",
    "gemma3n_text": "ValueError: The set of layer types producing a cache",
    "granitemoehybrid": "StrictDataclassClassValidationError",
    "jamba": "ValueError: `get_seq_length` can only be called on Attention layers",
    "lfm2_moe": "TypeError: 'NoneType' object is not subscriptable",
    "longcat_flash": "RuntimeError: The size of tensor a",
    "mamba2": "StrictDataclassClassValidationError",
    "nemotron_h": "ValueError: `get_seq_length` can only be called on Attention layers",
    "qwen4_exp_text": "TypeError: unsupported operand type(s) for //",
    "recurrent_gemma": "AttributeError: property 'layers_block_type'",
    "reformer": "AssertionError: If you want to use `ReformerModelWithLMHead`",
    "xlstm": "ValueError: matC_old has wrong shape",
    "zamba": "ValueError: There is an issue with your definition of `tie_weights_keys`",
    "zaya": "StrictDataclassClassValidationError",
}


def _walked_types() -> list[str]:
    """The mapping's decoder-only text types (``skip_reason`` None), sorted."""
    return [t for t in family_sweep.all_types() if family_sweep.skip_reason(t) is None]


WALKED = _walked_types()


def _build_and_reference(model_type):
    """(model, prompts, greedy references, sampled references), or the exception transformers raised."""
    try:
        model = family_sweep.build_tiny(model_type)
        prompts = family_sweep.prompts()
        greedy = [family_sweep.reference(model, p) for p in prompts]
        sampled = [family_sweep.reference_sampled(model, p, s) for p, s in zip(prompts, family_sweep.SEEDS)]
    except Exception as exc:  # noqa: BLE001 - transformers' own failure is what the listed types check
        return exc
    return model, prompts, greedy, sampled


def test_the_walk_covers_the_mapping():
    """The walk is the mapping's decoder-only text types, and the well-known ones are among them."""
    assert len(WALKED) >= 120
    assert {"llama", "gpt2", "mistral", "gemma3_text", "gpt_oss", "mamba", "qwen3_next"} <= set(WALKED)
    assert not {"bert", "bart", "gemma3"} & set(WALKED)  # an encoder, a seq2seq model, a multimodal one


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_type", WALKED)
def test_type_is_served_exactly_or_refused_in_one_line(model_type):
    try:
        message, seconds = family_sweep.refusal(model_type)
    except Exception:  # noqa: BLE001 - transformers cannot build it even on the meta device: see below
        message = seconds = None
    if message is not None:
        assert "\n" not in message and "not served by hf_contbatch" in message
        assert seconds < 1.0, f"refused after {seconds:.2f} s"
        return
    built = _build_and_reference(model_type)
    if isinstance(built, Exception):
        assert model_type in TRANSFORMERS_FAILS_TINY, f"transformers failed: {built!r}"
        assert f"{type(built).__name__}: {built}".startswith(TRANSFORMERS_FAILS_TINY[model_type])
        return
    model, prompts, greedy, sampled = built
    try:
        run = family_sweep.serve_float(model, prompts)
    except EngineError as err:  # the attention function's refusal at the first step, in one line
        cause = err.__cause__
        assert isinstance(cause, ValueError) and "not served by hf_contbatch" in str(cause), repr(cause)
        assert "\n" not in str(cause)
        return
    assert run.num_preemptions > 0, "the pool was meant to force preemption"
    # A seeded request recomputed after preemption draws on from where its generator was.
    assert run.sampled_preemptions > 0, "the pool was meant to preempt a seeded request"
    assert run.greedy == greedy
    assert run.greedy_one_row == greedy
    assert run.sampled == sampled
    outs, int8_linears = family_sweep.serve_int8(model, prompts)
    lm_head = model.get_output_embeddings()
    assert any(m is lm_head for n, m in model.named_modules() if n in int8_linears), "LM head left float"
    dequantized = family_sweep.dequantized_copy(model, int8_linears)
    assert outs == [family_sweep.reference(dequantized, p) for p in prompts]


def test_markdown_table_has_a_column_per_check_and_what_is_missing():
    rows = [
        {"type": "llama", "status": "exact", "detail": "", "greedy": "exact", "sampled": "exact", "int8": "exact"}
        | {"preemptions": 3, "refusal_seconds": 0.01, "seconds": 0.6},
        {"type": "mamba", "status": "refused", "detail": "model type 'mamba' is not served: layer kinds 'a|b'"}
        | {"greedy": None, "sampled": None, "int8": None, "preemptions": None, "refusal_seconds": 0.0, "seconds": 0.2},
    ]
    lines = family_sweep.markdown_table(rows).splitlines()
    header = next(line for line in lines if line.startswith("| model type"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "model type",
        "status",
        "greedy",
        "sampled",
        "int8",
        "preemptions",
        "what is missing / detail",
    ]
    assert "| llama | exact | exact | exact | exact | 3 |  |" in lines
    assert "| mamba | refused |  |  |  |  | model type 'mamba' is not served: layer kinds 'a\\|b' |" in lines
    assert any("**1 served exactly**" in line and "1 refused in one line" in line for line in lines)
