# A causal LM as a Hub repository's own modeling file would define it (loaded with
# trust_remote_code=True): config, attention, decoder, written against transformers' public API only.
# tests/engine/test_real_checkpoints.py copies this file into a checkpoint directory, whose
# config.json names these classes in its auto_map. The attention looks its function up in
# ALL_ATTENTION_FUNCTIONS and stores K/V with cache.update right before it: the interface
# hf_contbatch serves.
import torch
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


class WalkRemoteConfig(PretrainedConfig):
    model_type = "walk_remote"

    def __init__(
        self,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kwargs)


def eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """softmax(q k^T * scaling + mask) v, K/V heads repeated for grouped queries; [B, S, H, D] out."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(2, 3) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return (weights @ value).transpose(1, 2).contiguous(), weights


class WalkRemoteAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads  # sdpa reads it
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        out, _ = attend(self, q, k, v, attention_mask, scaling=self.scaling, dropout=0.0, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1))


class WalkRemoteLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size)
        self.attn = WalkRemoteAttention(config, layer_idx)
        self.norm2 = nn.LayerNorm(config.hidden_size)
        self.up = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        hidden_states = hidden_states + self.attn(self.norm1(hidden_states), attention_mask, cache, **kwargs)
        return hidden_states + self.down(nn.functional.gelu(self.up(self.norm2(hidden_states))))


class WalkRemotePreTrainedModel(PreTrainedModel):
    config_class = WalkRemoteConfig
    base_model_prefix = "model"
    _supports_attention_backend = True
    _supports_sdpa = True
    _no_split_modules = ["WalkRemoteLayer"]


class WalkRemoteModel(WalkRemotePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(WalkRemoteLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None, **kwargs):
        embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)[None]
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        hidden_states = embeds + self.embed_positions(position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, cache, position_ids=position_ids, **kwargs)
        return self.norm(hidden_states), cache


class WalkRemoteForCausalLM(WalkRemotePreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = WalkRemoteModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        hidden_states, cache = self.model(input_ids, attention_mask, position_ids, cache, use_cache, **kwargs)
        if isinstance(logits_to_keep, torch.Tensor):  # the positions whose logits are wanted
            hidden_states = hidden_states[:, logits_to_keep]
        elif logits_to_keep:  # the last logits_to_keep positions
            hidden_states = hidden_states[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden_states), cache=cache)
