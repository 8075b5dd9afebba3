"""lm-eval model type ``hf-contbatch``: lm-eval's ``hf`` model with every request run through the engine.

Importing this module registers the type (``lm_eval --model hf-contbatch`` through ``hf-contbatch
eval ...``, or ``lm_eval.simple_evaluate(model="hf-contbatch", ...)`` after the import). It subclasses
lm-eval's ``HFLM`` so that model loading, ``model_args``, tokenization, truncation, chat templates and
the post-processing of generations are lm-eval's own; only the model calls change:

Every result goes to lm-eval's cache (``--use_cache``) as soon as its request finishes, not when the
whole request type is done: a killed run keeps what finished, and the rerun computes only the rest.

- ``generate_until`` submits every request at once (lm-eval does no batching for us), honouring
  ``until`` (stop strings), ``max_gen_toks``, ``do_sample``, ``temperature`` and the rest of the
  generation kwargs, resolved over the model's generation config exactly as ``generate`` would.
- ``loglikelihood`` / ``loglikelihood_rolling`` score through the paged prefill with prompt
  log-probabilities (``SamplingParams.prompt_logprobs``), all requests in flight together.

LoRA adapters: ``peft=PATH`` (lm-eval's ``hf`` spelling) loads a PEFT adapter over ``pretrained``;
the engine serves the resulting ``peft.PeftModel`` with the adapter on every request. Under
``accelerate launch`` with several processes each process serves its own shard of the requests
(lm-eval's data parallelism), also on CPU, where ``hf`` itself would give every process all of them.

Engine settings are extra ``model_args``: ``block_size``, ``num_blocks``, ``cache_gib``,
``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``, ``attention_backend``,
``engine_seed`` (defaults and meanings in ``lm_eval_args``, which ``hf-contbatch eval --help`` prints).
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import lm_eval.models  # noqa: F401  (first: registering into an empty registry hides lm-eval's own models)
import torch
from lm_eval import utils as lm_utils
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from ...config import CacheConfig, EngineConfig, SchedulerConfig
from ...engine.handles import RequestHandle
from ...engine.llm_engine import LLMEngine
from ...engine.logits_processors import logits_device, with_processors
from ...engine.stopping import StopStringCheckers
from ...request import SamplingParams
from ..generation_args import resolve_generate_config, sampling_params_from_config
from ..progress import wait_for
from .lm_eval_args import ENGINE_ARGS, MODEL_TYPE

_ENGINE_ARGS = {name: default for name, (default, _) in ENGINE_ARGS.items()}


@register_model(MODEL_TYPE)
class ContinuousBatchingLM(HFLM):
    """lm-eval's ``HFLM`` whose generation and scoring run on the continuous-batching engine.

    Args:
        pretrained: Hub id, local path or a loaded causal LM (as for lm-eval's ``hf``); None (no
            ``model_args``) uses the embedded default model, as ``hf-contbatch generate`` does.
            With ``peft=PATH`` (an ``hf`` argument) a LoRA adapter over it serves every request.
        block_size, num_blocks, cache_gib, max_num_seqs, max_num_batched_tokens,
        enable_prefix_caching, attention_backend, engine_seed, quantization: engine settings (see
            ``EngineConfig``; ``quantization=int8`` or ``w8a8`` in ``model_args``).
        **kwargs: every other ``hf`` model argument (``dtype``, ``device``, ``max_length``,
            ``add_bos_token``, ``trust_remote_code``...). ``batch_size`` is accepted and unused.

    Raises:
        ValueError: a seq2seq model, or a model family the engine does not support.
    """

    def __init__(self, pretrained=None, **kwargs) -> None:
        if pretrained is None:
            from ...default_model import default_model_path

            pretrained = default_model_path()
        engine_args = {k: kwargs.pop(k, default) for k, default in _ENGINE_ARGS.items()}
        if kwargs.get("device") is None:
            kwargs["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(pretrained, **kwargs)
        accelerator = getattr(self, "accelerator", None)
        if accelerator is not None and accelerator.num_processes > 1 and self._world_size == 1:
            # hf shards requests over processes only when it counts several GPUs; on CPU (gloo)
            # every process would run every request: shard there too (evaluator gathers by rank).
            self._rank, self._world_size = accelerator.process_index, accelerator.num_processes
        if self.backend != "causal":
            raise ValueError(f"{MODEL_TYPE} serves causal (decoder-only) models; this one is {self.backend}")
        cache = CacheConfig(
            block_size=engine_args["block_size"],
            num_blocks=engine_args["num_blocks"],
            cpu_cache_gib=engine_args["cache_gib"],
            enable_prefix_caching=engine_args["enable_prefix_caching"],
        )
        sched = SchedulerConfig(
            max_num_seqs=engine_args["max_num_seqs"],
            max_num_batched_tokens=engine_args["max_num_batched_tokens"],
        )
        self.engine = LLMEngine(
            self.model,
            EngineConfig(
                cache=cache,
                scheduler=sched,
                attention_backend=engine_args["attention_backend"],
                seed=engine_args["engine_seed"],
                quantization=engine_args["quantization"],
            ),
        )
        self._stop_checkers = StopStringCheckers(self.tokenizer)

    def close(self) -> None:
        """Stop the engine thread and free the KV pool."""
        self.engine.close()

    # --- running many requests at once ---------------------------------------------------------
    def _wait_all(
        self, handles: list[RequestHandle], desc: str, disable_tqdm: bool, on_result: Callable[[int], None]
    ) -> None:
        """Wait for ``handles`` as the pipeline does: this thread drives the engine (cancels all of
        them if interrupted). ``on_result(i)`` runs in this thread as soon as ``handles[i]``
        finished well: each result goes to lm-eval's cache then (``cache_hook.add_partial``; with
        ``--use_cache`` a killed run keeps every request that finished, and a rerun computes only
        the others)."""
        position = {id(h): i for i, h in enumerate(handles)}

        def finished(h: RequestHandle) -> None:
            if h.request.error is None and h.request.finish_reason != "cancelled":
                on_result(position[id(h)])

        wait_for(self.engine, handles, desc=desc, show=not (disable_tqdm or self.rank != 0), on_finished=finished)

    # --- scoring ---------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None, on_result=None):
        """``(sum log-prob, all greedy)`` of each continuation, scored as ``hf`` does: the last
        ``max_length + 1`` tokens of context + continuation, the final one never fed to the model.
        Each answer goes to lm-eval's cache as it is scored (and to ``on_result(i, answer)``)."""
        built = []
        spans = []
        for _, context_enc, continuation_enc in requests:
            if not context_enc or not continuation_enc:
                raise ValueError(
                    "loglikelihood needs a non-empty context and continuation (lm-eval adds a prefix token)"
                )
            if len(continuation_enc) > self.max_length:
                raise ValueError(
                    f"a continuation of {len(continuation_enc)} tokens exceeds max_length={self.max_length}"
                )
            whole = (context_enc + continuation_enc)[-(self.max_length + 1) :]
            first = len(whole) - len(continuation_enc)  # position of the first continuation token
            sp = SamplingParams(max_new_tokens=1, prompt_logprobs=first, score_token_id=whole[-1])
            built.append(self.engine.build_request(whole[:-1], sp))
            spans.append((first, len(whole) - 1))
        handles = [hs[0] for hs in self.engine.enqueue(built)]  # all validated: none queued if one is bad
        results: list = [None] * len(handles)

        def score(i: int) -> None:
            h, (first, last) = handles[i], spans[i]
            scored = (h.request.prompt_logprobs or [])[first : last + 1]
            if len(scored) != last + 1 - first or any(x is None for x in scored):
                raise RuntimeError(
                    f"request {h.request_id}: prompt log-probs missing for scored tokens (a prefix-cache hit "
                    "must not cover rows that prompt_logprobs asks for)"
                )
            results[i] = (float(sum(lp for lp, _ in scored)), all(greedy for _, greedy in scored))
            request_str = requests[i][0]
            if request_str is not None:
                self.cache_hook.add_partial("loglikelihood", request_str, results[i])
            if on_result is not None:
                on_result(i, results[i])

        self._wait_all(handles, "Running loglikelihood requests", disable_tqdm, score)
        for h in handles:
            h.result()  # an engine error surfaces here
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """As ``hf``: disjoint rolling windows of ``max_length`` tokens; all windows in flight at once."""
        windows = []
        counts = []
        for (string,) in [req.args for req in requests]:
            rolling = list(
                map(
                    lm_utils.make_disjoint_window,
                    lm_utils.get_rolling_token_windows(
                        token_list=self.tok_encode(string),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    ),
                )
            )
            windows.extend((None,) + w for w in rolling)
            counts.append(len(rolling))
        owner = [i for i, n in enumerate(counts) for _ in range(n)]  # window -> request
        starts = [0, *itertools.accumulate(counts)][:-1]
        left = list(counts)
        window_lps = [0.0] * len(windows)

        def total(i: int) -> float:
            return sum(window_lps[starts[i] : starts[i] + counts[i]])  # in window order, as hf sums

        def window_scored(w: int, answer) -> None:
            window_lps[w] = answer[0]
            i = owner[w]
            left[i] -= 1
            if left[i] == 0:  # the request's last window: its total goes to the cache now
                self.cache_hook.add_partial("loglikelihood_rolling", requests[i].args, total(i))

        self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm, on_result=window_scored)
        return [total(i) for i in range(len(counts))]

    # --- generation ------------------------------------------------------------------------------
    def _sampling_for(self, gen_kwargs: dict, prompt: list, max_gen_toks: int) -> SamplingParams:
        """The generation ``hf`` runs (``HFLM._model_generate`` then ``generate``'s resolution),
        with the logits processors ``generate`` builds for ``prompt``."""
        context_len = len(prompt)
        kwargs = dict(gen_kwargs)
        kwargs["temperature"] = kwargs.get("temperature", 0.0)
        do_sample = kwargs.get("do_sample")
        if kwargs["temperature"] == 0.0 and do_sample is None:
            kwargs["do_sample"] = do_sample = False
        if do_sample is False and kwargs["temperature"] == 0.0:
            kwargs.pop("temperature")
        max_length = kwargs.pop("max_length", context_len + max_gen_toks)
        cfg = resolve_generate_config(
            self.model, None, max_length=max_length, pad_token_id=self.tokenizer.pad_token_id, **kwargs
        )
        return with_processors(
            self.model, cfg, sampling_params_from_config(cfg, context_len), prompt, device=logits_device(self.model)
        )

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Every request submitted at once; the text is post-processed as ``hf`` does."""
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        built = []
        untils = []
        for req in requests:
            context, gen_kwargs = req.args
            if not isinstance(gen_kwargs, dict):
                raise ValueError(f"Expected `kwargs` to be of type `dict` but got {type(gen_kwargs)}")
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            max_ctx_len = self.max_length - max_gen_toks
            if max_ctx_len <= 0:
                raise ValueError(
                    f"Invalid configuration: requested max tokens to generate ({max_gen_toks}) must be less than "
                    f"model's maximum sequence length ({self.max_length})."
                )
            # one context at a time: hf's special-token decision looks at the batch's first string
            ids, _ = self.tok_batch_encode([context], left_truncate_len=max_ctx_len, truncation=self.truncation)
            prompt = ids[0].tolist()
            sp = self._sampling_for(kwargs, prompt, max_gen_toks)
            # lm-eval's hf backend matches stop sequences in the new tokens only (MultiTokenEOSCriteria).
            checker = self._stop_checkers.checker([u for u in until if u], over_prompt=False)
            built.append(self.engine.build_request(prompt, sp, stop_checker=checker))
            untils.append(until)
        # Every request validated before any is queued; the wait cancels them all if interrupted.
        handles: list[RequestHandle] = [hs[0] for hs in self.engine.enqueue(built)]
        results: list = [None] * len(handles)

        def finished(i: int) -> None:
            results[i] = self._generated_text(handles[i].request.output_token_ids, untils[i])
            self.cache_hook.add_partial("generate_until", requests[i].args, results[i])

        self._wait_all(handles, "Running generate_until requests", disable_tqdm, finished)
        for h in handles:
            h.result()  # an engine error surfaces here
        return results

    def _generated_text(self, cont_toks: list[int], until: list[str]) -> str:
        """A continuation's text as ``hf`` post-processes it (thinking cut, stop sequences)."""
        if isinstance(self.think_end_token, int):
            marks = [i for i, t in enumerate(cont_toks) if t == self.think_end_token]
            if marks:
                cont_toks = cont_toks[marks[-1] + 1 :]
        text = self.tok_decode(cont_toks)
        if isinstance(self.think_end_token, int):
            text = text.lstrip()
        return postprocess_generated_text(
            generation=text,
            stop=until,
            think_end_token=self.think_end_token if isinstance(self.think_end_token, str) else None,
        )


def simple_evaluate(model_args: Optional[str] = None, **kwargs):
    """``lm_eval.simple_evaluate`` with ``model="hf-contbatch"`` (a convenience for scripts)."""
    import lm_eval

    return lm_eval.simple_evaluate(model=MODEL_TYPE, model_args=model_args, **kwargs)
