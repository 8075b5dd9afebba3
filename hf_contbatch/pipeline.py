"""``ContinuousBatchingPipeline``: the ``transformers`` text-generation pipeline's inputs and outputs,
served by the continuous-batching engine.

Inputs, generation defaults and output records follow ``transformers.TextGenerationPipeline``
(transformers 5.x): a string, a chat (list of role/content dicts), a list of either, or any iterable
of them; ``max_new_tokens``/``do_sample``/... resolved on top of the model's ``generation_config``
and the pipeline defaults (max_new_tokens=256, do_sample=True, temperature=0.7), exactly as
transformers resolves them.
"""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
import time
from collections import OrderedDict
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from .config import CacheConfig, EngineConfig, SchedulerConfig
from .engine import EngineError, LLMEngine, RequestHandle
from .reliability import check_request
from .request import Request, SamplingParams
from .streaming import text_deltas

# transformers.TextGenerationPipeline._default_generation_config
PIPELINE_GENERATION_DEFAULTS = {"max_new_tokens": 256, "do_sample": True, "temperature": 0.7}
_SAMPLING_ONLY = {"temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"}

PREPROCESS_KWARGS = (
    "prefix", "add_special_tokens", "continue_final_message", "tokenizer_encode_kwargs", "tools", "documents",
    "truncation", "padding", "handle_long_generation",
)
POSTPROCESS_KWARGS = (
    "return_full_text", "return_text", "return_tensors", "return_type", "clean_up_tokenization_spaces",
    "skip_special_tokens",
)
# batch_size/num_workers size transformers' static batches; the engine batches continuously.
ENGINE_KWARGS = ("priority", "progress_bar", "batch_size", "num_workers", "ignore_eos", "seed")
# Generation settings the engine does not implement, with the values that leave generation unchanged
# (after transformers' global defaults); any other value, from the call or from the model's
# generation_config, is rejected instead of silently ignored.
_NEUTRAL_GENERATION = {
    "num_beams": (None, 1), "num_beam_groups": (None, 1), "penalty_alpha": (None,), "dola_layers": (None,),
    "diversity_penalty": (None, 0.0), "max_time": (None,), "min_p": (None, 0.0), "top_h": (None,),
    "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
    "no_repeat_ngram_size": (None, 0), "encoder_no_repeat_ngram_size": (None, 0), "bad_words_ids": (None, []),
    "renormalize_logits": (None, False), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,), "suppress_tokens": (None, []), "begin_suppress_tokens": (None, []),
    "sequence_bias": (None, {}), "token_healing": (None, False), "guidance_scale": (None, 1.0),
    "watermarking_config": (None,), "constraints": (None, []), "force_words_ids": (None, []),
    "prompt_lookup_num_tokens": (None,), "use_mtp": (None, False), "output_scores": (None, False),
    "output_logits": (None, False), "return_dict_in_generate": (None, False),
    "output_attentions": (None, False), "output_hidden_states": (None, False),
}
# Generation parameters the engine honours; anything else a GenerationConfig knows is rejected
# with a clear error instead of being silently ignored.
SUPPORTED_GENERATION_KWARGS = (
    "max_new_tokens", "max_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "repetition_penalty", "eos_token_id", "pad_token_id", "bos_token_id", "stop_strings",
    "num_return_sequences", "generation_config", "min_length",
)

Chat = list  # a list of {"role": ..., "content": ...} dicts

_TextInput = Union[str, Chat]


def _as_device(device) -> Optional[torch.device]:
    """transformers' pipeline device convention: -1 is CPU, an int >= 0 an accelerator index."""
    if device is None or isinstance(device, torch.device):
        return device
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            return torch.device("cpu")
        return torch.device(f"cuda:{device}" if torch.cuda.is_available() else f"{_accelerator_type()}:{device}")
    if isinstance(device, str):
        return torch.device(device)
    raise ValueError(f"`device` must be an int, a string or a torch.device, got {device!r}")


def _accelerator_type() -> str:
    acc = getattr(torch, "accelerator", None)
    dev = acc.current_accelerator() if acc is not None and acc.is_available() else None
    return dev.type if dev is not None else "cuda"


def resolve_generate_config(model, generation_config: Optional[GenerationConfig] = None, **kwargs) -> GenerationConfig:
    """The config ``model.generate(generation_config=..., **kwargs)`` would run with: the kwargs over
    the given config over the model's generation config over transformers' global defaults.

    Raises:
        ValueError: a setting the engine does not implement (beam search, min_p, bad_words_ids...)
            has a non-neutral value; the message says whether the call or the model set it.
    """
    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is not None:
        cfg, _ = prepare(copy.deepcopy(generation_config) if generation_config is not None else None, **kwargs)
    else:  # the same rule, for a transformers without the helper
        cfg = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
        cfg.update(**model.generation_config.to_dict(), defaults_only=True)
        cfg.update(**cfg._get_default_generation_params(), defaults_only=True)
        cfg.update(**kwargs)
    for name, neutral in _NEUTRAL_GENERATION.items():
        value = getattr(cfg, name, None)
        if value not in neutral:
            source = "this call" if name in kwargs or (generation_config is not None and name in generation_config.to_diff_dict()) else "the model's generation_config"
            raise ValueError(
                f"generation setting `{name}`={value!r} (from {source}) is not supported by hf_contbatch; "
                f"supported: {', '.join(SUPPORTED_GENERATION_KWARGS)}"
            )
    return cfg


def sampling_params_from_config(
    cfg: GenerationConfig, prompt_len: int, *, ignore_eos: bool = False, seed: Optional[int] = None, prefix_len: int = 0
) -> SamplingParams:
    """The engine's ``SamplingParams`` for a resolved generation config and a ``prompt_len``-token prompt.

    ``prefix_len``: tokens of the pipeline ``prefix`` in the prompt, which transformers adds to
    ``max_length``/``min_length`` (they count the user's text, not the prefix).

    Raises:
        ValueError: a parameter out of range, or ``max_length`` leaving no room for new tokens.
    """
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
        max_new = cfg.max_length + prefix_len - prompt_len
        if max_new < 1:
            raise ValueError(
                f"`max_length`={cfg.max_length} leaves no room after a {prompt_len}-token prompt; use `max_new_tokens` >= 1"
            )
    check_int("max_new_tokens", max_new, 1)
    min_new = cfg.min_new_tokens or 0
    check_int("min_new_tokens", min_new, 0)
    if cfg.min_length:  # MinLengthLogitsProcessor, as a count of new tokens
        check_int("min_length", cfg.min_length, 0)
        min_new = max(min_new, cfg.min_length + prefix_len - prompt_len)
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
    if seed is not None:
        check_int("seed", seed, 0)
    return SamplingParams(
        max_new_tokens=max_new, min_new_tokens=min_new, do_sample=do_sample, temperature=float(temperature),
        top_k=top_k, top_p=top_p, repetition_penalty=rp, eos_token_ids=() if ignore_eos else eos_ids,
        ignore_eos=ignore_eos, seed=seed,
    )


def _resolve_return_type(post: dict) -> dict:
    """``return_full_text`` / ``return_text`` / ``return_tensors`` / ``return_type`` to one
    ``return_type`` ("full_text", "new_text" or "tensors"), with transformers' exclusivity rules
    and quirks (``return_text`` alone keeps the default; any ``return_tensors`` value selects tensors)."""
    post = dict(post)
    full, tensors, text = post.pop("return_full_text", None), post.pop("return_tensors", None), post.pop("return_text", None)
    return_type = post.pop("return_type", None)
    if return_type is not None:
        name = getattr(return_type, "name", return_type)
        return_type = str(name).lower()
        if return_type not in ("full_text", "new_text", "tensors"):
            raise ValueError(f"`return_type` must be 'full_text', 'new_text', 'tensors' or a transformers ReturnType, got {name!r}")
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


def _is_chat(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, dict) and "role" in m for m in x)


_INT_KWARGS = ("max_new_tokens", "min_new_tokens", "max_length", "top_k", "num_return_sequences")
_FLOAT_KWARGS = ("temperature", "top_p", "repetition_penalty")


def _check_generation_kwarg_types(kwargs: dict) -> None:
    """Type errors named by argument, before GenerationConfig turns them into TypeErrors."""
    for key in _INT_KWARGS:
        v = kwargs.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"`{key}` must be an int, got {v!r}")
    for key in _FLOAT_KWARGS:
        v = kwargs.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"`{key}` must be a number, got {v!r}")
    v = kwargs.get("do_sample")
    if v is not None and not isinstance(v, bool):
        raise ValueError(f"`do_sample` must be True or False, got {v!r}")


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
        try:
            for h in self.handles:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                outs.append(h.result(left))
        except KeyboardInterrupt:
            self._pipe.engine.cancel_now(self.handles)  # all sequences of this prompt, not only the one waited on
            raise
        except EngineError as exc:
            exc.partial_results = self._pipe._records_or_partial(self.prompt, self.handles, self._post)
            raise
        return [self._pipe._record(self.prompt, o, self._post) for o in outs]

    def finish_reasons(self) -> list[Optional[str]]:
        return [h.request.finish_reason for h in self.handles]

    # --- streaming ---------------------------------------------------------------------------------
    def stream(self, index: int = 0) -> Iterator[str]:
        """Text deltas of sequence ``index`` as its tokens arrive (blocking iterator).

        Deltas never split a multi-byte character and never contain any part of a stop string: text
        that could still become one is held back, and the stream ends before the stop string (the
        final ``generated_text`` keeps it, as transformers does). Without stop strings the deltas
        concatenate to the sequence's new text. Each sequence can be streamed once.

        Raises:
            EngineError: the engine failed the request.
            KeyboardInterrupt: interrupted while waiting; this sequence is cancelled first.
        """
        handle = self.handles[index]
        try:
            yield from text_deltas(
                handle.token_stream(), self._pipe.tokenizer, stop_strings=self._post.get("_stop_strings"),
                skip_special_tokens=self._pipe._skip_special_tokens(self._post),
                clean_up_tokenization_spaces=self._post.get("clean_up_tokenization_spaces"),
            )
        except KeyboardInterrupt:  # a Stop pressed while the stream waits: this sequence only
            self._pipe.engine.cancel_now([handle])
            raise
        handle.result()  # surfaces an engine error instead of ending the stream silently

    def __iter__(self) -> Iterator[str]:
        """Text deltas of the first sequence (see ``stream``)."""
        return self.stream(0)

    async def astream(self, index: int = 0):
        """``async for delta in handle.astream()``: ``stream(index)`` for asyncio code and notebooks.

        A helper thread waits on the engine so the event loop never blocks.
        """
        loop = asyncio.get_running_loop()
        deltas: "asyncio.Queue[tuple[Optional[str], Optional[BaseException]]]" = asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(deltas.put_nowait, item)
            except RuntimeError:  # the loop closed while we were still streaming
                pass

        def pump() -> None:
            try:
                for delta in self.stream(index):
                    put((delta, None))
                put((None, None))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
                put((None, exc))

        threading.Thread(target=pump, name="hf_contbatch-astream", daemon=True).start()
        while True:
            delta, exc = await deltas.get()
            if exc is not None:
                raise exc
            if delta is None:
                return
            yield delta

    async def aresult(self) -> list[dict]:
        """``await handle.aresult()``: ``result()`` without blocking the event loop."""
        loop = asyncio.get_running_loop()
        futures = []
        for h in self.handles:
            fut = loop.create_future()

            def done(_h, fut=fut) -> None:
                try:
                    loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))
                except RuntimeError:
                    pass

            h.add_done_callback(done)
            futures.append(fut)
        await asyncio.gather(*futures)
        return self.result()


class ContinuousBatchingPipeline:
    """Drop-in for ``transformers.pipeline("text-generation")`` with continuous batching.

    Args:
        model: a ``PreTrainedModel`` or a name/path for ``AutoModelForCausalLM.from_pretrained``.
        tokenizer: a tokenizer or name/path; defaults to the model's.
        engine_config: full engine configuration; or give ``cache_config`` / ``scheduler_config``.
        dtype: load dtype when ``model`` is a name ("auto", "float32", a ``torch.dtype``...).
        device: the model's device ("cpu", "cuda", 0, -1 for CPU, a ``torch.device``): a model loaded
            here is put there, a given model is moved there unless it was dispatched by ``device_map``
            (as transformers' pipeline does).
        device_map: load a named model with this ``device_map`` (e.g. "auto"); each layer's KV pool
            then lives on that layer's device.
        **kwargs: generation parameters used as call defaults (like transformers' pipeline), and
            transformers pipeline plumbing (``task``, ``framework``...) which is accepted and ignored.

    ``transformers.pipeline("text-generation", model=..., pipeline_class=ContinuousBatchingPipeline)``
    builds this class with transformers' own loading (it reads the ``_load_*`` flags below), and
    ``hf_contbatch.register_pipeline()`` adds a task name for it.

    Raises:
        ValueError: an unsupported model family or bad configuration.
    """

    task = "text-generation"
    # Read by transformers.pipeline(..., pipeline_class=...): which components it loads for us.
    _load_tokenizer = True
    _load_processor = False
    _load_image_processor = False
    _load_video_processor = False
    _load_feature_extractor = False

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
        device_map=None,
        **kwargs,
    ) -> None:
        for plumbing in ("task", "framework", "binary_output", "feature_extractor", "image_processor",
                         "processor", "video_processor", "model_card", "args_parser", "torch_dtype", "num_workers"):
            value = kwargs.pop(plumbing, None)
            if plumbing == "torch_dtype" and dtype is None:
                dtype = value
            if plumbing == "task" and value is not None:
                self.task = value
        if kwargs.get("model_kwargs") is not None and not isinstance(kwargs["model_kwargs"], dict):
            raise ValueError(f"`model_kwargs` must be a dict, got {type(kwargs['model_kwargs']).__name__}")
        model_kwargs = dict(kwargs.pop("model_kwargs", None) or {})
        device = _as_device(device)
        if isinstance(model, str):
            model_id = model
            if device_map is not None:
                model_kwargs["device_map"] = device_map
            model_kwargs.setdefault("dtype", dtype if dtype is not None else "auto")
            model = AutoModelForCausalLM.from_pretrained(model_id, **model_kwargs)
            if tokenizer is None:
                tokenizer = model_id
        elif device_map is not None:
            raise ValueError("`device_map` applies when `model` is a name or path; dispatch a loaded model yourself")
        if device is not None and getattr(model, "hf_device_map", None) is None and model.device != device:
            model = model.to(device)
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
        prefix = getattr(model.config, "prefix", None)
        if prefix is not None and "prefix" not in kwargs:
            kwargs["prefix"] = prefix  # transformers' pipeline takes the model's prompt prefix by default
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
                raise ValueError(
                    f"unknown argument `{key}`; allowed: generation parameters "
                    f"({', '.join(SUPPORTED_GENERATION_KWARGS)}), preprocessing ({', '.join(PREPROCESS_KWARGS)}), "
                    f"postprocessing ({', '.join(POSTPROCESS_KWARGS)}), engine ({', '.join(ENGINE_KWARGS)})"
                )
        if "stop_sequence" in kwargs:
            # transformers' pipeline (5.x) passes stop_sequence to generate as stop_strings
            stop = kwargs["stop_sequence"]
            groups["gen"]["stop_strings"] = [stop] if isinstance(stop, str) else stop
        groups["post"] = _resolve_return_type(groups["post"])
        return groups

    def resolve_generation_config(self, gen_kwargs: dict) -> GenerationConfig:
        """The generation config ``generate`` runs with under transformers' text-generation pipeline.

        As ``Pipeline._prepare_generate_kwargs`` then ``generate`` do: the pipeline defaults
        (max_new_tokens=256, do_sample=True, temperature=0.7; the sampling ones only when sampling)
        for what neither the call nor the model's generation config sets, then the call's parameters
        over the model's generation config over transformers' global defaults (e.g. top_k=50).

        Raises:
            ValueError: a setting the engine does not implement has a non-neutral value.
        """
        gen_kwargs = dict(gen_kwargs)
        _check_generation_kwarg_types(gen_kwargs)
        user_config = gen_kwargs.pop("generation_config", None)
        if user_config is not None and not isinstance(user_config, GenerationConfig):
            raise ValueError(f"`generation_config` must be a transformers.GenerationConfig, got {type(user_config).__name__}")
        set_params = {**self.model.generation_config.to_diff_dict(), **(user_config.to_diff_dict() if user_config else {}), **gen_kwargs}
        added = {
            k: v for k, v in PIPELINE_GENERATION_DEFAULTS.items()
            if k not in set_params and not (k == "max_new_tokens" and "max_length" in set_params)
        }
        if self.tokenizer is not None and self.tokenizer.pad_token_id is not None and "pad_token_id" not in set_params:
            added["pad_token_id"] = self.tokenizer.pad_token_id
        if not {**set_params, **added}.get("do_sample"):
            added = {k: v for k, v in added.items() if k not in _SAMPLING_ONLY}
        if user_config is None:
            return resolve_generate_config(self.model, None, **{**gen_kwargs, **added})
        user_config = copy.deepcopy(user_config)
        user_config.update(**added)
        return resolve_generate_config(self.model, user_config, **gen_kwargs)

    def _sampling_params(self, cfg: GenerationConfig, prompt_len: int, engine_kw: dict, prefix_len: int = 0) -> SamplingParams:
        return sampling_params_from_config(
            cfg, prompt_len, ignore_eos=bool(engine_kw.get("ignore_eos", False)), seed=engine_kw.get("seed"),
            prefix_len=prefix_len,
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
        # As TextGenerationPipeline.preprocess: only the set tokenizer arguments, then tokenizer_encode_kwargs.
        extra = {k: pre[k] for k in ("add_special_tokens", "truncation", "padding", "max_length") if pre.get(k) is not None}
        extra.update(pre.get("tokenizer_encode_kwargs") or {})
        if isinstance(prompt, str):
            return list(self.tokenizer(pre.get("prefix", "") + prompt, **extra)["input_ids"])
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

    def _keep_hole(self, ids: list[int], cfg: GenerationConfig) -> list[int]:
        """``handle_long_generation="hole"``: drop prompt tokens from the left so the prompt plus the
        new tokens fit ``tokenizer.model_max_length`` (as transformers does)."""
        new_tokens = cfg.max_new_tokens if cfg.max_new_tokens is not None else cfg.max_length - len(ids)
        if new_tokens < 0:
            raise ValueError("We cannot infer how many new tokens are expected")
        limit = self.tokenizer.model_max_length
        if len(ids) + new_tokens > limit:
            keep = limit - new_tokens
            if keep <= 0:
                raise ValueError(
                    "We cannot use `hole` to handle this generation the number of desired tokens exceeds the models max length"
                )
            ids = ids[-keep:]
        return ids

    def _prefix_length(self, pre: dict) -> int:
        """Tokens transformers counts for ``prefix`` (tokenized without special tokens unless asked)."""
        prefix = pre.get("prefix")
        if not prefix:
            return 0
        return len(self.tokenizer(prefix, add_special_tokens=bool(pre.get("add_special_tokens", False)))["input_ids"])

    def _skip_special_tokens(self, post: dict) -> bool:
        if getattr(self.tokenizer, "response_template", None):
            return False  # as transformers: the response parser needs the special tokens
        skip = post.get("skip_special_tokens")
        return True if skip is None else skip

    def _record(self, prompt: _TextInput, out, post: dict) -> dict:
        """One output record, as ``TextGenerationPipeline.postprocess`` builds it."""
        return_type = post.get("return_type", "full_text")
        if return_type == "tensors":
            return {"generated_token_ids": out.prompt_token_ids + out.output_token_ids}
        skip = self._skip_special_tokens(post)
        clean = post.get("clean_up_tokenization_spaces")
        text = self.tokenizer.decode(out.output_token_ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean)
        if return_type == "full_text":
            if isinstance(prompt, str):
                text = prompt + text
            else:
                msgs = [dict(m) for m in prompt]
                cont = post.get("continue_final_message")
                if cont is None:
                    cont = msgs[-1]["role"] == "assistant"
                if cont:
                    msgs[-1]["content"] = msgs[-1]["content"] + text
                    text = msgs
                elif getattr(self.tokenizer, "response_template", None) is not None:
                    prompt_text = self.tokenizer.decode(
                        out.prompt_token_ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean
                    )
                    text = msgs + [self.tokenizer.parse_response(text, prefix=prompt_text, tools=post.get("tools"))]
                else:
                    text = msgs + [{"role": "assistant", "content": text}]
        return {"generated_text": text}

    def _prepare(self, prompts: Sequence[_TextInput], kwargs: dict):
        """Tokenize and validate everything before submitting anything (nothing half-submitted)."""
        call = self._split_kwargs(kwargs)
        groups = {k: {**self._init_kwargs[k], **call[k]} for k in call}
        if "generation_config" in call["gen"]:
            groups["gen"] = dict(call["gen"])  # as transformers: a call's generation_config replaces init parameters
        pre, post, eng, gen = groups["pre"], groups["post"], groups["engine"], groups["gen"]
        if pre.get("handle_long_generation") not in (None, "hole"):
            raise ValueError(
                f"{pre['handle_long_generation']} is not a valid value for `handle_long_generation` parameter expected [None, 'hole']"
            )
        if pre.get("continue_final_message") is not None:
            post["continue_final_message"] = pre["continue_final_message"]
        stop_strings = gen.pop("stop_strings", None)
        cfg = self.resolve_generation_config(gen)
        if cfg.stop_strings and stop_strings is None:
            stop_strings = cfg.stop_strings
        post["_stop_strings"] = [stop_strings] if isinstance(stop_strings, str) else stop_strings
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
        prefix_len = self._prefix_length(pre) if cfg.max_new_tokens is None or cfg.min_length else 0
        jobs = []
        for prompt, prio in zip(prompts, priorities):
            ids = self._tokenize(prompt, pre)
            if len(ids) == 0:
                raise ValueError("a prompt tokenized to 0 tokens; give a non-empty prompt")
            if pre.get("handle_long_generation") == "hole":
                ids = self._keep_hole(ids, cfg)
            sp = self._sampling_params(cfg, len(ids), eng, prefix_len=prefix_len)
            check_request(ids, sp, self.engine.vocab_size)  # every prompt checked before any is submitted
            jobs.append((prompt, ids, sp, prio))
        return jobs, nrs, checker, post, eng

    def _submit_jobs(self, jobs, nrs, checker) -> list[list[RequestHandle]]:
        submitted: list[list[RequestHandle]] = []
        try:
            for prompt, ids, sp, prio in jobs:
                # One engine request forked after prefill: the prompt's KV is computed once and
                # shared; sequence k samples with seed + k when a seed is set.
                submitted.append(
                    self.engine.submit(ids, sp, priority=prio, stop_checker=checker, num_return_sequences=nrs)
                )
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

    async def astream(self, prompt: _TextInput, **kwargs):
        """``async for delta in pipe.astream(prompt, max_new_tokens=...)``: submit one prompt and
        stream its text deltas (see ``GenerationHandle.stream``); leaving the loop early cancels it."""
        handle = self.submit(prompt, **kwargs)
        finished = False
        try:
            async for delta in handle.astream():
                yield delta
            finished = True
        finally:
            if not finished:
                handle.cancel()

    def _call_with_streamer(self, text_inputs, streamer, kwargs: dict) -> list[dict]:
        """``streamer=`` as ``generate`` feeds it: the prompt ids (``[1, L]``) first, then each new
        token (``[1]``), then ``end()``; one prompt and one sequence only, as in transformers."""
        if isinstance(text_inputs, (list, tuple)) and len(text_inputs) == 1 and not _is_chat(text_inputs):
            return [self._call_with_streamer(text_inputs[0], streamer, kwargs)]
        if not (isinstance(text_inputs, str) or _is_chat(text_inputs)):
            raise ValueError("`streamer` works with a single prompt (a string or a chat), as in transformers' generate")
        handle = self.submit(text_inputs, **kwargs)
        try:
            if len(handle.handles) != 1:
                raise ValueError("`streamer` needs num_return_sequences=1, as in transformers' generate")
            streamer.put(torch.tensor([handle.handles[0].request.prompt_token_ids]))
            for new in handle.handles[0].token_stream():
                for token in new:
                    streamer.put(torch.tensor([token]))
        except BaseException:  # the streamer raised, or an interrupt: this request only
            self.engine.cancel_now(handle.handles)
            raise
        finally:
            streamer.end()  # a TextIteratorStreamer consumer must never hang
        return handle.result()

    def __call__(self, text_inputs, **kwargs):
        """Generate for one input or many; same inputs and output shapes as transformers' pipeline.

        Args:
            text_inputs: a string, a chat, a list of strings/chats, or an iterable (generator,
                dataset) of them.
            **kwargs: generation parameters (``max_new_tokens``, ``do_sample``, ``temperature``,
                ``top_k``, ``top_p``, ``repetition_penalty``, ``eos_token_id``, ``stop_strings``,
                ``num_return_sequences``...), ``return_full_text``, ``priority`` (int or one per
                input; lower first), ``progress_bar`` (bool; default on for several inputs),
                ``streamer`` (a transformers ``TextStreamer``/``TextIteratorStreamer``; one prompt),
                ``prefix``, ``stop_sequence``, ``continue_final_message``, ``return_tensors``,
                ``return_text``, ``handle_long_generation`` as in transformers.

        Returns:
            For one input, a list of ``{"generated_text": ...}`` (one per returned sequence); for
            several, a list of such lists in input order; for a generator/dataset, an iterator of them.

        Raises:
            ValueError: bad inputs or arguments, token ids outside the model's vocabulary (a
                tokenizer with added tokens and no ``resize_token_embeddings``); nothing is
                submitted then.
            EngineError: the engine failed one of this call's requests. The others ran to the end;
                ``exc.partial_results`` is what the call would have returned, the failed
                sequence's text cut where it failed.
            KeyboardInterrupt: interrupted (Ctrl-C, a notebook's Stop button): this call's requests
                are cancelled and their blocks freed before it propagates; requests submitted
                elsewhere keep running.
        """
        streamer = kwargs.pop("streamer", None)
        if streamer is not None:
            return self._call_with_streamer(text_inputs, streamer, kwargs)
        if isinstance(text_inputs, str) or _is_chat(text_inputs):
            try:
                return self._run([text_inputs], kwargs)[0]
            except EngineError as exc:
                if getattr(exc, "partial_results", None):
                    exc.partial_results = exc.partial_results[0]  # the shape a one-prompt call returns
                raise
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
        finished = 0

        def record(h: RequestHandle) -> None:
            nonlocal tokens, finished
            finished += 1
            tokens += len(h.request.output_token_ids)
            if bar is not None:
                elapsed = max(time.monotonic() - t0, 1e-9)
                bar.set_postfix_str(f"{tokens / elapsed:.0f} tok/s", refresh=False)
                bar.update(1)

        def drain() -> None:
            while True:
                try:
                    record(done_q.get_nowait())
                except queue.Empty:
                    return

        try:
            if self.engine.drives_callers:
                # This thread runs the iterations (faster than a second thread on CPU).
                self.engine.drive(lambda: all(h.done() for h in flat), after_iteration=drain)
                drain()
            while finished < len(flat):
                record(done_q.get())  # blocks without spinning
        except KeyboardInterrupt:
            # This call's requests only: requests submitted elsewhere keep running.
            self.engine.cancel_now(flat)
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
        results = [self._records_or_partial(prompt, hs, post) for (prompt, *_), hs in zip(jobs, submitted)]
        failed = [h for h in flat if h.request.error is not None]
        if failed:
            try:
                failed[0].result()
            except EngineError as exc:  # the others completed: their records travel with the error
                exc.partial_results = results
                raise
        return results

    def _records_or_partial(self, prompt, handles: Sequence[RequestHandle], post: dict) -> list[dict]:
        """The records of finished handles; a failed one's record holds the text it had generated."""
        return [self._record(prompt, h.output(), post) for h in handles]


def pipeline(task: str = "text-generation", model=None, tokenizer=None, **kwargs) -> ContinuousBatchingPipeline:
    """Like ``transformers.pipeline`` for ``task="text-generation"``, returning our pipeline.

    Raises:
        ValueError: any other task, or no model.
    """
    from .integrations.transformers import TASK_NAME

    if task not in ("text-generation", TASK_NAME):
        raise ValueError(f"`task` must be 'text-generation' (or {TASK_NAME!r}), got {task!r}")
    if model is None:
        from .default_model import default_model_path

        model = default_model_path()
    return ContinuousBatchingPipeline(model, tokenizer, **kwargs)
