"""Attention backends: one object per way of storing K/V into the paged pool and attending over it.

An engine selects its backend once (:func:`select_backend`, from ``EngineConfig.attention_backend``
and ``HF_CONTBATCH_ATTENTION_BACKEND``); the backend then builds each step's metadata, stores the
step's K/V and attends. A new KV layout (an int8 cache with scales, say) is a ``KVCacheSpec`` and one
backend that accepts it in :meth:`AttentionBackend.check_spec`.

* :class:`TorchAttentionBackend`: plain torch (``torch_paged``), any device.
* :class:`CPUKernelAttentionBackend`: the torch path with decode attention and the KV store in the
  compiled C kernel (``cpu_kernel``) and prefill attention in ``cpu_prefill``, each where it is
  faster on this CPU (``decode_choice``, ``cpu_prefill.choose_prefill_path``).
* :class:`TritonAttentionBackend`: the Triton kernels (``triton_kernels``), CUDA (or the interpreter).
* :class:`Int8TorchAttentionBackend`, :class:`Int8CPUKernelAttentionBackend`,
  :class:`Int8TritonAttentionBackend`: the same three paths over an int8 cache with one float32
  scale per token and KV head (``CacheConfig(dtype="int8")``, scheme in ``kv_quant``): K/V are
  quantized on write, attention reads the scales.
"""

from __future__ import annotations

import os
import warnings
from abc import ABC, abstractmethod
from typing import ClassVar, Optional, Sequence

import torch

from ...config import ATTENTION_BACKENDS
from ..kv_spec import KVCacheSpec
from .metadata import AttentionMetadata


class AttentionBackend(ABC):
    """How one engine stores K/V and attends; per engine (it may hold per-engine state).

    Tensors: ``key``/``value`` ``[T, KVH, D]`` (this step's rows), pools ``spec.layer_shape(num_blocks)``,
    ``query`` ``[T, H, D]``; :meth:`attend` returns ``[T, H, D]`` in the query's dtype.
    """

    name: ClassVar[str]

    def check_spec(self, spec: KVCacheSpec) -> None:
        """Raise ValueError where this backend cannot store ``spec``'s layout (the float backends
        here store plain K/V, no scales)."""
        if spec.is_quantized:
            raise ValueError(f"attention backend {self.name!r} stores float K/V only, not a layout with scales")

    def setup(self, spec: KVCacheSpec, num_heads: int) -> Optional[str]:
        """Per-engine preparation once the pools exist (kernel timing); a line for the log, or None."""
        return None

    @property
    def supports_graph_capture(self) -> bool:
        """Whether a decode step (every row one query token) through this backend can be captured
        in a CUDA graph and replayed: the hook for capturing decode steps. True where
        :meth:`store_kv` and :meth:`attend` launch device kernels whose launches depend only on
        tensor shapes, never on values read on the host, so a graph captured over persistent
        metadata tensors (block tables padded to a bucket's width, ``max_query_len`` 1) replays any
        step of that bucket. False here: the torch path loops over the step's host-side lists
        (``query_start_loc_cpu``, ``seq_lens_cpu``), and the CPU paths have no graphs to capture."""
        return False

    def build_metadata(
        self,
        *,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc_cpu: list[int],
        seq_lens_cpu: list[int],
        num_decodes: int,
        block_size: int,
        num_kv_heads: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """The step's metadata from the runner's common inputs: ``slot_mapping`` int64 ``[T]``,
        ``block_tables`` int32 ``[B, max_blocks]``, cumulative query lengths int32 ``[B + 1]`` and
        context lengths int32 ``[B]`` (CPU or ``device``; the runner's persistent buffers), the same
        two as lists, decodes first. Tensors end up on ``device``."""
        return AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            query_start_loc=query_start_loc.to(device),
            seq_lens=seq_lens.to(device),
            block_tables=block_tables.to(device),
            num_decodes=num_decodes,
            max_query_len=max(b - a for a, b in zip(query_start_loc_cpu, query_start_loc_cpu[1:])),
            max_seq_len=max(seq_lens_cpu),
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
        )

    @abstractmethod
    def store_kv(self, key, value, k_pool, v_pool, meta: AttentionMetadata) -> None:
        """Write ``key``/``value`` into their slots (``meta.slot_mapping``), cast to the pool dtype.
        A backend of a quantized layout also takes ``k_scale``/``v_scale`` keywords (the layer's
        scale tensors, ``KVCacheSpec.scale_shape``), in :meth:`attend` too."""

    @abstractmethod
    def attend(
        self,
        query,
        k_pool,
        v_pool,
        meta: AttentionMetadata,
        scale: float,
        sliding_window=None,
        softcap=None,
        key=None,
        value=None,
    ) -> torch.Tensor:
        """Attention of every query row over its request's context in the pools (already holding
        this step's K/V). ``key``/``value`` ``[KVH, T, D]`` may be passed for a path that reads a
        whole-context prefill chunk from them instead of the pool."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TorchAttentionBackend(AttentionBackend):
    """Plain torch: ``index_copy_`` into the pool, ``torch_paged.torch_paged_attention``."""

    name = "torch"

    def store_kv(self, key, value, k_pool, v_pool, meta):
        kvh = k_pool.shape[2]
        k_pool.view(-1, kvh, k_pool.shape[3]).index_copy_(0, meta.slot_mapping, key.to(k_pool.dtype))
        v_pool.view(-1, kvh, v_pool.shape[3]).index_copy_(0, meta.slot_mapping, value.to(v_pool.dtype))

    def attend(self, query, k_pool, v_pool, meta, scale, sliding_window=None, softcap=None, key=None, value=None):
        from .torch_paged import torch_paged_attention

        return torch_paged_attention(
            query, k_pool, v_pool, meta, scale, sliding_window, softcap, key=key, value=value, decode_kernel=None
        )


class CPUKernelAttentionBackend(TorchAttentionBackend):
    """The torch path with the compiled CPU kernels, each where :meth:`setup` timed it faster than
    torch here: ``cpu_kernel.CPUDecodeKernel`` (built on first use) storing K/V and serving decode
    rows, ``cpu_prefill.CPUPrefillKernel`` serving prefill rows (prompt chunks). Everything where a
    kernel cannot serve takes the torch path."""

    name = "torch"
    POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

    def __init__(self) -> None:
        from .cpu_kernel import CPUDecodeKernel
        from .cpu_prefill import CPUPrefillKernel

        self.decode_kernel = CPUDecodeKernel()
        self.prefill_kernel = CPUPrefillKernel()

    def setup(self, spec, num_heads):
        from .cpu_prefill import choose_prefill_path
        from .decode_choice import choose_decode_path

        geometry = (num_heads, spec.num_kv_heads, spec.head_size, spec.block_size, spec.dtype)
        decode = choose_decode_path(self.decode_kernel, *geometry)
        return f"{decode}; {choose_prefill_path(self.prefill_kernel, *geometry)}"

    def store_kv(self, key, value, k_pool, v_pool, meta):
        if not self.decode_kernel.store(key, value, k_pool, v_pool, meta.slot_mapping):
            super().store_kv(key, value, k_pool, v_pool, meta)

    def attend(self, query, k_pool, v_pool, meta, scale, sliding_window=None, softcap=None, key=None, value=None):
        from .torch_paged import torch_paged_attention

        return torch_paged_attention(
            query,
            k_pool,
            v_pool,
            meta,
            scale,
            sliding_window,
            softcap,
            key=key,
            value=value,
            decode_kernel=self.decode_kernel,
            prefill_kernel=self.prefill_kernel,
        )


class _StepsAsideForLayers:
    """What the Triton backends share: per layer, whether the kernels serve that layer's pools.

    The engine checks its spec's layer 0 once (``resolve_backend_name``); a model whose layers
    differ (Gemma 4's global layers of 512-channel heads, MiMo-V2-Flash's V heads narrower than its
    K heads) has layers the kernels may lack: those step aside to the torch path, which reads the
    same pools, so the model is served and no token changes."""

    def serves_layer(self, query_dim: int, k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads=None) -> bool:
        """Whether the kernels serve a layer with these pools (``[blocks, block_size, KVH, D]``) and
        ``query_dim`` channels per query head (``num_heads`` query heads; None: not checked, as for
        storing): K and V heads of one size, equal to the query's, and a shape the kernels have
        (``triton_kernels.unsupported_reason``; memoised per shape)."""
        kvh, dk, dv = k_pool.shape[2], k_pool.shape[3], v_pool.shape[3]
        if dk != dv or query_dim != dk:
            return False
        memo = self.__dict__.setdefault("_served_shapes", {})
        key = (k_pool.device, kvh, dk, k_pool.shape[1], num_heads)
        if key not in memo:
            from .triton_kernels import unsupported_reason

            reason = unsupported_reason(
                k_pool.device, head_dim=dk, num_heads=num_heads, num_kv_heads=kvh, block_size=k_pool.shape[1]
            )
            memo[key] = reason is None
        return memo[key]


class TritonAttentionBackend(_StepsAsideForLayers, AttentionBackend):
    """The Triton kernels: ``triton_kernels.store_kv`` and ``triton_kernels.paged_attention``; a
    layer whose shape they lack takes :class:`TorchAttentionBackend`'s path (``serves_layer``)."""

    name = "triton"

    @property
    def supports_graph_capture(self) -> bool:
        """True: the decode kernel and the K/V store are launched from tensor shapes alone (the
        split count from the block table's width), with no host synchronisation."""
        return True

    def store_kv(self, key, value, k_pool, v_pool, meta):
        from .triton_kernels import store_kv

        if not self.serves_layer(key.shape[-1], k_pool, v_pool):
            return TorchAttentionBackend.store_kv(self, key, value, k_pool, v_pool, meta)
        store_kv(key, value, k_pool, v_pool, meta.slot_mapping)

    def attend(self, query, k_pool, v_pool, meta, scale, sliding_window=None, softcap=None, key=None, value=None):
        from .triton_kernels import paged_attention

        if not self.serves_layer(query.shape[-1], k_pool, v_pool, query.shape[1]):
            return TorchAttentionBackend.attend(
                self, query, k_pool, v_pool, meta, scale, sliding_window, softcap, key=key, value=value
            )
        return paged_attention(
            query.contiguous(),
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


INT8_SPEC_ERROR = "an int8 cache with one float32 scale per token and KV head (CacheConfig(dtype='int8'))"


def _check_int8_spec(name: str, spec: KVCacheSpec) -> None:
    if not (spec.dtype == torch.int8 and spec.scale_dtype == torch.float32 and spec.scales_per_token_head == 1):
        raise ValueError(
            f"attention backend {name!r} (int8) stores only {INT8_SPEC_ERROR}, got dtype {spec.dtype}, "
            f"scale_dtype {spec.scale_dtype}, scales_per_token_head {spec.scales_per_token_head}"
        )


class Int8TorchAttentionBackend(AttentionBackend):
    """Plain torch over an int8 cache: ``kv_quant.store_quantized`` on write, then
    ``torch_paged_attention`` with the scales (it gathers and dequantizes what each request reads)."""

    name = "torch"

    def check_spec(self, spec: KVCacheSpec) -> None:
        _check_int8_spec(self.name, spec)

    def store_kv(self, key, value, k_pool, v_pool, meta, k_scale=None, v_scale=None):
        from .kv_quant import store_quantized

        store_quantized(key, value, k_pool, v_pool, k_scale, v_scale, meta.slot_mapping)

    def attend(
        self,
        query,
        k_pool,
        v_pool,
        meta,
        scale,
        sliding_window=None,
        softcap=None,
        key=None,
        value=None,
        k_scale=None,
        v_scale=None,
    ):
        from .torch_paged import torch_paged_attention

        return torch_paged_attention(
            query,
            k_pool,
            v_pool,
            meta,
            scale,
            sliding_window,
            softcap,
            decode_kernel=getattr(self, "decode_kernel", None),
            prefill_kernel=getattr(self, "prefill_kernel", None),
            k_scale=k_scale,
            v_scale=v_scale,
        )


class Int8CPUKernelAttentionBackend(Int8TorchAttentionBackend):
    """:class:`Int8TorchAttentionBackend` with the compiled CPU kernels: the decode kernel quantizing
    on write (always, where built: the same bits as the torch store but for ties, see
    ``cpu_decode.c``) and serving decode rows (``CPUDecodeKernel``'s int8 path: each int8 row widened
    in registers once for its query heads, the token's scale applied once per dot product, float32
    accumulation), the prefill kernel serving prompt chunks (``CPUPrefillKernel``'s int8 path: value
    rows dequantized into its float32 tiles; key rows too, or, for a bfloat16 query on a CPU with
    AVX512-BF16, kept as bfloat16 for ``vdpbf16ps`` scores with the scale applied per key), each
    where :meth:`setup` timed it faster than the torch path here."""

    def __init__(self) -> None:
        from .cpu_kernel import CPUDecodeKernel
        from .cpu_prefill import CPUPrefillKernel

        self.decode_kernel = CPUDecodeKernel()
        self.prefill_kernel = CPUPrefillKernel()

    def setup(self, spec, num_heads):
        from .cpu_prefill import choose_prefill_path
        from .decode_choice import choose_decode_path

        geometry = (num_heads, spec.num_kv_heads, spec.head_size, spec.block_size, torch.int8)
        decode = choose_decode_path(self.decode_kernel, *geometry)
        return f"{decode}; {choose_prefill_path(self.prefill_kernel, *geometry)}"

    def store_kv(self, key, value, k_pool, v_pool, meta, k_scale=None, v_scale=None):
        if not self.decode_kernel.store_int8(key, value, k_pool, v_pool, k_scale, v_scale, meta.slot_mapping):
            super().store_kv(key, value, k_pool, v_pool, meta, k_scale=k_scale, v_scale=v_scale)


class Int8TritonAttentionBackend(_StepsAsideForLayers, AttentionBackend):
    """The Triton kernels over an int8 cache: ``triton_kernels.store_kv`` quantizing on write and
    ``triton_kernels.paged_attention`` dequantizing each K/V tile with its tokens' scales; a layer
    whose shape they lack takes :class:`Int8TorchAttentionBackend`'s path (``serves_layer``)."""

    name = "triton"

    @property
    def supports_graph_capture(self) -> bool:
        """True, as :class:`TritonAttentionBackend`: the scales are tensors beside the pools."""
        return True

    def check_spec(self, spec: KVCacheSpec) -> None:
        _check_int8_spec(self.name, spec)

    def store_kv(self, key, value, k_pool, v_pool, meta, k_scale=None, v_scale=None):
        from .triton_kernels import store_kv

        if not self.serves_layer(key.shape[-1], k_pool, v_pool):
            return Int8TorchAttentionBackend.store_kv(self, key, value, k_pool, v_pool, meta, k_scale, v_scale)
        store_kv(key, value, k_pool, v_pool, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)

    def attend(
        self,
        query,
        k_pool,
        v_pool,
        meta,
        scale,
        sliding_window=None,
        softcap=None,
        key=None,
        value=None,
        k_scale=None,
        v_scale=None,
    ):
        from .triton_kernels import paged_attention

        if not self.serves_layer(query.shape[-1], k_pool, v_pool, query.shape[1]):
            return Int8TorchAttentionBackend.attend(
                self, query, k_pool, v_pool, meta, scale, sliding_window, softcap, k_scale=k_scale, v_scale=v_scale
            )
        return paged_attention(
            query.contiguous(),
            k_pool,
            v_pool,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            scale,
            sliding_window=sliding_window,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
        )


def resolve_backend_name(requested: str, device: torch.device, **shape) -> str:
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
            warnings.warn(f"attention_backend='auto' uses the torch attention path: {reason}", stacklevel=4)
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


def select_backend(
    requested: str,
    device: torch.device,
    spec: KVCacheSpec,
    num_heads: int,
    layer_devices: Optional[Sequence[torch.device]] = None,
) -> AttentionBackend:
    """A new backend object for one engine: ``requested`` ("auto", "torch" or "triton", see
    :func:`resolve_backend_name` for the environment override, warnings and errors) for a cache of
    ``spec`` whose layers live on ``layer_devices`` (default: all on ``device``). The torch path
    uses the compiled CPU kernel where every layer is on the CPU and the pools are float32,
    bfloat16 or int8; an int8 layout (``spec.is_quantized``) gets the int8 class of each path.

    Raises:
        ValueError: an unknown or unusable backend, or a layout the backend cannot store.
    """
    # The shape the kernels are checked against: the first layer they could run (K and V heads of
    # one size, not latent, pools of its own); the other layers step aside per layer where the
    # kernels lack their shape. A model with no such layer (every layer latent) reads no pool
    # through the kernels, so no shape is checked.
    layers = (spec.layer(i) for i in range(spec.num_layers))
    kernel_layer = next(
        (s for s in layers if not s.latent and s.shared_from is None and s.head_size == s.v_head_size), None
    )
    name = resolve_backend_name(
        requested,
        device,
        dtype=None if spec.is_quantized else spec.dtype,  # int8 tiles compute in the model's dtype
        head_dim=kernel_layer.head_size if kernel_layer else None,
        num_heads=num_heads if kernel_layer else None,
        num_kv_heads=kernel_layer.num_kv_heads if kernel_layer else None,
        block_size=spec.block_size,
    )
    devices = [torch.device(d) for d in (layer_devices or [device])]
    on_cpu = all(d.type == "cpu" for d in devices)
    if spec.is_quantized:
        if name == "triton":
            backend: AttentionBackend = Int8TritonAttentionBackend()
        elif on_cpu:
            backend = Int8CPUKernelAttentionBackend()
        else:
            backend = Int8TorchAttentionBackend()
    elif name == "triton":
        backend = TritonAttentionBackend()
    elif spec.dtype in CPUKernelAttentionBackend.POOL_DTYPES and on_cpu:
        backend = CPUKernelAttentionBackend()
    else:
        backend = TorchAttentionBackend()
    backend.check_spec(spec)
    return backend
