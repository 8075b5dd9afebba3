"""``ContinuousBatchingPipeline``: the ``transformers`` text-generation pipeline's inputs and outputs,
served by the continuous-batching engine.

Inputs, generation defaults and output records follow ``transformers.TextGenerationPipeline``
(transformers 5.x): a string, a chat (list of role/content dicts), a list of either, or any iterable
of them; ``max_new_tokens``/``do_sample``/... resolved on top of the model's ``generation_config``
and the pipeline defaults (max_new_tokens=256, do_sample=True, temperature=0.7), exactly as
transformers resolves them (``generation_args``). Prompts and records: ``text_io``; stop strings:
``stopping``; the blocking wait: ``progress``.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from typing import Iterable, Iterator, Optional, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from ..config import CacheConfig, EngineConfig, SchedulerConfig, is_int
from ..engine.llm_engine import EngineError, LLMEngine, RequestHandle
from ..engine.logits_processors import logits_device, prepare_generation_config, with_processors
from ..engine.reliability import check_request
from ..engine.stopping import StopStringCheckers
from .generation_args import (  # noqa: F401  (re-exported: their former home)
    ENGINE_KWARGS,
    PIPELINE_GENERATION_DEFAULTS,
    POSTPROCESS_KWARGS,
    PREPROCESS_KWARGS,
    SUPPORTED_GENERATION_KWARGS,
    resolve_generate_config,
    resolve_pipeline_generation_config,
    sampling_params_from_config,
    split_call_kwargs,
)
from .progress import wait_for
from .streaming import text_deltas
from .text_io import (
    TextInput,
    is_chat,
    output_record,
    prefix_length,
    skip_special_tokens,
    tokenize_prompt,
    truncate_for_hole,
)

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


def _cancel_if_abandoned(handles: list[RequestHandle], abandoned: list[bool]) -> None:
    """Finalizer of a ``GenerationHandle``: nothing can reach its requests any more; if a stream of
    it was left early, stop them (their KV blocks go to other requests)."""
    if abandoned[0]:
        for h in handles:
            if not h.done():
                h.cancel()


class GenerationHandle:
    """A prompt submitted with ``ContinuousBatchingPipeline.submit``.

    Iterating yields text deltas as tokens arrive; ``result()`` returns the same records
    ``__call__`` returns for one prompt; ``cancel()`` stops it (its partial text is kept).

    Leaving an iteration early: a KeyboardInterrupt (the notebook's Stop) while the loop waits for
    tokens cancels the prompt's requests and re-raises. After a ``break`` the request is cancelled
    when nothing else holds the handle (``for delta in pipe.submit(...): ... break``: nobody could
    ever read the rest); a handle you keep (``h = pipe.submit(...)``) keeps generating, and
    ``h.result()`` or ``h.cancel()`` decide.
    """

    def __init__(self, pipe: "ContinuousBatchingPipeline", prompt: TextInput, handles: list[RequestHandle], post: dict):
        self._pipe = pipe
        self.prompt = prompt
        self.handles = handles
        self._post = post
        # Set when a stream is left early; the finalizer (run when the last reference goes) reads it.
        self._abandoned = [False]
        weakref.finalize(self, _cancel_if_abandoned, handles, self._abandoned)

    def done(self) -> bool:
        """True once every sequence of the prompt finished; never blocks."""
        return all(h.done() for h in self.handles)

    def cancel(self) -> None:
        """Stop every sequence of the prompt (freed at the engine's next reap step; partial text is
        kept, finish reason "cancelled"). Never raises."""
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
        return [output_record(self._pipe.tokenizer, self.prompt, o, self._post) for o in outs]

    def finish_reasons(self) -> list[Optional[str]]:
        """Per sequence: "stop", "length", "cancelled", "error", or None while it runs."""
        return [h.request.finish_reason for h in self.handles]

    # --- streaming ---------------------------------------------------------------------------------
    def stream(self, index: int = 0) -> Iterator[str]:
        """Text deltas of sequence ``index`` as its tokens arrive (blocking iterator).

        Deltas never split a multi-byte character and never contain any part of a stop string: text
        that could still become one is held back, and the stream ends before the stop string (the
        final ``generated_text`` keeps it, as transformers does). Without stop strings the deltas
        concatenate to the sequence's new text. Each sequence can be streamed once.

        Leaving early: see the class docstring (Stop cancels; ``break`` cancels when nothing else
        holds this handle).

        Raises:
            EngineError: the engine failed the request.
            KeyboardInterrupt: interrupted while waiting; this sequence is cancelled first.
        """
        handle = self.handles[index]
        finished = False
        try:
            yield from text_deltas(
                handle.token_stream(),
                self._pipe.tokenizer,
                stop_strings=self._post.get("_stop_strings"),
                skip_special_tokens=skip_special_tokens(self._pipe.tokenizer, self._post),
                clean_up_tokenization_spaces=self._post.get("clean_up_tokenization_spaces"),
            )
            finished = True
        except KeyboardInterrupt:
            self._pipe.engine.cancel_now([handle])  # Stop while the stream waits: this sequence only
            # A fresh exception: its traceback ends here, not deep in a queue wait or a decoder.
            raise KeyboardInterrupt(f"streaming interrupted; request {handle.request_id} cancelled") from None
        finally:
            if not finished:
                self._abandoned[0] = True
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
            engine_config = EngineConfig(
                cache=cache_config or CacheConfig(), scheduler=scheduler_config or SchedulerConfig()
            )
        elif cache_config is not None or scheduler_config is not None:
            raise ValueError("pass either `engine_config` or `cache_config`/`scheduler_config`, not both")
        prefix = getattr(model.config, "prefix", None)
        if prefix is not None and "prefix" not in kwargs:
            kwargs["prefix"] = prefix  # transformers' pipeline takes the model's prompt prefix by default
        self._init_kwargs = split_call_kwargs(kwargs)
        self.engine = LLMEngine(model, engine_config)
        self._stop_checkers = StopStringCheckers(tokenizer)
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
        """A live ipywidgets view of blocks and queues (see ``hf_contbatch.frontends.dashboard``)."""
        from .dashboard import Dashboard

        return Dashboard(self, **kwargs)

    # --- argument handling -------------------------------------------------------------------------

    # --- argument handling -------------------------------------------------------------------------
    def resolve_generation_config(self, gen_kwargs: dict) -> GenerationConfig:
        """The generation config ``generate`` runs with under transformers' text-generation pipeline
        for these generation arguments (see ``generation_args.resolve_pipeline_generation_config``).

        Raises:
            ValueError: a setting the engine does not implement has a non-neutral value.
        """
        return resolve_pipeline_generation_config(self.model, self.tokenizer, gen_kwargs)

    def _prepare(self, prompts: Sequence[TextInput], kwargs: dict):
        """Tokenize and validate everything before submitting anything (nothing half-submitted)."""
        call = split_call_kwargs(kwargs)
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
        cfgs = self._per_prompt_configs(gen, len(prompts))
        cfg = cfgs[0]
        if cfg.stop_strings and stop_strings is None:
            stop_strings = cfg.stop_strings
        post["_stop_strings"] = [stop_strings] if isinstance(stop_strings, str) else stop_strings
        num_sequences = cfg.num_return_sequences or 1
        if not is_int(num_sequences) or num_sequences < 1:
            raise ValueError(f"`num_return_sequences` must be an int >= 1, got {num_sequences!r}")
        if num_sequences > 1 and not cfg.do_sample:
            raise ValueError(
                "`num_return_sequences` > 1 needs `do_sample=True` (greedy decoding would return the same sequence)"
            )
        checker = self._stop_checkers.checker(stop_strings)
        priorities = eng.get("priority", 0)
        if isinstance(priorities, (list, tuple)):
            if len(priorities) != len(prompts):
                raise ValueError(f"`priority` has {len(priorities)} entries for {len(prompts)} prompts")
        else:
            priorities = [priorities] * len(prompts)
        for p in priorities:
            if not is_int(p):
                raise ValueError(f"`priority` must be an int or a list of ints (lower runs first), got {p!r}")
        prefix_len = prefix_length(self.tokenizer, pre) if cfg.max_new_tokens is None or cfg.min_length else 0
        proc_cfg = prepare_generation_config(self.model, cfg, logits_device(self.model))  # once per call
        if prefix_len and cfg.min_length and cfg.min_new_tokens is None:
            # transformers' pipeline counts min_length without the prefix (adds its length)
            proc_cfg.min_length = cfg.min_length + prefix_len
        jobs = []
        for prompt, prio, prompt_cfg in zip(prompts, priorities, cfgs):
            ids = tokenize_prompt(self.tokenizer, prompt, pre)
            if len(ids) == 0:
                raise ValueError("a prompt tokenized to 0 tokens; give a non-empty prompt")
            if pre.get("handle_long_generation") == "hole":
                ids = truncate_for_hole(self.tokenizer, ids, prompt_cfg)
            sp = sampling_params_from_config(
                prompt_cfg,
                len(ids),
                ignore_eos=bool(eng.get("ignore_eos", False)),
                seed=eng.get("seed"),
                prefix_len=prefix_len,
            )
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
            )
            check_request(ids, sp, self.engine.vocab_size)  # every prompt checked before any is submitted
            jobs.append((prompt, ids, sp, prio))
        return jobs, num_sequences, checker, post, eng

    def _per_prompt_configs(self, gen: dict, num_prompts: int) -> list[GenerationConfig]:
        """One resolved generation config per prompt: ``max_new_tokens`` may be a list with one int
        per prompt (like ``priority``); everything else is shared.

        Raises:
            ValueError: a list of the wrong length or with a value that is not an int >= 1.
        """
        values = gen.get("max_new_tokens")
        if not isinstance(values, (list, tuple)):
            return [self.resolve_generation_config(gen)] * num_prompts
        if len(values) != num_prompts:
            raise ValueError(
                f"`max_new_tokens` has {len(values)} entries for {num_prompts} prompts; give an int or one per prompt"
            )
        for v in values:
            if not is_int(v) or v < 1:
                raise ValueError(f"`max_new_tokens` must be an int >= 1 or a list of them (one per prompt), got {v!r}")
        resolved = {v: self.resolve_generation_config({**gen, "max_new_tokens": v}) for v in dict.fromkeys(values)}
        return [resolved[v] for v in values]

    def _submit_jobs(self, jobs, num_sequences, checker) -> list[list[RequestHandle]]:
        submitted: list[list[RequestHandle]] = []
        try:
            for _prompt, ids, sp, prio in jobs:
                # One engine request forked after prefill: the prompt's KV is computed once and
                # shared; sequence k samples with seed + k when a seed is set.
                submitted.append(
                    self.engine.submit(ids, sp, priority=prio, stop_checker=checker, num_return_sequences=num_sequences)
                )
        except BaseException:
            for hs in submitted:
                for h in hs:
                    h.cancel()
            raise
        return submitted

    # --- public calls ------------------------------------------------------------------------------
    def submit(self, prompt: TextInput, **kwargs) -> GenerationHandle:
        """Queue one prompt without blocking; returns a ``GenerationHandle`` (iterate for text deltas)."""
        if not (isinstance(prompt, str) or is_chat(prompt)):
            raise ValueError(
                f"`prompt` must be a string or a chat (list of role/content dicts), got {type(prompt).__name__}"
            )
        jobs, num_sequences, checker, post, _ = self._prepare([prompt], kwargs)
        return GenerationHandle(self, prompt, self._submit_jobs(jobs, num_sequences, checker)[0], post)

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
                ``num_return_sequences``...; ``max_new_tokens`` may also be a list, one per input),
                ``return_full_text``, ``priority`` (int or one per input; lower first), ``progress_bar`` (bool; default on for several inputs),
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
            return self._run(list(text_inputs), kwargs)
        if isinstance(text_inputs, Iterable) and not isinstance(text_inputs, (dict, bytes)):
            return iter(self._run(list(text_inputs), kwargs))
        raise ValueError(
            "`text_inputs` must be a string, a chat (list of role/content dicts), a list of those, or an "
            f"iterable of those; got {type(text_inputs).__name__}"
        )

    def _run(self, prompts: list, kwargs: dict) -> list[list[dict]]:
        jobs, num_sequences, checker, post, eng = self._prepare(prompts, kwargs)
        t0 = time.monotonic()
        submitted = self._submit_jobs(jobs, num_sequences, checker)
        flat = [h for hs in submitted for h in hs]
        show = eng.get("progress_bar")
        if show is None:
            show = len(prompts) > 1
        tokens = wait_for(self.engine, flat, desc="hf_contbatch", show=bool(show))
        elapsed = time.monotonic() - t0
        self.last_call_stats = {
            "num_requests": len(flat),
            "generated_tokens": tokens,
            "seconds": elapsed,
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
        return [output_record(self.tokenizer, prompt, h.output(), post) for h in handles]


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
