"""``ContinuousBatchingPipeline``: the ``transformers`` text-generation pipeline's inputs and outputs,
served by the continuous-batching engine.

Inputs, generation defaults and output records follow ``transformers.TextGenerationPipeline``
(transformers 5.x): a string, a chat (list of role/content dicts), a list of either, or any iterable
of them; ``max_new_tokens``/``do_sample``/... resolved on top of the model's ``generation_config``
and the pipeline defaults (max_new_tokens=256, do_sample=True, temperature=0.7), exactly as
transformers resolves them (``generation_args``).

A call reads top to bottom: ``__call__`` -> ``_run`` -> ``CallRequestBuilder.prepare`` (every
prompt tokenized and its request built and validated by the engine; ``call_requests``) ->
``LLMEngine.enqueue`` (all at once) -> ``progress.wait_for`` (this thread drives the engine) ->
output records (``text_io``). ``submit`` takes the same path for one prompt and returns a
``GenerationHandle`` (``generation_handle``) instead of waiting.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable, Iterator, Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from ..config import CacheConfig, EngineConfig, SchedulerConfig, is_int, quant_scheme
from ..engine.handles import EngineError
from ..engine.llm_engine import LLMEngine
from ..request import LatencySamples, RequestMetrics
from .call_requests import CallRequestBuilder
from .generation_args import (  # noqa: F401  (re-exported: their former home)
    ENGINE_KWARGS,
    PIPELINE_GENERATION_DEFAULTS,
    POSTPROCESS_KWARGS,
    PREPROCESS_KWARGS,
    SUPPORTED_GENERATION_KWARGS,
    check_engine_flags,
    check_generation_kwarg_types,
    resolve_generate_config,
    resolve_pipeline_generation_config,
    sampling_params_from_config,
    split_call_kwargs,
)
from .generation_handle import GenerationHandle, records_so_far
from .progress import wait_for
from .quiet_imports import quiet_optional_import_notices
from .streamed_call import StreamedCall, call_level_kwargs, in_flight_limit, is_indexed_dataset
from .text_io import TextInput, is_chat

TASK_NAME = "continuous-batching-text-generation"  # the task ``register_pipeline()`` adds to transformers


def _as_device(device) -> Optional[torch.device]:
    """transformers' pipeline device convention: -1 is CPU, an int >= 0 an accelerator index."""
    if device is None or isinstance(device, torch.device):
        return device
    if is_int(device):
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


class CallStats(dict):
    """``pipe.last_call_stats``: the latest blocking call's figures, a plain ``dict`` with exact values.

    Keys: ``num_requests`` (sequences the call ran), ``generated_tokens``, ``seconds`` (wall time of
    the call, tokenizing to the last token), ``tokens_per_s`` (generated tokens / seconds),
    ``preemptions`` (times its requests were preempted), ``ttft_s`` (time to first token) and
    ``itl_s`` (inter-token latency: seconds per output token after the first), the medians over the
    call's sequences (for one prompt, its own figures; None without a value: ITL needs two tokens;
    each sequence's are in ``RequestOutput.metrics``). Only the repr (what ``print`` and a notebook
    cell show) rounds: seconds to milliseconds, rates to one decimal.
    """

    def __repr__(self) -> str:
        def short(key, value) -> str:
            if not isinstance(value, float):
                return repr(value)
            return f"{value:.1f}" if key.endswith("_per_s") else f"{value:.3f}"

        return "{" + ", ".join(f"{key!r}: {short(key, value)}" for key, value in self.items()) + "}"

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        """IPython's display (a cell's last expression): the same rounded text as ``repr``."""
        printer.text(repr(self))


class ContinuousBatchingPipeline:
    """Drop-in for ``transformers.pipeline("text-generation")`` with continuous batching.

    Args:
        model: a ``PreTrainedModel`` or a name/path for ``AutoModelForCausalLM.from_pretrained``; or a
            ``peft.PeftModel``, whose loaded LoRA adapters serve requests side by side (``adapter_names``).
        tokenizer: a tokenizer or name/path; defaults to the model's.
        engine_config: full engine configuration; or give ``cache_config`` / ``scheduler_config``.
        quantization: ``EngineConfig.quantization`` ("int8": weight-only int8 linears; "w8a8": int8
            weights and activations), with either.
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
        quantization: Optional[str] = None,
        dtype=None,
        device=None,
        device_map=None,
        **kwargs,
    ) -> None:
        for plumbing in (
            "task",
            "framework",
            "binary_output",
            "feature_extractor",
            "image_processor",
            "processor",
            "video_processor",
            "model_card",
            "args_parser",
            "torch_dtype",
            "num_workers",
        ):
            value = kwargs.pop(plumbing, None)
            if plumbing == "torch_dtype" and dtype is None:
                dtype = value
            if plumbing == "task" and value is not None:
                self.task = value
        if kwargs.get("model_kwargs") is not None and not isinstance(kwargs["model_kwargs"], dict):
            raise ValueError(f"`model_kwargs` must be a dict, got {type(kwargs['model_kwargs']).__name__}")
        model_kwargs = dict(kwargs.pop("model_kwargs", None) or {})
        _check_config_types(engine_config, cache_config, scheduler_config)
        _check_dtype(dtype)
        device = _as_device(device)
        if isinstance(model, str):
            model_id = model
            if device_map is not None:
                model_kwargs["device_map"] = device_map
            model_kwargs.setdefault("dtype", dtype if dtype is not None else "auto")
            with quiet_optional_import_notices():  # torchao's CPU-machine notices (quiet_imports)
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
            engine_config = EngineConfig(
                cache=cache_config or CacheConfig(), scheduler=scheduler_config or SchedulerConfig()
            )
        elif cache_config is not None or scheduler_config is not None:
            raise ValueError("pass either `engine_config` or `cache_config`/`scheduler_config`, not both")
        if quantization is not None:  # EngineConfig.quantization, spelled as a pipeline argument
            if engine_config.quant_scheme not in (None, quant_scheme(quantization)):
                raise ValueError(
                    f"`quantization={quantization!r}` disagrees with `engine_config.quantization="
                    f"{engine_config.quantization!r}`; pass one"
                )
            engine_config = dataclasses.replace(engine_config, quantization=quantization)
        prefix = getattr(model.config, "prefix", None)
        if prefix is not None and "prefix" not in kwargs:
            kwargs["prefix"] = prefix  # transformers' pipeline takes the model's prompt prefix by default
        init_kwargs = split_call_kwargs(kwargs)  # bad arguments raise before the engine changes the model
        # Values wrong whatever a call adds (temperature=-1, progress_bar="x") fail here, once, not in
        # every call; defaults a call may override (a max_new_tokens too long for the pool, the model's
        # generation_config) are checked per call, as transformers' pipeline does.
        check_generation_kwarg_types(init_kwargs["gen"])
        check_engine_flags(init_kwargs["engine"])
        self.engine = LLMEngine(model, engine_config, tokenizer=tokenizer)
        self._call_requests = CallRequestBuilder(self.engine, tokenizer, init_kwargs)
        self.last_call_stats = CallStats()  # filled by each blocking call

    # --- context management ----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine thread, free the KV pool and restore the model's attention. The pipeline
        cannot generate afterwards (calls raise ``RuntimeError``); build a new one."""
        self.engine.close()

    def _check_open(self) -> None:
        if self.engine.closed:
            raise RuntimeError(
                "this pipeline is closed (close() ran, or its `with` block ended) and cannot generate: "
                'build a new pipeline, e.g. hf_contbatch.pipeline("text-generation", model=...)'
            )

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
        """A live ipywidgets view of blocks and queues (see ``hf_contbatch.frontends.dashboard``)."""
        from .dashboard import Dashboard

        return Dashboard(self, **kwargs)

    # --- argument handling -------------------------------------------------------------------------
    def resolve_generation_config(self, gen_kwargs: dict) -> GenerationConfig:
        """The generation config ``generate`` runs with under transformers' text-generation pipeline
        for these generation arguments (see ``generation_args.resolve_pipeline_generation_config``).

        Raises:
            ValueError: a setting the engine does not implement has a non-neutral value.
        """
        return resolve_pipeline_generation_config(self.model, self.tokenizer, gen_kwargs)

    # --- public calls ------------------------------------------------------------------------------
    def submit(self, prompt: TextInput, **kwargs) -> GenerationHandle:
        """Queue one prompt without blocking; returns a ``GenerationHandle`` (iterate for text deltas).

        Raises:
            ValueError: a bad prompt or argument; nothing is queued then.
            RuntimeError: the pipeline is closed.
        """
        self._check_open()
        if not (isinstance(prompt, str) or is_chat(prompt)):
            raise ValueError(
                f"`prompt` must be a string or a chat (list of role/content dicts), got {type(prompt).__name__}"
            )
        call = self._call_requests.prepare([prompt], kwargs)
        return GenerationHandle(self, prompt, self.engine.enqueue(call.requests)[0], call.output)

    async def astream(self, prompt: TextInput, **kwargs):
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
        if isinstance(text_inputs, (list, tuple)) and len(text_inputs) == 1 and not is_chat(text_inputs):
            return [self._call_with_streamer(text_inputs[0], streamer, kwargs)]
        if not (isinstance(text_inputs, str) or is_chat(text_inputs)):
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
            self.engine.driver.cancel_now(handle.handles)
            raise
        finally:
            streamer.end()  # a TextIteratorStreamer consumer must never hang
        return handle.result()

    def __call__(self, text_inputs, **kwargs):
        """Generate for one input or many; same inputs and output shapes as transformers' pipeline.

        Args:
            text_inputs: a string, a chat, a list of strings/chats, or any other iterable of them
                (a generator, a ``datasets`` column such as ``ds["text"]``, ``KeyDataset(ds, "text")``
                or another torch ``Dataset`` with ``__getitem__``/``__len__``), pulled lazily.
            **kwargs: generation parameters (``max_new_tokens``, ``do_sample``, ``temperature``,
                ``top_k``, ``top_p``, ``repetition_penalty``, ``eos_token_id``, ``stop_strings``,
                ``num_return_sequences``...; ``max_new_tokens`` may also be a list, one per input),
                ``return_full_text``, ``priority`` (int or one per input; lower first), ``progress_bar`` (bool; default on for several inputs),
                ``adapter_names`` (a ``peft.PeftModel``'s LoRA adapter: one name, or one per input;
                ``"__base__"`` for the base model; default: the model's active adapter),
                ``response_format`` / ``structured_outputs`` (output constrained to a JSON schema, regex,
                choice or grammar; one value or one per input; see ``frontends.response_format``),
                ``streamer`` (a transformers ``TextStreamer``/``TextIteratorStreamer``; one prompt),
                ``prefix``, ``stop_sequence``, ``continue_final_message``, ``return_tensors``,
                ``return_text``, ``handle_long_generation`` as in transformers. ``batch_size``
                (int >= 1) is, for us, the most prompts in flight: pulled from the input and not
                yet returned (queued, running, or finished behind an earlier one still running);
                the engine still batches continuously up to ``max_num_seqs``. Without it an
                iterable input keeps ``4 * max_num_seqs`` in flight and a list is queued whole.

        Returns:
            As transformers' pipeline: for one input, a list of ``{"generated_text": ...}`` (one
            per returned sequence); for a list or tuple, a list of such lists in input order; for
            any other iterable or dataset, a generator of them in input order, each yielded as soon
            as it and every input before it are done (``streamed_call.StreamedCall``). Leaving the
            generator early (``break``, ``close()``) cancels the call's requests still in flight.

        Raises:
            ValueError: bad inputs or arguments, token ids outside the model's vocabulary (a
                tokenizer with added tokens and no ``resize_token_embeddings``); nothing is
                submitted then. From a generator: the message starts ``input i:`` naming the bad
                element; the records before it were yielded and the requests in flight cancelled.
            RuntimeError: the pipeline is closed (``close()`` ran, or its ``with`` block ended).
            EngineError: the engine failed one of this call's requests. The others ran to the end;
                ``exc.partial_results`` is what the call would have returned, the failed
                sequence's text cut where it failed.
            KeyboardInterrupt: interrupted (Ctrl-C, a notebook's Stop button): this call's requests
                are cancelled and their blocks freed before it propagates; requests submitted
                elsewhere keep running.
        """
        self._check_open()
        streamer = kwargs.pop("streamer", None)
        if streamer is not None:
            return self._call_with_streamer(text_inputs, streamer, kwargs)
        if isinstance(text_inputs, str) or is_chat(text_inputs):
            try:
                return self._run([text_inputs], kwargs)[0]
            except EngineError as exc:
                if getattr(exc, "partial_results", None):
                    exc.partial_results = exc.partial_results[0]  # the shape a one-prompt call returns
                raise
        if isinstance(text_inputs, (list, tuple)):
            if len(text_inputs) == 0:
                raise ValueError("`text_inputs` is an empty list; give at least one prompt")
            if self._call_default(kwargs, "batch_size") is not None:  # a bounded number in flight
                return list(self._stream(text_inputs, kwargs))
            return self._run(list(text_inputs), kwargs)
        if (isinstance(text_inputs, Iterable) and not isinstance(text_inputs, (dict, bytes))) or is_indexed_dataset(
            text_inputs
        ):
            return self._stream(text_inputs, kwargs)
        raise ValueError(
            "`text_inputs` must be a string, a chat (list of role/content dicts), a list of those, or an "
            f"iterable of those; got {type(text_inputs).__name__}"
        )

    def _call_default(self, kwargs: dict, name: str):
        """A call argument of the engine group (``batch_size``, ``progress_bar``): the call's, else the pipeline's."""
        return kwargs[name] if name in kwargs else self._call_requests.init_kwargs["engine"].get(name)

    def _stream(self, inputs, kwargs: dict) -> Iterator[list[dict]]:
        """A lazy call over ``inputs`` (``streamed_call.StreamedCall``): a generator of each input's
        records in input order, with at most ``batch_size`` (default ``4 * max_num_seqs``) prompts
        pulled and not yet yielded."""
        in_flight = in_flight_limit(self._call_default(kwargs, "batch_size"), self.engine.config.scheduler.max_num_seqs)
        # The call's arguments are checked now, with no prompt (as a list call checks them before
        # returning): a bad one is the call's error, not one of the inputs'.
        self._call_requests.prepare([], call_level_kwargs(kwargs))
        show = self._call_default(kwargs, "progress_bar")
        call = StreamedCall(
            self,
            inputs,
            kwargs,
            in_flight=in_flight,
            show=True if show is None else bool(show),
            on_end=self._set_call_stats,
        )
        return iter(call)

    def _set_call_stats(
        self, num_requests: int, tokens: int, seconds: float, preemptions: int, latency: LatencySamples
    ) -> None:
        figures = latency.summary()
        self.last_call_stats = CallStats(
            num_requests=num_requests,
            generated_tokens=tokens,
            seconds=seconds,
            tokens_per_s=tokens / seconds if seconds else 0.0,
            preemptions=preemptions,
            ttft_s=figures["ttft_s"],
            itl_s=figures["itl_s"],
        )

    def _run(self, prompts: list, kwargs: dict) -> list[list[dict]]:
        """Build every prompt's request, queue them all, wait (driving the engine), return records."""
        call = self._call_requests.prepare(prompts, kwargs)
        t0 = time.monotonic()
        submitted = self.engine.enqueue(call.requests)
        flat = [h for hs in submitted for h in hs]
        show = call.progress_bar if call.progress_bar is not None else len(prompts) > 1
        tokens = wait_for(self.engine, flat, desc="hf_contbatch", show=bool(show))
        latency = LatencySamples()
        latency.extend(RequestMetrics.of(h.request) for h in flat)
        self._set_call_stats(
            len(flat), tokens, time.monotonic() - t0, sum(h.request.num_preemptions for h in flat), latency
        )
        results = [
            records_so_far(self.tokenizer, prompt, hs, call.output) for prompt, hs in zip(call.prompts, submitted)
        ]
        failed = [h for h in flat if h.request.error is not None]
        if failed:
            try:
                failed[0].result()
            except EngineError as exc:  # the others completed: their records travel with the error
                exc.partial_results = results
                raise
        return results


def _check_config_types(engine_config, cache_config, scheduler_config) -> None:
    """Each config argument is its config class or None (named as the caller wrote it: a dict given
    as ``cache_config`` was reported as ``cache``)."""
    for name, value, cls in (
        ("engine_config", engine_config, EngineConfig),
        ("cache_config", cache_config, CacheConfig),
        ("scheduler_config", scheduler_config, SchedulerConfig),
    ):
        if value is not None and not isinstance(value, cls):
            hint = f" (e.g. {cls.__name__}(**{value!r}))" if isinstance(value, dict) else ""
            raise ValueError(f"`{name}` must be a {cls.__name__} or None, got {type(value).__name__}{hint}")


def _check_dtype(dtype) -> None:
    """``dtype`` is None, "auto", a ``torch.dtype`` or the name of one (transformers raised an
    ``AttributeError`` for a misspelt name)."""
    if dtype is None or dtype == "auto" or isinstance(dtype, (torch.dtype, dict)):  # dict: per submodule
        return
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return
    raise ValueError(
        f"`dtype` must be 'auto', a torch.dtype or its name ('float32', 'bfloat16', 'float16', ...), got {dtype!r}"
    )


def pipeline(task: str = "text-generation", model=None, tokenizer=None, **kwargs) -> ContinuousBatchingPipeline:
    """Like ``transformers.pipeline`` for ``task="text-generation"``, returning our pipeline; without
    ``model``, the embedded default model.

    Raises:
        ValueError: any other task.
    """
    if task not in ("text-generation", TASK_NAME):
        raise ValueError(f"`task` must be 'text-generation' (or {TASK_NAME!r}), got {task!r}")
    if model is None:
        from ..default_model import default_model_path

        model = default_model_path()
    return ContinuousBatchingPipeline(model, tokenizer, **kwargs)
