"""``ContinuousBatchingPipeline``: the ``transformers`` text-generation pipeline's inputs and outputs,
served by the continuous-batching engine.

Inputs, generation defaults and output records follow ``transformers.TextGenerationPipeline``
(transformers 5.x): a string, a chat (list of role/content dicts), a list of either, or any iterable
of them; ``max_new_tokens``/``do_sample``/... resolved on top of the model's ``generation_config``
and the pipeline defaults (max_new_tokens=256, do_sample=True, temperature=0.7), exactly as
transformers resolves them.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections import OrderedDict
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from .config import CacheConfig, EngineConfig, SchedulerConfig
from .engine import LLMEngine, RequestHandle
from .request import Request, SamplingParams

# transformers.TextGenerationPipeline._default_generation_config
PIPELINE_GENERATION_DEFAULTS = {"max_new_tokens": 256, "do_sample": True, "temperature": 0.7}
_SAMPLING_ONLY = {"temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"}

PREPROCESS_KWARGS = ("prefix", "add_special_tokens", "continue_final_message", "tokenizer_encode_kwargs", "tools", "documents")
POSTPROCESS_KWARGS = ("return_full_text", "return_text", "return_tensors", "clean_up_tokenization_spaces", "skip_special_tokens")
ENGINE_KWARGS = ("priority", "progress_bar", "batch_size", "ignore_eos", "seed")
# Generation parameters the engine honours; anything else a GenerationConfig knows is rejected
# with a clear error instead of being silently ignored.
SUPPORTED_GENERATION_KWARGS = (
    "max_new_tokens", "max_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "repetition_penalty", "eos_token_id", "pad_token_id", "bos_token_id", "stop_strings",
    "num_return_sequences", "generation_config",
)

Chat = list  # a list of {"role": ..., "content": ...} dicts

_TextInput = Union[str, Chat]


def _is_chat(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, dict) and "role" in m for m in x)


class GenerationHandle:
    """A prompt submitted with ``ContinuousBatchingPipeline.submit``.

    Iterating yields text deltas as tokens arrive; ``result()`` returns the same records
    ``__call__`` returns for one prompt; ``cancel()`` stops it (its partial text is kept).
    """

    def __init__(self, pipe: "ContinuousBatchingPipeline", prompt: _TextInput, handles: list[RequestHandle], post: dict):
        self._pipe = pipe
        self.prompt = prompt
        self.handles = handles
        self._post = post

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()

    def result(self, timeout: Optional[float] = None) -> list[dict]:
        """Records ``[{"generated_text": ...}] * num_return_sequences``; raises ``EngineError`` or
        ``TimeoutError``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        outs = []
        for h in self.handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            outs.append(h.result(left))
        return [self._pipe._record(self.prompt, o, self._post) for o in outs]

    def finish_reasons(self) -> list[Optional[str]]:
        return [h.request.finish_reason for h in self.handles]

    def __iter__(self) -> Iterator[str]:
        """Text deltas of the first sequence, never splitting a multi-byte character."""
        tok = self._pipe.tokenizer
        skip = self._post.get("skip_special_tokens", True)
        ids: list[int] = []
        emitted = ""
        for new in self.handles[0].token_stream():
            ids.extend(new)
            text = tok.decode(ids, skip_special_tokens=skip)
            if text.endswith("\ufffd"):
                continue  # a character split across tokens: wait for the rest
            if text.startswith(emitted) and len(text) > len(emitted):
                yield text[len(emitted):]
                emitted = text
        text = tok.decode(ids, skip_special_tokens=skip)
        if text.startswith(emitted) and len(text) > len(emitted):
            yield text[len(emitted):]


class ContinuousBatchingPipeline:
    """Drop-in for ``transformers.pipeline("text-generation")`` with continuous batching.

    Args:
        model: a ``PreTrainedModel`` or a name/path for ``AutoModelForCausalLM.from_pretrained``.
        tokenizer: a tokenizer or name/path; defaults to the model's.
        engine_config: full engine configuration; or give ``cache_config`` / ``scheduler_config``.
        dtype: load dtype when ``model`` is a name ("auto", "float32", a ``torch.dtype``...).
        device: load device when ``model`` is a name (e.g. "cpu", "cuda", 0).
        **kwargs: generation parameters used as call defaults (like transformers' pipeline), and
            transformers pipeline plumbing (``task``, ``framework``...) which is accepted and ignored.

    Raises:
        ValueError: an unsupported model family or bad configuration.
    """

    task = "text-generation"

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        engine_config: Optional[EngineConfig] = None,
        cache_config: Optional[CacheConfig] = None,
        scheduler_config: Optional[SchedulerConfig] = None,
        dtype=None,
        device=None,
        **kwargs,
    ) -> None:
        for plumbing in ("task", "framework", "binary_output", "feature_extractor", "image_processor",
                         "processor", "video_processor", "model_card", "args_parser", "torch_dtype", "num_workers"):
            value = kwargs.pop(plumbing, None)
            if plumbing == "torch_dtype" and dtype is None:
                dtype = value
        if isinstance(model, str):
            model_id = model
            model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype if dtype is not None else "auto")
            if device is not None:
                model = model.to(device if not isinstance(device, int) else f"cuda:{device}")
            if tokenizer is None:
                tokenizer = model_id
        if tokenizer is None:
            name = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
            if not name:
                raise ValueError("`tokenizer` is required when the model was not loaded from a name or path")
            tokenizer = name
        if isinstance(tokenizer, str):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.model = model
        self.tokenizer = tokenizer
        if engine_config is None:
            engine_config = EngineConfig(cache=cache_config or CacheConfig(), scheduler=scheduler_config or SchedulerConfig())
        elif cache_config is not None or scheduler_config is not None:
            raise ValueError("pass either `engine_config` or `cache_config`/`scheduler_config`, not both")
        self._init_kwargs = self._split_kwargs(kwargs)
        self.engine = LLMEngine(model, engine_config)
        self._stop_criteria: "OrderedDict[tuple, Any]" = OrderedDict()
        self._stop_lock = threading.Lock()
        self.last_call_stats: dict = {}

    # --- context management ----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine thread, free the KV pool and restore the model's attention."""
        self.engine.close()

    def __enter__(self) -> "ContinuousBatchingPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.engine.close()
        except Exception:
            pass

    def stats(self):
        """An immutable ``EngineStats`` snapshot."""
        return self.engine.stats()

    def dashboard(self, **kwargs):
        """A live ipywidgets view of blocks and queues (see ``hf_contbatch.dashboard``)."""
        from .dashboard import Dashboard

        return Dashboard(self, **kwargs)

    # --- argument handling -------------------------------------------------------------------------
    def _split_kwargs(self, kwargs: dict) -> dict:
        groups = {"pre": {}, "post": {}, "engine": {}, "gen": {}}
        for key, value in kwargs.items():
            if key in PREPROCESS_KWARGS:
                groups["pre"][key] = value
            elif key in POSTPROCESS_KWARGS:
                groups["post"][key] = value
            elif key in ENGINE_KWARGS:
                groups["engine"][key] = value
            elif key in SUPPORTED_GENERATION_KWARGS:
                groups["gen"][key] = value
            elif key == "stop_sequence":
                # transformers' pipeline turns stop_sequence into eos_token_id of its first token;
                # a stop string is the exact version of that intent.
                groups["gen"].setdefault("stop_strings", value)
            elif hasattr(GenerationConfig(), key) or key in ("num_beams", "streamer", "assistant_model"):
                raise ValueError(
                    f"generation parameter `{key}` is not supported by ContinuousBatchingPipeline; supported: "
                    f"{', '.join(SUPPORTED_GENERATION_KWARGS)}"
                )
            else:
                raise ValueError(
                    f"unknown argument `{key}`; allowed: generation parameters "
                    f"({', '.join(SUPPORTED_GENERATION_KWARGS)}), preprocessing ({', '.join(PREPROCESS_KWARGS)}), "
                    f"postprocessing ({', '.join(POSTPROCESS_KWARGS)}), engine ({', '.join(ENGINE_KWARGS)})"
                )
        return groups

    def resolve_generation_config(self, gen_kwargs: dict) -> GenerationConfig:
        """The generation config ``generate`` would run with, resolved as transformers' pipeline does:
        the call's parameters over the model's generation config, and the pipeline defaults for what
        neither sets (sampling defaults only when sampling)."""
        gen_kwargs = dict(gen_kwargs)
        user_config = gen_kwargs.pop("generation_config", None)
        if user_config is not None and not isinstance(user_config, GenerationConfig):
            raise ValueError(f"`generation_config` must be a transformers.GenerationConfig, got {type(user_config).__name__}")
        base = copy.deepcopy(user_config if user_config is not None else self.model.generation_config)
        set_params = {**self.model.generation_config.to_diff_dict(), **(user_config.to_diff_dict() if user_config else {}), **gen_kwargs}
        added = {
            k: v for k, v in PIPELINE_GENERATION_DEFAULTS.items()
            if k not in set_params and not (k == "max_new_tokens" and "max_length" in set_params)
        }
        if not {**set_params, **added}.get("do_sample"):
            added = {k: v for k, v in added.items() if k not in _SAMPLING_ONLY}
        if self.tokenizer is not None and self.tokenizer.pad_token_id is not None and "pad_token_id" not in set_params:
            added["pad_token_id"] = self.tokenizer.pad_token_id
        base.update(**{**added, **gen_kwargs})
        return base

    def _sampling_params(self, cfg: GenerationConfig, prompt_len: int, engine_kw: dict) -> SamplingParams:
        def check_int(name, value, low):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}")

        if getattr(cfg, "num_beams", 1) not in (None, 1):
            raise ValueError(f"`num_beams` must be 1 (beam search is not supported), got {cfg.num_beams}")
        max_new = cfg.max_new_tokens
        if max_new is None:
            if cfg.max_length is None:
                raise ValueError("set `max_new_tokens` (an int >= 1)")
            check_int("max_length", cfg.max_length, 1)
            max_new = cfg.max_length - prompt_len
            if max_new < 1:
                raise ValueError(
                    f"`max_length`={cfg.max_length} leaves no room after a {prompt_len}-token prompt; use `max_new_tokens` >= 1"
                )
        check_int("max_new_tokens", max_new, 1)
        min_new = cfg.min_new_tokens or 0
        check_int("min_new_tokens", min_new, 0)
        do_sample = cfg.do_sample
        if not isinstance(do_sample, bool):
            raise ValueError(f"`do_sample` must be True or False, got {do_sample!r}")
        temperature = cfg.temperature if cfg.temperature is not None else 1.0
        if do_sample and (not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature <= 0):
            raise ValueError(f"`temperature` must be a float > 0 when do_sample=True, got {temperature!r}")
        top_k = cfg.top_k
        if top_k is not None:
            check_int("top_k", top_k, 0)
        top_p = cfg.top_p
        if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"`top_p` must be in (0, 1], got {top_p!r}")
        rp = cfg.repetition_penalty
        if rp is not None and not (isinstance(rp, (int, float)) and rp > 0):
            raise ValueError(f"`repetition_penalty` must be a float > 0, got {rp!r}")
        eos = cfg.eos_token_id
        eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        if not all(isinstance(e, int) for e in eos_ids):
            raise ValueError(f"`eos_token_id` must be an int or a list of ints, got {eos!r}")
        ignore_eos = bool(engine_kw.get("ignore_eos", False))
        seed = engine_kw.get("seed")
        if seed is not None:
            check_int("seed", seed, 0)
        return SamplingParams(
            max_new_tokens=max_new, min_new_tokens=min_new, do_sample=do_sample, temperature=float(temperature),
            top_k=top_k, top_p=top_p, repetition_penalty=rp, eos_token_ids=() if ignore_eos else eos_ids,
            ignore_eos=ignore_eos, seed=seed,
        )

    def _stop_checker(self, stop_strings):
        if not stop_strings:
            return None
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        if not (isinstance(stop_strings, (list, tuple)) and all(isinstance(s, str) and s for s in stop_strings)):
            raise ValueError(f"`stop_strings` must be a non-empty string or a list of them, got {stop_strings!r}")
        key = tuple(stop_strings)
        with self._stop_lock:
            criteria = self._stop_criteria.get(key)
            if criteria is None:
                from transformers.generation.stopping_criteria import StopStringCriteria

                criteria = StopStringCriteria(tokenizer=self.tokenizer, stop_strings=list(stop_strings))
                self._stop_criteria[key] = criteria
                if len(self._stop_criteria) > 32:
                    self._stop_criteria.popitem(last=False)
        tail = max(len(s) for s in stop_strings) + 8

        def check(req: Request) -> bool:
            ids = torch.tensor([req.output_token_ids[-tail:]])
            return bool(criteria(ids, None)[0])

        return check

    def _tokenize(self, prompt: _TextInput, pre: dict) -> list[int]:
        extra = dict(pre.get("tokenizer_encode_kwargs") or {})
        if pre.get("add_special_tokens") is not None:
            extra["add_special_tokens"] = pre["add_special_tokens"]
        if isinstance(prompt, str):
            return self.tokenizer(pre.get("prefix", "") + prompt, **extra)["input_ids"]
        if _is_chat(prompt):
            extra.pop("add_special_tokens", None)
            cont = pre.get("continue_final_message")
            if cont is None:
                cont = prompt[-1]["role"] == "assistant"
            enc = self.tokenizer.apply_chat_template(
                list(prompt), add_generation_prompt=not cont, continue_final_message=cont, return_dict=True,
                tools=pre.get("tools"), documents=pre.get("documents"), **extra,
            )
            ids = enc["input_ids"]
            return list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)
        raise ValueError(
            "each input must be a string or a chat (a list of {'role': ..., 'content': ...} dicts), "
            f"got {type(prompt).__name__}"
        )

    def _record(self, prompt: _TextInput, out, post: dict) -> dict:
        return_tensors = post.get("return_tensors", False)
        return_text = post.get("return_text", True)
        full = post.get("return_full_text", True)
        rec: dict = {}
        if return_tensors:
            rec["generated_token_ids"] = out.prompt_token_ids + out.output_token_ids
            if not post.get("return_text"):
                return rec
        if return_text:
            text = self.tokenizer.decode(
                out.output_token_ids, skip_special_tokens=post.get("skip_special_tokens", True),
                clean_up_tokenization_spaces=post.get("clean_up_tokenization_spaces"),
            )
            if full:
                if isinstance(prompt, str):
                    text = prompt + text
                else:
                    msgs = [dict(m) for m in prompt]
                    if msgs[-1]["role"] == "assistant" and post.get("continue_final_message", None) is not False:
                        msgs[-1]["content"] = msgs[-1]["content"] + text
                        text = msgs
                    else:
                        text = msgs + [{"role": "assistant", "content": text}]
            rec["generated_text"] = text
        return rec

    def _prepare(self, prompts: Sequence[_TextInput], kwargs: dict):
        """Tokenize and validate everything before submitting anything (nothing half-submitted)."""
        call = self._split_kwargs(kwargs)
        groups = {k: {**self._init_kwargs[k], **call[k]} for k in call}
        pre, post, eng, gen = groups["pre"], groups["post"], groups["engine"], groups["gen"]
        if not isinstance(post.get("return_full_text", True), bool):
            raise ValueError(f"`return_full_text` must be True or False, got {post['return_full_text']!r}")
        stop_strings = gen.pop("stop_strings", None)
        cfg = self.resolve_generation_config(gen)
        if cfg.stop_strings and stop_strings is None:
            stop_strings = cfg.stop_strings
        nrs = cfg.num_return_sequences or 1
        if isinstance(nrs, bool) or not isinstance(nrs, int) or nrs < 1:
            raise ValueError(f"`num_return_sequences` must be an int >= 1, got {nrs!r}")
        if nrs > 1 and not cfg.do_sample:
            raise ValueError(
                "`num_return_sequences` > 1 needs `do_sample=True` (greedy decoding would return the same sequence)"
            )
        checker = self._stop_checker(stop_strings)
        priorities = eng.get("priority", 0)
        if isinstance(priorities, (list, tuple)):
            if len(priorities) != len(prompts):
                raise ValueError(f"`priority` has {len(priorities)} entries for {len(prompts)} prompts")
        else:
            priorities = [priorities] * len(prompts)
        for p in priorities:
            if isinstance(p, bool) or not isinstance(p, int):
                raise ValueError(f"`priority` must be an int or a list of ints (lower runs first), got {p!r}")
        jobs = []
        for prompt, prio in zip(prompts, priorities):
            ids = self._tokenize(prompt, pre)
            if len(ids) == 0:
                raise ValueError("a prompt tokenized to 0 tokens; give a non-empty prompt")
            sp = self._sampling_params(cfg, len(ids), eng)
            jobs.append((prompt, ids, sp, prio))
        return jobs, nrs, checker, post, eng

    def _submit_jobs(self, jobs, nrs, checker) -> list[list[RequestHandle]]:
        submitted: list[list[RequestHandle]] = []
        try:
            for prompt, ids, sp, prio in jobs:
                hs = []
                for k in range(nrs):
                    sp_k = sp if sp.seed is None else SamplingParams(**{**sp.__dict__, "seed": sp.seed + k})
                    hs.append(self.engine.submit(ids, sp_k, priority=prio, stop_checker=checker))
                submitted.append(hs)
        except BaseException:
            for hs in submitted:
                for h in hs:
                    h.cancel()
            raise
        return submitted

    # --- public calls ------------------------------------------------------------------------------
    def submit(self, prompt: _TextInput, **kwargs) -> GenerationHandle:
        """Queue one prompt without blocking; returns a ``GenerationHandle`` (iterate for text deltas)."""
        if not (isinstance(prompt, str) or _is_chat(prompt)):
            raise ValueError(
                f"`prompt` must be a string or a chat (list of role/content dicts), got {type(prompt).__name__}"
            )
        jobs, nrs, checker, post, _ = self._prepare([prompt], kwargs)
        return GenerationHandle(self, prompt, self._submit_jobs(jobs, nrs, checker)[0], post)

    def __call__(self, text_inputs, **kwargs):
        """Generate for one input or many; same inputs and output shapes as transformers' pipeline.

        Args:
            text_inputs: a string, a chat, a list of strings/chats, or an iterable (generator,
                dataset) of them.
            **kwargs: generation parameters (``max_new_tokens``, ``do_sample``, ``temperature``,
                ``top_k``, ``top_p``, ``repetition_penalty``, ``eos_token_id``, ``stop_strings``,
                ``num_return_sequences``...), ``return_full_text``, ``priority`` (int or one per
                input; lower first), ``progress_bar`` (bool; default on for several inputs).

        Returns:
            For one input, a list of ``{"generated_text": ...}`` (one per returned sequence); for
            several, a list of such lists in input order; for a generator/dataset, an iterator of them.

        Raises:
            ValueError: bad inputs or arguments (nothing is submitted then).
            EngineError: the engine failed while generating.
        """
        if isinstance(text_inputs, str) or _is_chat(text_inputs):
            return self._run([text_inputs], kwargs)[0]
        if isinstance(text_inputs, (list, tuple)):
            if len(text_inputs) == 0:
                raise ValueError("`text_inputs` is an empty list; give at least one prompt")
            return self._run(list(text_inputs), kwargs)
        if isinstance(text_inputs, Iterable) and not isinstance(text_inputs, (dict, bytes)):
            return iter(self._run(list(text_inputs), kwargs))
        raise ValueError(
            "`text_inputs` must be a string, a chat (list of role/content dicts), a list of those, or an "
            f"iterable of those; got {type(text_inputs).__name__}"
        )

    def _run(self, prompts: list, kwargs: dict) -> list[list[dict]]:
        jobs, nrs, checker, post, eng = self._prepare(prompts, kwargs)
        t0 = time.monotonic()
        submitted = self._submit_jobs(jobs, nrs, checker)
        flat = [h for hs in submitted for h in hs]
        show = eng.get("progress_bar")
        if show is None:
            show = len(prompts) > 1
        done_q: "queue.SimpleQueue[RequestHandle]" = queue.SimpleQueue()
        for h in flat:
            h.add_done_callback(done_q.put)
        tokens = 0
        bar = None
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(flat), desc="hf_contbatch", unit="req")
        try:
            for _ in range(len(flat)):
                h = done_q.get()  # blocks without spinning
                tokens += len(h.request.output_token_ids)
                if bar is not None:
                    elapsed = max(time.monotonic() - t0, 1e-9)
                    bar.set_postfix_str(f"{tokens / elapsed:.0f} tok/s", refresh=False)
                    bar.update(1)
        except KeyboardInterrupt:
            for h in flat:
                h.cancel()
            raise
        finally:
            if bar is not None:
                bar.close()
        elapsed = time.monotonic() - t0
        self.last_call_stats = {
            "num_requests": len(flat), "generated_tokens": tokens, "seconds": elapsed,
            "tokens_per_s": tokens / elapsed if elapsed else 0.0,
            "preemptions": sum(h.request.num_preemptions for h in flat),
        }
        results = []
        for (prompt, *_), hs in zip(jobs, submitted):
            results.append([self._record(prompt, h.result(), post) for h in hs])
        return results


def pipeline(task: str = "text-generation", model=None, tokenizer=None, **kwargs) -> ContinuousBatchingPipeline:
    """Like ``transformers.pipeline`` for ``task="text-generation"``, returning our pipeline.

    Raises:
        ValueError: any other task, or no model.
    """
    if task != "text-generation":
        raise ValueError(f"`task` must be 'text-generation', got {task!r}")
    if model is None:
        from .default_model import default_model_path

        model = default_model_path()
    return ContinuousBatchingPipeline(model, tokenizer, **kwargs)
