"""Generation arguments as transformers resolves them: the pipeline's argument groups, the
generation config ``generate`` would run with, and the engine's ``SamplingParams`` from it.

Used by ``ContinuousBatchingPipeline`` and by the lm-eval integration (no pipeline needed).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
from typing import Optional

from transformers import GenerationConfig

from ..config import CacheConfig, EngineConfig, SchedulerConfig, check_int, is_int
from ..engine.logits_processors import PROCESSOR_SETTINGS, UNSUPPORTED_GENERATION, check_supported
from ..request import SamplingParams

# transformers.TextGenerationPipeline._default_generation_config
PIPELINE_GENERATION_DEFAULTS = {"max_new_tokens": 256, "do_sample": True, "temperature": 0.7}
_SAMPLING_ONLY = {"temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"}

PREPROCESS_KWARGS = (
    "prefix",
    "add_special_tokens",
    "continue_final_message",
    "tokenizer_encode_kwargs",
    "tools",
    "documents",
    "truncation",
    "padding",
    "handle_long_generation",
)
POSTPROCESS_KWARGS = (
    "return_full_text",
    "return_text",
    "return_tensors",
    "return_type",
    "clean_up_tokenization_spaces",
    "skip_special_tokens",
)
# batch_size/num_workers size transformers' static batches; the engine batches continuously.
# logits_processor / prefix_allowed_tokens_fn / stopping_criteria are generate's call-time objects;
# logprobs=N is an engine extra (top-N log-probs per token, as vLLM offers).
ENGINE_KWARGS = (
    "priority",
    "progress_bar",
    "batch_size",
    "num_workers",
    "ignore_eos",
    "seed",
    "logits_processor",
    "prefix_allowed_tokens_fn",
    "stopping_criteria",
    "logprobs",
    "adapter_names",  # LoRA adapter per prompt (PEFT's mixed-batch spelling; a peft.PeftModel)
    "response_format",  # structured outputs (frontends.response_format)
    "structured_outputs",
)
# Generation settings the engine does not run (beam search, contrastive search, DoLa...): any value
# but a neutral one, from the call or from the model's generation_config, is rejected by name with
# the reason and an alternative (``generation.UNSUPPORTED_GENERATION``).
_NEUTRAL_GENERATION = {name: neutral for name, (neutral, _, _) in UNSUPPORTED_GENERATION.items()}
# Generation parameters the engine honours (processor settings through transformers' own processors).
SUPPORTED_GENERATION_KWARGS = (
    "max_new_tokens",
    "max_length",
    "min_new_tokens",
    "do_sample",
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
    "stop_strings",
    "num_return_sequences",
    "generation_config",
    "min_length",
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
) + tuple(k for k in PROCESSOR_SETTINGS if k not in ("min_length", "min_new_tokens"))


def resolve_generate_config(model, generation_config: Optional[GenerationConfig] = None, **kwargs) -> GenerationConfig:
    """The config ``model.generate(generation_config=..., **kwargs)`` would run with: the kwargs over
    the given config over the model's generation config over transformers' global defaults.

    Raises:
        ValueError: a setting the engine does not implement (beam search, contrastive search, DoLa...)
            has a non-neutral value; the message says whether the call or the model set it, why, and
            what to use instead.
    """
    cfg, _ = model._prepare_generation_config(
        copy.deepcopy(generation_config) if generation_config is not None else None, **kwargs
    )

    def source(name: str) -> str:
        called = name in kwargs or (generation_config is not None and name in generation_config.to_diff_dict())
        return "this call" if called else "the model's generation_config"

    check_supported(cfg, source)
    return cfg


def sampling_params_from_config(
    cfg: GenerationConfig, prompt_len: int, *, ignore_eos: bool = False, seed: Optional[int] = None, prefix_len: int = 0
) -> SamplingParams:
    """The engine's ``SamplingParams`` for a resolved generation config and a ``prompt_len``-token prompt.

    ``prefix_len``: tokens of the pipeline ``prefix`` in the prompt, which transformers adds to
    ``max_length``/``min_length`` (they count the user's text, not the prefix).

    Raises:
        ValueError: a parameter out of range (from ``SamplingParams``' own check, which names it),
            ``num_beams`` > 1, or ``max_length`` leaving no room for new tokens.
    """
    if getattr(cfg, "num_beams", 1) not in (None, 1):
        raise ValueError(f"`num_beams` must be 1 (beam search is not supported), got {cfg.num_beams}")
    max_new = cfg.max_new_tokens
    if max_new is None:
        if cfg.max_length is None:
            raise ValueError("set `max_new_tokens` (an int >= 1)")
        check_int("max_length", cfg.max_length, 1)
        max_new = cfg.max_length + prefix_len - prompt_len
        if max_new < 1:
            raise ValueError(
                f"`max_length`={cfg.max_length} leaves no room after a {prompt_len}-token prompt; use `max_new_tokens` >= 1"
            )
    min_new = cfg.min_new_tokens or 0
    if cfg.min_length:  # MinLengthLogitsProcessor, as a count of new tokens
        check_int("min_length", cfg.min_length, 0)
        min_new = max(min_new, cfg.min_length + prefix_len - prompt_len) if is_int(min_new) else min_new
    temperature = cfg.temperature if cfg.temperature is not None else 1.0
    if isinstance(temperature, int) and not isinstance(temperature, bool):
        temperature = float(temperature)
    eos = cfg.eos_token_id
    eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    if not all(isinstance(e, int) for e in eos_ids):
        raise ValueError(f"`eos_token_id` must be an int or a list of ints, got {eos!r}")
    # Every value is checked where SamplingParams is built (request.check_sampling_values), the
    # same place for every front end.
    return SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        do_sample=cfg.do_sample,
        temperature=temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        repetition_penalty=cfg.repetition_penalty,
        eos_token_ids=() if ignore_eos else eos_ids,
        ignore_eos=ignore_eos,
        seed=seed,
        prompt_lookup_num_tokens=getattr(cfg, "prompt_lookup_num_tokens", None),
        max_matching_ngram_size=getattr(cfg, "max_matching_ngram_size", None),
    )


def resolve_pipeline_generation_config(model, tokenizer, gen_kwargs: dict) -> GenerationConfig:
    """The generation config ``generate`` runs with under transformers' text-generation pipeline.

    As ``Pipeline._prepare_generate_kwargs`` then ``generate`` do: the pipeline defaults
    (max_new_tokens=256, do_sample=True, temperature=0.7; the sampling ones only when sampling)
    for what neither the call nor the model's generation config sets, then the call's parameters
    over the model's generation config over transformers' global defaults (e.g. top_k=50).

    Raises:
        ValueError: a setting the engine does not implement has a non-neutral value.
    """
    gen_kwargs = dict(gen_kwargs)
    check_generation_kwarg_types(gen_kwargs)
    user_config = gen_kwargs.pop("generation_config", None)
    if user_config is not None and not isinstance(user_config, GenerationConfig):
        raise ValueError(
            f"`generation_config` must be a transformers.GenerationConfig, got {type(user_config).__name__}"
        )
    set_params = {
        **model.generation_config.to_diff_dict(),
        **(user_config.to_diff_dict() if user_config else {}),
        **gen_kwargs,
    }
    added = {
        k: v
        for k, v in PIPELINE_GENERATION_DEFAULTS.items()
        if k not in set_params and not (k == "max_new_tokens" and "max_length" in set_params)
    }
    if tokenizer is not None and tokenizer.pad_token_id is not None and "pad_token_id" not in set_params:
        added["pad_token_id"] = tokenizer.pad_token_id
    if not {**set_params, **added}.get("do_sample"):
        added = {k: v for k, v in added.items() if k not in _SAMPLING_ONLY}
    if user_config is None:
        return resolve_generate_config(model, None, **{**gen_kwargs, **added})
    user_config = copy.deepcopy(user_config)
    user_config.update(**added)
    return resolve_generate_config(model, user_config, **gen_kwargs)


def split_call_kwargs(kwargs: dict) -> dict:
    """A pipeline call's (or constructor's) keyword arguments by consumer: ``{"pre": tokenizing,
    "post": output records, "engine": submission, "gen": generation}``.

    Raises:
        ValueError: an argument no group takes, or a generation setting the engine does not implement.
    """
    groups = {"pre": {}, "post": {}, "engine": {}, "gen": {}}
    for key, value in kwargs.items():
        if key in PREPROCESS_KWARGS:
            groups["pre"][key] = value
        elif key in POSTPROCESS_KWARGS:
            groups["post"][key] = value
        elif key in ENGINE_KWARGS:
            groups["engine"][key] = value
        elif key in SUPPORTED_GENERATION_KWARGS or key in _NEUTRAL_GENERATION:
            groups["gen"][key] = value  # unsupported settings are rejected unless neutral
            if key == "max_length":
                groups["pre"][key] = value  # transformers also passes it to the tokenizer
        elif key == "use_cache":
            pass  # the paged cache is always used
        elif key == "stop_sequence":
            pass  # below
        elif hasattr(GenerationConfig(), key) or key in ("streamer", "assistant_model", "assistant_tokenizer"):
            raise ValueError(
                f"generation parameter `{key}` is not supported by ContinuousBatchingPipeline; supported: "
                f"{', '.join(SUPPORTED_GENERATION_KWARGS)}"
            )
        else:
            config_hint = _config_field_hint(key)
            if config_hint:
                raise ValueError(config_hint)
            known = (*SUPPORTED_GENERATION_KWARGS, *PREPROCESS_KWARGS, *POSTPROCESS_KWARGS, *ENGINE_KWARGS)
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean `{close[0]}`?)" if close else ""
            raise ValueError(
                f"unknown argument `{key}`{hint}; allowed: generation parameters "
                f"({', '.join(SUPPORTED_GENERATION_KWARGS)}), preprocessing ({', '.join(PREPROCESS_KWARGS)}), "
                f"postprocessing ({', '.join(POSTPROCESS_KWARGS)}), engine ({', '.join(ENGINE_KWARGS)})"
            )
    if "stop_sequence" in kwargs:
        # transformers' pipeline (5.x) passes stop_sequence to generate as stop_strings
        stop = kwargs["stop_sequence"]
        groups["gen"]["stop_strings"] = [stop] if isinstance(stop, str) else stop
    groups["post"] = resolve_return_type(groups["post"])
    return groups


def _config_field_hint(key: str) -> Optional[str]:
    """Where ``key`` belongs when it is a field of the engine's configs (``num_blocks``,
    ``max_num_seqs``...): those size the engine, so they are given once, when the pipeline is built.
    None for any other name, and for ``dtype`` (the pipeline's own argument names the model's dtype;
    ``CacheConfig.dtype`` is the KV cache's)."""
    for cls, arg in (
        (CacheConfig, "cache_config"),
        (SchedulerConfig, "scheduler_config"),
        (EngineConfig, "engine_config"),
    ):
        if key != "dtype" and key in {f.name for f in dataclasses.fields(cls)}:
            return (
                f"unknown argument `{key}`: it is a {cls.__name__} field, set when the pipeline is built: "
                f'hf_contbatch.pipeline("text-generation", ..., {arg}={cls.__name__}({key}=...))'
            )
    return None


def check_engine_flags(eng: dict) -> None:
    """The engine group's on/off arguments are bools (``bool("no")`` is True: a string would be read
    as on). Raises ValueError naming the argument."""
    for flag in ("ignore_eos", "progress_bar"):
        value = eng.get(flag)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"`{flag}` must be True or False, got {value!r}")


def resolve_return_type(post: dict) -> dict:
    """``return_full_text`` / ``return_text`` / ``return_tensors`` / ``return_type`` to one
    ``return_type`` ("full_text", "new_text" or "tensors"), with transformers' exclusivity rules
    and quirks (``return_text`` alone keeps the default; any ``return_tensors`` value selects tensors)."""
    post = dict(post)
    full, tensors, text = (
        post.pop("return_full_text", None),
        post.pop("return_tensors", None),
        post.pop("return_text", None),
    )
    return_type = post.pop("return_type", None)
    if return_type is not None:
        name = getattr(return_type, "name", return_type)
        return_type = str(name).lower()
        if return_type not in ("full_text", "new_text", "tensors"):
            raise ValueError(
                f"`return_type` must be 'full_text', 'new_text', 'tensors' or a transformers ReturnType, got {name!r}"
            )
    if full is not None and return_type is None:
        if not isinstance(full, bool):
            raise ValueError(f"`return_full_text` must be True or False, got {full!r}")
        if text is not None:
            raise ValueError("`return_text` is mutually exclusive with `return_full_text`")
        if tensors is not None:
            raise ValueError("`return_full_text` is mutually exclusive with `return_tensors`")
        return_type = "full_text" if full else "new_text"
    if tensors is not None and return_type is None:
        if text is not None:
            raise ValueError("`return_text` is mutually exclusive with `return_tensors`")
        return_type = "tensors"
    if return_type is not None:
        post["return_type"] = return_type
    return post


# The lowest allowed value of each integer generation argument, as the range checks downstream
# have it (SamplingParams, the request factory), checked here first so that a call gets our message
# (``check_int``'s), not GenerationConfig's.
_INT_KWARGS = {"max_new_tokens": 1, "min_new_tokens": 0, "max_length": 1, "top_k": 0, "num_return_sequences": 1}
# Floats: the type and finiteness here (temperature=inf samples uniformly: junk text); the ranges
# that depend on do_sample stay downstream (temperature=0 is fine for greedy decoding, as lm-eval
# sends it).
_FLOAT_KWARGS = {
    "temperature": "a finite number >= 0 (> 0 when do_sample=True)",
    "top_p": "a number in (0, 1]",
    "repetition_penalty": "a finite number > 0",
}


def check_generation_kwarg_types(kwargs: dict) -> None:
    """Type errors (and the integers' ranges, the floats' finiteness) named by argument, with the
    allowed values, before GenerationConfig turns them into TypeErrors or its own wording. ``None``
    means unset and passes.

    Raises:
        ValueError: ``"`max_new_tokens` must be an int >= 1, got 'x'"`` and the like.
    """
    for key, low in _INT_KWARGS.items():
        if kwargs.get(key) is not None:
            check_int(key, kwargs[key], low)
    for key, allowed in _FLOAT_KWARGS.items():
        v = kwargs.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise ValueError(f"`{key}` must be {allowed}, got {v!r}")
    if kwargs.get("temperature") is not None and kwargs["temperature"] < 0:  # never valid, greedy or not
        raise ValueError(f"`temperature` must be {_FLOAT_KWARGS['temperature']}, got {kwargs['temperature']!r}")
    v = kwargs.get("do_sample")
    if v is not None and not isinstance(v, bool):
        raise ValueError(f"`do_sample` must be True or False, got {v!r}")
