"""Configuration dataclasses for the engine, validated on construction.

Every check raises ``ValueError`` naming the argument and its allowed values, in the manner of
``transformers.GenerationConfig``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Mapping, Optional, get_args

PREEMPTION_MODES = ("recompute", "swap", "auto")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_CACHE_DTYPES = (None, "float32", "float16", "bfloat16", "int8")
"""``CacheConfig.dtype`` names: None (the model's dtype), a float dtype, or "int8" (K/V quantized on
write, symmetric, one float32 scale per token and KV head for K and for V each)."""
LinearBackend = Literal["auto", "torch", "native", "onednn"]
LINEAR_BACKENDS = get_args(LinearBackend)
"""The ``linear_backend`` names: "auto" and one per GEMM kernel (``kernels.linears.registry`` maps
them to kernel classes and checks that the two lists agree)."""
Quantization = Literal["int8", "w8a8"]
QUANTIZATIONS = get_args(Quantization)
"""The ``EngineConfig.quantization`` schemes (None: the model's own weights): "int8", int8 weights
with the activations in the model's dtype; "w8a8", int8 weights and int8 activations."""


@dataclass(frozen=True)
class QuantScheme:
    """A linear-weight quantization scheme as a value: what the kernels and the patches read.

    Decoded once from the user's name (:func:`quant_scheme`); no other module compares the names.

    Attributes:
        name: the scheme's name ("int8", "w8a8"; "torchao-int8" for a torchao model's own int8
            weight-only linears, never a user's choice).
        weight_dtype: the stored weight's dtype name ("int8").
        activation_dtype: None, the activations stay in the model's dtype (weight-only); "int8",
            each input row of a linear is quantized on the fly (symmetric, one scale per row).
        group_size: input channels sharing one weight scale; None, one scale per output channel
            (``scale = absmax / 127`` over the whole row, symmetric).
        quantize_float_weights: the model's float linears are quantized at load; False, only
            linears already quantized by torchao are served (repacked exactly), the float ones stay.
    """

    name: str
    weight_dtype: str = "int8"
    activation_dtype: Optional[str] = None
    group_size: Optional[int] = None
    quantize_float_weights: bool = True

    @property
    def label(self) -> str:
        """The weights' format as served, for reports: "int8" (weight-only, a torchao model's
        too) or "w8a8"."""
        if self.activation_dtype is None:
            return self.weight_dtype
        return f"w{self.weight_dtype.removeprefix('int')}a{self.activation_dtype.removeprefix('int')}"


QUANT_SCHEMES: Mapping[str, QuantScheme] = MappingProxyType(
    {"int8": QuantScheme("int8"), "w8a8": QuantScheme("w8a8", activation_dtype="int8")}
)
"""The scheme of each user-facing ``EngineConfig.quantization`` name (keys: :data:`QUANTIZATIONS`)."""
TORCHAO_INT8 = QuantScheme("torchao-int8", quantize_float_weights=False)
"""A torchao int8 weight-only model's own linears, repacked exactly into the weight-only int8
kernels while its float linears stay float (the engine's choice, not a user's)."""


@dataclass(frozen=True)
class KVQuantScheme:
    """A quantized KV cache layout as a value: ``CacheConfig.dtype`` decoded
    (``CacheConfig.kv_quant``), what the pools' ``KVCacheSpec`` is built from.

    Attributes:
        name: the ``CacheConfig.dtype`` name ("int8").
        dtype: the stored K/V elements' dtype name ("int8"; symmetric, ``scale = absmax / 127`` over
            a head's channels, quantized on write).
        scale_dtype: the scales' dtype name ("float32").
        scales_per_token_head: scales per token and KV head, for K and for V each (1).
    """

    name: str
    dtype: str = "int8"
    scale_dtype: str = "float32"
    scales_per_token_head: int = 1


KV_QUANT_SCHEMES: Mapping[str, KVQuantScheme] = MappingProxyType({"int8": KVQuantScheme("int8")})
"""The layout of each quantized ``CacheConfig.dtype`` name (the others are float dtypes)."""


def quant_scheme(name, allow_none: bool = True) -> Optional[QuantScheme]:
    """The :class:`QuantScheme` of a user's ``quantization`` name (None for None when
    ``allow_none``).

    Raises:
        ValueError: "`quantization` must be [None or ]one of ('int8', 'w8a8'), got ..." for any
            other value.
    """
    if name is None and allow_none:
        return None
    if isinstance(name, str) and name in QUANT_SCHEMES:
        return QUANT_SCHEMES[name]
    allowed = "None or one of" if allow_none else "one of"
    raise ValueError(f"`quantization` must be {allowed} {QUANTIZATIONS}, got {name!r}")


def is_int(value) -> bool:
    """True for an ``int`` that is not a ``bool`` (the one integer-argument test of the package)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value, low: int) -> None:
    """Raise ``ValueError("`name` must be an int >= low, got ...")`` unless ``value`` is one."""
    if not is_int(value) or value < low:
        raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}")


def _check_positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not is_int(value) or value < 1:
        allowed = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}")


@dataclass
class CacheConfig:
    """Size and layout of the paged KV cache.

    Args:
        block_size: tokens per KV block (a power of two, 1..256). Default 16, as in vLLM.
        num_blocks: blocks in the pool. When ``None`` the pool is sized from memory: on CUDA from
            ``gpu_memory_utilization`` of the free device memory after the weights, on CPU from
            ``cpu_cache_gib``. The engine logs the size it chose (logger ``hf_contbatch.engine``).
        cpu_cache_gib: GiB of host memory for the KV pool when running on CPU and ``num_blocks`` is
            None. None (the default) sizes it from what the model can use: ``max_num_seqs`` requests
            at the model's full context, at most 1 GiB and a quarter of the available memory
            (``hf_contbatch.core.pool_size``).
        gpu_memory_utilization: fraction (0, 1] of device memory the engine may fill (weights included)
            on CUDA when ``num_blocks`` is None.
        swap_space_gib: GiB of host memory for the swap pool used by swap preemption. None (the
            default) gives it as many blocks as the KV pool, at most what the model can use, under
            the same caps (``hf_contbatch.core.pool_size``).
        enable_prefix_caching: reuse the KV blocks of identical full-block prompt prefixes (a
            shared system prompt, few-shot contexts, a prompt sent again). On by default, as in
            vLLM (V1) and SGLang: a finished request's blocks stay hashed in the free queue and are
            evicted least-recently-freed first, so it costs no pool space; False recomputes every
            prompt.
        dtype: KV cache dtype name ("float32", "float16", "bfloat16", "int8") or None for the
            model's dtype. "int8" stores K and V as int8 with one float32 scale per token and KV
            head each (symmetric: scale = absmax / 127 over the head's channels, quantized on
            write), about a quarter of float32's bytes: the pool holds >= 3x the tokens of float32
            in the same memory; attention reads the scales and computes in the model's dtype.

    Attributes:
        kv_quant: ``dtype`` decoded when it names a quantized layout (:class:`KVQuantScheme`),
            else None: what the pools read.
    """

    block_size: int = 16
    num_blocks: Optional[int] = None
    cpu_cache_gib: Optional[float] = None
    gpu_memory_utilization: float = 0.9
    swap_space_gib: Optional[float] = None
    enable_prefix_caching: bool = True
    dtype: Optional[str] = None
    kv_quant: Optional[KVQuantScheme] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1) or self.block_size > 256:
            raise ValueError(f"`block_size` must be a power of two between 1 and 256, got {self.block_size}")
        _check_positive_int("num_blocks", self.num_blocks, allow_none=True)
        if self.cpu_cache_gib is not None and not (
            isinstance(self.cpu_cache_gib, (int, float))
            and not isinstance(self.cpu_cache_gib, bool)
            and self.cpu_cache_gib > 0
        ):
            raise ValueError(f"`cpu_cache_gib` must be a positive number of GiB or None, got {self.cpu_cache_gib!r}")
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"`gpu_memory_utilization` must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.swap_space_gib is not None and not (
            isinstance(self.swap_space_gib, (int, float))
            and not isinstance(self.swap_space_gib, bool)
            and self.swap_space_gib >= 0
        ):
            raise ValueError(f"`swap_space_gib` must be a number >= 0 or None, got {self.swap_space_gib!r}")
        if not isinstance(self.enable_prefix_caching, bool):  # a string "False" would read as on
            raise ValueError(f"`enable_prefix_caching` must be True or False, got {self.enable_prefix_caching!r}")
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"`dtype` must be one of {KV_CACHE_DTYPES}, got {self.dtype!r}")
        self.kv_quant = KV_QUANT_SCHEMES.get(self.dtype) if self.dtype is not None else None


@dataclass
class SchedulerConfig:
    """Limits that shape each scheduler iteration.

    Args:
        max_num_seqs: most requests running at once (decode batch size).
        max_num_batched_tokens: token budget of one forward (decode tokens plus prefill chunks).
            A prompt longer than the remaining budget is prefilled in chunks (chunked prefill).
        watermark: fraction [0, 1) of the pool kept free at admission so running requests can grow
            without immediate preemption (vLLM's watermark).
        preemption_mode: "recompute" (free the KV, recompute it on resumption), "swap" (copy the KV
            to a host pool of ``CacheConfig.swap_space_gib`` and back) or "auto" (per victim, swap
            when ``swap_cost_per_block * blocks`` is below the tokens a recompute would redo).
            Swap falls back to recompute when the host pool is full.
        long_prefill_token_threshold: most prefill tokens one request may take in a step, so a long
            prompt does not starve short ones; None means no limit beyond the token budget.
        max_preemptions: after this many preemptions a request escalates ahead of every other
            priority and is chosen as a victim only when nothing else is left to preempt, so it
            cannot be preempted forever.
        aging_seconds: every ``aging_seconds`` of age is worth one priority level (continuously:
            the effective level is ``priority - age / aging_seconds``), so no request waits forever
            behind a stream of higher-priority arrivals. None disables.
        swap_cost_per_block: cost of moving one block to the host and back, in tokens of recompute,
            for ``preemption_mode="auto"``; None lets the engine estimate it from the model size,
            the block bytes and the device (see ``LLMEngine``).
        per_request_state: the model keeps a recurrent state per request (Mamba, linear attention,
            short convolutions; the engine sets it for such a model): a prefill that fits one
            step's token budget runs whole (a chunk would need the state a chunk leaves, which some
            families' layers do not start from), and parallel sampling's sequences run as
            independent requests (a fork would need its parent's state at the fork point).
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    watermark: float = 0.01
    preemption_mode: Literal["recompute", "swap", "auto"] = "recompute"
    long_prefill_token_threshold: Optional[int] = None
    max_preemptions: int = 8
    aging_seconds: Optional[float] = 30.0
    swap_cost_per_block: Optional[float] = None
    per_request_state: bool = False

    def __post_init__(self) -> None:
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if not (isinstance(self.watermark, (int, float)) and 0 <= self.watermark < 1):
            raise ValueError(f"`watermark` must be in [0, 1), got {self.watermark!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"`preemption_mode` must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        _check_positive_int("long_prefill_token_threshold", self.long_prefill_token_threshold, allow_none=True)
        _check_positive_int("max_preemptions", self.max_preemptions)
        if self.aging_seconds is not None and not (
            isinstance(self.aging_seconds, (int, float)) and self.aging_seconds > 0
        ):
            raise ValueError(f"`aging_seconds` must be a positive number or None, got {self.aging_seconds!r}")
        if self.swap_cost_per_block is not None and not (
            isinstance(self.swap_cost_per_block, (int, float))
            and not isinstance(self.swap_cost_per_block, bool)
            and self.swap_cost_per_block >= 0
        ):
            raise ValueError(f"`swap_cost_per_block` must be a number >= 0 or None, got {self.swap_cost_per_block!r}")


@dataclass
class EngineConfig:
    """Everything the engine needs besides the model.

    Args:
        cache: the KV cache configuration.
        scheduler: the scheduler limits.
        attention_backend: "auto" (Triton on CUDA, plain torch on CPU), "torch" or "triton". The
            environment variable ``HF_CONTBATCH_ATTENTION_BACKEND`` overrides "auto".
        num_threads: if set, ``torch.set_num_threads(num_threads)`` when the background thread starts
            (torch has one process-wide setting, so this changes it for the caller too); None
            keeps torch's setting.
        seed: seed of the engine's own sampling generator (no global RNG is touched).
        record_phases: keep the per-iteration phase log (used by tests and the dashboard).
        linear_backend: how the model's float32 CPU ``nn.Linear`` layers run. "auto" packs their
            weights for our own GEMM (built with the system C compiler), or for oneDNN where it
            cannot be built, when the packed copy takes at most a quarter of the available memory;
            "native" (ours) and "onednn" always pack with that kernel; "torch" never packs
            (``F.linear``). Packed weights skip the per-call layout work of ``F.linear`` at small row
            counts; they cost a copy of the weights and are removed on close (see
            ``hf_contbatch.kernels.linears``; figures in ``docs/benchmarks.md``).
        fuse_linears: with packed linears, run sibling projections that read the same input
            (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``) as one GEMM over their
            concatenated packed weights; outputs are bit-identical, the model is not modified, and
            the fused copy replaces the members' own (see ``hf_contbatch.kernels.linears.fused``).
        fuse_model_ops: on CPU, run the model's RMSNorms and gated SiLU MLPs' ``silu(gate) * up``
            with our C kernels (one pass each instead of transformers' 5-7 ops) where they time
            faster than the modules' own ops on this CPU, as per-instance forwards removed on close
            (``hf_contbatch.kernels.fused_ops``); and run each decoder layer of the Llama form
            (Llama, SmolLM, Mistral, Qwen2 and any family whose layer, attention, MLP, RMSNorm and
            rotary code read the same) as one fused step: input RMSNorm, the q/k/v GEMM, rotary in
            C, the paged attention, o_proj, residual add + RMSNorm in one C pass, gate/up GEMM,
            SiLU-and-mul, down_proj (``hf_contbatch.kernels.fused_layer``; the layer's own forward
            for any call it does not serve exactly). Not with ``compile_model``. Outputs may differ
            from the modules' in the last bit of a float32 value (the RMSNorms' rounding order).
        drive_in_caller: a blocking call (``pipe(...)``, ``handle.result()``) runs the engine's
            iterations in the calling thread while the background thread leaves, so one thread's
            OpenMP team runs torch instead of two competing for the cores. False keeps all work on the
            background thread, as does a running live dashboard (it needs the CPU to render).
        prompt_lookup_num_tokens: default for requests that do not set it: draft up to this many
            tokens per step by prompt lookup and verify them in the batch (speculative decoding,
            ``hf_contbatch.core.prompt_lookup``; exact for greedy requests, which are the ones that
            draft). 0 (default) is off: drafts cost forward rows, so they pay on input-grounded
            work (editing, extraction, code) and cost a little elsewhere.
        compile_model: compile the model forward with ``torch.compile`` (inductor), attention and
            packed linears kept as opaque ops (``hf_contbatch.kernels.compiled_forward``). On CPU this
            fuses transformers' small ops around the GEMMs (fewer ops per step), but the first steps
            compile for tens of seconds (faster in later processes, from inductor's on-disk cache),
            so it pays off on long jobs. None (default) reads the
            environment variable ``HF_CONTBATCH_COMPILE`` ("1" on, "0" or unset off). Needs a C++
            compiler; where compiling fails the model runs eagerly with one warning.
        quantization: None (default: the weights as loaded), "int8" or "w8a8". "int8": every
            ``nn.Linear`` of the model (decoder layers and LM head) served with weight-only int8
            weights, quantized at load (symmetric, one scale per output channel,
            ``scale = absmax / 127``: torchao's ``Int8WeightOnlyConfig`` scheme), activations in the
            model's dtype. "w8a8": the same int8 weights, and each input row of a linear quantized
            to int8 on the fly (symmetric, one scale per row: torchao's
            ``Int8DynamicActivationInt8WeightConfig``, vLLM's dynamic W8A8), products summed in
            int32 (VNNI / AMX-int8 dot products): about twice the bfloat16 GEMM's rate where the CPU
            has VNNI, at some accuracy (see ``quality_report``). The kernel per shape and row count
            is chosen by timing (ours, ``int8_gemm.c``, or torch's); ``linear_backend``
            "native"/"torch" force ours/torch's ("onednn" has no int8 kernel). CPU models only.
            The model's float weights are kept and the model restored exactly on close.

    Attributes:
        quant_scheme: ``quantization`` decoded (:class:`QuantScheme`, None without one): the value
            the engine's patches and the kernels read.
    """

    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    linear_backend: LinearBackend = "auto"
    num_threads: Optional[int] = None
    seed: Optional[int] = None
    record_phases: bool = True
    drive_in_caller: bool = True
    fuse_linears: bool = True
    fuse_model_ops: bool = True
    prompt_lookup_num_tokens: int = 0
    compile_model: Optional[bool] = None
    quantization: Optional[Quantization] = None
    quant_scheme: Optional[QuantScheme] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.cache, CacheConfig):
            raise ValueError(f"`cache` must be a CacheConfig, got {type(self.cache).__name__}")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ValueError(f"`scheduler` must be a SchedulerConfig, got {type(self.scheduler).__name__}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"`attention_backend` must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"`linear_backend` must be one of {LINEAR_BACKENDS}, got {self.linear_backend!r}")
        _check_positive_int("num_threads", self.num_threads, allow_none=True)
        if not isinstance(self.fuse_linears, bool):
            raise ValueError(f"`fuse_linears` must be True or False, got {self.fuse_linears!r}")
        if not isinstance(self.fuse_model_ops, bool):
            raise ValueError(f"`fuse_model_ops` must be True or False, got {self.fuse_model_ops!r}")
        if self.compile_model is not None and not isinstance(self.compile_model, bool):
            raise ValueError(f"`compile_model` must be True, False or None, got {self.compile_model!r}")
        if not is_int(self.prompt_lookup_num_tokens) or self.prompt_lookup_num_tokens < 0:
            raise ValueError(
                f"`prompt_lookup_num_tokens` must be an int >= 0 (0: off), got {self.prompt_lookup_num_tokens!r}"
            )
        # The one decoding of the user's name: everything downstream reads ``quant_scheme``'s fields.
        self.quant_scheme = quant_scheme(self.quantization)
        if self.quantization is not None and self.linear_backend == "onednn":
            raise ValueError(
                f"`linear_backend='onednn'` has no {self.quantization} kernel; with `quantization={self.quantization!r}` "
                "use 'auto', 'native' or 'torch'"
            )


def resolve_compile_model(requested: Optional[bool]) -> bool:
    """``EngineConfig.compile_model``, with None read from ``HF_CONTBATCH_COMPILE`` ("1"/"0"/unset).

    Raises ValueError for any other value of the variable.
    """
    if requested is not None:
        return requested
    env = os.environ.get("HF_CONTBATCH_COMPILE", "0")
    if env not in ("0", "1"):
        raise ValueError(f"HF_CONTBATCH_COMPILE must be '0' or '1', got {env!r}")
    return env == "1"
