"""What an engine changes on its model, and how ``LLMEngine.close`` undoes it: packed (and fused)
linears (float, or int8 with ``EngineConfig.quantization="int8"``/``"w8a8"``), per-row LoRA
forwards (a ``peft.PeftModel``'s adapters), the switch to paged attention, and a compiled forward.

Models quantized by transformers' own quantizers (a linear whose weight is a tensor subclass, e.g.
torchao's ``Int8Tensor``): their weights never reach a float kernel. torchao's int8 weight-only
linears are repacked exactly into the int8 kernels (unless ``linear_backend="torch"``); any other
such linear runs its own ``F.linear``, probed once here, and one whose own linear fails is refused
by name (``ValueError``) before anything changes."""

from __future__ import annotations

import warnings
from typing import Optional

from ..config import TORCHAO_INT8, EngineConfig, QuantScheme, resolve_compile_model
from ..kernels.linears import pack_linears, tune_linears
from ..kernels.linears.linear_units import check_quantized_linears
from ..kernels.linears.registry import AUTO, UNPACKED
from ..kernels.linears.unquantized import FloatWeightsWarning, unquantized_weights
from ..kernels.linears.weight_spill import WeightSpill
from ..kernels.model_layout import ModelLayout
from . import model_users
from .attention_switch import restore_attention, switch_to_paged_attention
from .cross_token_routers import acquire_cross_token_routers, release_cross_token_routers
from .dynamic_mask import acquire_dynamic_masks, release_dynamic_masks
from .lora_adapters import acquire_lora_layers, release_lora_layers
from .pool_sizing import available_host_memory
from .rotary_variants import acquire_rotary_variants, release_rotary_variants
from .sparse_indexer import acquire_sparse_indexers, release_sparse_indexers

_FUSED_OPS_USERS = "_hf_contbatch_fused_ops"  # on the model: [FusedModelOps, open engines using it]
_FUSED_LAYERS_USERS = "_hf_contbatch_fused_layers"  # on the model: [FusedLayers, open engines using it]
_FUSED_MODEL_USERS = "_hf_contbatch_fused_model"  # on the model: [FusedModel, open engines using it]
_WEIGHT_FORMAT_USERS = "_hf_contbatch_weight_format"  # on the model: WeightFormatUsers


class ModelPatches:
    """The engine's changes to one model: applied by the constructor, undone by ``undo``.

    Args:
        model: the engine's model (the inner transformers model of a ``peft.PeftModel``).
        config: the engine configuration (``linear_backend``, ``fuse_linears``, ``compile_model``).
        cache: the engine's ``PagedKVCache`` (a compiled forward stores K/V into it itself).
        runner: the engine's ``ModelRunner``: it runs the compiled forward, or checks the packed
            linears once a step when the forward is eager.

    Attributes:
        packed_linears: the ``PackedLinears`` (None when the linears stay as they are).
        weight_spill: under a ``quantization`` (not with ``compile_model``), the float weights
            of the int8 linears on disk until ``undo`` (``kernels.linears.weight_spill``: reading one
            meanwhile raises an error naming it), else None.
        lora_layers: the model's ``LoraLayers`` (None without LoRA layers), shared by the engines
            serving the model (``lora_adapters.acquire_lora_layers``).
        compiled_forward: the ``CompiledForward`` (None unless ``compile_model``).
        fused_ops, fused_layers: under ``fuse_model_ops`` on CPU (not with ``compile_model``), the
            model's ``FusedModelOps`` (RMSNorms, SiLU-and-mul) and ``FusedLayers`` (decoder
            layers of the Llama form or a recognized variation of it, ``kernels.fused_layer``'s
            ``LayerForm``, as one fused step), shared by the engines on
            the model; else None.
        fused_model: with ``fused_layers``, the model's ``FusedModel`` (``kernels.fused_model``: the
            per-forward work around the layers once per step, for Llama-form models whose layers
            all run the fused step), shared by the engines on the model; else None.
        previous_attention: the model's own attention implementation, restored by ``undo``.
        rotary_variants: the model's ``RotaryVariants`` (LongRoPE factors per request, shared by the
            engines on the model), or None for a rotary that needs none.
        layout: the one walk of the model (``kernels.model_layout.ModelLayout``: attention layers and
            their kinds, linears, norms) that the checks, packing, quantizing and fusing read.
        weight_format: the linears' weights as served, for reports: "int8" / "w8a8" (``quantization``),
            "torchao Int8Tensor" (a quantizer's weights, by type name), else the model's dtype name.
        unquantized: under a ``quantization``, the weights it leaves float (a mixture of experts'
            3-D expert weights and router, ``kernels.linears.unquantized``; a
            ``FloatWeightsWarning`` names them when there are any), else None.

    Raises:
        ValueError: ``quantization`` on a model that is not on the CPU, a linear whose quantized
            weight cannot run (named), a bad ``HF_CONTBATCH_COMPILE``, a forced linear backend that cannot pack, a
            LoRA feature per-row adapters cannot serve (``kernels.lora.find_lora_layers``), or
            ``compile_model`` with LoRA adapters or a LongRoPE rotary, a LongRoPE rotary per layer
            type (``rotary_variants``). On any error the model is left as it was.
    """

    def __init__(self, model, config: EngineConfig, cache, runner) -> None:
        self.model = model
        # Before anything changes the model: quantized weights we cannot serve are refused by name.
        scheme = config.quant_scheme
        check_quantization_device(scheme, model_device(model))
        # One walk of the model: packing, quantizing and fusing read it (kernels.model_layout).
        self.layout = layout = ModelLayout.of(model)
        foreign = check_quantized_linears(model, layout)
        self.weight_format = weight_format(model, scheme, foreign)
        # Before anything changes the model: one weight format per model object (WeightFormatUsers).
        self._format_users = acquire_weight_format(model, self.weight_format, layout)
        # Before anything changes the model: a bad HF_CONTBATCH_COMPILE raises with the model untouched.
        compile_model = resolve_compile_model(config.compile_model)
        # Before anything changes the model: unsupported LoRA features raise with the model untouched.
        self.lora_layers = acquire_lora_layers(model)
        if self.lora_layers is not None and compile_model:
            release_lora_layers(model)
            self._format_users.open -= 1
            raise ValueError(
                "compile_model (HF_CONTBATCH_COMPILE=1) cannot serve LoRA adapters per request; turn it off for a "
                "peft.PeftModel"
            )
        self.packed_linears = None
        self.weight_spill = None
        self.rotary_variants = None
        self.sparse_indexers = None
        self.dynamic_masks = None
        self.cross_token_routers = None
        try:
            # Before anything else changes the model: a rotary we cannot serve per request raises.
            self.rotary_variants = acquire_rotary_variants(model)
            if self.rotary_variants is not None and compile_model:
                raise ValueError(
                    "compile_model (HF_CONTBATCH_COMPILE=1) cannot serve rope_type 'longrope', whose factors are "
                    "chosen per request; turn it off for this model"
                )
            # Sparse attention's indexers pick their top-k per request, as generate's rows do.
            self.sparse_indexers = acquire_sparse_indexers(model)
            # Dynamic mask attention (Doge) stores its per-key biases beside the keys.
            self.dynamic_masks = acquire_dynamic_masks(model)
            # Routers that mix a forward's tokens (Doge's CDMoE) run per request, as generate's forwards do.
            self.cross_token_routers = acquire_cross_token_routers(model)
            # LoRA's A and B stay unpacked (kernels.lora reads them); the base weights pack as usual.
            lora_ab = [
                ab for m in getattr(self.lora_layers, "modules", ()) for ab in (*m.lora_A.values(), *m.lora_B.values())
            ]
            self.packed_linears = self._pack(model, config, config.linear_backend, lora_ab, scheme, layout)
            if scheme is None and foreign and config.linear_backend != UNPACKED:
                # torchao's int8 weight-only linears: repacked exactly into the int8 kernels.
                backend = config.linear_backend if config.linear_backend != "onednn" else AUTO
                int8 = self._pack(model, config, backend, lora_ab, TORCHAO_INT8, layout)
                if int8 is not None:
                    self.packed_linears = int8.merged(self.packed_linears)
            self.unquantized = None
            if scheme is not None and scheme.quantize_float_weights:
                # Counted before the spill (sizes only): what "int8" does not cover, said loudly. A
                # later engine of the format runs the first one's int8 linears: its figures hold.
                users = self._format_users
                if users.unquantized is None:
                    served = self.packed_linears.modules if self.packed_linears is not None else []
                    users.unquantized = unquantized_weights(model, served, lora_ab, layout)
                self.unquantized = users.unquantized
            if scheme is not None and self.packed_linears is not None and not compile_model:
                # The int8 copies serve: the float weights wait on disk for undo() (weight_spill).
                self.weight_spill = WeightSpill(model, self.packed_linears.modules, layout)
                self.weight_spill.rekey(self.packed_linears.forwards)
            if runner.uses_attention_interface:
                self.previous_attention = switch_to_paged_attention(model)
            else:  # a model attending in its own code (dense_runner): counted as served, not switched
                self.previous_attention = switch_to_paged_attention(model, switch=False)
        except BaseException:
            if self.rotary_variants is not None:
                release_rotary_variants(model)
            if self.sparse_indexers is not None:
                release_sparse_indexers(model)
            if self.dynamic_masks is not None:
                release_dynamic_masks(model)
            if self.cross_token_routers is not None:
                release_cross_token_routers(model)
            restore_linears(self.packed_linears, self.weight_spill)
            self.weight_spill = None
            self._format_users.open -= 1
            if self.lora_layers is not None:
                release_lora_layers(model)
            raise
        if self.unquantized is not None and self.unquantized.names:
            warnings.warn(self.unquantized.describe(scheme.label), FloatWeightsWarning, stacklevel=3)
        model.eval()
        self.fused_ops = self.fused_layers = self.fused_model = None
        if config.fuse_model_ops and not compile_model:
            self.fused_ops = acquire_fused_ops(model, layout)
            self.fused_layers = acquire_fused_layers(model, layout)
            if self.fused_layers is not None:
                self.fused_model = acquire_fused_model(model, self.fused_layers)
        self.compiled_forward = None
        if compile_model:
            from ..kernels.compiled_forward import CompiledForward

            self.compiled_forward = CompiledForward(model, cache, runner._cache_arg, self.packed_linears)
            runner.model = self.compiled_forward
        else:  # eager steps check the packed linears once a step (a compiled forward refreshes them itself)
            runner.packed_linears = self.packed_linears
        runner.lora_layers = self.lora_layers
        runner.rotary_variants = self.rotary_variants
        runner.needs_prompt_lens = self.cross_token_routers is not None

    @staticmethod
    def _pack(model, config: EngineConfig, backend: str, lora_ab, scheme: Optional[QuantScheme], layout):
        """The packed linears of one weight format (``scheme``; None: float) or None when nothing packs."""
        # "auto": the kernel per GEMM unit is chosen first (timings from the tuner's disk cache,
        # measured only on a CPU seen for the first time), then packed by those choices.
        choices = None
        if backend == AUTO:
            choices = tune_linears(
                model,
                available_bytes=available_host_memory,
                exclude=lora_ab,
                fuse=config.fuse_linears,
                max_rows=config.scheduler.max_num_batched_tokens,
                max_head_rows=config.scheduler.max_num_seqs,
                quantization=scheme,
                layout=layout,
            )
        # Before the attention switch: a forced backend that cannot pack raises with nothing changed.
        if choices is None and backend == AUTO:
            return None
        return pack_linears(
            model,
            backend,
            available_host_memory,
            exclude=lora_ab,
            fuse=config.fuse_linears,
            choices=choices,
            quantization=scheme,
            layout=layout,
        )

    def undo(self) -> None:
        """Stop the compiled forward, restore the original linears, LoRA layers and the model's
        attention (the last engine open on the model restores the shared ones: the linears every
        engine on it packed too, so that the engines still open keep serving their weight format)."""
        if self.compiled_forward is not None:
            self.compiled_forward.close()
        users = self._format_users
        users.deferred.append((self.packed_linears, self.weight_spill))
        self.weight_spill = None
        users.open -= 1
        if users.open <= 0:
            for packed, spill in users.deferred:
                restore_linears(packed, spill)
            users.deferred = []
        if self.lora_layers is not None:
            release_lora_layers(self.model)
        restore_attention(self.model, self.previous_attention)
        if self.rotary_variants is not None:
            release_rotary_variants(self.model)
            self.rotary_variants = None
        if self.sparse_indexers is not None:
            release_sparse_indexers(self.model)
            self.sparse_indexers = None
        if self.dynamic_masks is not None:
            release_dynamic_masks(self.model)
            self.dynamic_masks = None
        if self.cross_token_routers is not None:
            release_cross_token_routers(self.model)
            self.cross_token_routers = None
        if self.fused_ops is not None:
            release_fused_ops(self.model)
            self.fused_ops = None
        if self.fused_model is not None:
            release_fused_model(self.model)
            self.fused_model = None
        if self.fused_layers is not None:
            release_fused_layers(self.model)
            self.fused_layers = None


# --- the weight format of the linears: one per model object, the last close restores them


class WeightFormatUsers:
    """The weight format the open engines on one model serve (``ModelPatches.weight_format``), how
    many are open, and the packed linears (with their spilled float weights) of those already
    closed, which the last close restores.

    Why: an engine changes the model's linears in place (an instance forward per linear, int8
    copies, float weights on disk), and a later engine leaves a linear that already has a forward
    alone. Two engines of different formats on one model object would each serve a mixture of
    both, so the second is refused; engines of one format share the first's packed linears, kept
    until the last of them closes. A copy of the model (``copy.deepcopy``, pickling) gets an empty
    record: no engine serves the copy.
    """

    def __init__(self, weight_format: Optional[str] = None) -> None:
        self.weight_format = weight_format
        self.open = 0
        self.deferred: list = []  # (PackedLinears or None, WeightSpill or None) of closed engines
        self.unquantized = None  # the first quantized engine's UnquantizedWeights, for the later ones

    def __reduce__(self):
        return (WeightFormatUsers, ())


def acquire_weight_format(model, fmt: str, layout: ModelLayout) -> WeightFormatUsers:
    """Count one more engine serving ``model``'s linears as ``fmt`` ("float32", "int8", "w8a8",
    "torchao Int8Tensor"...; see :func:`weight_format`) and return the model's record.

    Raises:
        ValueError: an open engine serves the model in another format, or the model is a copy of
            one an engine served (its linears carry that engine's packed forwards); nothing is changed.
    """
    users = model.__dict__.get(_WEIGHT_FORMAT_USERS)
    if users is None or users.open <= 0:
        from ..kernels.linears.packed_forward import PackedForward

        carried = [n for n, m in layout.linears if isinstance(m.__dict__.get("forward"), PackedForward)]
        if carried:
            raise ValueError(
                f"this model is a copy (copy.deepcopy, pickle) of a model an open engine serves: its linears "
                f"({carried[0]!r} and {len(carried) - 1} more) carry that engine's packed forwards, which this engine "
                "would serve instead of its own. Copy the model before building the first engine (or close() that "
                "engine, then copy)"
            )
    if users is not None and users.open > 0 and users.weight_format != fmt:
        engines = "engine" if users.open == 1 else f"{users.open} engines"
        raise ValueError(
            f"this model object is already served by an open {engines} with {users.weight_format} linears; this "
            f"engine would serve it as {fmt}. An engine changes the model's linears in place (packed or quantized "
            "copies that every engine on the model then runs), so two weight formats on one model would each "
            f"serve a mixture of both. Serve a copy: `copy.deepcopy(model)` made before the first engine was "
            "built (or close() the other engine first)"
        )
    if users is None or users.open <= 0:
        leftover = users.deferred if users is not None else []
        users = WeightFormatUsers(fmt)
        users.deferred = leftover
        model.__dict__[_WEIGHT_FORMAT_USERS] = users
    users.open += 1
    return users


def restore_linears(packed, spill) -> None:
    """Put one engine's linears back: the spilled float weights first, exactly
    (``WeightSpill.restore``; the packed forwards read real weights from then on), then the
    modules' own forwards (``PackedLinears.restore``). Either may be None."""
    if spill is not None:
        spill.restore()
        if packed is not None:
            spill.rekey(packed.forwards)
    if packed is not None:
        packed.restore()


# --- fused model ops (RMSNorm, SiLU-and-mul): installed by the first engine, removed by the last close


def acquire_fused_ops(model, layout=None):
    """The model's ``FusedModelOps`` (kernels.fused_ops), installed by the first engine on it (its
    per-shape choice timed then) and shared by the later ones; None where the model is not on CPU.
    ``layout``: the engine's walk of the model (``kernels.model_layout``; default: walked there)."""

    def build():
        param = next(model.parameters(), None)
        if param is None or param.device.type != "cpu":
            return None
        from ..kernels.fused_ops import FusedModelOps

        return FusedModelOps(model, layout=layout)

    return model_users.acquire(model, _FUSED_OPS_USERS, build)


def release_fused_ops(model) -> None:
    """One engine fewer on ``model``; the last one removes the fused forwards."""
    model_users.release(model, _FUSED_OPS_USERS, undo=lambda ops: ops.restore())


def acquire_fused_layers(model, layout=None):
    """The model's ``FusedLayers`` (kernels.fused_layer: its decoder layers of the Llama form or a
    recognized variation, ``LayerForm``, as one fused step each), installed by the first engine on it and shared by the later ones; None where the
    model is not on CPU or has no such layer. ``layout``: the engine's walk of the model."""

    def build():
        param = next(model.parameters(), None)
        if param is None or param.device.type != "cpu":
            return None
        from ..kernels.fused_layer import FusedLayers

        layers = FusedLayers(model, layout=layout)
        return layers if layers.installed else None

    return model_users.acquire(model, _FUSED_LAYERS_USERS, build)


def release_fused_layers(model) -> None:
    """One engine fewer on ``model``; the last one removes the fused layer forwards."""
    model_users.release(model, _FUSED_LAYERS_USERS, undo=lambda layers: layers.restore())


def acquire_fused_model(model, fused_layers):
    """The model's ``FusedModel`` (kernels.fused_model: the causal LM's and base model's per-forward
    work once per step), installed by the first engine on it and shared by the later ones; None
    where the model's code does not read as the Llama form or a layer lacks the fused step.
    ``fused_layers``: the model's ``FusedLayers`` (``acquire_fused_layers``)."""

    def build():
        from ..kernels.fused_model import FusedModel

        fused = FusedModel(model, fused_layers)
        return fused if fused.installed else None

    return model_users.acquire(model, _FUSED_MODEL_USERS, build)


def release_fused_model(model) -> None:
    """One engine fewer on ``model``; the last one removes the fused model forwards."""
    model_users.release(model, _FUSED_MODEL_USERS, undo=lambda fused: fused.restore())


def model_device(model) -> str:
    """The device type of the model's first parameter ("cpu" for a model without any)."""
    param = next(iter(model.parameters()), None)
    return "cpu" if param is None else param.device.type


def check_quantization_device(scheme: Optional[QuantScheme], device: str) -> None:
    """Raise ``ValueError`` for a quantization ``scheme`` on a non-CPU model: the int8 kernels are
    CPU ones (on CUDA a model quantized by torchao is served through its own kernels instead)."""
    if scheme is not None and device != "cpu":
        raise ValueError(
            f"`quantization={scheme.name!r}` serves CPU models only (its kernels are CPU kernels); the model is on "
            f"{device}. On CUDA, load the model quantized (transformers' TorchAoConfig) and leave `quantization=None`: "
            "its own kernels serve it"
        )


def weight_format(model, scheme: Optional[QuantScheme], foreign: dict) -> str:
    """How the linears' weights are served, for stats and the CLI: the scheme's label ("int8",
    "w8a8"), the quantizer's weight types ("torchao Int8Tensor"), or the model's dtype name ("float32")."""
    if scheme is not None:
        return scheme.label
    if foreign:
        return ", ".join(sorted({f"torchao {k}" if k == "Int8Tensor" else k for k in foreign.values()}))
    param = next(iter(model.parameters()), None)
    return "float32" if param is None else str(param.dtype).removeprefix("torch.")
