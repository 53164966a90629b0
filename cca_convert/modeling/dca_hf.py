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

On CUDA, decode steps replay CUDA graphs through CCA's mechanism (``decode_graph.py``; ``dca_cuda_graphs=False``
turns them off): a step writes its column at a device-side index and the kernel reads the cache's whole buffers,
ending each row's keys at its query, so a replay needs no host-side length. A step replays when the mask so far is
pads first and its new column is real (what ``generate()`` passes); anything else runs eagerly. There, as for CCA,
``generate()`` reads its stopping flag one step late (``decode_graph.defer_stop_checks``; ``dca_defer_stop_checks=
False`` turns it off), so no step waits for the host.
"""

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from .attention_hooks import (CACHE_ARG, BatchOpsMixin, MethodModelMixin, crop_length, dispatching, given_cache,
                              inverse_rope, unrope)
from .decode_graph import DEFERRED_TOKENS, GraphDecodeMixin, rope_round_trip, take_unrotated
from ..kernels.dca_params import check_params
from ..kernels.dca_reference import dca_attention_blocked, rotate_keys, temperature

try:  # the kernel needs triton; CPU-only installs run the PyTorch twin
    from ..kernels.dca_triton import append_rotated_triton, dca_attention_triton, rope_table, rotate_keys_triton
except ImportError:  # pragma: no cover
    append_rotated_triton = dca_attention_triton = rope_table = rotate_keys_triton = None

QUERY_BLOCK = 1024  # queries per SDPA call of the PyTorch path: bounds its (block x keys) mask (one layer at 16K
# on CPU: 4.7 s with 512, 3.5 s with 1024)
SPARE_COLUMNS = 1024  # a cache's room past a prompt (then doubling): appends in place, replays without a re-capture
STEP_ROOM = 2 * DEFERRED_TOKENS  # columns past the sequence a captured step reserves (DecodeGraphs.capture)
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
    for option in ("dca_cuda_graphs", "dca_compile_decode", "dca_defer_stop_checks"):
        if getattr(config, option, False) not in (True, False):
            raise ValueError(f"{option} must be true or false, got {getattr(config, option)!r}")
    return chunk, local, cfg.get("original_max_position_embeddings") or 0


class DCALayerCache(BatchOpsMixin, CacheLayerMixin):
    """Every key of one layer (DCA evicts nothing), rotated once at ``j % s``, its value, its position and whether
    it is a real token; stored in buffers with spare room along the sequence. New columns are written at device-side
    indices (``DCACache.next_columns``), so a CUDA-graph step replays its writes at the next columns."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, plan: dict | None = None):
        super().__init__()
        self.buffers, self.length = None, 0  # [keys, values, pos, valid]; seq dim 2, 2, 1, 1
        # columns to allocate at once while the sequence fits (generate()'s length), shared by the cache's layers
        self.plan = plan if plan is not None else {"columns": 0, "layers": 1, "checked": True}
        self.version = 0  # bumped whenever a buffer is replaced: a captured step writes the old ones

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        # CacheLayerMixin's entry point; DCACache.update never calls it (the attention function appends, with the
        # positions and validity this method's signature cannot carry), so a direct call is a wiring error
        raise RuntimeError("DCALayerCache is filled through the 'dca' attention function, not update(): load the "
                           "model with its DCA class (DCAModelMixin)")

    _SEQ_DIMS = (2, 2, 1, 1)

    def append(self, k, v, pos, valid, columns):
        """Write a pass's tokens at ``columns`` (a device tensor: ``length .. length + n - 1``)."""
        new = (k, v, pos, valid)
        self.reserve(self.length + k.shape[2], like=new)
        for buf, x, dim in zip(self.buffers, new, self._SEQ_DIMS):
            buf.index_copy_(dim, columns, x)
        self.length += k.shape[2]

    @property
    def planned(self) -> int:
        return self.plan["columns"]

    def _check_plan(self, like):
        """Once per cache, at its first allocation: the plan holds only if every layer's buffers at the planned length
        fit in the device's free memory (a generation_config's large ``max_length`` with a short output must not
        allocate what the output never uses); otherwise the buffers grow with the sequence."""
        plan = self.plan
        if plan["checked"]:
            return
        plan["checked"] = True
        free = free_bytes(like[0].device)
        per_column = sum(x.numel() // x.shape[dim] * x.element_size() for x, dim in zip(like, self._SEQ_DIMS))
        if free is not None and per_column * plan["columns"] * plan["layers"] > free:
            plan["columns"] = 0

    def append_rotated(self, k, v, pos, valid, columns, chunk, local, table, deferred=None):
        """``append`` of keys not yet rotated (``k``: the pass's keys before RoPE), rotated at ``pos % s`` as they are
        written: one Triton launch (``append_rotated_triton``) for the five ops of rotating and appending; with
        ``deferred``, that launch also takes a captured step's RoPE back (its queries are returned)."""
        like = None if self.buffers is not None else (torch.empty_like(k, dtype=v.dtype), v, pos, valid)
        self.reserve(self.length + k.shape[2], like=like)
        q = append_rotated_triton(k, v, pos, valid, columns, chunk, local, table, self.buffers, deferred)
        self.length += k.shape[2]
        return q

    def reserve(self, end: int, like=None):
        """Room for ``end`` columns (``like``: tensors of the layout, for the first pass): the planned length in one
        allocation while it holds them (a chunked prefill and the decode steps then never copy the cache, nor hold
        two copies of it); past it, ``end`` + ``SPARE_COLUMNS``, then by doubling, so that appends stay O(1)
        amortised."""
        if self.buffers is not None and end <= self.buffers[0].shape[2]:
            return
        if self.buffers is None:
            self._check_plan(like)
        capacity = max(end + SPARE_COLUMNS, 2 * (self.buffers[0].shape[2] if self.buffers else 0))
        if end <= self.planned:
            capacity = self.planned
        grown = []
        for i, (x, dim) in enumerate(zip(like or self.buffers, self._SEQ_DIMS)):
            shape = list(x.shape)
            shape[dim] = capacity
            buf = x.new_zeros(shape)
            if self.buffers is not None:
                buf.narrow(dim, 0, self.length).copy_(self.buffers[i].narrow(dim, 0, self.length))
            grown.append(buf)
        self.buffers = grown
        self.version += 1

    def tensors(self):
        """(keys, values, pos, valid) of the tokens held, as views."""
        return tuple(buf.narrow(dim, 0, self.length) for buf, dim in zip(self.buffers, self._SEQ_DIMS))

    @property
    def max_seen(self) -> int:  # (the host count decode_graph compares with a captured step's replay limit)
        return self.length

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self):
        self.buffers, self.length = None, 0
        self.version += 1

    def _map(self, fn):
        if self.buffers is not None:
            self.buffers = [fn(x) for x in self.buffers]
            self.version += 1

    def crop(self, tokens: int):
        """Rejected draft tokens go away: ``-n`` drops the last ``n`` columns and 0 is a no-op (transformers >= 5.2x);
        a positive value is the length to keep (what older versions pass). Keys are rotated at their own position
        only, so nothing else changes; the dropped columns stop counting as real tokens."""
        keep = crop_length(self.length, tokens)
        if self.buffers is not None and keep < self.length:
            self.buffers[3].narrow(1, keep, self.length - keep).zero_()
        self.length = keep


class DCACache(Cache):
    stop_check_option = "dca_defer_stop_checks"  # (decode_graph.defer_stop_checks)

    def __init__(self, config, max_cache_length: int | None = None):
        """``max_cache_length``: the columns generate() will feed (prompt + new tokens - 1): every layer's buffers
        are then allocated once at that length, plus the room a captured decode step reserves."""
        layers = config.num_hidden_layers
        plan = {"columns": max_cache_length + STEP_ROOM if max_cache_length else 0, "layers": layers,
                "checked": not max_cache_length}
        super().__init__(layers=[DCALayerCache(plan) for _ in range(layers)])
        self.config = config
        self.leading_pads_only = None  # of the whole mask (cache + new tokens), set per step by the model
        self.step = {}  # what the layers of one pass share, set by layer 0; "at": (cache length before, pass length)
        self.columns = None  # (1,) int64 on the device: the next column to write (read and advanced by CUDA graphs)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states  # the dca attention function stores what it needs itself

    def next_columns(self, n: int, device) -> torch.Tensor:
        """The device indices of a pass's ``n`` new columns, advancing the device-side counter (once per pass: every
        layer writes at the same columns)."""
        if self.columns is None:
            self.columns = torch.zeros(1, dtype=torch.long, device=device)
        columns = self.columns + torch.arange(n, device=device)
        self.columns += n
        return columns

    def crop(self, tokens: int):
        super().crop(tokens)
        if self.columns is not None:
            self.columns.fill_(self.get_seq_length())

    def reset(self):
        super().reset()
        self.columns = None

    # --- what a CUDA-graph decode step (decode_graph.py) needs ----------------------------------------------------
    step_real = None  # (set by DecodeGraphs.capture; a DCA step is captured only with every column real)

    def graph_step_allowed(self, real, extended=False) -> bool:
        """Whether a step may replay: the kernel reads each row's keys as one run after its leading pads, so every
        column so far must be pads first (the model checked the mask on its last pass) and every new one real:
        known without a look at the device when generate() made the mask (``extended``: its last mask extended by
        ones), else one small host read of the step's mask column."""
        return self.leading_pads_only is True and (real is None or extended or bool(real.all()))

    def graphable(self, head_dim: int) -> bool:
        layers = self.layers
        return bool(layers) and all(isinstance(x, DCALayerCache) and x.buffers is not None and x.buffers[0].is_cuda
                                    for x in layers) and self.step.get("layout") is True  # (the kernel ran)

    def token_steps(self) -> int:
        return 1

    def reserve(self, steps: int):
        for layer in self.layers:
            layer.reserve(layer.length + steps)

    def state_version(self) -> tuple:
        return tuple(layer.version for layer in self.layers)

    def replay_limit(self) -> int:
        return min(layer.buffers[0].shape[2] for layer in self.layers) - 1

    def host_counters(self) -> list:
        return [layer.length for layer in self.layers]

    def set_host_counters(self, counters: list):
        for layer, length in zip(self.layers, counters):
            layer.length = length

    def advance(self, tokens: int, real=None):
        for layer in self.layers:
            layer.length += tokens


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
        # at 0, as the spec requires), whatever position_ids the caller passed. Counted over the whole buffer (its
        # spare room is not real): the same count at every replay of a captured step.
        seen = layer.buffers[3].sum(1, keepdim=True) if layer is not None and layer.length else 0
        qpos = (seen + qvalid.long().cumsum(1) - 1).clamp_min(0)
        step.update(qvalid=qvalid, qpos=qpos, real=seen + qvalid.sum(1, keepdim=True),
                    inverse=inverse_rope(cos, sin))
        if layer is not None:
            step["columns"] = cache.next_columns(q_len, query.device)
    qvalid, qpos = step["qvalid"], step["qpos"]
    kernel = _use_kernel(module.config, query)
    # Under autocast the family's RoPE promotes bf16 q/k to fp32 next to a bf16 v: compute in v's dtype
    deferred = None
    if take_unrotated(query, key):  # a captured decode step left the family's RoPE to us (decode_graph._deferring)
        if layer is not None and kernel and query.dtype == value.dtype:  # the cache write takes it back, as eager
            deferred = (query, cos, sin, *step["inverse"])
            q, k = None, key
        else:
            q, k = rope_round_trip(module, query, key, cos, sin, step["inverse"], value.dtype)
    else:
        q, k = unrope(module, query, key, cos, sin, step["inverse"])
    if kernel and "qpos32" not in step:  # the kernels' int32 positions, cast once per pass (not once per layer)
        step["qpos32"] = qpos.to(torch.int32)
    if layer is not None and kernel:  # rotated and written with the values, positions and validity in one launch
        taken_back = layer.append_rotated(k, value, qpos, qvalid, step["columns"], chunk, local,
                                          _query_table(rotary, chunk), deferred)
        q = q if deferred is None else taken_back
    elif kernel:
        k_rot = rotate_keys_triton(k, step["qpos32"], chunk, local, _query_table(rotary, chunk), value.dtype)
    else:
        k_rot = rotate_keys(k, qpos, chunk, local, rotary.inv_freq, rotary.attention_scaling).to(value.dtype)
    if layer is not None:
        cache.step = step
        if not kernel:
            layer.append(k_rot, value, qpos, qvalid, step["columns"])
        k_rot, v, kpos, kvalid = layer.tensors()
    else:
        v, kpos, kvalid = value, qpos, qvalid
    out = None
    if kernel:
        if "kstart" not in step:
            # the kernel reads each sequence's keys as one run after its leading pads; DCAModelMixin.forward checked
            # the layout once for the pass (one host sync per step, not per layer). From device counters only (a
            # captured step's replays read them anew): pads = columns written - real tokens.
            layout = cache.leading_pads_only if isinstance(cache, DCACache) else None
            real = step["real"].squeeze(1)
            ends = cache.columns if layer is not None else kvalid.shape[1]
            step.update(kstart=(ends - real).to(torch.int32),
                        layout=_leading_pads_only(kvalid) if layout is None else layout,
                        temp=temperature(real.clamp_min(1), c_orig).to(torch.float32) if c_orig else None,
                        kernel_qpos=torch.where(qvalid, step["qpos32"], -1))
        if step["layout"]:
            # A captured step reads the cache's whole buffers (the kernel ends each row's keys at its query, and
            # splits the columns by that span), so that its replays see the columns written after the capture
            whole = layer is not None and query.is_cuda and torch.cuda.is_current_stream_capturing()
            k_all, v_all = (layer.buffers[0], layer.buffers[1]) if whole else (k_rot, v)
            out = dca_attention_triton(q.to(value.dtype), k_all, v_all, step["kernel_qpos"], step["kstart"], chunk,
                                       local, rotary.inv_freq, scaling, step["temp"], rotary.attention_scaling,
                                       table=_query_table(rotary, chunk), split_by_span=whole)
    if out is None:  # the PyTorch twin: on CPU, under autograd, or pads that are not all leading
        out = dca_attention_blocked(q.to(value.dtype), k_rot, v, qpos, kpos, kvalid, qvalid, chunk, local,
                                    rotary.inv_freq, scaling, c_orig, rotary.attention_scaling, keys_rotated=True,
                                    block=QUERY_BLOCK)
    return out.to(value.dtype).transpose(1, 2), None


def free_bytes(device) -> int | None:
    """Memory a new allocation can take on ``device``: the driver's free bytes plus the caching allocator's reserved
    but unused ones; None (no limit known) off CUDA."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


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


class DCAModelMixin(GraphDecodeMixin, MethodModelMixin):
    """Put in front of a stock causal-LM class: ``class DCAQwen2ForCausalLM(DCAModelMixin, Qwen2ForCausalLM)``."""

    method = "dca"
    no_weights = "DCA's kernel forms no attention matrix"
    graph_cache = DCACache  # (what GraphDecodeMixin replays steps of)

    def __init__(self, config, *args, **kwargs):
        unprefixed = sorted(set(kwargs) & {"attn_backend", "chunk_size", "local_size", "cuda_graphs"})
        if unprefixed:  # from_pretrained hands keys the config does not know to the model
            raise ValueError(f"unknown option(s) {unprefixed}: DCA's sizes live in dual_chunk_attention_config; "
                             "the backend is dca_attn_backend=..., CUDA-graph decoding dca_cuda_graphs=...")
        dca_settings(config)  # bad values fail when the model is built
        super().__init__(config, *args, **kwargs)
        rotary = self.model.rotary_emb
        for module in self._hook_attention_modules(_attention):
            object.__setattr__(module, "_dca_rotary", rotary)  # a reference, not a submodule

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate()'s cache: a DCACache from the start (not the DynamicCache ``forward`` would swap at the prefill),
        so that generate() returns the cache it decoded with."""
        result = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get(CACHE_ARG)
        if (type(cache) is DynamicCache and not getattr(cache, "_is_user_defined", False) and not self.training
                and cache.get_seq_length() == 0 and self.config._attn_implementation == "dca"):
            # (generation_mode, batch_size, max_cache_length): the length sizes the buffers once
            length = kwargs.get("max_cache_length", args[2] if len(args) > 2 else None)
            model_kwargs[CACHE_ARG] = DCACache(self.config, length if isinstance(length, int) else None)
        return result

    def forward(self, *args, cache=None, past_key_values=None, use_cache=None, attention_mask=None,
                output_attentions=None, logits_to_keep=0, **kwargs):
        kwargs = self._stock_kwargs(kwargs, output_attentions, logits_to_keep)
        cache = given_cache(cache, past_key_values)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.config._attn_implementation == "dca" and use_cache and not self.training:
            if cache is None or (not isinstance(cache, DCACache) and cache.get_seq_length() == 0):
                cache = DCACache(self.config)
        if len(args) == 1 and "input_ids" not in kwargs:  # model(ids, ...): a causal LM's first argument
            (kwargs["input_ids"],), args = args, ()
        if isinstance(cache, DCACache):
            if not args and cache.get_seq_length():  # a step after the prompt: from a CUDA graph if it can
                logits = self._replayed_decode(cache, dict(kwargs, attention_mask=attention_mask))
                if logits is not None:
                    return CausalLMOutputWithPast(logits=logits, **{CACHE_ARG: cache})
            cache.leading_pads_only = (None if attention_mask is None or attention_mask.dim() != 2
                                       else _leading_pads_only(attention_mask.bool()))
        return super().forward(*args, use_cache=use_cache, attention_mask=attention_mask, **kwargs,
                               **{CACHE_ARG: cache})


__all__ = ["DCACache", "DCAModelMixin", "dca_attention_forward", "dca_settings"]
