"""Attention that reads the paged KV cache, plugged in through ``transformers.AttentionInterface``.

The registered function is stateless: the step's cache and metadata travel in the forward's keyword
arguments (``paged_cache``), so any number of engines can share the one global registration.

Under a compiled forward (``EngineConfig.compile_model``, ``hf_contbatch.kernels.compiled_forward``) the
function instead calls one opaque custom op, ``torch.ops.hf_contbatch.paged_attention``, that stores
the step's K/V and attends: torch.compile then fuses everything around it without tracing the
pool, the block tables or the step's Python-side metadata (which change every step and would force
a recompile). The op finds its cache through a handle (a 0-d int64 tensor, so its value is data,
not a guard) in a weak registry: two engines have two handles, and a closed engine's cache is not
kept alive by it. vLLM does the same with its ``unified_attention`` op and forward context.
"""

from __future__ import annotations

import itertools
import os
import warnings
import weakref
from typing import Optional

import torch

from ...config import ATTENTION_BACKENDS

ATTENTION_NAME = "hf_contbatch_paged"  # no "sdpa"/"flash"/"flex" in it: transformers substring-checks names


def resolve_backend(requested: str, device: torch.device, **shape) -> str:
    """Pick "torch" or "triton" for ``device``.

    ``HF_CONTBATCH_ATTENTION_BACKEND`` overrides an "auto" request. ``shape`` (optional keywords
    ``dtype``, ``head_dim``, ``num_heads``, ``num_kv_heads``, ``block_size``) describes the cache the
    kernels will serve: "auto" then takes the torch path, with one warning, where the Triton kernels
    cannot serve it (bfloat16 below compute capability 8.0, a head size, block size or GQA group the
    kernels lack, no tile that fits the device's shared memory), and on GPUs below sm_80 (see
    :func:`triton_kernels.prefers_torch`). "triton" needs CUDA tensors, or the interpreter
    (``TRITON_INTERPRET=1``) on CPU, and a configuration the kernels serve; otherwise a ValueError
    says why.
    """
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"`attention_backend` must be one of {ATTENTION_BACKENDS}, got {requested!r}")
    if requested == "auto":
        env = os.environ.get("HF_CONTBATCH_ATTENTION_BACKEND", "auto")
        if env not in ATTENTION_BACKENDS:
            raise ValueError(f"HF_CONTBATCH_ATTENTION_BACKEND must be one of {ATTENTION_BACKENDS}, got {env!r}")
        requested = env
    if requested == "auto":
        from . import triton_kernels as tk

        if device.type != "cuda" or not tk.TRITON_AVAILABLE or tk.prefers_torch(device):
            return "torch"
        reason = tk.unsupported_reason(device, **shape)
        if reason is not None:
            warnings.warn(f"attention_backend='auto' uses the torch attention path: {reason}", stacklevel=3)
            return "torch"
        return "triton"
    if requested == "triton":
        from . import triton_kernels as tk

        if not tk.TRITON_AVAILABLE:
            raise ValueError("attention_backend='triton' but triton is not importable; use 'torch'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' on a CPU device needs TRITON_INTERPRET=1 (slow; for tests); use 'torch'"
            )
        reason = tk.unsupported_reason(device, **shape)
        if reason is not None:
            raise ValueError(f"attention_backend='triton' cannot serve this model here: {reason}")
    return requested


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    paged_cache=None,
    **kwargs,
):
    """The ``AttentionInterface`` entry: ``query`` ``[1, H, T, D]`` -> ``([1, T, H, D], None)``.

    ``key``/``value`` are this step's rows, already stored by ``PagedKVCache.update`` (under a
    compiled forward the op stores them); the context is read from the pool. Raises RuntimeError
    if called without an engine step's cache.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if paged_cache is not None and paged_cache.compiled_handle is not None:
        # Compiled forward: the model was called without a cache, so store and attend in one op
        # (which checks for the step's metadata: reading it here would make it part of the graph).
        out = torch.ops.hf_contbatch.paged_attention(
            query,
            key,
            value,
            paged_cache.compiled_handle,
            module.layer_idx,
            float(scale),
            -1 if sliding_window is None else int(sliding_window),
            0.0 if softcap is None else float(softcap),
        )
        return out, None
    if paged_cache is None or paged_cache.metadata is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} only runs inside an hf_contbatch engine step; "
            "close the pipeline (which restores the model's attention) before calling model.generate"
        )
    layer_idx = module.layer_idx
    return _attend_pool(paged_cache, layer_idx, query, key, value, scale, sliding_window, softcap), None


def _attend_pool(paged_cache, layer_idx: int, query, key, value, scale: float, sliding_window, softcap):
    """``query`` ``[1, H, T, D]`` over the pool of ``layer_idx`` -> ``[1, T, H, D]``."""
    k_pool = paged_cache.key_cache[layer_idx]
    v_pool = paged_cache.value_cache[layer_idx]
    meta = paged_cache.metadata.to(k_pool.device)
    q = query[0].transpose(0, 1)  # [T, H, D]
    if paged_cache.attention_backend == "triton":
        from .triton_kernels import paged_attention

        out = paged_attention(
            q.contiguous(),
            k_pool,
            v_pool,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            scale,
            sliding_window=sliding_window,
            softcap=softcap,
        )
    else:
        from .torch_paged import torch_paged_attention

        out = torch_paged_attention(
            q,
            k_pool,
            v_pool,
            meta,
            scale,
            sliding_window=sliding_window,
            softcap=softcap,
            key=key[0] if key.shape[0] == 1 else None,
            value=value[0] if value.shape[0] == 1 else None,
            decode_kernel=paged_cache.cpu_decode_kernel,
        )
    return out.unsqueeze(0)


# --- the compiled forward's op ---------------------------------------------------------------------
_CACHES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def register_compiled_cache(paged_cache) -> torch.Tensor:
    """Give ``paged_cache`` a handle for the compiled forward's op and return it (0-d int64)."""
    handle = next(_HANDLES)
    _CACHES[handle] = paged_cache
    return torch.tensor(handle, dtype=torch.int64)


# A plain ``torch.library.Library`` kernel, not ``torch.library.custom_op``: the latter adds Python
# autograd and alias-check layers to every call (see ``hf_contbatch.kernels.linears.linear_op``).
# Inference only: no autograd formula.
_OPS = torch.library.Library("hf_contbatch", "FRAGMENT")
_OPS.define(
    "paged_attention(Tensor query, Tensor key, Tensor value, Tensor cache_handle, int layer_idx, float scale, "
    "int sliding_window, float softcap) -> Tensor"
)


def _paged_attention_op(query, key, value, cache_handle, layer_idx: int, scale: float, sliding_window: int, softcap):
    """Store ``key``/``value`` ``[1, KVH, T, D]`` into the pool and attend: ``query`` ``[1, H, T, D]``
    -> ``[1, T, H, D]``. ``sliding_window`` -1 and ``softcap`` 0.0 mean none. The pool is written
    although it is not an argument: nothing else in the compiled graph reads it, and declaring it
    would make the compiler copy it (functionalization)."""
    paged_cache = _CACHES.get(int(cache_handle))
    if paged_cache is None or paged_cache.metadata is None:
        raise RuntimeError("hf_contbatch.paged_attention called outside an engine step (no cache for this handle)")
    paged_cache.update(key, value, layer_idx)
    out = _attend_pool(
        paged_cache,
        layer_idx,
        query,
        key,
        value,
        scale,
        None if sliding_window < 0 else sliding_window,
        None if softcap == 0.0 else softcap,
    )
    # The compiler reads the output with the fake's (contiguous) strides; the torch path's output
    # follows the query's memory layout, which a compiled graph may have permuted.
    return out.contiguous()


def _paged_attention_fake(query, key, value, cache_handle, layer_idx, scale, sliding_window, softcap):
    return query.new_empty((1, query.shape[2], query.shape[1], query.shape[3]))


_OPS.impl("paged_attention", _paged_attention_op, "CompositeExplicitAutograd")
torch.library.register_fake("hf_contbatch::paged_attention", _paged_attention_fake, lib=_OPS)


def register_attention() -> str:
    """Register the paged attention function (idempotent) and return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
