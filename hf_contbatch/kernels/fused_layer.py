"""A decoder layer of the Llama form, or of a recognized variation of it, as one per-instance
forward: a few native calls per layer instead of transformers' Python around the GEMMs.

Why: on CPU, a decode step of a small batch spends 15-40% of its time in the Python between the
GEMMs (about 13 ``nn.Module`` calls a layer, their decorators, rotary's 14 small eager ops,
residual adds, views and transposes, the attention interface's plumbing). :class:`FusedLayerForward`
runs the same arithmetic as the layer's own forward:

(for the Llama form; :class:`LayerForm`'s variations below)

1. input RMSNorm (``fused_ops.rms_norm``'s kernel);
2. the q/k/v projections through their own forwards, called directly (no ``nn.Module.__call__``:
   the layer checks that no hook is registered); when they are the verified packed members of one
   fused group (``kernels.linears.fused``), one call of the group gives all three (one GEMM, its
   column views);
3. rotary embedding of q and k in C from the ``position_embeddings`` (cos, sin) the model computed
   once per forward (``fused_ops.rotary``'s kernel: the same bits as transformers' eager
   ``q * cos + rotate_half(q) * sin``), written in the ``[T, heads, head_dim]`` layout attention
   reads; at one row (a one-request decode) q and k, adjacent in the fused GEMM's output, in one call;
4. K/V stored and attention over the paged pool through the step's backend
   (``PagedCacheStep.store_and_attend``), as the registered attention function would call it;
5. ``o_proj``; 6. residual add and post-attention RMSNorm in one C pass (``fused_ops.add_rms_norm``'s kernel);
7. ``gate_proj``/``up_proj`` (one fused GEMM), ``silu(gate) * up`` in C, ``down_proj``;
8. residual add.

The C kernels are called through ``fused_ops.UncheckedKernels`` (no per-call argument checks):
:meth:`FusedLayerForward.fits` and the call check what they need once. What is the same for every
layer of a forward (position embeddings, the hidden state's dtype and shape, the attention
implementation) is checked by its first layer and kept on the step (``PagedCacheStep.layer_checks``).

Which layers: recognized by the text of their code, never by model type (:func:`layer_form`): the
decoder layer's, attention's and MLP's forwards, the RMSNorms' and the attention module's
``apply_rotary_pos_emb``/``rotate_half`` must read as Llama's do or as one of the variations a
:class:`LayerForm` describes (data: each known text sets some of its fields, and the one forward
does each field's arithmetic):

- attention's sliding-window argument (Mistral's from the config, Qwen2's from the module);
- ``qk_norm``: an RMSNorm of q and k before rotary, per head (Qwen3, Qwen3-MoE's dense layers,
  dots1) or over the whole projection (OLMo2, OLMo3), run in C with the rotary after it
  (``fused_ops.rms_norm_rotary``);
- ``packed_qkv``/``packed_gate_up``: Phi-3's one q/k/v linear (its output's column slices) and one
  gate/up linear (``chunk(2)``);
- ``partial_rotary``: Phi-3's rotary over cos's width, the rest of each head copied (the C rotary's
  ``rotary_dim``);
- ``dropouts``: Phi-3's residual dropouts (``nn.Dropout`` in evaluation mode: the identity);
- ``residual_multiplier``: Granite's branches scaled before the residual adds;
- ``post_norms``: OLMo2's norms after attention and the MLP instead of before;
- ``one_plus_norms``/``module_activation``: Gemma's RMSNorms (``1 + weight`` in float32, one
  rounding: ``fused_ops.rms_norm``'s other order) and a gated MLP whose activation is not SiLU
  (Gemma's GELU-tanh), called as the module's own ``act_fn`` (torch's vectorized tanh is not
  reproduced in C; calling the module keeps its bits). Gemma's embedding scale is the model's code.

So Llama, SmolLM, Mistral, Qwen2, Qwen3, Phi-3, Granite, OLMo2, Gemma and every family whose code
reads as one of these get it; every other family (Gemma 2 and 3 with their four norms a layer and
soft-capping, GLM, Helium...) keeps its own forward. Per call,
anything the fast path does not do exactly as the layer would (see :meth:`FusedLayerForward.fits`)
runs the layer's own forward.

Installed per instance (``module.forward``; the class and other instances untouched) by the first
engine on the model and removed by the last ``close`` (``engine.model_patches``).
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from dataclasses import dataclass
from typing import Optional

import torch

from .attention import _layer_chunk_size, _mask_only_window, _temperature_tuning, is_paged_attention
from .fused_ops import (
    FusedMLPForward,
    FusedNormForward,
    UncheckedKernels,
    fits,
    fused_library,
    gated_mlp_form,
    norm_form,
    remove_forwards,
    unchecked_kernels,
)
from .linears.packed_forward import PackedForward
from .model_layout import ModelLayout
from .paged_cache import PagedCacheStep


def code_text(fn) -> str:
    """The statements of function ``fn``'s body (docstring dropped) as ``ast.unparse`` writes them:
    comments, formatting and the signature left out; "" where the source cannot be read. Decorators
    are looked through (``inspect.unwrap``): the caller checks what they may change."""
    try:
        src = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
        node = ast.parse(src).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return ""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return ""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.unparse(ast.Module(body=body, type_ignores=[]))


# The code the fast path reproduces, as transformers 5 writes it (a family whose code reads
# otherwise keeps its own forward; these texts are checked, never derived from transformers' Llama,
# so a change in Llama's code turns the fast path off rather than making it wrong).
_LAYER = """residual = hidden_states
hidden_states = self.input_layernorm(hidden_states)
hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids, cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
hidden_states = residual + hidden_states
residual = hidden_states
hidden_states = self.post_attention_layernorm(hidden_states)
hidden_states = self.mlp(hidden_states)
hidden_states = residual + hidden_states
return hidden_states"""
_ATTENTION = """input_shape = hidden_states.shape[:-1]
hidden_shape = (*input_shape, -1, self.head_dim)
query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
cos, sin = position_embeddings
query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
if cache is not None:
    key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
attn_output, attn_weights = attention_interface(self, query_states, key_states, value_states, attention_mask, dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling{window}, **kwargs)
attn_output = attn_output.reshape(*input_shape, -1).contiguous()
attn_output = self.o_proj(attn_output)
return (attn_output, attn_weights)"""
# The layer's variations: its text -> the LayerForm fields it sets.
# Phi-3: dropouts on the two residual branches (identity in evaluation mode).
_DROPOUT_LAYER = (
    _LAYER.replace("hidden_states, _ = self.self_attn", "hidden_states, self_attn_weights = self.self_attn")
    .replace("residual + hidden_states\nresidual", "residual + self.resid_attn_dropout(hidden_states)\nresidual")
    .replace("residual + hidden_states\nreturn", "residual + self.resid_mlp_dropout(hidden_states)\nreturn")
)
# Granite: each branch scaled by the config's residual multiplier before the residual add.
_MULTIPLIER_LAYER = _LAYER.replace(
    "residual + hidden_states\n", "residual + hidden_states * self.residual_multiplier\n"
)
# OLMo2: no norm before attention or the MLP; their outputs normalized before the residual adds.
_POST_NORM_LAYER = """residual = hidden_states
hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids, cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
hidden_states = self.post_attention_layernorm(hidden_states)
hidden_states = residual + hidden_states
residual = hidden_states
hidden_states = self.mlp(hidden_states)
hidden_states = self.post_feedforward_layernorm(hidden_states)
hidden_states = residual + hidden_states
return hidden_states"""
_LAYER_FORMS = {
    _LAYER: {},
    _DROPOUT_LAYER: {"dropouts": True},
    _MULTIPLIER_LAYER: {"residual_multiplier": True},
    _POST_NORM_LAYER: {"post_norms": True},
}
_Q_K = """query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
"""
_V = "value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)\n"
# Qwen3: a per-head RMSNorm of q and of k before the transpose (and rotary).
_Q_K_HEAD_NORMED = """query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
"""
# OLMo2: an RMSNorm of the whole q and k projections (all heads' features together).
_Q_K_V_NORMED = """query_states = self.q_norm(self.q_proj(hidden_states))
key_states = self.k_norm(self.k_proj(hidden_states))
value_states = self.v_proj(hidden_states)
query_states = query_states.view(hidden_shape).transpose(1, 2)
key_states = key_states.view(hidden_shape).transpose(1, 2)
value_states = value_states.view(hidden_shape).transpose(1, 2)
"""
# Phi-3: one q/k/v linear, its output's column ranges (query heads from the config).
_PACKED_QKV = """qkv = self.qkv_proj(hidden_states)
query_pos = self.config.num_attention_heads * self.head_dim
query_states = qkv[..., :query_pos]
key_states = qkv[..., query_pos:query_pos + self.num_key_value_heads * self.head_dim]
value_states = qkv[..., query_pos + self.num_key_value_heads * self.head_dim:]
query_states = query_states.view(hidden_shape).transpose(1, 2)
key_states = key_states.view(hidden_shape).transpose(1, 2)
value_states = value_states.view(hidden_shape).transpose(1, 2)
"""
# How attention makes q/k/v -> the LayerForm fields it sets.
_PROJECTIONS = {
    _Q_K + _V: {},
    _Q_K_HEAD_NORMED + _V: {"qk_norm": "head"},
    _Q_K_V_NORMED: {"qk_norm": "all"},
    _PACKED_QKV: {"packed_qkv": True},
}
# Attention's sliding-window argument -> where its value comes from: None (Llama: no argument, the
# attention function reads a mask-only window from the config), "config" (Mistral), "module" (Qwen2).
_WINDOWS = {
    "": None,
    ", sliding_window=getattr(self.config, 'sliding_window', None)": "config",
    ", sliding_window=self.sliding_window": "module",
}
# Attention's text -> the LayerForm fields it sets: every projection form with every window.
_ATTENTION_FORMS = {
    _ATTENTION.replace(_Q_K + _V, proj).format(window=arg): {**fields, "window_source": source}
    for proj, fields in _PROJECTIONS.items()
    for arg, source in _WINDOWS.items()
}
_ROTARY = """cos = cos.unsqueeze(unsqueeze_dim)
sin = sin.unsqueeze(unsqueeze_dim)
q_embed = q * cos + rotate_half(q) * sin
k_embed = k * cos + rotate_half(k) * sin
return (q_embed, k_embed)"""
# Phi-3's: rotary over cos's width, the rest of each head passed through. The fast path takes cos/sin
# only as wide as the head (checked per forward), where q_pass/k_pass are empty and the result is
# Llama's bit for bit (a cat with an empty tensor copies); partial rotary runs the layer's own forward.
_PARTIAL_ROTARY = """cos = cos.unsqueeze(unsqueeze_dim)
sin = sin.unsqueeze(unsqueeze_dim)
rotary_dim = cos.shape[-1]
q_rot, q_pass = (q[..., :rotary_dim], q[..., rotary_dim:])
k_rot, k_pass = (k[..., :rotary_dim], k[..., rotary_dim:])
q_embed = torch.cat([q_rot * cos + rotate_half(q_rot) * sin, q_pass], dim=-1)
k_embed = torch.cat([k_rot * cos + rotate_half(k_rot) * sin, k_pass], dim=-1)
return (q_embed, k_embed)"""
# OLMo2's: Llama's with the results cast back to q's and k's dtypes, which cos/sin share (checked per
# forward): the casts return their input.
_CAST_ROTARY = """q_type, k_type = (q.dtype, k.dtype)
""" + _ROTARY.replace("return (q_embed, k_embed)", "return (q_embed.to(q_type), k_embed.to(k_type))")
_ROTARIES = (_ROTARY, _PARTIAL_ROTARY, _CAST_ROTARY)
_ROTATE_HALF = """x1 = x[..., :x.shape[-1] // 2]
x2 = x[..., x.shape[-1] // 2:]
return torch.cat((-x2, x1), dim=-1)"""
# The keyword arguments a Llama-form model passes its decoder layers in an engine step (anything
# else, e.g. a request for attention weights, runs the layer's own forward).
# ``output_router_logits``: what a mixture-of-experts model (Qwen3-MoE) passes every layer; a dense
# layer's code only hands it on to the attention function, which does not read it (router logits
# are collected by hooks on the routers, which a dense layer has none of).
_LAYER_KWARGS = frozenset(
    {
        "attention_mask",
        "position_ids",
        "cache",
        "past_key_values",
        "use_cache",
        "position_embeddings",
        "paged_cache",
        "output_router_logits",
    }
)


_DROPOUTS = ("resid_attn_dropout", "resid_mlp_dropout")
_PRE_NORMS = ("input_layernorm", "post_attention_layernorm")
_POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")
_QK_NORMS = ("q_norm", "k_norm")
_QKV = ("q_proj", "k_proj", "v_proj")
_QKV_PACKED = ("qkv_proj",)


def _plain_function(fn, text: str) -> bool:
    """Whether ``fn`` is a plain (undecorated) function whose body reads ``text``."""
    return inspect.isfunction(fn) and not hasattr(fn, "__wrapped__") and code_text(fn) == text


@dataclass(frozen=True)
class LayerForm:
    """How a recognized decoder layer varies from Llama's (each field read from its code's text,
    :func:`layer_form`); the fast path does each variation's arithmetic exactly as its code does.

    Attributes:
        window_source: where attention's sliding window comes from: None (no argument: a mask-only
            window from the config, Llama), "config" (Mistral, Phi-3) or "module" (Qwen2, Qwen3).
        qk_norm: an RMSNorm ``q_norm``/``k_norm`` of q and k before rotary: None, "head" (each head's
            features, Qwen3) or "all" (the whole projection's, OLMo2).
        packed_qkv: one ``qkv_proj`` linear whose output's columns are q, k, v (Phi-3).
        packed_gate_up: one ``gate_up_proj`` linear, ``chunk(2)`` into gate and up (Phi-3).
        dropouts: ``resid_attn_dropout``/``resid_mlp_dropout`` on the residual branches (Phi-3;
            ``nn.Dropout`` in evaluation mode: the identity).
        residual_multiplier: each branch times the layer's ``residual_multiplier`` before its
            residual add (Granite).
        post_norms: no norm before attention and the MLP; ``post_attention_layernorm`` and
            ``post_feedforward_layernorm`` of their outputs before the residual adds (OLMo2).
        module_activation: the MLP's activation is not SiLU (Gemma's GELU-tanh): the module's own
            ``act_fn`` is called on gate, then ``* up`` in torch, instead of the C ``silu_mul``.
        one_plus_norms: the RMSNorms scale by ``1 + weight`` in float32 with one rounding (Gemma).
        partial_rotary: rotary over cos's width, the rest of each head copied (Phi-3's code; the
            same as Llama's where cos is as wide as the head).
    """

    window_source: Optional[str] = None
    qk_norm: Optional[str] = None
    packed_qkv: bool = False
    packed_gate_up: bool = False
    dropouts: bool = False
    residual_multiplier: bool = False
    post_norms: bool = False
    module_activation: bool = False
    one_plus_norms: bool = False
    partial_rotary: bool = False

    def name(self) -> str:
        """A short label for reports: "llama", or its variations joined by "+" ("qk-norm", ...)."""
        parts = [
            label
            for label, on in (
                ("qk-norm", self.qk_norm == "head"),
                ("qk-norm-all", self.qk_norm == "all"),
                ("packed-qkv", self.packed_qkv),
                ("packed-gate-up", self.packed_gate_up),
                ("dropouts", self.dropouts),
                ("residual-multiplier", self.residual_multiplier),
                ("post-norms", self.post_norms),
                ("module-activation", self.module_activation),
                ("one-plus-norms", self.one_plus_norms),
                ("partial-rotary", self.partial_rotary),
            )
            if on
        ]
        return "+".join(parts) or "llama"

    def norm_names(self) -> tuple[str, ...]:
        """The layer's own RMSNorm children (before or after its sublayers)."""
        return _POST_NORMS if self.post_norms else _PRE_NORMS


def layer_form(layer, texts: Optional[dict] = None) -> Optional[LayerForm]:
    """The :class:`LayerForm` of ``layer`` when it is a decoder layer the fast path reproduces
    (module docstring: Llama's code, or one of the variations :class:`LayerForm` describes), else
    None. ``texts``: a memo of :func:`code_text` by function, shared over a model's layers."""
    memo = {} if texts is None else texts

    def text(fn) -> str:
        if fn not in memo:
            memo[fn] = code_text(fn)
        return memo[fn]

    children = layer.__dict__.get("_modules", {})
    attn, mlp = children.get("self_attn"), children.get("mlp")
    if attn is None or mlp is None:
        return None
    layer_fields = _LAYER_FORMS.get(text(type(layer).forward))
    if layer_fields is None:
        return None
    if "forward" in attn.__dict__ or text(type(attn).forward) not in _ATTENTION_FORMS:
        return None  # an instance forward someone installed on attention: theirs
    gated = gated_mlp_form(mlp)
    if gated is None:
        return None
    attn_fields = _ATTENTION_FORMS[text(type(attn).forward)]
    attn_children = attn.__dict__.get("_modules", {})
    norms = [children.get(n) for n in (_POST_NORMS if layer_fields.get("post_norms") else _PRE_NORMS)]
    if attn_fields.get("qk_norm"):
        norms += [attn_children.get(n) for n in _QK_NORMS]
    # Llama's RMSNorm (the weight times the rounded normalized value), OLMo2's (one rounding) or
    # Gemma's (1 + weight, one rounding): one of them for all the layer's norms.
    norm_forms = {norm_form(n) if n is not None else None for n in norms}
    if len(norm_forms) != 1 or next(iter(norm_forms)) not in ((True, False), (False, False), (False, True)):
        return None
    scope = vars(sys.modules.get(type(attn).__module__, object))
    rotary = [t for t in _ROTARIES if _plain_function(scope.get("apply_rotary_pos_emb"), t)]
    if not rotary or not _plain_function(scope.get("rotate_half"), _ROTATE_HALF):
        return None
    form = LayerForm(
        **layer_fields,
        **attn_fields,
        packed_gate_up=gated[0] == "fused_gate_up",
        module_activation=not gated[1],
        one_plus_norms=norm_forms == {(False, True)},
        partial_rotary=rotary[0] is _PARTIAL_ROTARY,
    )
    if form.dropouts and not all(type(children.get(n)) is torch.nn.Dropout for n in _DROPOUTS):
        return None
    if form.residual_multiplier and type(layer.__dict__.get("residual_multiplier")) not in (float, int):
        return None
    projections = _QKV_PACKED if form.packed_qkv else _QKV
    if not all(isinstance(attn_children.get(a), torch.nn.Module) for a in (*projections, "o_proj")):
        return None
    if not (isinstance(attn.__dict__.get("head_dim"), int) and isinstance(attn.__dict__.get("layer_idx"), int)):
        return None
    if form.packed_qkv and not isinstance(attn.__dict__.get("num_key_value_heads"), int):
        return None
    return form


def _global_hooks() -> bool:
    """Whether torch has module hooks registered for every module (``register_module_forward_hook``...)."""
    mod = torch.nn.modules.module
    return any(
        getattr(mod, name, None)
        for name in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        )
    )


class FusedLayerForward:
    """``layer.forward`` for a decoder layer :func:`layer_form` recognizes (see the module docstring):
    ``hidden_states`` ``[1, T, hidden]`` -> ``[1, T, hidden]`` in its dtype, in an eager engine step
    over the paged cache; the layer's own forward otherwise."""

    def __init__(self, layer, form: LayerForm) -> None:
        self.layer = layer
        self.attn, self.mlp = layer.self_attn, layer.mlp
        self.form = form
        self.window_source = form.window_source
        a, m = self.attn, self.mlp
        layer_norms = tuple(getattr(layer, n) for n in form.norm_names())
        qk_norms = tuple(getattr(a, n) for n in _QK_NORMS) if form.qk_norm else ()
        # The layer's two norms (input and post-attention; OLMo2: post-attention and post-MLP),
        # then q's and k's, each with its own rounding order (Llama's or OLMo2's: layer_form).
        self.layer_norms = tuple(FusedNormForward(n, *norm_form(n)) for n in layer_norms)
        self.qk_norms = tuple(FusedNormForward(n, *norm_form(n)) for n in qk_norms)
        self.qkv_names = _QKV_PACKED if form.packed_qkv else _QKV
        self.gate_up_names = ("gate_up_proj",) if form.packed_gate_up else ("gate_proj", "up_proj")
        dropouts = tuple(getattr(layer, n) for n in _DROPOUTS) if form.dropouts else ()
        # Those whose forwards it does the work of instead of calling them.
        self.skipped = (*layer_norms, a, m, *qk_norms, *dropouts)
        # The modules whose forwards the fast path calls (or replaces) without their __call__:
        # any hook on them (accelerate's offload, transformers' output capture) runs the layer's own.
        self.bypassed = (
            *self.skipped,
            *(getattr(a, n) for n in (*self.qkv_names, "o_proj")),
            *(getattr(m, n) for n in (*self.gate_up_names, "down_proj")),
        )
        # Each RMSNorm with the width its weight must have: None for the hidden size; a per-head
        # q/k norm's head_dim; 0 for a whole-projection q/k norm (checked against q/k per call).
        qk_width = a.head_dim if form.qk_norm == "head" else 0
        self.norms = tuple((n, None) for n in layer_norms) + tuple((n, qk_width) for n in qk_norms)
        self.dropouts = dropouts

    def original(self, *args, **kwargs):
        return type(self.layer).forward(self.layer, *args, **kwargs)

    def fits(self, hidden_states, args, kwargs) -> Optional[tuple[PagedCacheStep, UncheckedKernels]]:
        """The step's cache view and the dtype's :class:`~.fused_ops.UncheckedKernels` when this
        call is one the fast path serves exactly, else None: an eager engine step (the runner's
        ``PagedCacheStep`` as ``cache`` and ``paged_cache``, with metadata; no mask; the model's
        paged attention registered; no keyword argument beyond :data:`_LAYER_KWARGS`), no autograd,
        one contiguous CPU row ``[1, T, hidden]`` (T >= 1) of a dtype the C kernels have, norm
        weights of that dtype (``[hidden]``; a per-head q/k norm's ``[head_dim]``), contiguous
        cos/sin ``[1, T, head_dim]`` of it (so no partial rotary), no module hooks, evaluation mode
        (the layer, attention and any residual dropout), and a layer whose K/V are stored and read as they are (not latent, not
        shared, no per-key bias, chunk or position-scaled queries).

        What is the same for every layer of one forward (the position embeddings, the hidden
        state's dtype and shape, the attention implementation) is checked by the first layer and
        kept in the step's ``layer_checks``: the others compare identities (:meth:`_forward_fits`)."""
        if args or not kwargs.keys() <= _LAYER_KWARGS or kwargs.get("attention_mask") is not None:
            return None
        step = kwargs.get("paged_cache")
        if type(step) is not PagedCacheStep or kwargs.get("cache", kwargs.get("past_key_values")) is not step:
            return None
        if torch.is_grad_enabled():
            return None
        layer, attn = self.layer, self.attn
        pos, config, d = kwargs.get("position_embeddings"), attn.config, attn.head_dim
        partial = self.form.partial_rotary
        key = (id(config), d, partial)
        checked = step.layer_checks.get(key)
        if (
            checked is None
            or checked[0] is not pos
            or checked[1] is not hidden_states.dtype
            or checked[2] != hidden_states.shape
            or checked[3] is not config
        ):
            checked = (
                pos,
                hidden_states.dtype,
                hidden_states.shape,
                config,
                self._forward_fits(hidden_states, pos, config, d, partial),
            )
            step.layer_checks[key] = checked
        kernels = checked[4]
        if kernels is None or not hidden_states.is_contiguous() or layer.training or attn.training:
            return None
        dtype, width = hidden_states.dtype, hidden_states.shape[-1]
        for norm, n in self.norms:
            w = norm._parameters.get("weight")  # the dict, not nn.Module.__getattr__: per layer and step
            if w is None or w.dtype != dtype or not w.is_cpu or w.dim() != 1 or (n != 0 and w.shape[0] != (n or width)):
                return None
        for dropout in self.dropouts:  # the identity only in evaluation mode
            if dropout.training:
                return None
        if _global_hooks():
            return None
        for m in self.bypassed:
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
                return None
        # Forwards replaced since (accelerate's offload wraps ``forward`` and keeps ``_hf_hook``):
        # the modules whose forwards the fast path does not call must still be the class's or ours.
        for m in self.skipped:
            fwd = m.__dict__.get("forward")
            if (
                fwd is not None and not isinstance(fwd, (FusedNormForward, FusedMLPForward))
            ) or "_hf_hook" in m.__dict__:
                return None
        idx = attn.layer_idx
        if not step.plain_layer(idx) or _layer_chunk_size(attn) is not None or _temperature_tuning(attn) is not None:
            return None
        return step, kernels

    @staticmethod
    def _forward_fits(hidden_states, pos, config, head_dim: int, partial: bool) -> Optional[UncheckedKernels]:
        """The per-forward part of :meth:`fits`, the same for every layer of one forward with this
        attention ``config``, ``head_dim`` and rotary form (the caller keys it by them): the kernels
        of the hidden state's dtype when it fits, ``pos`` is a (cos, sin) pair of contiguous CPU
        tensors ``[1, T, head_dim]`` of that dtype (``partial``: ``[1, T, r]``, ``0 < r <= head_dim``)
        and the config's attention is ours; else None."""
        if (
            not fits(hidden_states)
            or hidden_states.dim() != 3
            or hidden_states.shape[0] != 1
            or not hidden_states.shape[1]
            or not hidden_states.shape[2]
            or not is_paged_attention(config._attn_implementation)
            or not (isinstance(pos, tuple) and len(pos) == 2)
        ):
            return None
        dtype, shape = hidden_states.dtype, (1, hidden_states.shape[1], head_dim)
        if partial and isinstance(pos[0], torch.Tensor) and pos[0].dim() == 3 and 0 < pos[0].shape[2] <= head_dim:
            shape = (*shape[:2], pos[0].shape[2])
        for t in pos:
            if (
                not isinstance(t, torch.Tensor)
                or t.shape != shape
                or t.dtype != dtype
                or not t.is_cpu
                or not t.is_contiguous()
            ):
                return None
        return unchecked_kernels(dtype)

    def _window(self) -> Optional[int]:
        """The sliding window attention passes the attention function (as its forward computes it)."""
        attn = self.attn
        if self.window_source == "config":
            return getattr(attn.config, "sliding_window", None)
        if self.window_source == "module":
            return attn.sliding_window
        return _mask_only_window(attn)

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        fit = self.fits(hidden_states, args, kwargs)
        if fit is None:
            return self.original(hidden_states, *args, **kwargs)
        step, kernels = fit
        form, attn, mlp = self.form, self.attn, self.mlp
        # The projections looked up in the modules' dicts (nn.Module.__getattr__ costs about 0.5 us
        # a lookup), current ones each call: a wrapper swapped in since (LoRA) is the one called.
        projections, mlp_projections = attn._modules, mlp._modules
        dtype, rows, d = hidden_states.dtype, hidden_states.shape[1], attn.head_dim
        first, second = self.layer_norms
        if form.post_norms:
            h = hidden_states  # OLMo2: attention reads the residual stream itself
        else:
            h = kernels.rms_norm(hidden_states, first.scale(), first.eps, first.round_first)
        # Called as the modules' __call__ would (no hooks: checked), so packed, fused, int8 and
        # LoRA forwards run as they do under the layer's own forward.
        if form.packed_qkv:
            # As the attention slices its one linear's output: query heads from the config.
            qkv = projections["qkv_proj"].forward(h)
            q_end = attn.config.num_attention_heads * d
            k_end = q_end + attn.num_key_value_heads * d
            q, k, v = qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
        else:
            qkv = _group_outputs(projections, _QKV, h)
            if qkv is None:
                q = projections["q_proj"].forward(h)
                k = projections["k_proj"].forward(h)
                v = projections["v_proj"].forward(h)
            else:
                q, k, v = qkv
        lead = hidden_states.shape[:-1]
        if (
            q.shape[:-1] != lead
            or k.shape != v.shape
            or k.shape[:-1] != lead
            or q.shape[-1] % d
            or k.shape[-1] % d
            or q.dtype is not dtype
            or k.dtype is not dtype
            or v.dtype is not dtype
            or not (q.is_cpu and k.is_cpu and v.is_cpu)
            or q.stride(-1) != 1
            or k.stride(-1) != 1
            or v.stride(-1) != 1
        ):
            return self.original(hidden_states, *args, **kwargs)  # projections of another shape or dtype
        cos, sin = kwargs["position_embeddings"]
        heads, kv_heads = q.shape[-1] // d, k.shape[-1] // d
        rot = cos.shape[-1]  # < d only for a partial-rotary form (checked per forward)
        if rot != d:
            # Phi-3's partial rotary: each head's first rot features rotated, the rest copied.
            if form.qk_norm is not None:
                return self.original(hidden_states, *args, **kwargs)  # no kernel for both: theirs
            query = kernels.rotary(q, rows, heads, d, q.stride(1), cos, sin, rot)
            key = kernels.rotary(k, rows, kv_heads, d, k.stride(1), cos, sin, rot)
        elif form.qk_norm is not None:
            # The RMSNorm of each head (Qwen3) or of the whole projection (OLMo2) with q_norm's and
            # k_norm's weight and eps, then rotary: one pass each.
            qn, kn = self.qk_norms
            q_scale, k_scale = qn.scale(), kn.scale()
            per_head = form.qk_norm == "head"
            q_group, k_group = (1, 1) if per_head else (heads, kv_heads)
            if q_scale.shape[0] != q_group * d or k_scale.shape[0] != k_group * d:
                return self.original(hidden_states, *args, **kwargs)  # norms of another width: theirs fail
            query = kernels.rms_norm_rotary(
                q, rows, heads, d, q.stride(1), q_group, q_scale, qn.eps, qn.round_first, cos, sin
            )
            key = kernels.rms_norm_rotary(
                k, rows, kv_heads, d, k.stride(1), k_group, k_scale, kn.eps, kn.round_first, cos, sin
            )
        elif rows == 1 and k.data_ptr() == q.data_ptr() + q.shape[-1] * q.element_size():
            # One row whose k follows q in memory (a fused q/k/v GEMM's output): one rotary call
            # over both heads; the two views of its output are contiguous (one row).
            both = kernels.rotary(q, 1, heads + kv_heads, d, 0, cos, sin)
            query, key = both[:, :heads], both[:, heads:]
        else:
            query = kernels.rotary(q, rows, heads, d, q.stride(1), cos, sin)  # [T, H, D]
            key = kernels.rotary(k, rows, kv_heads, d, k.stride(1), cos, sin)  # [T, KVH, D]
        value = v[0].view(rows, -1, d)
        out = step.store_and_attend(attn.layer_idx, query, key, value, attn.scaling, self._window())
        out = projections["o_proj"].forward(out.reshape(1, rows, -1).contiguous())
        if out.dtype is not dtype or out.shape != hidden_states.shape or not out.is_cpu:
            # An o_proj of another output dtype (torch would promote the sum): the layer's own ops.
            return self._rest_as_the_layer(hidden_states, out)
        if not out.is_contiguous():
            out = out.contiguous()
        if form.post_norms:
            # OLMo2: residual + post_attention_layernorm(out); the MLP reads the sum itself.
            total = hidden_states + kernels.rms_norm(out, first.scale(), first.eps, first.round_first)
            h = total
        else:
            if form.residual_multiplier:
                out = out * self.layer.residual_multiplier  # Granite: the branch scaled, then added
            total, h = kernels.add_rms_norm(out, hidden_states, second.scale(), second.eps, second.round_first)
        if form.packed_gate_up:
            gate, up = mlp_projections["gate_up_proj"].forward(h).chunk(2, dim=-1)
        else:
            gate_up = _group_outputs(mlp_projections, ("gate_proj", "up_proj"), h)
            if gate_up is None:
                gate, up = mlp_projections["gate_proj"].forward(h), mlp_projections["up_proj"].forward(h)
            else:
                gate, up = gate_up
        if (
            not form.module_activation
            and gate.shape == up.shape
            and gate.shape[:-1] == lead
            and gate.dtype is dtype
            and up.dtype is dtype
            and gate.is_cpu
            and up.is_cpu
            and gate.stride(-1) == 1
            and up.stride(-1) == 1
        ):
            act = kernels.silu_mul(gate, up, gate.stride(1), up.stride(1))
        elif form.packed_gate_up:
            act = up * mlp.activation_fn(gate)  # Phi-3's order of operands
        else:
            act = mlp.act_fn(gate) * up
        down = mlp_projections["down_proj"].forward(act)
        if down.dtype != total.dtype or down.shape != total.shape or not down.is_cpu:
            return total + self._branch(down, second)  # as the layer adds them (dtype promotion, broadcasting)
        if form.post_norms:
            down = kernels.rms_norm(down.contiguous(), second.scale(), second.eps, second.round_first)
        elif form.residual_multiplier:
            down = down * self.layer.residual_multiplier
        return total.add_(down)  # total is ours: the residual add in place

    def _branch(self, out: torch.Tensor, post_norm: FusedNormForward) -> torch.Tensor:
        """A sublayer's output as the layer adds it to the residual stream, in torch's ops (the
        post-norm's or multiplier's, where the form has one)."""
        if self.form.post_norms:
            return post_norm.module(out)
        if self.form.residual_multiplier:
            return out * self.layer.residual_multiplier
        return out

    def _rest_as_the_layer(self, hidden_states: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The layer's code after attention from ``out`` (o_proj's output) on, its own modules called."""
        first, second = self.layer_norms
        total = hidden_states + self._branch(out, first)
        h = total if self.form.post_norms else second.module(total)
        return total + self._branch(self.mlp(h), second)


def _group_outputs(modules: dict, names: tuple[str, ...], x: torch.Tensor) -> Optional[tuple[torch.Tensor, ...]]:
    """The outputs for ``x`` of the projections ``names`` (children in ``modules``) from one call of
    their fused group (``FusedGroup.outputs_verified``: one GEMM, its column views) when their
    current forwards are, in order, exactly the packed members of one group (no wrapper, LoRA say,
    swapped in since) verified for this step; else None (the caller calls each forward)."""
    first = modules[names[0]].__dict__.get("forward")
    if type(first) is not PackedForward or first.group is None:
        return None
    members = first.group.members
    if len(members) != len(names):
        return None
    for f, name in zip(members, names):
        if modules[name].__dict__.get("forward") is not f:
            return None
    return first.group.outputs_verified(x)


class FusedLayers:
    """The fused decoder-layer forwards installed on one model: every layer :func:`layer_form`
    recognizes whose weights are of a dtype the C kernels have (none where they cannot be built)."""

    def __init__(self, model, layout: Optional[ModelLayout] = None) -> None:
        self.installed: list[tuple] = []
        self.recognized = 0
        lib = fused_library()
        if lib is None:
            return
        texts: dict = {}
        for _, module in (layout or ModelLayout.of(model)).modules:
            if "forward" in module.__dict__ or not hasattr(module, "self_attn"):
                continue
            form = layer_form(module, texts)
            if form is None:
                continue
            self.recognized += 1
            if getattr(module, form.norm_names()[0]).weight.dtype in lib.dtypes:
                fwd = FusedLayerForward(module, form)
                module.forward = fwd
                self.installed.append((module, fwd))

    def restore(self) -> None:
        """Remove the installed forwards (the layers' class forwards serve again)."""
        remove_forwards(self.installed)
        self.installed = []

    def forms(self) -> dict[str, int]:
        """``{form name: installed layers}`` (:meth:`LayerForm.name`: "llama", "qk-norm", ...)."""
        counts: dict[str, int] = {}
        for _, fwd in self.installed:
            counts[fwd.form.name()] = counts.get(fwd.form.name(), 0) + 1
        return counts

    def report(self) -> str:
        """One line: how many decoder layers run the fused step, and of which forms."""
        forms = ", ".join(f"{name} {n}" for name, n in self.forms().items())
        return f"fused decoder layers: {len(self.installed)} of {self.recognized} recognized layers ({forms or 'none'})"
