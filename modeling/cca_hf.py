"""CCA attention inside transformers' own model classes (design C of FAMILIES-NOTES.md; not yet used by the CLI).

A family's CCA model is its stock ``XForCausalLM`` (embeddings, norms incl. q/k-norm, MLP/MoE, rotary variants,
weight conversions: all transformers' own code) with three changes, none of which copies model code:

- ``config._attn_implementation = "cca"``: the attention function registered below replaces SDPA. It receives
  transformers' post-RoPE q/k, recovers the pre-RoPE tensors with the family's own ``apply_rotary_pos_emb`` (CCA
  pools pre-RoPE keys and rotates them at the group middle), and runs the project's CCA attention or cache layer.
- a forward pre-hook on every ``self_attn`` keeps the layer's ``position_embeddings`` and cache for that function
  (transformers passes neither to attention functions);
- ``forward`` swaps an empty cache for a compressed ``CCACache`` (``generate()`` creates a ``DynamicCache``).

The CCA settings live in the stock config as ``cca_group_size``, ``cca_local_window``, ``cca_pooling`` and
``cca_attn_backend`` (``from_pretrained(..., cca_group_size=8)`` overrides them); ``attn_implementation="sdpa"`` at
load time runs the base model's own attention on the same weights.
"""

import sys

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from .attention_cca import cca_attention, left_padding, shift_rows
from .cache_cca import CCACache

DEFAULTS = {"group_size": 16, "local_window": 1024, "pooling": "kv", "attn_backend": "auto"}


class CCASettings:
    """The CCA fields of a stock config, under the names the attention and cache code read (looked up on each
    access, so overrides made after loading apply)."""

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        if name in DEFAULTS:
            return getattr(self._config, f"cca_{name}", DEFAULTS[name])
        return getattr(self._config, name)


class HFCCACache(CCACache):
    """``CCACache`` for stock attention modules: they call ``update(k, v, layer)`` before the attention function,
    which then does the real (compressed) work, so ``update`` hands the new tensors through unchanged."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states


def _capture(module, args, kwargs):
    if "position_embeddings" not in kwargs:
        raise RuntimeError(f"{type(module).__name__} was not called with position_embeddings=...: this transformers "
                           "version is not supported by CCA's attention hook")
    module._cca_ctx = (kwargs["position_embeddings"], kwargs.get("past_key_values"))


def _unrope(module, x, cos, sin):
    """The exact inverse of the family's own RoPE (rotation by -theta; YaRN-style scaling divided out)."""
    rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
    s2 = cos[..., :1].float() ** 2 + sin[..., :1].float() ** 2
    xf = x.float()
    return rope(xf, xf, cos.float() / s2, -sin.float() / s2)[0].to(x.dtype)


def cca_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                          softcap=None, **kwargs):
    """The "cca" attention function: (B, H, L, d) post-RoPE q/k in, (B, L, H, d) out, no attention weights."""
    # Refused, not approximated: each would silently change the base model's attention.
    if sliding_window is not None:
        raise ValueError(f"layer {module.layer_idx} is a sliding-window layer (sliding_window={sliding_window}): "
                         "CCA replaces only full-attention layers, and this shim does not yet keep local layers "
                         "as they are; load this model with attn_implementation='sdpa'")
    if softcap is not None:
        raise ValueError(f"this model caps attention logits (softcap={softcap}), which the CCA kernels do not "
                         "implement; load it with attn_implementation='sdpa'")
    if dropout:
        raise ValueError(f"CCA attention has no attention dropout (got {dropout}): set config.attention_dropout=0")
    (cos, sin), cache = module._cca_ctx
    q, k = _unrope(module, query, cos, sin), _unrope(module, key, cos, sin)
    settings = CCASettings(module.config)
    if isinstance(cache, CCACache):
        out = cache.cca_attention(module.layer_idx, q, k, value, cos, sin, attention_mask, scaling)
    else:
        out = _no_cache_attention(q, k, value, cos, sin, attention_mask, settings, scaling)
    return out.transpose(1, 2), None


def _no_cache_attention(q, k, v, cos, sin, attention_mask, settings, scale):
    n_pad = left_padding(attention_mask)
    if n_pad is None:
        return cca_attention(q, k, v, cos, sin, settings, scale)
    bsz, q_len = q.shape[0], q.shape[2]
    q, k, v = (shift_rows(x, n_pad, 2) for x in (q, k, v))
    cos, sin = (shift_rows(x.expand(bsz, -1, -1), n_pad, 1) for x in (cos, sin))
    return shift_rows(cca_attention(q, k, v, cos, sin, settings, scale), q_len - n_pad, 2)


AttentionInterface.register("cca", cca_attention_forward)
AttentionMaskInterface.register("cca", flash_attention_mask)  # the 2-D padding mask (or None), as CCA expects


def make_cca_class(base):
    """``CCA<Base>`` = the stock causal-LM class ``base`` with CCA attention and the compressed cache."""

    class CCAForCausalLM(base):
        def __init__(self, config):
            super().__init__(config)
            for module in self.modules():
                if hasattr(module, "layer_idx") and hasattr(module, "o_proj"):  # the attention modules
                    module.register_forward_pre_hook(_capture, with_kwargs=True)

        def forward(self, *args, past_key_values=None, use_cache=None, **kwargs):
            use_cache = self.config.use_cache if use_cache is None else use_cache
            if self.config._attn_implementation == "cca" and use_cache and not self.training:
                if past_key_values is None or (not isinstance(past_key_values, CCACache)
                                               and past_key_values.get_seq_length() == 0):
                    past_key_values = HFCCACache(CCASettings(self.config))
            return super().forward(*args, past_key_values=past_key_values, use_cache=use_cache, **kwargs)

    CCAForCausalLM.__name__ = CCAForCausalLM.__qualname__ = "CCA" + base.__name__
    return CCAForCausalLM


__all__ = ["CCASettings", "HFCCACache", "cca_attention_forward", "make_cca_class"]
