"""Core Context Aware (CCA) attention for Llama- and Qwen2-style causal LMs.

The architecture and parameter names are the base model's (``model.layers.N.self_attn.q_proj`` ...),
so base checkpoints load unchanged. Only attention differs: each group of ``group_size`` tokens is
pooled into a core token, and every query attends to the core tokens of distant groups plus the raw
keys of its ``local_window`` most recent positions, in one softmax (see ``cca_reference.py``).

Backends (``config.attn_backend``): ``auto`` uses the Triton kernel on CUDA and the PyTorch reference
elsewhere; ``full`` runs plain causal attention with the same weights, for A/B comparisons.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from .cache_cca import CCACache
from .cca_reference import apply_rope, cca_attention_reference, pool_core_tokens
from .configuration_cca import CCAConfig

try:
    from .cca_triton import cca_attention_triton
except ImportError:  # triton is optional: CPU-only installs use the reference
    cca_attention_triton = None


def cca_attention(q, k, v, cos, sin, config: CCAConfig, scale: float, return_core: bool = False):
    """CCA over whole sequences whose positions are ``0 .. L-1``; picks the backend. With ``return_core``
    also returns the pooled ``(K_core, V_core)`` (a KV cache keeps them), computed once with the attention."""
    use_triton = config.attn_backend == "triton" or (config.attn_backend == "auto" and q.is_cuda)
    if config.attn_backend == "triton" and not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attn_backend='triton' needs a CUDA GPU (the model is on the CPU); "
                         "use attn_backend='auto' or 'reference' there")
    if use_triton and cca_attention_triton is None:
        if config.attn_backend == "triton":
            raise ImportError("attn_backend='triton' needs the `triton` package (pip install triton)")
        use_triton = False
    if use_triton and q.shape[2] <= config.local_window:
        # No query is past the window: CCA is exactly causal attention (spec), and SDPA is faster.
        q_rot, k_rot = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = full_causal_attention(q_rot, k_rot, v, None, scale)
        if not return_core:
            return out
        return out, *pool_core_tokens(q_rot, k_rot, k, v, cos, sin, config.group_size, config.pooling, scale)
    attend = cca_attention_triton if use_triton else cca_attention_reference
    return attend(q, k, v, cos, sin, config.group_size, config.local_window, config.pooling, scale, return_core)


def left_padding(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Per-sequence count of leading pad tokens, or None when no sequence is left-padded.

    CCA groups are counted from each sequence's first real token, so left-padded rows are shifted
    to start at index 0 before attention (right padding needs nothing: pads come after every real
    query and are never seen by one).
    """
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    mask = attention_mask.bool()
    n_pad = (~mask).long().cumprod(-1).sum(-1)
    idx = torch.arange(mask.shape[1], device=mask.device)
    n_real = mask.long().sum(-1)
    expected = (idx[None] >= n_pad[:, None]) & (idx[None] < (n_pad + n_real)[:, None])
    if not torch.equal(mask, expected):
        raise ValueError("CCA attention supports left or right padding only, not holes inside a sequence")
    return n_pad if bool(n_pad.any()) else None


def shift_rows(x: torch.Tensor, shift: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """Roll each batch row of ``x`` left by ``shift[b]`` positions along ``seq_dim``."""
    seq_len = x.shape[seq_dim]
    idx = (torch.arange(seq_len, device=x.device)[None] + shift[:, None]) % seq_len  # (B, L)
    shape = [x.shape[0]] + [1] * (x.dim() - 1)
    shape[seq_dim] = seq_len
    return x.gather(seq_dim, idx.view(shape).expand_as(x))


def full_causal_attention(q, k, v, attention_mask, scale) -> torch.Tensor:
    """Plain causal attention (backend ``full``), with the padding mask if any."""
    q_len, kv_len = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if attention_mask is None and q_len == kv_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    qi = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
    ki = torch.arange(kv_len, device=q.device)[None, :]
    mask = (ki <= qi)[None, None]
    if attention_mask is not None:
        keep = attention_mask[:, None, None, -kv_len:].bool()
        mask = mask & (keep | (ki == qi))  # a pad query still needs one key to avoid NaN rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


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
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), past_key_values=past_key_values)


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
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)


__all__ = ["CCAForCausalLM", "CCAModel", "CCAPreTrainedModel"]
