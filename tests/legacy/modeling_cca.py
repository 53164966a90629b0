"""Core Context Aware (CCA) attention for Llama- and Qwen2-style causal LMs.

The architecture and parameter names are the base model's (``model.layers.N.self_attn.q_proj`` ...),
so base checkpoints load unchanged. Only attention differs: each group of ``group_size`` tokens is
pooled into a core token, and every query attends to the core tokens of distant groups plus the raw
keys of its ``local_window`` most recent positions, in one softmax (see ``cca_reference.py``).

Backends (``config.attn_backend``): ``auto`` uses the Triton kernel on CUDA and the PyTorch reference
elsewhere; ``full`` runs plain causal attention with the same weights, for A/B comparisons.
"""

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from cca_convert.kernels.cca_reference import apply_rope
from cca_convert.modeling.attention_hooks import CACHE_ARG, given_cache
from cca_convert.modeling.attention_cca import cca_attention, full_causal_attention, left_padding, shift_rows
from cca_convert.modeling.cache_cca import CCACache

from .configuration_cca import CCAConfig


class CCAAttention(nn.Module):
    def __init__(self, config: CCAConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        hidden, qkv_bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.attention_out_bias)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings

        if self.config.attn_backend == "full":
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if past_key_values is not None:
                k, v = past_key_values.update(k, v, self.layer_idx)
            out = full_causal_attention(q, k, v, attention_mask, self.scaling)
        elif past_key_values is not None:
            out = past_key_values.cca_attention(self.layer_idx, q, k, v, cos, sin, attention_mask, self.scaling)
        else:
            n_pad = left_padding(attention_mask)
            if n_pad is None:
                out = cca_attention(q, k, v, cos, sin, self.config, self.scaling)
            else:
                q, k, v = (shift_rows(x, n_pad, 2) for x in (q, k, v))
                cos, sin = (shift_rows(x.expand(bsz, -1, -1), n_pad, 1) for x in (cos, sin))
                out = cca_attention(q, k, v, cos, sin, self.config, self.scaling)
                out = shift_rows(out, q_len - n_pad, 2)

        out = out.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)


class CCADecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: CCAConfig, layer_idx: int):
        super().__init__()
        self.self_attn = CCAAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, past_key_values
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class CCAPreTrainedModel(PreTrainedModel):
    config_class = CCAConfig
    config: CCAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["CCADecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]


class CCAModel(CCAPreTrainedModel):
    def __init__(self, config: CCAConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(CCADecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values: Cache | None = None,
        inputs_embeds=None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and not self.training:  # generate() passes an empty DynamicCache: CCA swaps in a CCACache
            past_key_values = CCACache.prepare(self.config, past_key_values)
        if not use_cache:
            past_key_values = None

        if position_ids is None:
            past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            if attention_mask is not None and attention_mask.dim() == 2:
                # Positions count real tokens only: with left padding the first real token is position 0.
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -inputs_embeds.shape[1] :]
            else:
                position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)[None] + past_seen

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask, past_key_values)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), **{CACHE_ARG: past_key_values})


class CCAForCausalLM(CCAPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: CCAConfig):
        super().__init__(config)
        self.model = CCAModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values: Cache | None = None,
        inputs_embeds=None,
        labels=None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: Cache | None = None,  # (generate()'s name for it from transformers 5.24 on)
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=given_cache(cache, past_key_values),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_ARG: getattr(outputs, CACHE_ARG)})


__all__ = ["CCAForCausalLM", "CCAModel", "CCAPreTrainedModel"]
