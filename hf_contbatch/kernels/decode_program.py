"""Every decoder layer of a float32 or bfloat16 decode step in one native call (``fused_ops.c``,
``hf_contbatch_decode_layers_f32`` and ``_bf16``).

At a decode step the fused layer step (``kernels.fused_layer``) makes about a dozen short native
calls per layer from Python: two RMSNorms, three GEMMs of fused packed weights, two rotary passes,
the K/V store, the paged decode attention and SiLU-and-mul. Each costs a ctypes call, an output
allocation and a few checks, and the weights streaming through the caches between the calls evict
the interpreter's working set, so a call costs 10-15 µs where the same call in a loop costs 5
(``benchmarks/bench_decode_program.py``). On a small model, or on any model at a few requests, that
is most of the step. The program runs the same kernels in the same order with the same arguments
from C, once per step: the same bits as the layer-by-layer path. Each layer's arguments (a ctypes
struct of pointers) are kept and reused while the objects they were read from are the same ones.

It serves a step only when every one of these holds (otherwise the layers run one by one, as
before; nothing changes but the speed):

- float32 or bfloat16 hidden states and every row a decode (one query row per request);
- every layer is of the plain pre-norm form (Llama, Mistral, Qwen2: no q/k norms, no post-norms,
  no residual multiplier, no partial rotary, separate q/k/v and gate/up projections) and its fused
  step would serve it (``FusedLayerForward.fits``: no hooks, evaluation mode, a plain paged layer);
- q/k/v and gate/up are each one fused group of packed linears, o and down packed linears,
  verified for this step (``PackedLinears.verified_step``: no LoRA wrapper or other forward
  swapped in), and the GEMM serving this step's row count is our kernel (``NativeGEMM``: float32,
  or bfloat16 widened in registers or by VDPBF16PS);
- the attention backend is the CPU kernels' with the compiled decode attention chosen, and the
  layer's pools of the model's dtype and contiguous (not quantized).
"""

from __future__ import annotations

import ctypes
import operator
import threading
from typing import Optional

import torch

from .attention.backends import CPUKernelAttentionBackend
from .fused_ops import fused_library
from .linears.dispatch_gemm import DispatchGEMM
from .linears.native_gemm import NativeGEMM, gemm_function, native_library
from .linears.packed_forward import PackedForward


class DecodeLayer(ctypes.Structure):
    """``hf_decode_layer`` of ``fused_ops.c`` (field for field, in its order)."""

    _fields_ = [
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("qkv_gemm", ctypes.c_void_p),
        ("o_gemm", ctypes.c_void_p),
        ("gate_up_gemm", ctypes.c_void_p),
        ("down_gemm", ctypes.c_void_p),
        ("qkv", ctypes.c_void_p),
        ("qkv_bias", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("o_bias", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p),
        ("gate_up_bias", ctypes.c_void_p),
        ("down", ctypes.c_void_p),
        ("down_bias", ctypes.c_void_p),
        ("k_pool", ctypes.c_void_p),
        ("v_pool", ctypes.c_void_p),
        ("eps1", ctypes.c_float),
        ("eps2", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("sliding_window", ctypes.c_int64),
        ("qkv_kind", ctypes.c_int64),
        ("o_kind", ctypes.c_int64),
        ("gate_up_kind", ctypes.c_int64),
        ("down_kind", ctypes.c_int64),
        ("round_first1", ctypes.c_int64),
        ("round_first2", ctypes.c_int64),
    ]


class DecodeStep(ctypes.Structure):
    """``hf_decode_step`` of ``fused_ops.c``."""

    _fields_ = [
        ("rows", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("max_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("threads", ctypes.c_int64),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
        ("lens", ctypes.c_void_p),
        ("store", ctypes.c_void_p),
        ("attend", ctypes.c_void_p),
        ("scratch", ctypes.c_void_p),
    ]


_DTYPES = (torch.float32, torch.bfloat16)


def _gemm_entry(kernel: NativeGEMM, data: torch.Tensor, dtype: torch.dtype) -> tuple[int, int]:
    """(address, kind) of the GEMM entry point ``_native_gemm`` calls for inputs of ``dtype`` over
    ``data`` packed by ``kernel``'s build (``native_gemm.gemm_function``): kind 0 returns nothing
    (float32; bfloat16 by VDPBF16PS), kind 1 returns -1 when out of memory (bfloat16 widened)."""
    fn = gemm_function(kernel._own_library() or native_library(), dtype, data)
    return ctypes.cast(fn, ctypes.c_void_p).value, int(fn.restype is ctypes.c_int)


def _native_part(kernel, packed, bias, rows: int, dtype: torch.dtype):
    """The (NativeGEMM, packed panels, dense float32 bias or None) that serve a call of ``rows``
    rows of ``dtype``, or None when our kernel does not serve it."""
    if type(kernel) is DispatchGEMM:
        i = kernel.index_for_rows(rows)
        kernel, packed, bias = kernel.kernels[i], packed.data[i], None if bias is None else bias[i]
    if type(kernel) is not NativeGEMM or packed is None:
        return None
    data = packed.data
    if not isinstance(data, torch.Tensor) or data.element_size() != (4 if dtype == torch.float32 else 2):
        return None
    return kernel, data, bias


def _layer_key(fused, thread: int) -> Optional[tuple]:
    """The objects a layer's struct is filled from, read without resolving them (compared by
    identity): the projections' modules and current forwards (each verified for ``thread``'s
    step), their groups, packed weights, biases and kernels, the norms' scales and constants. None
    when a projection is not a verified packed forward (the full resolution then says no)."""
    attn, mlp = fused.attn, fused.mlp
    am, mm = attn._modules, mlp._modules
    key = []
    for modules, names in ((am, ("q_proj", "k_proj", "v_proj", "o_proj")), (mm, ("gate_proj", "up_proj", "down_proj"))):
        for name in names:
            m = modules.get(name)
            f = None if m is None else m.__dict__.get("forward")
            if type(f) is not PackedForward or f.verified_thread != thread:
                return None
            group = f.group
            key += (m, f, group, f.kernel, f.packed, f.verified_bias, f.active, f.dtype)
            if group is not None:
                key += (group.packed, group.bias, group.kernel)
    first, second = fused.layer_norms
    key += (
        first.scale(),
        second.scale(),
        first.eps,
        second.eps,
        attn.scaling,
        attn.head_dim,
        fused._window(),
    )
    return tuple(key)


class DecodeProgram:
    """The decode program of one model's fused layers (see the module docstring).

    Args:
        layers: ``(layer module, FusedLayerForward)`` in model order, as ``FusedModelForward``
            holds them.

    Attributes:
        served: how many steps the program ran (for tests and reports).
    """

    def __init__(self, layers: list) -> None:
        self.layers = layers
        self.served = 0
        # Per layer: ((rows, dtype, pool addresses, shape, dtype), the objects its struct was filled
        # from (_layer_key), the struct, the geometry); the struct is reused while every value is
        # equal and every object the same one.
        self._layers: list = []
        form_ok = all(
            not (f.form.post_norms or f.form.residual_multiplier or f.form.packed_qkv or f.form.packed_gate_up)
            and f.form.qk_norm is None
            and not f.form.partial_rotary
            and not f.form.module_activation
            for _, f in layers
        )
        # No ctypes function is kept (looked up per call): a deepcopy or pickle of the model carries
        # this object, and ctypes pointers cannot be copied.
        self.usable = bool(layers) and form_ok and fused_library() is not None

    def run(self, h: torch.Tensor, position_embeddings, position_ids, step) -> Optional[torch.Tensor]:
        """The hidden states ``[1, T, hidden]`` after every layer for a step this program serves,
        computed in one native call; None (nothing computed, nothing stored) otherwise.

        Args:
            h: the embedded input ids, ``[1, T, hidden]``, float32 or bfloat16, contiguous.
            position_embeddings: ``(cos, sin)``, each ``[1, T, head_dim]`` of ``h``'s dtype.
            position_ids: int64 ``[1, T]``.
            step: the step's ``PagedCacheStep``.

        Raises:
            MemoryError: the decode attention could not allocate its scratch, or a widening
                bfloat16 GEMM its float32 copy of the inputs.
        """
        dtype = h.dtype
        if not self.usable or dtype not in _DTYPES or not h.is_contiguous():
            return None
        meta = step.metadata
        rows = h.shape[1]
        if meta is None or meta.num_decodes != rows or meta.num_requests != rows:
            return None
        cache = step.cache
        backend = getattr(cache, "backend", None)
        if type(backend) is not CPUKernelAttentionBackend or cache.key_scales:
            return None
        decode_kernel = backend.decode_kernel
        entry = decode_kernel.entry_points() if decode_kernel.available else None
        if entry is None:
            return None
        cos, sin = position_embeddings
        kwargs = {
            "attention_mask": None,
            "position_embeddings": position_embeddings,
            "position_ids": position_ids,
            "cache": step,
            "use_cache": True,
            "paged_cache": step,
        }
        thread = threading.get_ident()
        n = len(self.layers)
        structs = (DecodeLayer * n)()
        geometry = None
        for i, (layer, fused) in enumerate(self.layers):
            if (
                layer._forward_hooks
                or layer._forward_pre_hooks
                or layer._backward_hooks
                or layer._backward_pre_hooks
                or layer.__dict__.get("forward") is not fused
            ):
                return None  # hooks to run, or the layer's fused step removed since: one by one
            fit = fused.fits(h, (), kwargs)
            if fit is None or fit[1].dtype != dtype:
                return None
            attn, mlp = fused.attn, fused.mlp
            key = _layer_key(fused, thread)
            idx = attn.layer_idx
            k_pool, v_pool = cache.key_cache[idx], cache.value_cache[idx]
            # The pools by address, not held: a closed engine's pools must not outlive it here.
            values = (rows, dtype, k_pool.data_ptr(), v_pool.data_ptr(), k_pool.shape, k_pool.dtype)
            cached = self._layers[i] if i < len(self._layers) else None
            if (
                key is not None
                and cached is not None
                and cached[0] == values
                and len(cached[1]) == len(key)
                and all(map(operator.is_, cached[1], key))
                and (geometry is None or cached[3] == geometry)
            ):
                # The same forwards, packed weights, biases, pools, norm scales and constants as at
                # the step that filled this layer's struct, at the same row count: its values hold.
                structs[i] = cached[2]
                geometry = cached[3]
                continue
            qkv = self._group(attn._modules, ("q_proj", "k_proj", "v_proj"), rows, dtype, thread)
            gate_up = self._group(mlp._modules, ("gate_proj", "up_proj"), rows, dtype, thread)
            o = self._single(attn._modules.get("o_proj"), rows, dtype, thread)
            down = self._single(mlp._modules.get("down_proj"), rows, dtype, thread)
            if qkv is None or gate_up is None or o is None or down is None:
                return None
            if (
                k_pool.dtype != dtype
                or v_pool.shape != k_pool.shape
                or v_pool.dtype != dtype
                or not decode_kernel.can_serve(h, k_pool, v_pool)
            ):
                return None
            d = attn.head_dim
            q_n, kv_n, kv_n2 = qkv[4]
            inter = gate_up[4][0]
            layer_geometry = (d, q_n // d, kv_n // d, inter, k_pool.shape[1])
            if (
                q_n % d
                or kv_n % d
                or kv_n2 != kv_n
                or gate_up[4][1] != inter
                or k_pool.shape[2:] != (kv_n // d, d)
                or o[4] != (q_n, h.shape[2])
                or down[4] != (inter, h.shape[2])
                or (geometry is not None and layer_geometry != geometry)
            ):
                return None
            geometry = layer_geometry
            first, second = fused.layer_norms
            window = fused._window()
            s = structs[i]
            s.norm1, s.norm2 = first.scale().data_ptr(), second.scale().data_ptr()
            s.qkv_gemm, s.qkv_kind, s.qkv, s.qkv_bias = qkv[:4]
            s.o_gemm, s.o_kind, s.o, s.o_bias = o[:4]
            s.gate_up_gemm, s.gate_up_kind, s.gate_up, s.gate_up_bias = gate_up[:4]
            s.down_gemm, s.down_kind, s.down, s.down_bias = down[:4]
            s.round_first1, s.round_first2 = int(first.round_first), int(second.round_first)
            s.k_pool, s.v_pool = k_pool.data_ptr(), v_pool.data_ptr()
            s.eps1, s.eps2, s.scale = first.eps, second.eps, attn.scaling
            s.sliding_window = int(window) if window else 0
            if key is not None:
                while len(self._layers) <= i:
                    self._layers.append(None)
                copy = DecodeLayer()
                ctypes.pointer(copy)[0] = s
                self._layers[i] = (values, key, copy, geometry)
        d, heads, kv_heads, inter, block_size = geometry
        hidden = h.shape[2]
        tables, lens = meta.derived(
            ("decode_kernel",),
            lambda: (meta.block_tables[:rows].to(torch.int32).contiguous(), meta.seq_lens[:rows].to(torch.int32)),
        )
        slots = meta.slot_mapping
        if slots.dtype != torch.int64 or not slots.is_contiguous() or not lens.is_contiguous():
            return None
        if cos.shape != (1, rows, d) or cos.dtype != dtype or not (cos.is_contiguous() and sin.is_contiguous()):
            return None
        lib = fused_library()
        scratch = torch.empty(lib.decode_scratch_floats(rows, hidden, heads, kv_heads, d, inter), dtype=torch.float32)
        out = torch.empty_like(h)
        st = DecodeStep(
            rows,
            hidden,
            heads,
            kv_heads,
            d,
            inter,
            tables.shape[1],
            block_size,
            torch.get_num_threads(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            entry[1],
            entry[0],
            scratch.data_ptr(),
        )
        run = lib.decode_layers_f32 if dtype == torch.float32 else lib.decode_layers_bf16
        # ctypes releases the GIL for the call: engines in other threads keep running.
        status = run(ctypes.byref(st), structs, n, h.data_ptr(), out.data_ptr())
        if status == 1:
            raise MemoryError("paged decode attention: the kernel could not allocate its scratch")
        if status:
            raise MemoryError(f"native linear: no memory for a float32 copy of {rows} rows of inputs")
        self.served += 1
        return out

    def _group(self, modules: dict, names: tuple, rows: int, dtype: torch.dtype, thread: int):
        """(GEMM address, GEMM kind, packed pointer, bias pointer or None, member sizes) of the
        fused group whose members are exactly ``names``' current forwards, in order, verified for
        this thread's step and served by our GEMM at ``rows`` rows of ``dtype``; else None."""
        first = modules[names[0]].__dict__.get("forward")
        if type(first) is not PackedForward or first.group is None:
            return None
        group = first.group
        if len(group.members) != len(names) or group.packed is None:
            return None
        for f, name in zip(group.members, names):
            if modules[name].__dict__.get("forward") is not f or f.verified_thread != thread:
                return None
            if f.dtype != dtype:
                return None
        part = _native_part(group.kernel, group.packed, group.bias, rows, dtype)
        if part is None:
            return None
        kernel, data, bias = part
        return (
            *_gemm_entry(kernel, data, dtype),
            data.data_ptr(),
            None if bias is None else bias.data_ptr(),
            tuple(group.sizes),
        )

    def _single(self, module, rows: int, dtype: torch.dtype, thread: int):
        """As :meth:`_group` for one packed linear outside any group; the sizes are
        ``(in_features, out_features)``."""
        if module is None:
            return None
        f = module.__dict__.get("forward")
        if type(f) is not PackedForward or f.group is not None or f.verified_thread != thread:
            return None
        if f.dtype != dtype or not f.active:
            return None
        part = _native_part(f.kernel, f.packed, f.verified_bias, rows, dtype)
        if part is None:
            return None
        kernel, data, bias = part
        m = f.module
        return (
            *_gemm_entry(kernel, data, dtype),
            data.data_ptr(),
            None if bias is None else bias.data_ptr(),
            (m.in_features, m.out_features),
        )
