"""The model forward compiled with ``torch.compile`` (inductor), for ``EngineConfig.compile_model``.

Why: on CPU a small model's step is dominated by work around the GEMMs (transformers' Python
modules: RMSNorm, rotary embeddings, residual adds, SiLU, each a few small eager ops). Inductor fuses
them into a few C++ loops; vLLM's CPU build compiles its models the same way.

What is compiled: the unmodified transformers model, with two custom ops left opaque to the
compiler: the paged attention (``torch.ops.hf_contbatch.paged_attention``, which also stores the
step's K/V, so the cache the model gets stores nothing) and the packed linears
(``torch.ops.hf_contbatch.native_linear``, our GEMM, or ``onednn_linear``, rows padded as in eager). The token dimension and the
logits rows are marked dynamic, so a handful of graphs serve every batch (one-token steps get their
own). Inductor's on-disk caches (under ``TORCHINDUCTOR_CACHE_DIR``, default a ``torchinductor_$USER``
folder in the temp directory) make later processes compile much faster.

Where compiling fails (no C++ compiler, an unsupported model), or the attention op meets a model
whose K/V it cannot store itself (``CompiledAttentionUnserved``: heads picked after the cache
update, one module storing as several layers), the forward runs eagerly from then on, with one
warning; outputs are the same either way.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings

import torch

from .attention import COMPILED_STEP_SUPPORTED, CompiledAttentionUnserved, CompiledStep

logger = logging.getLogger(__name__)

# torch.compile's tracing and compiling are not thread-safe (two engines compiling in two threads
# fail with RecursionError inside AOTAutograd), and engines drive from their own
# threads, so compiled forwards run one at a time in a process. On CPU two forwards at once would
# share the same cores anyway.
_COMPILED_CALLS = threading.Lock()
_RECOMPILE_LIMIT = 64


class CompiledForward:
    """Callable like the model (keyword arguments), running its compiled forward.

    Args:
        model: the transformers causal LM, already switched to the paged attention.
        cache: the engine's ``PagedKVCache``; the graph gets a view of it that stores nothing (the
            attention op stores K/V through each step's own view, its argument as a ``CompiledStep``).
        cache_arg: the forward's cache argument name ("past_key_values" or "cache").
        packed_linears: the engine's ``PackedLinears`` (refreshed before each step) or None.
    """

    def __init__(self, model, cache, cache_arg: str, packed_linears=None) -> None:
        self.model = model
        self.cache = cache
        self.cache_arg = cache_arg
        self.packed_linears = packed_linears
        # One object for every call: the compiled graph guards on its identity. To transformers'
        # mask code it is a paged cache, so the graph builds no mask either.
        self.graph_cache = cache.for_step(None)
        self.compiled = torch.compile(model, dynamic=False)
        # The one logits row a step that samples nothing gets (below): an ordinary tensor like the
        # engine's input buffers, not an inference tensor made inside the step (the graph guards
        # on dispatch keys, and one made there compiled a fourth graph per model).
        with torch.inference_mode(False):
            self._one_row = torch.zeros(1, dtype=torch.int64)
        self.failed: Exception | None = None
        if cache.latent_layers:
            # Multi-head latent attention: the model expands the contexts that update returns, but
            # under the compiled graph the op stores and attends without returning them.
            self.failed = RuntimeError("multi-head latent attention layers")
            warnings.warn(
                "compile_model: layers of multi-head latent attention expand the stored contexts the cache "
                "returns, which the compiled attention op does not return; running the model eagerly instead",
                RuntimeWarning,
                stacklevel=3,
            )
        elif cache.key_bias_layers:
            # Dynamic mask attention (Doge): its per-key biases are stored by the model's own
            # prepare_dynamic_mask right after update, which the compiled op's store never runs.
            self.failed = RuntimeError("layers with a cached per-key attention bias")
            warnings.warn(
                "compile_model: layers with a dynamic attention mask store a bias per key beside the K/V, which "
                "the compiled attention op does not; running the model eagerly instead",
                RuntimeWarning,
                stacklevel=3,
            )
        elif not COMPILED_STEP_SUPPORTED:
            # The attention op takes the step's view as an opaque object: without them, eager.
            self.failed = RuntimeError("this torch has no opaque objects for custom ops")
            warnings.warn(
                f"compile_model: torch {torch.__version__} cannot pass the step's cache view to the compiled "
                "attention op (no opaque reference objects); running the model eagerly instead",
                RuntimeWarning,
                stacklevel=3,
            )
        self.compile_seconds = 0.0  # wall time of the calls that compiled a new graph

    def __call__(self, **kwargs):
        """Run the forward with the model's keyword arguments (``input_ids``/``position_ids``
        int64 ``[1, T]``, ``logits_to_keep`` int64 ``[R]``, ``paged_cache`` the step's view, which the
        graph gets wrapped in a ``CompiledStep``, and the cache argument, which is replaced by a view
        that stores nothing) and return its output (``logits`` ``[1, R, vocab]``). Compile failures
        (``TorchDynamoException``) fall back to eager with one ``RuntimeWarning``; errors of the
        computation itself propagate."""
        if self.packed_linears is not None:
            self.packed_linears.refresh()
        if self.failed is not None:
            return self.model(**kwargs)  # eager: the step's view stores K/V through update()
        eager_kwargs = dict(kwargs)
        kwargs["paged_cache"] = CompiledStep(kwargs["paged_cache"])
        kwargs[self.cache_arg] = self.graph_cache  # the attention op stores K/V
        kwargs["use_cache"] = False
        rows = kwargs.get("logits_to_keep")
        no_rows = isinstance(rows, torch.Tensor) and rows.numel() == 0
        if no_rows:
            # A step that samples nothing (a prefill chunk) still needs every attention op to run,
            # for the K/V it stores: with no logits the graph's outputs do not depend on them and
            # the compiler would drop them as dead code. One row keeps them alive.
            kwargs["logits_to_keep"] = self._one_row if rows.device.type == "cpu" else rows.new_zeros(1)
        for name, dim in (("input_ids", 1), ("position_ids", 1), ("logits_to_keep", 0)):
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(value, dim)
        graphs = _unique_graphs()
        start = time.perf_counter()
        try:
            # transformers wraps every model class's forward in one shared function, and dynamo
            # counts recompiles per code object: several models in one process (each a few graphs)
            # would hit its default limit of 8 and silently run eagerly.
            with _COMPILED_CALLS, torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
                out = self.compiled(**kwargs)
        except (torch._dynamo.exc.TorchDynamoException, CompiledAttentionUnserved) as exc:
            # Compiling failed (not the model's computation), or the attention op met a model it
            # cannot serve (DiffLlama, JetMoE, HRM: K/V changed or stored twice): serve eagerly from
            # now on. The op may have stored some layers' K/V already; the eager rerun stores
            # every layer's again, as the model computes them.
            self.failed = exc
            kwargs = eager_kwargs
            warnings.warn(
                f"compile_model: torch.compile failed, running the model eagerly instead ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''})",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.model(**kwargs)
        if no_rows:
            out.logits = out.logits[:, :0]
        if _unique_graphs() != graphs:
            elapsed = time.perf_counter() - start
            self.compile_seconds += elapsed
            logger.info("compiled a forward graph for %d tokens in %.1f s", kwargs["input_ids"].shape[-1], elapsed)
        return out

    def close(self) -> None:
        """Stop using the compiled graphs (the model's own forward is untouched)."""
        self.compiled = None


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
