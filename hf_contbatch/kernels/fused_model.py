"""The per-forward work of a Llama-form model as per-instance forwards: what transformers does once
per forward around the decoder layers, done once per engine step with the Python cut.

Why: on CPU, a decode step of a tiny model spends about as much time in transformers' Python
around the layers as in its attention: the causal LM's and the base model's decorators (deprecated
keyword names, config defaults, output capture), ``nn.Module.__call__`` of every module, the rotary
module's cos/sin (a matmul, a cat, cos, sin, casts), the causal-mask call, the output dataclasses.
:class:`FusedModelForward` (on the base model) and :class:`FusedCausalLMForward` (on the causal LM)
run the same arithmetic as the models' own forwards in an engine step:

1. the embedding (``nn.Embedding``'s own forward, called directly);
2. rotary cos/sin gathered from a table over positions made by the rotary module's OWN forward
   (:class:`RotaryTable`: the same bits, checked when the table is built; rebuilt when the module's
   ``inv_freq``, ``attention_scaling``, dtype or device change);
3. no mask: for a paged cache transformers' mask functions return None (the paged attention keeps
   the requests apart through the step's metadata), so the layers get None, as they would;
4. the layers' fused bodies (``kernels.fused_layer.FusedLayerForward``) called without
   ``nn.Module.__call__`` (a layer with hooks is called through it);
5. the final RMSNorm in C (``fused_ops``' kernel), over only the rows the LM head reads when the
   causal LM's forward runs (RMSNorm is per row: the same bits as norming every row, then picking);
6. the LM head over those rows (``logits_to_keep``), its forward called directly.

Which models: recognized by the text of their code, never by model type (:func:`model_form`): the
causal LM's, the base model's and the rotary module's forwards must read as Llama's, Mistral's or
Qwen2's do (``kernels.fused_layer.code_text``), under the decorators transformers puts on them, and
every decoder layer must run the fused step. Per call, anything the fast path does not do exactly as
the model would (inputs_embeds, a mask, output_hidden_states/attentions, hooks on the model or a
module it bypasses, autograd, training, a non-paged step, a dynamic/LongRoPE rotary, a replaced
forward...) runs the model's own forward.

Installed per instance (``module.forward``; the classes and other instances untouched) by the first
engine on the model and removed by the last ``close`` (``engine.model_patches``), under
``fuse_model_ops`` and not with ``compile_model``.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from .decode_program import DecodeProgram
from .fused_layer import FusedLayerForward, _global_hooks, code_text
from .fused_ops import FusedNormForward, fused_library, norm_form, remove_forwards, unchecked_kernels
from .paged_cache import PagedCacheStep

# The base model's forward as transformers 5 writes it for Llama, Mistral and Qwen2 (checked texts,
# never derived from transformers' code: a change there turns the fast path off, not wrong). They
# differ in the masks they build, all None for a paged cache and no mask given.
_PROLOGUE = """if (input_ids is None) ^ (inputs_embeds is not None):
    raise ValueError('You must specify exactly one of input_ids or inputs_embeds')
if inputs_embeds is None:
    inputs_embeds{annotation} = self.embed_tokens(input_ids)
if use_cache and cache is None:
    cache = DynamicCache(config=self.config)
if position_ids is None:
    past_seen_tokens = cache.get_seq_length() if cache is not None else 0
    position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
    position_ids = position_ids.unsqueeze(0)
"""
_LLAMA = (
    _PROLOGUE.format(annotation=": torch.Tensor")
    + """causal_mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache, position_ids=position_ids)
hidden_states = inputs_embeds
position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
for decoder_layer in self.layers[:self.config.num_hidden_layers]:
    hidden_states = decoder_layer(hidden_states, attention_mask=causal_mask, position_embeddings=position_embeddings, position_ids=position_ids, cache=cache, use_cache=use_cache, **kwargs)
hidden_states = self.norm(hidden_states)
return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)"""
)
_MISTRAL = (
    _PROLOGUE.format(annotation="")
    + """mask_function = create_causal_mask if self.config.sliding_window is None else create_sliding_window_causal_mask
causal_mask = mask_function(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache, position_ids=position_ids)
hidden_states = inputs_embeds
position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
for decoder_layer in self.layers[:self.config.num_hidden_layers]:
    hidden_states = decoder_layer(hidden_states, attention_mask=causal_mask, position_ids=position_ids, cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
hidden_states = self.norm(hidden_states)
return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache if use_cache else None)"""
)
_QWEN2 = (
    _PROLOGUE.format(annotation="")
    + """if not isinstance((causal_mask_mapping := attention_mask), dict):
    mask_kwargs = {'config': self.config, 'inputs_embeds': inputs_embeds, 'attention_mask': attention_mask, 'cache': cache, 'position_ids': position_ids}
    causal_mask_mapping = {'full_attention': create_causal_mask(**mask_kwargs)}
    if self.has_sliding_layers:
        causal_mask_mapping['sliding_attention'] = create_sliding_window_causal_mask(**mask_kwargs)
hidden_states = inputs_embeds
position_embeddings = self.rotary_emb(hidden_states, position_ids)
for i, decoder_layer in enumerate(self.layers[:self.config.num_hidden_layers]):
    hidden_states = decoder_layer(hidden_states, attention_mask=causal_mask_mapping[self.config.layer_types[i]], position_embeddings=position_embeddings, position_ids=position_ids, cache=cache, use_cache=use_cache, **kwargs)
hidden_states = self.norm(hidden_states)
return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache if use_cache else None)"""
)
_BASE_FORMS = frozenset({_LLAMA, _MISTRAL, _QWEN2})
_CAUSAL_LM = """outputs: BaseModelOutputWithPast = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
hidden_states = outputs.last_hidden_state
hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
logits = self.lm_head(hidden_states)
loss = None
if labels is not None:
    loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache, hidden_states=outputs.hidden_states, attentions=outputs.attentions)"""
_ROTARY = """freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
emb = torch.cat((freqs, freqs), dim=-1)
cos = emb.cos() * self.attention_scaling
sin = emb.sin() * self.attention_scaling
return (cos.to(dtype=x.dtype), sin.to(dtype=x.dtype))"""

# The decorators transformers puts on those forwards (by their code's qualified name), whose work
# the fast path does or checks it need not do: keyword renames (past_key_values -> cache), config
# defaults (use_cache: the engine passes it), output capture (off: checked), tuple returns (off:
# checked), and the rotary update that only dynamic and LongRoPE types use (those step aside).
_DEPRECATE = "deprecate_kwarg.<locals>.wrapper.<locals>.wrapped_func"
_BASE_DECORATORS = frozenset(
    {_DEPRECATE, "merge_with_config_defaults.<locals>.wrapper", "capture_outputs.<locals>.wrapped_fn.<locals>.wrapper"}
)
_LM_DECORATORS = frozenset({_DEPRECATE, "can_return_tuple.<locals>.wrapper"})
_ROTARY_DECORATORS = (frozenset(), frozenset({"dynamic_rope_update.<locals>.wrapper"}))

# Keyword arguments of a served call (the runner's); attention_mask and inputs_embeds only as None.
_SERVED_KWARGS = frozenset(
    {
        "input_ids",
        "position_ids",
        "cache",
        "past_key_values",
        "use_cache",
        "paged_cache",
        "attention_mask",
        "inputs_embeds",
    }
)
_LM_SERVED_KWARGS = _SERVED_KWARGS | {"logits_to_keep", "labels"}

# torch runs an elementwise op on one thread below this many elements (at::internal::GRAIN_SIZE):
# the rotary table is built in chunks smaller than that, and a step of more rotary elements than
# that runs the module's own forward (threads split the work at points that may fall mid-vector).
_GRAIN = 32768


def decorators(fn) -> Optional[frozenset]:
    """The qualified names of the code of the wrappers around ``fn`` (``__wrapped__`` chain, as
    ``functools.wraps`` leaves it); None where a wrapper is not a plain function."""
    names = set()
    while hasattr(fn, "__wrapped__"):
        code = getattr(fn, "__code__", None)
        if code is None:
            return None
        names.add(code.co_qualname)
        fn = fn.__wrapped__
    return frozenset(names)


def _returned_class(fn, name: str):
    """The class the name ``name`` means in the module of function ``fn`` (decorators looked through):
    the output class its code (checked text) constructs, as that code would find it."""
    return inspect.unwrap(fn).__globals__[name]


def _hooked(m: torch.nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def _rotary_recognized(rotary) -> bool:
    fwd = type(rotary).forward
    return decorators(fwd) in _ROTARY_DECORATORS and code_text(fwd) == _ROTARY


def model_form(model) -> Optional[torch.nn.Module]:
    """The base model of causal LM ``model`` when both read as the module docstring says (the causal
    LM's, base model's and rotary module's forwards, an ``nn.Embedding``, a Llama RMSNorm, a
    ``layers`` list), else None. The layers are checked by the caller (all fused)."""
    base = model.__dict__.get("_modules", {}).get("model")
    if base is None or "forward" in model.__dict__ or "forward" in base.__dict__:
        return None
    lm_fwd, base_fwd = type(model).forward, type(base).forward
    if decorators(lm_fwd) != _LM_DECORATORS or code_text(lm_fwd) != _CAUSAL_LM:
        return None
    if decorators(base_fwd) != _BASE_DECORATORS or code_text(base_fwd) not in _BASE_FORMS:
        return None
    children = base._modules
    embed, rotary, norm, layers = (children.get(n) for n in ("embed_tokens", "rotary_emb", "norm", "layers"))
    if type(embed) is not torch.nn.Embedding or rotary is None or not isinstance(layers, torch.nn.ModuleList):
        return None
    if not _rotary_recognized(rotary) or norm is None or norm_form(norm) != (True, False):
        return None
    if not isinstance(model._modules.get("lm_head"), torch.nn.Module):
        return None
    return base


class RotaryTable:
    """cos/sin ``[1, T, head_dim]`` of a Llama-form rotary module for a step's positions, gathered
    from a table the module's own forward made (positions ``0 .. n-1``, grown by doubling as
    positions pass it), so the bits are the module's.

    Exactness: the module's arithmetic is elementwise per position (``position * inv_freq``, cos,
    sin, ``* attention_scaling``, a cast), so a position's values need not depend on the others; they
    would where torch computes some elements of a tensor with other code than the rest (a scalar
    tail after whole SIMD vectors, a split between threads mid-vector), which the torch builds seen
    do not do for cos/sin (2.13, AVX512: every element the same bits at any offset and length). So
    the table is built in chunks torch runs on one thread and checked against the module on random
    positions of odd and even counts when built; where the check fails, and for steps of
    ``T * head_dim >= 32768`` elements (threaded in torch), :meth:`__call__` calls the module's own
    forward (without ``nn.Module.__call__``).

    Args:
        rotary: the rotary module (``inv_freq`` ``[head_dim / 2]`` float32, ``attention_scaling``).
    """

    def __init__(self, rotary) -> None:
        self.rotary = rotary
        # (module state it was made for, cos [n, head_dim], sin [n, head_dim]); cos and sin None
        # where the table would not give the module's bits. Replaced whole, never changed in place:
        # engines stepping in two threads read one consistent table (a race only builds twice).
        self._table: Optional[tuple] = None

    @property
    def usable(self) -> bool:
        """Whether the current table serves (gives the module's bits); False before the first call."""
        t = self._table
        return t is not None and t[1] is not None

    def own(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's own forward (its class's, wrappers included) for ``x``'s dtype and device."""
        return type(self.rotary).forward(self.rotary, x, position_ids)

    def _state(self, x: torch.Tensor) -> tuple:
        inv = self.rotary._buffers.get("inv_freq")
        scaling = self.rotary.__dict__.get("attention_scaling")
        return (inv, None if inv is None else inv._version, scaling, x.dtype, x.device)

    def _build(self, state: tuple, x: torch.Tensor, rows: int) -> tuple:
        """The table of ``rows`` positions for ``x``'s dtype and device, module state ``state``;
        cos and sin None where it does not give the module's bits (checked on random positions)."""
        inv = state[0]
        if inv is None or inv.dim() != 1 or x.device.type != "cpu":
            return (state, None, None)
        d = 2 * inv.shape[0]
        chunk = max(1, (_GRAIN // 2) // d)
        cos, sin = [], []
        for start in range(0, rows, chunk):
            c, s = self.own(x, torch.arange(start, min(rows, start + chunk)).unsqueeze(0))
            cos.append(c[0])
            sin.append(s[0])
        table = (state, torch.cat(cos).contiguous(), torch.cat(sin).contiguous())
        if table[1].shape != (rows, d) or table[1].dtype != x.dtype:
            return (state, None, None)
        g = torch.Generator().manual_seed(rows)
        for n in (1, 3, 16, 61, min(rows, 256)):
            pos = torch.randint(0, rows, (1, n), generator=g)
            want, got = self.own(x, pos), _gather(table, pos)
            if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                return (state, None, None)
        return table

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[1, T, head_dim]`` in ``x``'s dtype for ``position_ids`` ``[1, T]`` int64 (>= 0),
        as the module's forward gives them."""
        state = self._state(x)
        table = self._table
        if table is None or table[0][0] is not state[0] or table[0][1:] != state[1:]:
            # First call, or the module changed (inv_freq replaced or written, scaling, dtype, device)
            table = self._table = self._build(state, x, 256)
        cos = table[1]
        if cos is None or position_ids.shape[-1] * cos.shape[1] >= _GRAIN:
            return self.own(x, position_ids)
        top = int(position_ids.max())
        if top >= cos.shape[0]:
            rows = cos.shape[0]
            while rows <= top:
                rows *= 2
            table = self._table = self._build(state, x, rows)
            if table[1] is None:
                return self.own(x, position_ids)
        return _gather(table, position_ids)


def _gather(table: tuple, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[1, T, head_dim]`` of ``table`` (``RotaryTable``'s) at ``position_ids`` ``[1, T]``."""
    p = position_ids[0]
    return table[1].index_select(0, p).unsqueeze(0), table[2].index_select(0, p).unsqueeze(0)


class FusedModelForward:
    """``base_model.forward`` for a base model :func:`model_form` recognizes: in an engine step
    (module docstring), ``BaseModelOutputWithPast(last_hidden_state [1, T, hidden], cache)``
    computed as the model's own forward would; the model's own forward for any other call.

    Attributes:
        served: how many calls (base model's or causal LM's) the fast path served (a count for tests
            and reports).
    """

    def __init__(self, base, layers: list[tuple[torch.nn.Module, FusedLayerForward]]) -> None:
        self.base = base
        self.layers = layers
        c = base._modules
        self.embed, self.rotary, self.norm = c["embed_tokens"], c["rotary_emb"], c["norm"]
        self.table = RotaryTable(self.rotary)
        self.final_norm = FusedNormForward(self.norm, True, False)
        # Every layer of a float32 or bfloat16 decode step in one native call, where it serves
        # (decode_program).
        self.program = DecodeProgram(layers)
        # The modules whose __call__ (and forwards, but the layers') the fast path does without.
        self.bypassed = (base, self.embed, self.rotary, self.norm)
        self.served = 0
        self.__signature__ = inspect.signature(type(base).forward.__get__(base))
        self.output = _returned_class(type(base).forward, "BaseModelOutputWithPast")

    def original(self, *args, **kwargs):
        return type(self.base).forward(self.base, *args, **kwargs)

    def hidden(self, kwargs: dict, keep=None) -> Optional[torch.Tensor]:
        """The final-normed hidden states ``[1, T, hidden]`` of a call with keyword arguments
        ``kwargs`` when the fast path serves it exactly (an eager engine step; see the module
        docstring), else None. ``keep``: the causal LM's ``logits_to_keep`` (an int64 tensor of
        rows, or an int: the last rows, 0 all); only those rows are normed and returned."""
        if not kwargs.keys() <= _SERVED_KWARGS or kwargs.get("attention_mask") is not None:
            return None
        if kwargs.get("inputs_embeds") is not None or not kwargs.get("use_cache"):
            return None
        step = kwargs.get("paged_cache")
        if type(step) is not PagedCacheStep or kwargs.get("cache", kwargs.get("past_key_values")) is not step:
            return None
        ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
        if not isinstance(ids, torch.Tensor) or not isinstance(pos, torch.Tensor):
            return None
        if ids.dim() != 2 or ids.shape[0] != 1 or pos.shape != ids.shape or pos.dtype != torch.int64:
            return None
        base, config = self.base, self.base.config
        if torch.is_grad_enabled() or base.training or getattr(config, "output_hidden_states", False):
            return None
        if getattr(config, "output_attentions", False) or _global_hooks():
            return None
        for m in self.bypassed:
            if _hooked(m) or "_hf_hook" in m.__dict__:
                return None
        if "forward" in self.embed.__dict__ or "forward" in self.rotary.__dict__:
            return None  # a forward someone installed since (per-request rotary factors): theirs
        fwd = self.norm.__dict__.get("forward")
        if fwd is not None and not isinstance(fwd, FusedNormForward):
            return None
        rope = self.rotary.__dict__.get("rope_type")
        if not isinstance(rope, str) or "dynamic" in rope or rope == "longrope":
            return None
        layers = base._modules["layers"]
        n = config.num_hidden_layers
        if len(layers) < n or n != len(self.layers):
            return None
        for i, (layer, fused) in enumerate(self.layers):
            if layers[i] is not layer or layer.__dict__.get("forward") is not fused:
                return None  # a layer replaced, or its fused step removed since: the model's own
        self.served += 1
        h = self.embed.forward(ids)
        position_embeddings = self.table(h, pos)
        out = self.program.run(h, position_embeddings, pos, step) if self.program.usable else None
        for layer, fused in self.layers if out is None else ():
            call = layer if _hooked(layer) else fused
            h = call(
                h,
                attention_mask=None,
                position_embeddings=position_embeddings,
                position_ids=pos,
                cache=step,
                use_cache=True,
                paged_cache=step,
            )
        if out is not None:
            h = out
        if isinstance(keep, torch.Tensor):
            h = h.index_select(1, keep)  # RMSNorm is per row: norming the kept rows only is exact
        elif isinstance(keep, int) and keep:
            h = h[:, -keep:, :]
        return self._norm(h)

    def _norm(self, h: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of ``h`` ``[1, R, hidden]``: the C kernel where it takes it (the bits of
        transformers' Llama RMSNorm, ``fused_ops``), else the module's forward."""
        w = self.norm._parameters.get("weight")
        kernels = unchecked_kernels(h.dtype) if h.is_cpu else None
        if kernels is None or w is None or w.dtype != h.dtype or not w.is_cpu or w.shape != h.shape[-1:]:
            return type(self.norm).forward(self.norm, h)
        if not h.is_contiguous():
            h = h.contiguous()
        return kernels.rms_norm(h, self.final_norm.scale(), self.final_norm.eps, True)

    def __call__(self, *args, **kwargs):
        h = None if args else self.hidden(kwargs)
        if h is None:
            return self.original(*args, **kwargs)
        return self.output(last_hidden_state=h, cache=kwargs["paged_cache"])


class FusedCausalLMForward:
    """``model.forward`` for a causal LM :func:`model_form` recognizes: in an engine step,
    ``CausalLMOutputWithPast(logits [1, len(logits_to_keep), vocab], cache)`` from the base
    model's fast path (:meth:`FusedModelForward.hidden`, only the kept rows normed) and the LM
    head's forward; the model's own forward for any other call."""

    def __init__(self, model, base_forward: FusedModelForward) -> None:
        self.model = model
        self.base_forward = base_forward
        self.lm_head = model._modules["lm_head"]
        self.__signature__ = inspect.signature(type(model).forward.__get__(model))
        self.output = _returned_class(type(model).forward, "CausalLMOutputWithPast")

    def original(self, *args, **kwargs):
        return type(self.model).forward(self.model, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        model = self.model
        if (
            args
            or not kwargs.keys() <= _LM_SERVED_KWARGS
            or kwargs.get("labels") is not None
            or model.training
            or not getattr(model.config, "return_dict", True)
            or "_hf_hook" in model.__dict__
            or "_hf_hook" in self.lm_head.__dict__
            or model._modules.get("model") is not self.base_forward.base
            or model._modules.get("lm_head") is not self.lm_head
            or self.base_forward.base.__dict__.get("forward") is not self.base_forward
        ):
            return self.original(*args, **kwargs)
        keep = kwargs.pop("logits_to_keep", 0)
        kwargs.pop("labels", None)
        h = self.base_forward.hidden(kwargs, keep)
        if h is None:
            return self.original(*args, logits_to_keep=keep, **kwargs)
        head = self.lm_head
        logits = head(h) if _hooked(head) else head.forward(h)
        return self.output(logits=logits, cache=kwargs["paged_cache"])


class FusedModel:
    """The fused per-forward work installed on one causal LM (module docstring): its base model's
    and its own forwards, where :func:`model_form` recognizes them and every decoder layer runs the
    fused step (``fused_layers``: the model's ``kernels.fused_layer.FusedLayers``)."""

    def __init__(self, model, fused_layers) -> None:
        self.installed: list[tuple] = []
        self.base_forward: Optional[FusedModelForward] = None
        if fused_library() is None or fused_layers is None:
            return
        base = model_form(model)
        if base is None:
            return
        fused = {id(m): f for m, f in fused_layers.installed}
        layers = list(base._modules["layers"])[: base.config.num_hidden_layers]
        pairs = [(m, fused.get(id(m))) for m in layers]
        if not pairs or any(f is None or m.__dict__.get("forward") is not f for m, f in pairs):
            return
        self.base_forward = FusedModelForward(base, pairs)
        lm_forward = FusedCausalLMForward(model, self.base_forward)
        base.forward = self.base_forward
        model.forward = lm_forward
        self.installed = [(base, self.base_forward), (model, lm_forward)]

    def restore(self) -> None:
        """Remove the installed forwards (the classes' forwards serve again)."""
        remove_forwards(self.installed)
        self.installed = []

    def report(self) -> str:
        """One line: whether the model's per-forward work runs fused."""
        return f"fused model forward: {'yes' if self.installed else 'no'}"
