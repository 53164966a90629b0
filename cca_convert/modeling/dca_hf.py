"""Dual Chunk Attention inside transformers' own model classes (the second method; DCA-SPEC.md, ``dca_reference.py``).

As for CCA (``cca_hf.py``), a family's DCA model is its stock causal-LM class with ``DCAModelMixin`` in front: the
attention implementation defaults to ``"dca"``, a forward pre-hook keeps each attention module's positions and cache,
and ``forward`` gives ``generate()`` a ``DCACache``. The settings are Qwen2.5-1M's ``dual_chunk_attention_config``
(``chunk_size``, ``local_size``, ``original_max_position_embeddings``) plus ``dca_attn_backend``: "auto" (the Triton
kernel on CUDA for inference, the PyTorch reference elsewhere and whenever gradients are needed), "triton" or
"reference". ``attn_implementation="sdpa"`` at load runs the base model's plain RoPE attention on the same weights.

The cache holds every key rotated once at ``j % s`` (keys never need re-rotation) in buffers that grow by doubling,
so a decode step appends in place instead of copying the whole cache. The RoPE is the model's own (its ``inv_freq``
and ``attention_scaling``; NeoX layout).
"""

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from .attention_hooks import BatchOpsMixin, MethodModelMixin, crop_length, dispatching, inverse_rope, unrope
from ..kernels.dca_params import check_params
from ..kernels.dca_reference import dca_attention_blocked, rotate_keys, temperature_per_sequence

try:  # the kernel needs triton; CPU-only installs run the PyTorch twin
    from ..kernels.dca_triton import dca_attention_triton, rope_table, rotate_keys_triton
except ImportError:  # pragma: no cover
    dca_attention_triton = rope_table = rotate_keys_triton = None

QUERY_BLOCK = 512  # queries per reference call: bounds the (block x keys) score matrices
BACKENDS = ("auto", "triton", "reference")
KERNEL_ON_CPU = False  # tests: run the Triton kernels on CPU tensors (TRITON_INTERPRET=1), as "auto" does on CUDA


def dca_settings(config) -> tuple[int, int, int]:
    """``(chunk_size, local_size, original_max_position_embeddings or 0)``; ValueError for values the spec rejects."""
    cfg = getattr(config, "dual_chunk_attention_config", None) or {}
    chunk, local = cfg.get("chunk_size"), cfg.get("local_size")
    check_params(chunk, local)
    backend = getattr(config, "dca_attn_backend", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"dca_attn_backend must be one of {BACKENDS}, got {backend!r}")
    return chunk, local, cfg.get("original_max_position_embeddings") or 0


class DCALayerCache(BatchOpsMixin, CacheLayerMixin):
    """Every key of one layer (DCA evicts nothing), rotated once at ``j % s``, its value, its position and whether
    it is a real token; stored in buffers with spare room along the sequence."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self):
        super().__init__()
        self.buffers, self.length = None, 0  # [keys, values, pos, valid]; seq dim 2, 2, 1, 1

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        # CacheLayerMixin's entry point; DCACache.update never calls it (the attention function appends, with the
        # positions and validity this method's signature cannot carry), so a direct call is a wiring error
        raise RuntimeError("DCALayerCache is filled through the 'dca' attention function, not update(): load the "
                           "model with its DCA class (DCAModelMixin)")

    _SEQ_DIMS = (2, 2, 1, 1)

    def append(self, k, v, pos, valid):
        new = (k, v, pos, valid)
        end = self.length + k.shape[2]
        if self.buffers is None or end > self.buffers[0].shape[2]:
            # room for 1024 more tokens after a prefill, then doubling: appends stay O(1) amortised
            capacity = max(end + 1024, 2 * (self.buffers[0].shape[2] if self.buffers else 0))
            grown = []
            for i, (x, dim) in enumerate(zip(new, self._SEQ_DIMS)):
                shape = list(x.shape)
                shape[dim] = capacity
                buf = x.new_zeros(shape)
                if self.buffers is not None:
                    buf.narrow(dim, 0, self.length).copy_(self.buffers[i].narrow(dim, 0, self.length))
                grown.append(buf)
            self.buffers = grown
        for buf, x, dim in zip(self.buffers, new, self._SEQ_DIMS):
            buf.narrow(dim, self.length, x.shape[dim]).copy_(x)
        self.length = end
        return self.tensors()

    def tensors(self):
        """(keys, values, pos, valid) of the tokens held, as views."""
        return tuple(buf.narrow(dim, 0, self.length) for buf, dim in zip(self.buffers, self._SEQ_DIMS))

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self):
        self.buffers, self.length = None, 0

    def _map(self, fn):
        if self.buffers is not None:
            self.buffers = [fn(x) for x in self.buffers]

    def crop(self, tokens: int):
        """Rejected draft tokens go away: ``-n`` drops the last ``n`` columns and 0 is a no-op (transformers >= 5.2x);
        a positive value is the length to keep (what older versions pass). Keys are rotated at their own position
        only, so nothing else changes."""
        self.length = crop_length(self.length, tokens)


class DCACache(Cache):
    def __init__(self, config):
        super().__init__(layers=[DCALayerCache() for _ in range(config.num_hidden_layers)])
        self.leading_pads_only = None  # of the whole mask (cache + new tokens), set per step by the model
        self.step = {}  # what the layers of one pass share, set by layer 0; "at": (cache length before, pass length)

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
    rotary = module._dca_rotary
    bsz, q_len = query.shape[0], query.shape[2]
    layer = cache.layers[module.layer_idx] if isinstance(cache, DCACache) else None
    # what every layer of this pass shares (positions, the inverse RoPE, the kernel's layout): computed by the first
    # attention layer of the pass, reused by the others (fewer launches per decode step)
    at = (layer.length, q_len) if layer is not None else None
    step = cache.step if at is not None and module.layer_idx and cache.step.get("at") == at else {"at": at}
    if "qpos" not in step:
        qvalid = (attention_mask[:, -q_len:].bool() if attention_mask is not None
                  else torch.ones(bsz, q_len, dtype=torch.bool, device=query.device))
        # DCA positions are absolute and per sequence: each row counts its own real tokens (a left-padded row starts
        # at 0, as the spec requires), whatever position_ids the caller passed
        seen = layer.tensors()[3].sum(1, keepdim=True) if layer is not None and layer.length else 0
        qpos = (seen + qvalid.long().cumsum(1) - 1).clamp_min(0)
        step.update(qvalid=qvalid, qpos=qpos, inverse=inverse_rope(cos, sin))
    qvalid, qpos = step["qvalid"], step["qpos"]
    # Under autocast the family's RoPE promotes bf16 q/k to fp32 next to a bf16 v: compute in v's dtype
    q, k = unrope(module, query, key, cos, sin, step["inverse"])  # whatever positions RoPE used
    kernel = _use_kernel(module.config, query)
    if kernel:
        if "qpos32" not in step:  # the kernels' int32 positions, cast once per pass (not once per layer)
            step["qpos32"] = qpos.to(torch.int32)
        k_rot = rotate_keys_triton(k, step["qpos32"], chunk, local, _query_table(rotary, chunk), value.dtype)
    else:
        k_rot = rotate_keys(k, qpos, chunk, local, rotary.inv_freq, rotary.attention_scaling).to(value.dtype)
    if layer is not None:
        cache.step = step
        k_rot, v, kpos, kvalid = layer.append(k_rot, value, qpos, qvalid)
    else:
        v, kpos, kvalid = value, qpos, qvalid
    out = None
    if kernel:
        if "kstart" not in step:
            # the kernel reads each sequence's keys as one run after its leading pads; DCAModelMixin.forward checked
            # the layout once for the pass (one host sync per step, not per layer)
            layout = cache.leading_pads_only if isinstance(cache, DCACache) else None
            kstart = (~kvalid).sum(1)
            step.update(kstart=kstart.to(torch.int32), layout=_leading_pads_only(kvalid) if layout is None else layout,
                        temp=temperature_per_sequence(kstart, kvalid.shape[1], c_orig) if c_orig else None,
                        kernel_qpos=torch.where(qvalid, step["qpos32"], -1))
        if step["layout"]:
            out = dca_attention_triton(q.to(value.dtype), k_rot, v, step["kernel_qpos"], step["kstart"], chunk,
                                       local, rotary.inv_freq, scaling, step["temp"], rotary.attention_scaling,
                                       table=_query_table(rotary, chunk))
    if out is None:  # the PyTorch twin: on CPU, under autograd, or pads that are not all leading
        out = dca_attention_blocked(q.to(value.dtype), k_rot, v, qpos, kpos, kvalid, qvalid, chunk, local,
                                    rotary.inv_freq, scaling, c_orig, rotary.attention_scaling, keys_rotated=True,
                                    block=QUERY_BLOCK)
    return out.to(value.dtype).transpose(1, 2), None


def _query_table(rotary, chunk):
    """The kernels' cos/sin table (queries and keys), once per model (not per layer and step): kept on the rotary module, keyed by
    what would make it stale (its inv_freq moved or rewritten in place, another chunk size)."""
    inv = rotary.inv_freq
    key = (inv.data_ptr(), inv._version, inv.device, chunk, rotary.attention_scaling)
    held = getattr(rotary, "_dca_table", None)
    if held is None or held[0] != key:
        held = (key, rope_table(inv, chunk, rotary.attention_scaling))
        object.__setattr__(rotary, "_dca_table", held)  # a plain attribute: not a buffer, never saved
    return held[1]


def _leading_pads_only(valid) -> bool:
    """Whether every row of a (batch, columns) validity mask is pads first, then real tokens only."""
    start = (~valid).sum(1, keepdim=True)
    return bool((valid == (torch.arange(valid.shape[1], device=valid.device)[None] >= start)).all())


def _use_kernel(config, q) -> bool:
    backend = getattr(config, "dca_attn_backend", "auto")
    needs_grad = torch.is_grad_enabled() and q.requires_grad
    on_device = q.is_cuda or KERNEL_ON_CPU
    if backend == "triton":
        if dca_attention_triton is None or not on_device:
            raise RuntimeError("dca_attn_backend='triton' needs triton and a CUDA device; use 'auto' or 'reference'")
        if needs_grad:
            raise RuntimeError("the DCA Triton kernel is forward-only (DCA is training-free); set "
                               "dca_attn_backend='reference' to backpropagate through DCA attention")
        return True
    return backend == "auto" and dca_attention_triton is not None and on_device and not needs_grad


dca_attention_forward = dispatching("dca")
AttentionInterface.register("dca", dca_attention_forward)
AttentionMaskInterface.register("dca", flash_attention_mask)


class DCAModelMixin(MethodModelMixin):
    """Put in front of a stock causal-LM class: ``class DCAQwen2ForCausalLM(DCAModelMixin, Qwen2ForCausalLM)``."""

    method = "dca"
    no_weights = "DCA's kernel forms no attention matrix"

    def __init__(self, config, *args, **kwargs):
        unprefixed = sorted(set(kwargs) & {"attn_backend", "chunk_size", "local_size"})
        if unprefixed:  # from_pretrained hands keys the config does not know to the model
            raise ValueError(f"unknown option(s) {unprefixed}: DCA's sizes live in dual_chunk_attention_config; "
                             "the backend is dca_attn_backend=...")
        dca_settings(config)  # bad values fail when the model is built
        super().__init__(config, *args, **kwargs)
        rotary = self.model.rotary_emb
        for module in self._hook_attention_modules(_attention):
            object.__setattr__(module, "_dca_rotary", rotary)  # a reference, not a submodule

    def forward(self, *args, past_key_values=None, use_cache=None, attention_mask=None, output_attentions=None,
                logits_to_keep=0, **kwargs):
        kwargs = self._stock_kwargs(kwargs, output_attentions, logits_to_keep)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.config._attn_implementation == "dca" and use_cache and not self.training:
            if past_key_values is None or (not isinstance(past_key_values, DCACache)
                                           and past_key_values.get_seq_length() == 0):
                past_key_values = DCACache(self.config)
        if isinstance(past_key_values, DCACache):
            past_key_values.leading_pads_only = (None if attention_mask is None or attention_mask.dim() != 2
                                                 else _leading_pads_only(attention_mask.bool()))
        return super().forward(*args, past_key_values=past_key_values, use_cache=use_cache,
                               attention_mask=attention_mask, **kwargs)


__all__ = ["DCACache", "DCAModelMixin", "dca_attention_forward", "dca_settings"]
