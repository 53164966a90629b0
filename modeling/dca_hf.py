"""Dual Chunk Attention inside transformers' own model classes (the second method; DCA-SPEC.md, ``dca_reference.py``).

As for CCA (``cca_hf.py``), a family's DCA model is its stock causal-LM class with ``DCAModelMixin`` in front: the
attention implementation defaults to ``"dca"``, a forward pre-hook keeps each attention module's positions and cache,
and ``forward`` gives ``generate()`` a ``DCACache``. The settings are Qwen2.5-1M's ``dual_chunk_attention_config``
(``chunk_size``, ``local_size``, ``original_max_position_embeddings``).

This revision runs the PyTorch reference (one softmax per query, in query blocks) and caches pre-RoPE keys, which it
rotates at ``j % s`` on each pass; the fused Triton kernel and a cache of once-rotated keys come next. The RoPE is the
model's own (its ``inv_freq`` and ``attention_scaling``; NeoX layout, whole heads).
"""

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from .attention_hooks import capture_hook, dispatching, unrope
from .dca_reference import check_params, dca_attention_reference

QUERY_BLOCK = 512  # queries per reference call: bounds the (block x keys) score matrices


def dca_settings(config) -> tuple[int, int, int]:
    cfg = getattr(config, "dual_chunk_attention_config", None) or {}
    chunk, local = cfg.get("chunk_size"), cfg.get("local_size")
    check_params(chunk, local)
    return chunk, local, cfg.get("original_max_position_embeddings") or 0


class DCALayerCache(CacheLayerMixin):
    """Every key of one layer (DCA evicts nothing): pre-RoPE keys, values, positions and a validity mask."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self):
        super().__init__()
        self.keys = self.values = self.pos = self.valid = None

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        # CacheLayerMixin's entry point; DCACache.update never calls it (the attention function appends, with the
        # positions and validity this method's signature cannot carry), so a direct call is a wiring error
        raise RuntimeError("DCALayerCache is filled through the 'dca' attention function, not update(): load the "
                           "model with its DCA class (DCAModelMixin)")

    def append(self, k, v, pos, valid):
        if self.keys is None:
            self.keys, self.values, self.pos, self.valid = k, v, pos, valid
        else:
            self.keys, self.values = torch.cat([self.keys, k], 2), torch.cat([self.values, v], 2)
            self.pos, self.valid = torch.cat([self.pos, pos], 1), torch.cat([self.valid, valid], 1)
        return self.keys, self.values, self.pos, self.valid

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self):
        self.keys = self.values = self.pos = self.valid = None

    def _map(self, fn, seq=False):
        if self.keys is not None:
            self.keys, self.values = fn(self.keys, 2 if seq else 0), fn(self.values, 2 if seq else 0)
            self.pos, self.valid = fn(self.pos, 1 if seq else 0), fn(self.valid, 1 if seq else 0)

    def reorder_cache(self, beam_idx):
        self._map(lambda x, d: x.index_select(0, beam_idx.to(x.device)))

    def batch_select_indices(self, indices):
        self._map(lambda x, d: x[indices])

    def batch_repeat_interleave(self, repeats: int):
        self._map(lambda x, d: x.repeat_interleave(repeats, dim=0))

    def crop(self, tokens: int):
        """Rejected draft tokens go away: ``-n`` drops the last ``n`` columns and 0 is a no-op (transformers >= 5.2x);
        a positive value is the length to keep (what older versions pass)."""
        length = self.get_seq_length()
        keep = length + tokens if tokens <= 0 else min(tokens, length)
        if keep != length:
            self._map(lambda x, d: x.narrow(d, 0, keep), seq=True)


class DCACache(Cache):
    def __init__(self, config):
        super().__init__(layers=[DCALayerCache() for _ in range(config.num_hidden_layers)])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states  # the dca attention function stores what it needs itself


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
               softcap=None, **kwargs):
    if sliding_window is not None or softcap is not None or dropout:
        raise ValueError("DCA replaces full attention only: sliding-window layers, logit softcapping and attention "
                         "dropout are not supported; load the model with attn_implementation='sdpa'")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("DCA takes only a 2-D padding mask; load with attn_implementation='sdpa' for custom masks")
    (cos, sin), cache, _ = module._method_ctx
    chunk, local, c_orig = dca_settings(module.config)
    bsz, q_len = query.shape[0], query.shape[2]
    q, k = unrope(module, query, cos, sin), unrope(module, key, cos, sin)  # whatever positions RoPE used
    qvalid = (attention_mask[:, -q_len:].bool() if attention_mask is not None
              else torch.ones(bsz, q_len, dtype=torch.bool, device=q.device))
    layer = cache.layers[module.layer_idx] if isinstance(cache, DCACache) else None
    # DCA positions are absolute and per sequence: each row counts its own real tokens (a left-padded row starts
    # at 0, as the spec requires), whatever position_ids the caller passed
    seen = layer.valid.sum(1, keepdim=True) if layer is not None and layer.valid is not None else 0
    qpos = (seen + qvalid.long().cumsum(1) - 1).clamp_min(0)
    v = value.float()
    if layer is not None:
        k, v, kpos, kvalid = layer.append(k, v, qpos, qvalid)
    else:
        kpos, kvalid = qpos, qvalid
    rotary = module._dca_rotary
    out = torch.cat([dca_attention_reference(q[:, :, a:a + QUERY_BLOCK], k, v, qpos[:, a:a + QUERY_BLOCK], kpos, kvalid,
                                             qvalid[:, a:a + QUERY_BLOCK], chunk, local, rotary.inv_freq, scaling,
                                             c_orig, rotary.attention_scaling)
                     for a in range(0, q_len, QUERY_BLOCK)], 2)
    return out.to(value.dtype).transpose(1, 2), None


dca_attention_forward = dispatching("dca")
AttentionInterface.register("dca", dca_attention_forward)
AttentionMaskInterface.register("dca", flash_attention_mask)


class DCAModelMixin:
    """Put in front of a stock causal-LM class: ``class DCAQwen2ForCausalLM(DCAModelMixin, Qwen2ForCausalLM)``."""

    def __init__(self, config, *args, **kwargs):
        dca_settings(config)  # bad values fail when the model is built
        super().__init__(config, *args, **kwargs)
        rotary = self.model.rotary_emb
        for module in self.modules():
            if hasattr(module, "layer_idx") and hasattr(module, "o_proj"):
                module.register_forward_pre_hook(capture_hook("dca", _attention), with_kwargs=True)
                object.__setattr__(module, "_dca_rotary", rotary)  # a reference, not a submodule

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        if attn_implementation is None or attn_implementation == "dca":
            return "dca"
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)

    def forward(self, *args, past_key_values=None, use_cache=None, **kwargs):
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.config._attn_implementation == "dca" and use_cache and not self.training:
            if past_key_values is None or (not isinstance(past_key_values, DCACache)
                                           and past_key_values.get_seq_length() == 0):
                past_key_values = DCACache(self.config)
        return super().forward(*args, past_key_values=past_key_values, use_cache=use_cache, **kwargs)


__all__ = ["DCACache", "DCAModelMixin", "dca_attention_forward", "dca_settings"]
