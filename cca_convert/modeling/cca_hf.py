"""CCA attention inside transformers' own model classes.

A family's CCA model (``modeling_cca_<family>.py``) is its stock ``XForCausalLM`` — embeddings, norms incl. q/k-norm,
MLP/MoE blocks, rotary variants, weight conversions: all transformers' own code — with ``CCAModelMixin`` in front:

- the attention implementation defaults to ``"cca"``, the function registered below. It receives transformers'
  post-RoPE q/k and runs CCA (``attention_cca.py``) or its compressed cache (``cache_cca.py``) on them. CCA pools
  pre-RoPE keys (and rotates them at the group middle): the pooling undoes a ``rotate_half`` RoPE itself, any other
  goes back through the family's own ``apply_rotary_pos_emb`` with inverse tables. Sliding-window layers (Gemma 3's
  local layers, Qwen's ``max_window_layers``) keep their own sliding attention and cache: CCA replaces full attention
  only.
- a forward pre-hook on every attention module keeps the layer's ``position_embeddings`` and cache for that
  function (transformers passes neither to attention functions);
- ``forward`` swaps an empty cache for the compressed one (``generate()`` creates a ``DynamicCache``), and on CUDA
  replays one-token decode steps from CUDA graphs (``decode_graph.py``; ``cca_cuda_graphs=False`` turns it off),
  captured with ``torch.compile`` twins of the norms and MLPs, Triton few-row products for the linear layers and the
  step's RoPE left to the decode kernel (``cca_compile_decode=False``: the stock code).
- ``generate()`` reads its stopping flag one step late on CUDA when the cache is CCA's (``decode_graph.
  defer_stop_checks``; ``cca_defer_stop_checks=False`` turns it off).

Settings live in the stock config as ``cca_group_size``, ``cca_local_window``, ``cca_pooling`` and
``cca_attn_backend`` ("auto": Triton on CUDA, the PyTorch reference elsewhere; "full": the base model's attention on
the same weights — plain causal, or the sliding window CCA replaced). ``from_pretrained(..., cca_group_size=8)``
overrides them and is checked at load. ``attn_implementation="sdpa"`` or ``"eager"`` at load runs the base model's
own attention (no CCA) on the same weights.
"""

import functools

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

from .attention_hooks import CACHE_ARG, MethodModelMixin, dispatching, family_rope, given_cache, unrope
from .attention_cca import cca_attention, full_causal_attention, left_padding, shift_rows
from .cache_cca import SPECULATIVE_SLACK, CCACache, CCALayerCache
from ..kernels.cca_params import CHOICES, DEFAULTS, check_args
from ..kernels.cca_reference import apply_rope
from .decode_graph import GraphDecodeMixin, take_unrotated

logger = logging.get_logger(__name__)


class CCASettings:
    """The CCA fields of a stock config under the names the attention and cache code read (looked up on each access,
    so overrides made after loading apply)."""

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        if name in DEFAULTS:
            return getattr(self._config, f"cca_{name}", DEFAULTS[name])
        return getattr(self._config, name)


def check_settings(config):
    """Refuse bad ``cca_*`` values when the model is built, not at its first forward."""
    try:
        check_args(*(getattr(config, f"cca_{name}", DEFAULTS[name]) for name in ("group_size", "local_window")), "kv")
    except ValueError as exc:
        raise ValueError(f"cca_{exc}") from None
    for name in ("cuda_graphs", "compile_decode", "defer_stop_checks"):
        value = getattr(config, f"cca_{name}", True)
        if not isinstance(value, bool):
            raise ValueError(f"cca_{name} must be true or false, got {value!r}")
    for name, choices in CHOICES.items():
        value = getattr(config, f"cca_{name}", DEFAULTS[name])
        if value not in choices:
            raise ValueError(f"cca_{name} must be one of {choices}, got {value!r}")


class HFCCACache(CCACache):
    """The compressed cache for stock attention modules. They call ``update(k, v, layer)`` before the attention
    function: CCA layers hand the new tensors through (the function then does the compressed work); sliding-window
    layers are ordinary sliding caches."""

    def __init__(self, config):
        settings = CCASettings(config)
        types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        Cache.__init__(self, layers=[DynamicSlidingWindowLayer(config.sliding_window) if t == "sliding_attention"
                                     else CCALayerCache(settings) for t in types])
        self.config = settings

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if isinstance(self.layers[layer_idx], CCALayerCache):
            return key_states, value_states
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _sliding_attention(module, query, key, value, mask_2d, scaling, window):
    """A local layer's own attention: causal within ``window`` columns, over the keys its sliding cache holds.
    Long inputs go by blocks of 2 x ``window`` queries, each over the keys its window can reach: the same result as
    one masked call, without its O(L^2) work and L x L mask for an O(L x window) pattern (Gemma 3's 40 local layers
    at 32K: the bulk of the prefill)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    pad = None if mask_2d is None else mask_2d[:, None, None, -kv_len:].bool()
    step = 2 * window if q_len > 4 * window else q_len  # short inputs (and decode steps): one call
    outs = []
    for q0 in range(0, q_len, step):
        q1 = min(q0 + step, q_len)
        q_col = torch.arange(kv_len - q_len + q0, kv_len - q_len + q1, device=query.device)[:, None]
        k0 = max(0, kv_len - q_len + q0 - window + 1) if step < q_len else 0
        k1 = kv_len - q_len + q1
        k_col = torch.arange(k0, k1, device=query.device)[None, :]
        mask = ((k_col <= q_col) & (q_col - k_col < window))[None, None]
        if pad is not None:
            mask = mask & (pad[..., k0:k1] | (k_col == q_col))  # pad rows keep one key: no NaN
        outs.append(sdpa_attention_forward(module, query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1], mask,
                                           scaling=scaling)[0])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
               softcap=None, **kwargs):
    """CCA attention: (B, H, L, d) post-RoPE q/k in, (B, L, H, d) out, no attention weights."""
    # Refused, not approximated: each would silently change the base model's attention.
    if softcap is not None:
        raise ValueError(f"this model caps attention logits (softcap={softcap}), which the CCA kernels do not "
                         "implement; load it with attn_implementation='sdpa'")
    if dropout:
        raise ValueError(f"CCA attention has no attention dropout (got {dropout}): set config.attention_dropout=0")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"a {attention_mask.dim()}-D attention mask was passed: CCA's attention pattern is fixed (core "
                         "tokens + local window), so it takes only a 2-D padding mask (batch, columns); load the model "
                         "with attn_implementation='sdpa' to use custom masks without CCA")
    # While a decode step is captured, the family may leave RoPE to the decode kernel (decode_graph._deferring).
    unrotated = take_unrotated(query, key)
    # Under autocast the family's RoPE promotes bf16 q/k to fp32 (cos/sin are fp32) while v stays bf16: compute
    # in v's dtype, as autocast would for SDPA (the kernels take one dtype).
    query, key = query.to(value.dtype), key.to(value.dtype)
    if unrotated:
        (cos, sin), cache, _ = module._method_ctx
        if not (isinstance(cache, CCACache) and cache.decodes_rotated(module.layer_idx, query)):
            query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)  # (a step the kernel won't decode)
            unrotated = False
    if sliding_window is not None:
        return _sliding_attention(module, query, key, value, attention_mask, scaling, sliding_window), None
    (cos, sin), cache, _ = module._method_ctx
    settings = CCASettings(module.config)
    if settings.attn_backend == "full":  # the base model's attention: its own sliding window if CCA replaced one
        window = getattr(module.config, "cca_replaced_sliding_window", None)
        if window:
            return _sliding_attention(module, query, key, value, attention_mask, scaling, window), None
        out = full_causal_attention(query, key, value, attention_mask, scaling)
        return out.transpose(1, 2), None
    if isinstance(cache, CCACache) and cache.decodes_rotated(module.layer_idx, query):  # a decode step: as given
        out = cache.cca_attention(module.layer_idx, query, key, value, cos, sin, attention_mask, scaling,
                                  rotated="eager" if unrotated else True)
        return out.transpose(1, 2), None
    if isinstance(cache, CCACache) and not cache.prompts(module.layer_idx) and query.shape[2] == 1:
        q, k = (x.to(value.dtype) for x in unrope(module, query, key, cos, sin))  # PyTorch's one-token step
        out = cache.cca_attention(module.layer_idx, q, k, value, cos, sin, attention_mask, scaling)
        return out.transpose(1, 2), None
    if key.shape[2] != query.shape[2]:  # another cache handed back its past keys (the inner model's own DynamicCache)
        raise TypeError(f"CCA attention keeps its past in an HFCCACache, got a {type(cache).__name__} with past keys: "
                        f"call the CausalLM (it brings its cache), or pass {CACHE_ARG}=HFCCACache(model.config)")
    # A prompt or a chunk after it: the kernels attend with q and k as the family rotated them; only k is needed before
    # RoPE (it is what is pooled). Un-rotating q too, to rotate it again, cost ~8% of a 128K prefill
    # (decode-generate-h200.md); un-rotating k in torch cost more than the kernel's own RoPE (attention-h200-kv.md), so
    # where the family's RoPE is rotate_half the pooling undoes it in registers (k=None).
    k = None if rotates_half(family_rope(module)) else unrope(module, key[:, :0], key, cos, sin)[1].to(value.dtype)
    if isinstance(cache, CCACache):
        out = cache.cca_attention(module.layer_idx, None, k, value, cos, sin, attention_mask, scaling,
                                  given_rotated=(query, key))
    else:
        out = _no_cache_attention(query, key, k, value, cos, sin, attention_mask, settings, scaling)
    return out.transpose(1, 2), None


@functools.cache
def rotates_half(rope) -> bool:
    """Whether a family's ``apply_rotary_pos_emb`` is the full-width ``rotate_half`` RoPE (``cca_reference.apply_rope``),
    which the kernels can undo themselves; checked on random tables. Every supported family's is: CCA re-rotates its
    core tokens that way."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 3, 5, 8, generator=gen, dtype=torch.float64)
    cos, sin = torch.randn(2, 2, 5, 8, generator=gen, dtype=torch.float64)
    try:
        return all(torch.allclose(got, apply_rope(x, cos, sin)) for got, x in zip(rope(q, k, cos, sin), (q, k)))
    except (RuntimeError, TypeError):  # e.g. a hub kernel put in its place that takes no CPU float64: its own inverse
        return False


def _no_cache_attention(q_rot, k_rot, k, v, cos, sin, attention_mask, settings, scale):
    n_pad = left_padding(attention_mask)
    if n_pad is None:
        return cca_attention(None, k, v, cos, sin, settings, scale, q_rot=q_rot, k_rot=k_rot)
    bsz, q_len = q_rot.shape[0], q_rot.shape[2]
    q_rot, k_rot, k, v = (None if x is None else shift_rows(x, n_pad, 2) for x in (q_rot, k_rot, k, v))
    cos, sin = (shift_rows(x.expand(bsz, -1, -1), n_pad, 1) for x in (cos, sin))
    return shift_rows(cca_attention(None, k, v, cos, sin, settings, scale, q_rot=q_rot, k_rot=k_rot), q_len - n_pad, 2)


cca_attention_forward = dispatching("cca")
AttentionInterface.register("cca", cca_attention_forward)
AttentionMaskInterface.register("cca", flash_attention_mask)  # the 2-D padding mask (or None), as CCA expects


class CCAModelMixin(GraphDecodeMixin, MethodModelMixin):
    """Put in front of a stock causal-LM class: ``class CCAQwen3ForCausalLM(CCAModelMixin, Qwen3ForCausalLM)``."""

    method = "cca"
    no_weights = "CCA computes no attention matrix (core tokens and a local window share one softmax)"
    graph_cache = CCACache  # (what GraphDecodeMixin replays steps of)

    def __init__(self, config, *args, **kwargs):
        unprefixed = sorted(set(kwargs) & set(DEFAULTS))
        if unprefixed:  # from_pretrained hands keys the config does not know to the model
            raise ValueError(f"unknown option(s) {unprefixed}: CCA settings are named cca_<name>, e.g. "
                             f"from_pretrained(..., cca_{unprefixed[0]}=...)")
        check_settings(config)
        super().__init__(config, *args, **kwargs)
        list(self._hook_attention_modules(_attention))

    def forward(self, *args, cache=None, past_key_values=None, use_cache=None, output_attentions=None,
                logits_to_keep=0, **kwargs):
        uses_cca = self.config._attn_implementation == "cca"
        kwargs = self._stock_kwargs(kwargs, output_attentions, logits_to_keep)
        cache = given_cache(cache, past_key_values)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if uses_cca and use_cache and not self.training and CCASettings(self.config).attn_backend != "full":
            if cache is None or (not isinstance(cache, CCACache) and cache.get_seq_length() == 0):
                cache = HFCCACache(self.config)
        if len(args) == 1 and "input_ids" not in kwargs:  # model(ids, ...): a causal LM's first argument
            (kwargs["input_ids"],), args = args, ()
        if uses_cca and use_cache and not args:
            logits = self._replayed_decode(cache, kwargs)
            if logits is None:
                logits = self._prompt_then_drafts(cache, kwargs)
            if logits is not None:
                return CausalLMOutputWithPast(logits=logits, **{CACHE_ARG: cache})
        return super().forward(*args, use_cache=use_cache, **kwargs, **{CACHE_ARG: cache})

    def _prompt_then_drafts(self, cache, kwargs):
        """The first pass of assisted or prompt-lookup decoding (the prompt and the first k drafts in one call, the
        logits of the last ``logits_to_keep`` = k + 1 columns), run as plain greedy decoding runs the same tokens: the
        prompt's prefill, then the drafts as a verification pass. In one call of L + k columns the prompt's keys and
        values would round otherwise than in greedy's prefill of L columns, and a near tie could pick another token."""
        ids, keep, mask = kwargs.get("input_ids"), kwargs.get("logits_to_keep"), kwargs.get("attention_mask")
        first_layer = cache.layers[0] if isinstance(cache, CCACache) and cache.layers else None
        if (type(keep) is not int or not 1 < keep <= SPECULATIVE_SLACK + 1 or ids is None or ids.dim() != 2
                or keep >= ids.shape[1] or not getattr(first_layer, "record_past", False) or cache.get_seq_length()
                or (mask is not None and mask.dim() != 2) or not self.GRAPH_INPUTS.issuperset(kwargs)
                or kwargs.get("output_hidden_states") or kwargs.get("return_dict") is False):
            return None
        prompt = ids.shape[1] - (keep - 1)

        def columns(part, logits_to_keep):
            sliced = dict(kwargs, input_ids=ids[:, part], logits_to_keep=logits_to_keep)
            for name in ("position_ids", "cache_position"):
                if kwargs.get(name) is not None:
                    sliced[name] = kwargs[name][..., part]
            if mask is not None:
                sliced["attention_mask"] = mask[:, :part.stop]  # the columns so far
            return sliced

        logits = [self.forward(cache=cache, use_cache=True, **columns(part, n)).logits
                  for part, n in ((slice(0, prompt), 1), (slice(prompt, ids.shape[1]), keep - 1))]
        return torch.cat(logits, 1)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate()'s cache: the compressed one from the start (not the DynamicCache ``forward`` would swap at the
        prefill), so that what generate() tells the cache before the prefill reaches it: ``activate_past_recording``
        for assisted and prompt-lookup decoding (then crops are done in place, ``cache_cca.py``)."""
        result = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get(CACHE_ARG)
        if (type(cache) is DynamicCache and not getattr(cache, "_is_user_defined", False) and not self.training
                and cache.get_seq_length() == 0 and self.config._attn_implementation == "cca"
                and CCASettings(self.config).attn_backend != "full"):
            model_kwargs[CACHE_ARG] = HFCCACache(self.config)
        return result


__all__ = ["CCAModelMixin", "CCASettings", "HFCCACache", "cca_attention_forward", "check_settings"]
