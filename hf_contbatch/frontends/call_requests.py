"""A pipeline call's prompts and arguments as engine requests, built and validated, none queued.

One prompt's path, top to bottom (``CallRequestBuilder.prepare``): the call's keyword arguments are
split by consumer and merged over the pipeline's defaults (``generation_args.split_call_kwargs``);
the generation config is resolved as transformers' pipeline resolves it, once per distinct
``max_new_tokens`` (``generation_args.resolve_pipeline_generation_config``); the prompt is
tokenized (``text_io.tokenize_prompt``); its ``SamplingParams`` and logits processors are derived
from the config (``generation_args.sampling_params_from_config``,
``logits_processors.with_processors``); and the engine validates and builds the request
(``LLMEngine.build_request``, the one place a request is checked). Every prompt of the call is
built before any is queued, so a call with one bad prompt queues nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

from transformers import GenerationConfig

from ..config import is_int
from ..engine.llm_engine import LLMEngine
from ..engine.logits_processors import logits_device, prepare_generation_config, with_processors
from ..engine.stopping import StopStringCheckers
from ..request import Request
from .generation_args import (
    check_engine_flags,
    resolve_pipeline_generation_config,
    sampling_params_from_config,
    split_call_kwargs,
)
from .response_format import structured_outputs_per_prompt
from .text_io import OutputOptions, TextInput, prefix_length, tokenize_prompt, truncate_for_hole


@dataclass
class PreparedCall:
    """One pipeline call, ready to queue (``LLMEngine.enqueue``).

    Attributes:
        prompts: the call's prompts, in input order.
        requests: one engine request per prompt, built and validated, not queued; the prompt's
            other returned sequences are the request's pending forks.
        output: how its ids become output records and stream deltas.
        progress_bar: the call's ``progress_bar`` argument (None: the pipeline's default).
    """

    prompts: list[TextInput]
    requests: list[Request]
    output: OutputOptions
    progress_bar: Optional[bool]


class CallRequestBuilder:
    """Turns the calls of one ``ContinuousBatchingPipeline`` into engine requests.

    Args:
        engine: the pipeline's engine (it validates and builds each request).
        tokenizer: the pipeline's tokenizer.
        init_kwargs: the pipeline's constructor arguments by consumer (``split_call_kwargs``), the
            defaults of every call.
    """

    def __init__(self, engine: LLMEngine, tokenizer, init_kwargs: dict) -> None:
        self.engine = engine
        self.model = engine.model
        self.tokenizer = tokenizer
        self.init_kwargs = init_kwargs
        self.stop_checkers = StopStringCheckers(tokenizer)

    def prepare(self, prompts: Sequence[TextInput], kwargs: dict) -> PreparedCall:
        """Tokenize and validate every prompt of a call with its keyword arguments ``kwargs``.

        Raises:
            ValueError: a bad argument or prompt (named in the message); nothing is queued then.
        """
        call = split_call_kwargs(kwargs)
        groups = {k: {**self.init_kwargs[k], **call[k]} for k in call}
        if "generation_config" in call["gen"]:
            groups["gen"] = dict(call["gen"])  # as transformers: a call's generation_config replaces init parameters
        pre, post, eng, gen = groups["pre"], groups["post"], groups["engine"], groups["gen"]
        if pre.get("handle_long_generation") not in (None, "hole"):
            raise ValueError(
                f"{pre['handle_long_generation']} is not a valid value for `handle_long_generation` parameter expected [None, 'hole']"
            )
        stop_strings = gen.pop("stop_strings", None)
        cfgs = self._generation_configs(gen, len(prompts))
        # No prompt: only the call's arguments are checked (a streamed call, before its first input).
        cfg = cfgs[0] if cfgs else resolve_pipeline_generation_config(self.model, self.tokenizer, gen)
        if cfg.stop_strings and stop_strings is None:
            stop_strings = cfg.stop_strings
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        num_sequences = cfg.num_return_sequences  # checked by the engine's factory (an int >= 1)
        if is_int(num_sequences) and num_sequences > 1 and not cfg.do_sample:
            raise ValueError(
                "`num_return_sequences` > 1 needs `do_sample=True` (greedy decoding would return the same sequence)"
            )
        checker = self.stop_checkers.checker(stop_strings)
        check_engine_flags(eng)
        priorities = _priorities(eng.get("priority", 0), len(prompts))
        adapters = _adapter_names(eng.get("adapter_names"), len(prompts))
        prefix_len = prefix_length(self.tokenizer, pre) if cfg.max_new_tokens is None or cfg.min_length else 0
        proc_cfg = prepare_generation_config(self.model, cfg, logits_device(self.model))  # once per call
        if prefix_len and cfg.min_length and cfg.min_new_tokens is None:
            # transformers' pipeline counts min_length without the prefix (adds its length)
            proc_cfg.min_length = cfg.min_length + prefix_len
        constraints = structured_outputs_per_prompt(
            eng.get("response_format"), eng.get("structured_outputs"), len(prompts)
        )
        requests = []
        for prompt, priority, prompt_cfg, adapter, constraint in zip(prompts, priorities, cfgs, adapters, constraints):
            ids = tokenize_prompt(self.tokenizer, prompt, pre)
            if len(ids) == 0:
                raise ValueError("a prompt tokenized to 0 tokens; give a non-empty prompt")
            if pre.get("handle_long_generation") == "hole":
                ids = truncate_for_hole(self.tokenizer, ids, prompt_cfg)
            sp = sampling_params_from_config(
                prompt_cfg,
                len(ids),
                ignore_eos=eng.get("ignore_eos") or False,
                seed=eng.get("seed"),
                prefix_len=prefix_len,
            )
            if constraint is not None:
                sp = dataclasses.replace(sp, structured_outputs=constraint)
            # The processors generate would build for this prompt (transformers' own list and order).
            sp = with_processors(
                self.model,
                proc_cfg,
                sp,
                ids,
                logits_processor=eng.get("logits_processor"),
                prefix_allowed_tokens_fn=eng.get("prefix_allowed_tokens_fn"),
                stopping_criteria=eng.get("stopping_criteria"),
                logprobs=eng.get("logprobs"),
                device=logits_device(self.model),
                grammar_mask=constraint is not None,
            )
            if adapter is not None:  # resolved and checked by the engine (LoraAdapters.resolve)
                sp = dataclasses.replace(sp, adapter_name=adapter)
            # One engine request forked after prefill: the prompt's KV is computed once and shared;
            # sequence k samples with seed + k when a seed is set.
            requests.append(
                self.engine.build_request(
                    ids, sp, priority=priority, stop_checker=checker, num_return_sequences=num_sequences
                )
            )
        output = OutputOptions(
            return_type=post.get("return_type", "full_text"),
            skip_special_tokens=post.get("skip_special_tokens"),
            clean_up_tokenization_spaces=post.get("clean_up_tokenization_spaces"),
            continue_final_message=pre.get("continue_final_message"),
            stop_strings=tuple(stop_strings) if stop_strings else None,
        )
        return PreparedCall(list(prompts), requests, output, eng.get("progress_bar"))

    def _generation_configs(self, gen: dict, num_prompts: int) -> list[GenerationConfig]:
        """One resolved generation config per prompt: ``max_new_tokens`` may be a list with one int
        per prompt (like ``priority``); everything else is shared.

        Raises:
            ValueError: a list of the wrong length or with a value that is not an int >= 1.
        """
        values = gen.get("max_new_tokens")
        if not isinstance(values, (list, tuple)):
            return [resolve_pipeline_generation_config(self.model, self.tokenizer, gen)] * num_prompts
        if len(values) != num_prompts:
            raise ValueError(
                f"`max_new_tokens` has {len(values)} entries for {num_prompts} prompts; give an int or one per prompt"
            )
        for v in values:
            if not is_int(v) or v < 1:
                raise ValueError(f"`max_new_tokens` must be an int >= 1 or a list of them (one per prompt), got {v!r}")
        resolved = {
            v: resolve_pipeline_generation_config(self.model, self.tokenizer, {**gen, "max_new_tokens": v})
            for v in dict.fromkeys(values)
        }
        return [resolved[v] for v in values]


def _adapter_names(names, num_prompts: int) -> list:
    """The call's ``adapter_names`` (None, one name for all prompts, or a list with one per prompt,
    as PEFT's ``generate(adapter_names=...)``) as one entry per prompt; the engine checks the names.

    Raises:
        ValueError: a list of the wrong length.
    """
    if isinstance(names, (list, tuple)):
        if len(names) != num_prompts:
            raise ValueError(
                f"`adapter_names` has {len(names)} entries for {num_prompts} prompts; give one name or one per prompt"
            )
        return list(names)
    return [names] * num_prompts


def _priorities(priority, num_prompts: int) -> list:
    """The call's ``priority`` (an int, or a list with one per prompt) as one entry per prompt.

    Raises:
        ValueError: a list of the wrong length, or an entry that is not an int.
    """
    if isinstance(priority, (list, tuple)):
        if len(priority) != num_prompts:
            raise ValueError(f"`priority` has {len(priority)} entries for {num_prompts} prompts")
        priorities = list(priority)
    else:
        priorities = [priority] * num_prompts
    for p in priorities:
        if not is_int(p):
            raise ValueError(f"`priority` must be an int or a list of ints (lower runs first), got {p!r}")
    return priorities
