"""Decode steps replayed from CUDA graphs: what ``generate()`` runs once per new token, and the verification passes
of speculative decoding (a few tokens per row, up to the cache's speculative slack: ``CCACache.token_steps``), one
graph per (batch, tokens).

An eager step of an 8B model launches hundreds of small kernels from Python; at small batches the GPU waits for the
CPU. A captured step launches them all at once. A replay reads and writes fixed addresses, so it is valid only while
the cache's state tensors are the same objects it was captured with (the cache decodes in place and numbers every
assignment of one: ``state_version``); anything that replaces one (a prefill, a chunk, a crop that is not done in
place, beam reordering, the core outgrowing its reserve) makes the next step eager and the step after it captured
anew. The pad columns (``attention_mask`` 0) are an input of the graph, read on the device: no sync. Host-side
counters the captured Python code advanced once are put back, and advanced by the caller at each replay (``advance``).

While a step is warmed up and captured, the model's norms and dense MLPs run as ``torch.compile`` twins of
transformers' own code (``FusedModules``): one fused kernel where eager code launches one per elementwise op. The
family's RoPE of the step's q/k is left to the method (``_deferring``; other RoPE calls run a compiled twin): CCA's
decode kernel rotates them as it writes the cache; DCA, which un-rotates them, runs the RoPE and its inverse in its
cache write's launch (``dca_triton.append_rotated_triton``), or as one compiled kernel (``rope_round_trip``). The
linear layers of up to 16 rows run as Triton products (``skinny_triton.py``, ``SkinnyLinears``): one launch for a
layer's q/k/v projections, one for a gated MLP's gate and up projections with its activation. A decoder layer whose
forward is transformers' pre-norm code (``_prenorm_layer``: Llama's and its copies) adds its residuals in other
launches: the first in the post-attention norm's compiled kernel, the second in the down projection's product. Prefill,
training and eager steps keep the stock code.
"""

import functools
import gc
import sys
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from transformers.utils import logging

from .attention_hooks import CACHE_ARG, given_cache

logger = logging.get_logger(__name__)

try:
    from ..kernels.skinny_triton import skinny_gated, skinny_linear, usable as skinny_usable
except ImportError:  # triton is optional (without it no step is captured)
    skinny_gated = skinny_linear = skinny_usable = None

# The dtypes whose eager RoPE rounding CCA's decode kernel reproduces when a captured step leaves RoPE to it
# (``cca_decode_triton.EAGER_ROPE_DTYPES``, which a test holds equal: a DCA export ships no CCA kernel to import it
# from); none without triton, where nothing is captured
EAGER_ROPE_DTYPES = (torch.bfloat16, torch.float32) if skinny_linear is not None else ()


def _unhooked(module) -> bool:
    """No hooks and no patched ``forward`` (accelerate's offloading): what a call replacing the module's would skip."""
    return "forward" not in module.__dict__ and not module._forward_hooks and not module._forward_pre_hooks


def _fusable(model):
    """The stock modules whose decode-step work is mostly elementwise launches: RMS norms, dense MLPs (unhooked)."""
    for name, module in model.named_modules():
        kind = type(module).__name__
        if (kind.endswith("RMSNorm") or (kind.endswith("MLP") and name.endswith(".mlp"))) and _unhooked(module):
            yield module


def _rope_families(model):
    """The modeling files whose attention modules call their module-level ``apply_rotary_pos_emb`` (~10 launches)."""
    attention = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    files = {sys.modules[type(m).__module__] for m in attention}
    return [f for f in files if callable(getattr(f, "apply_rotary_pos_emb", None))]


_COMPILED = {}
_UNROTATED = {}  # id(k) -> (q, k): one-token q/k a family handed over un-rotated (``_deferring``), strong references


CAPTURE_ATTEMPTS = 3  # failed captures of one cache (each at a later step) before the model decodes eagerly
HOST_SYNC = "synchronizing CUDA operation"  # torch's sync-debug error: a layer that syncs with the host (data-
# dependent MoE routing) fails every capture, so it stops them at once

DEFERRED_TOKENS = 32  # the most tokens per row whose RoPE a captured step leaves to the decode kernel (a
# verification pass of speculative decoding: its tokens then round exactly as the one-token steps they stand for)


def _deferring(rope, stock=None, round_trip=None):
    """A family's ``apply_rotary_pos_emb`` (``rope``) that, for a decode step's full-width q/k (one token, or the few of
    a verification pass), leaves them un-rotated: the CCA decode kernel rotates them as it writes the cache, two
    launches fewer per layer. The attention function takes them back with ``take_unrotated``; anything else is
    rotated by ``rope``."""

    @functools.wraps(rope)
    def call(q, k, cos, sin, *args, **kwargs):
        if (args or kwargs or q.dim() != 4 or q.shape[2] > DEFERRED_TOKENS or cos.shape[-1] != q.shape[-1]
                or q.dtype not in EAGER_ROPE_DTYPES):  # (the dtypes whose rounding the kernel reproduces)
            return rope(q, k, cos, sin, *args, **kwargs)
        _UNROTATED[id(k)] = (q, k)
        return q, k

    call.cca_stock = rope  # what un-rotating code must call (attention_hooks.unrope)
    call.uncompiled, call.round_trip = stock or rope, round_trip or _round_trip  # (for rope_round_trip)
    return call


def _round_trip(rope, q, k, cos, sin, icos, isin, dtype):
    q, k = rope(q, k, cos, sin)
    q, k = rope(q.float(), k.float(), icos, isin)
    return q.to(dtype), k


def rope_round_trip(module, q, k, cos, sin, inverse, dtype):
    """What a method that un-rotates the family's RoPE (DCA: ``attention_hooks.unrope``) computes from q/k a captured
    step left un-rotated (``take_unrotated``): the family's RoPE, then its inverse (``inverse``: ``inverse_rope(cos,
    sin)``) in fp32, q cast to ``dtype``, as one ``FusedModules`` twin with eager's roundings instead of ~8 launches.
    So the step's numbers are the eager step's. Returns (q in ``dtype``, k in fp32)."""
    rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
    return getattr(rope, "round_trip", _round_trip)(getattr(rope, "uncompiled", rope), q, k, cos, sin, *inverse, dtype)


class DeferredRopeMismatch(RuntimeError):
    """The attention function got other q/k than the family's RoPE returned un-rotated: the family changes them in
    between, so it must rotate them itself. Raised at the first layer's attention, before the cache is touched."""


def take_unrotated(q, k) -> bool:
    """Whether ``q``/``k`` are the pair ``_deferring`` left un-rotated (then forgotten: each is taken once)."""
    if not _UNROTATED:
        return False
    pair = _UNROTATED.pop(id(k), None)
    if pair is not None and pair[0] is q and pair[1] is k:
        return True
    _UNROTATED.clear()
    raise DeferredRopeMismatch("the attention function got other q/k than the family's RoPE returned")


def _prenorm_layer(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                   position_embeddings=None, **kwargs):
    # transformers' pre-norm decoder layer (Llama's; Qwen2's, Qwen3's, Mistral's... are copies), verbatim: a layer
    # class whose forward compiles to this same code (from 5.24 on with past_key_values spelled cache) runs as
    # ``FusedModules.layer_step`` in a captured step
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    # Self Attention
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states = residual + hidden_states

    # Fully Connected
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states


_CODE = ("co_code", "co_consts", "co_names", "co_varnames", "co_freevars", "co_cellvars", "co_argcount",
         "co_kwonlyargcount", "co_flags")


def _renamed(code, old: str, new: str):
    """``code`` with the name ``old`` (of an argument, and of the keyword it is passed on as) spelled ``new``."""

    def swap(names):
        return tuple(new if name == old else name for name in names)

    return code.replace(co_varnames=swap(code.co_varnames),
                        co_consts=tuple(swap(c) if isinstance(c, tuple) else c for c in code.co_consts))


_PRENORM_CODES = (_prenorm_layer.__code__, _renamed(_prenorm_layer.__code__, "past_key_values", "cache"))


def _checkpointing_wrapper(fn) -> bool:
    """Whether ``fn`` is the wrapper around a layer's forward that checkpoints it in training (transformers' newer
    ``GradientCheckpointingLayer``), which otherwise calls the forward: not what runs in a decode step."""
    code = getattr(fn, "__code__", None)
    return (hasattr(fn, "__wrapped__") and code is not None and code.co_filename.endswith("modeling_layers.py")
            and "GradientCheckpointingLayer." in getattr(code, "co_qualname", ""))


def _renaming_wrapper(fn) -> bool:
    """Whether ``fn`` is transformers' ``deprecate_kwarg`` wrapper (5.24 puts one on each layer's forward to take the
    old name of an argument), which only renames keywords before it calls the forward."""
    code = getattr(fn, "__code__", None)
    return (hasattr(fn, "__wrapped__") and code is not None and code.co_filename.endswith("deprecation.py")
            and code.co_name == "wrapped_func")


def _prenorm_layers(model):
    """The decoder layers whose ``forward`` is ``_prenorm_layer`` (the same bytecode, names and constants: any other
    code, a hook or a patched ``forward`` keeps the layer stock)."""
    for module in model.modules():
        forward = type(module).__dict__.get("forward") or getattr(type(module), "forward", None)
        while _checkpointing_wrapper(forward) or _renaming_wrapper(forward):
            forward = forward.__wrapped__
        code = getattr(forward, "__code__", None)
        if code is None or not _unhooked(module) or forward.__defaults__ != _prenorm_layer.__defaults__:
            continue
        if any(all(getattr(code, a) == getattr(ours, a) for a in _CODE) for ours in _PRENORM_CODES):
            yield module


def _add_then_norm(norm, residual, update):
    """A pre-norm layer's ``residual + update`` and its norm: one compiled kernel."""
    total = residual + update
    return total, type(norm).forward(norm, total)


def _compiled(fn):
    """One ``torch.compile`` of ``fn`` per process, so every model (and layer) reuses its compiled shapes."""
    if fn not in _COMPILED:
        # emulate_precision_casts: round where eager rounds (bf16 between ops), so a twin gives eager's numbers
        _COMPILED[fn] = torch.compile(fn, dynamic=False, fullgraph=True, options={"emulate_precision_casts": True})
    return _COMPILED[fn]


def _plain_linear(module) -> bool:
    """A stock ``nn.Linear`` whose call is its ``forward`` (no LoRA wrapper, hook, patch or user's compile)."""
    return type(module) is torch.nn.Linear and _unhooked(module) and module._compiled_call_impl is None


def _activation(mlp) -> str | None:
    act = getattr(mlp, "act_fn", None)
    kind = type(act).__name__
    if kind in ("SiLU", "SiLUActivation"):
        return "silu"
    if kind in ("GELUTanh", "PytorchGELUTanh") or (kind == "GELU" and getattr(act, "approximate", None) == "tanh"):
        return "gelu_tanh"
    return None


def _rows(x):
    return x.reshape(-1, x.shape[-1])


class SkinnyLinears:
    """Calls that replace a decode step's stock linear layers by the Triton few-row products, while ``FusedModules``
    is active, where ``skinny_usable`` (16-bit CUDA tensors, at most 16 rows); otherwise the stock computation.

    - q/k/v: transformers' attention modules call ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` on one ``x``. The
      q_proj call computes all three in one launch and keeps k and v; the k_proj and v_proj calls on that same
      ``x`` hand them out (on any other input they compute their own).
    - o_proj: one launch without cuBLAS's split-K reduction.
    - the output embedding (lm_head): each row's logits the same whatever the rows, so that a verification pass of
      speculative decoding (n rows) gives the logits of the one-token steps it replaces (cuBLAS's 1-row and n-row
      kernels round differently, and a greedy token can flip on a near tie).
    - a gated MLP (``down(act(gate(x)) * up(x))``, SiLU or tanh-GELU): gate, up and the activation in one launch,
      then down. Its first call per MLP class is checked against the stock twin: a class whose forward computes
      something else keeps the twin."""

    def __init__(self, owner: "FusedModules", model):
        self.owner, self.pending, self.checked = owner, [], {}
        self.calls = []  # (module, call)
        if skinny_linear is None:
            return
        for module in model.modules():
            names = ("q_proj", "k_proj", "v_proj")
            projections = [getattr(module, n, None) for n in names]
            if (hasattr(module, "layer_idx") and all(map(_plain_linear, projections))
                    and len({p.in_features for p in projections}) == 1
                    and len({p.bias is None for p in projections}) == 1):
                self.calls += self._qkv(*projections)
            if hasattr(module, "layer_idx") and _plain_linear(getattr(module, "o_proj", None)):
                self.calls.append((module.o_proj, self._one(module.o_proj)))
        head = model.get_output_embeddings()
        if _plain_linear(head):  # (cuBLAS picks other kernels for 1 and n rows: a verification pass would round
            self.calls.append((head, self._one(head)))  # its logits otherwise than the one-token steps it stands for)

    def _failed(self, error):
        self.owner.failure = f"{type(error).__name__}: {error}"

    def _one(self, linear):
        def call(x):
            rows = _rows(x)
            if self.owner.failure is None and skinny_usable(rows, linear.weight):
                try:
                    bias = None if linear.bias is None else [linear.bias]
                    return skinny_linear(rows, [linear.weight], bias)[0].view(*x.shape[:-1], -1)
                except Exception as error:
                    self._failed(error)
            return F.linear(x, linear.weight, linear.bias)

        return call

    def _qkv(self, q, k, v):
        kept = {}
        self.pending.append(kept)
        weights = [q.weight, k.weight, v.weight]
        biases = None if q.bias is None else [q.bias, k.bias, v.bias]

        def q_call(x):
            kept.clear()
            rows = _rows(x)
            if self.owner.failure is None and skinny_usable(rows, *weights):
                try:
                    yq, kept[k], kept[v] = (y.view(*x.shape[:-1], -1) for y in skinny_linear(rows, weights, biases))
                    kept["input"] = x
                    return yq
                except Exception as error:
                    kept.clear()
                    self._failed(error)
            return F.linear(x, q.weight, q.bias)

        def handed(linear):
            def call(x):
                if kept.get("input") is x and linear in kept:
                    y = kept.pop(linear)
                    if len(kept) == 1:
                        kept.clear()  # both handed out: release the input
                    return y
                return F.linear(x, linear.weight, linear.bias)

            return call

        return [(q, q_call), (k, handed(k)), (v, handed(v))]

    def mlp_call(self, mlp, twin):
        """``mlp``'s call (``call(x, residual=None)``: with a residual, ``residual + mlp(x)``, the sum in the down
        projection's launch): the Triton gated product and down projection where they apply, else ``twin``."""
        act = _activation(mlp)
        linears = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if skinny_linear is None or act is None or not all(_plain_linear(x) and x.bias is None for x in linears):
            return lambda x, residual=None: twin(x) if residual is None else residual + twin(x)
        gate, up, down = (x.weight for x in linears)

        def call(x, residual=None):
            def stock():
                return twin(x) if residual is None else residual + twin(x)

            rows = _rows(x)
            kind = type(mlp)
            if self.owner.failure is None and self.checked.get(kind, True) and skinny_usable(rows, gate, up):
                first = kind not in self.checked  # (checked on its product alone: a residual would hide a difference)
                if first and x.is_cuda and torch.cuda.is_current_stream_capturing():
                    return stock()  # checked on the warm-up step (a capture cannot compare on the host)
                add = None if residual is None or first else _rows(residual)
                try:
                    h = skinny_gated(rows, gate, up, act)
                    if skinny_usable(h, down) and (add is None or add.is_contiguous()):
                        y = skinny_linear(h, [down], None, add)[0]
                    else:
                        y = F.linear(h, down) if add is None else add + F.linear(h, down)
                    y = y.view(*x.shape[:-1], -1)
                except Exception as error:
                    self._failed(error)
                    return stock()
                if first:
                    expected = twin(x)
                    self.checked[kind] = bool((y - expected).abs().max() <= 0.05 * expected.abs().max() + 1e-3)
                    y = y if self.checked[kind] else expected
                    return y if residual is None else residual + y
                return y
            return stock()

        return call

    def release(self):
        for kept in self.pending:
            kept.clear()


class FusedModules:
    """``torch.compile``'d twins of a model's norms, dense MLPs and RoPE function, switched on only inside
    ``active()``. One twin per function (a module class's ``forward``, the modeling file's ``apply_rotary_pos_emb``,
    which it stands in for while active: a one-token step's q/k are left to the decode kernel, ``_deferring``), shared
    by all layers and models: Dynamo compiles it once per shape.
    A twin that fails to compile or run makes every twin eager again: they are pure functions, so the call is simply
    redone."""

    RECOMPILES = 64  # shapes per twin (Qwen3's RMSNorm forward sees 3 per batch size: hidden, q-norm, k-norm)

    def __init__(self, model):
        self.modules = list(_fusable(model))
        self.families = _rope_families(model)
        self.failure = None
        self.defer_rope = True  # off for a family that changes q/k after its RoPE (DeferredRopeMismatch)
        self._twins = {}
        self.skinny = SkinnyLinears(self, model)
        self.layers = list(_prenorm_layers(model))

    def _twin(self, fn):
        if fn not in self._twins:
            compiled = _compiled(fn)

            def call(*args, **kwargs):
                if self.failure is None:
                    try:
                        with torch._dynamo.config.patch(recompile_limit=self.RECOMPILES):
                            return compiled(*args, **kwargs)
                    except Exception as error:
                        self.failure = f"{type(error).__name__}: {error}"
                return fn(*args, **kwargs)

            self._twins[fn] = call
        return self._twins[fn]

    @contextmanager
    def active(self):
        if self.failure is not None:
            yield
            return
        # a user's own compile stays, and so do modules hooked since
        modules = [m for m in self.modules if m._compiled_call_impl is None and _unhooked(m)]
        linears = [(m, call) for m, call in self.skinny.calls if _plain_linear(m)]  # (hooks added since are kept)
        ropes = [(f, f.apply_rotary_pos_emb) for f in self.families]
        layers = [m for m in self.layers if m._compiled_call_impl is None and _unhooked(m)]
        twins = {}  # module -> its call while active
        try:
            for module in modules:
                twin = functools.partial(self._twin(type(module).forward), module)
                is_mlp = not type(module).__name__.endswith("RMSNorm")
                twins[module] = self.skinny.mlp_call(module, twin) if is_mlp else twin
                module._compiled_call_impl = twins[module]
            for layer in layers:
                layer._compiled_call_impl = functools.partial(self.layer_step, twins, layer)
            for module, call in linears:
                module._compiled_call_impl = call
            for family, rope in ropes:
                twin = self._twin(rope)
                family.apply_rotary_pos_emb = (_deferring(twin, rope, self._twin(_round_trip)) if self.defer_rope
                                               else twin)
            yield
        finally:
            _UNROTATED.clear()
            for module in modules + layers:
                module._compiled_call_impl = None
            for module, _ in linears:
                module._compiled_call_impl = None
            for family, rope in ropes:
                family.apply_rotary_pos_emb = rope
            self.skinny.release()

    def layer_step(self, twins, layer, hidden_states, attention_mask=None, position_ids=None, cache=None,
                   past_key_values=None, use_cache=False, position_embeddings=None, **kwargs):
        """``_prenorm_layer`` (``layer``'s own code) with its two residual adds fused into other launches: the first
        into the post-attention norm's compiled kernel, the second into the down projection's product (``twins``:
        the norm's and the MLP's calls while active; a module without one runs its stock call and the add)."""
        update, _ = layer.self_attn(
            hidden_states=layer.input_layernorm(hidden_states), attention_mask=attention_mask,
            position_ids=position_ids, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
            **{CACHE_ARG: given_cache(cache, past_key_values)})
        norm, mlp = layer.post_attention_layernorm, layer.mlp
        if norm in twins:
            hidden_states, update = self._twin(_add_then_norm)(norm, hidden_states, update)
        else:
            hidden_states = hidden_states + update
            update = norm(hidden_states)
        if mlp in twins:
            return twins[mlp](update, hidden_states)
        return hidden_states + mlp(update)


class _Captured:
    """A captured step, its static inputs and output, and the cache state it is valid for."""

    def __init__(self, graph, ids, positions, real, logits, version, limit):
        self.graph, self.ids, self.positions, self.real, self.logits = graph, ids, positions, real, logits
        self.version, self.limit = version, limit
        self.all_real = bool(real.all())  # (once, at capture) whether a maskless step may skip copying the column
        self.columns = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # a pass's offsets from its start
        self.replays = 0


class DecodeGraphs:
    """Per-cache captured decode steps, one per batch size (``cache.decode_graphs``)."""

    def __init__(self):
        self.captured = {}  # (batch, tokens per row) -> _Captured
        self.stream = None
        self.failures = []  # why captures failed; after CAPTURE_ATTEMPTS (or one host sync) the model decodes eagerly
        self.failure = None  # (then set: what failed)
        self.replays = 0
        self.wasted = 0  # captures dropped unreplayed since the last replay (beam search reorders the cache
        # every step: stop capturing)

    def replay(self, cache, input_ids, position_ids, real):
        """Logits of one step (``n`` tokens per row at ``position_ids``: (B, n), or the first one's position as one int
        for every row; ``real`` (B, n) their mask columns or None) replayed from the graph of this shape, or None where
        there is none valid for the cache's state. The host work before the launch is kept to a few comparisons and
        copies: the device idles while it runs (generate() syncs once per step)."""
        n = input_ids.shape[1]
        entry = self.captured.get(input_ids.shape)
        if entry is None or entry.version != cache.state_version() or cache.layers[0].max_seen + n - 1 > entry.limit:
            return None
        entry.ids.copy_(input_ids)
        if isinstance(position_ids, int):
            if n == 1:
                entry.positions.fill_(position_ids)
            else:
                torch.add(entry.columns, position_ids, out=entry.positions)
        else:
            entry.positions.copy_(position_ids)
        if real is not None:
            entry.real.copy_(real)
            entry.all_real = False
        elif not entry.all_real:
            entry.real.fill_(1)
            entry.all_real = True
        entry.graph.replay()
        cache.advance(n, real)
        entry.replays += 1
        self.replays += 1
        self.wasted = 0
        return entry.logits.clone()  # the next replay overwrites the static buffer

    def capture(self, forward, cache, input_ids, position_ids, real, fused: FusedModules | None = None):
        """Logits of ``forward(input_ids, position_ids)`` run eagerly, and the step captured for the next ones (with
        ``fused``'s twins active); None (nothing run) where captures stopped paying."""
        version = cache.state_version()
        for key, entry in list(self.captured.items()):  # release stale graphs and what they hold first
            if key == input_ids.shape or entry.version != version:
                del self.captured[key]
                self.wasted += entry.replays == 0
        if self.wasted >= 2:
            return None
        if self.stream is None:
            self.stream = torch.cuda.Stream(input_ids.device)
        # this step and the first replay; as much for every step length, so that speculative decoding gets the core
        # capacity (and so the decode kernel's splits and roundings) of plain decoding
        cache.reserve(steps=2 * max(input_ids.shape[1], DEFERRED_TOKENS))
        ids, positions = input_ids.clone(), position_ids.clone()
        real = torch.ones_like(ids) if real is None else real.to(ids.dtype, copy=True)
        twins = fused.active if fused is not None else nullcontext
        cache.step_real = real  # the layers read the pad column from this buffer, in the warm-up and the graph
        try:
            # Warm-up on the capture stream (kernels compiled, libraries' lazy state set up) is a real step.
            self.stream.wait_stream(torch.cuda.current_stream(input_ids.device))
            with torch.cuda.stream(self.stream):
                try:
                    with twins():
                        logits = forward(ids, positions)
                except DeferredRopeMismatch:  # (raised before any layer's cache was written: the step is redone)
                    fused.defer_rope = False
                    with twins():
                        logits = forward(ids, positions)
            torch.cuda.current_stream(input_ids.device).wait_stream(self.stream)
            counters, sync_mode = cache.host_counters(), torch.cuda.get_sync_debug_mode()
            graph = torch.cuda.CUDAGraph()
            # No garbage collection while capturing: destroying a CUDA graph then (one in another cache's garbage)
            # invalidates the capture. Other threads' CUDA calls (event queries, pinned allocations) do not count
            # against it ("thread_local", as torch.compile's own graphs). Measured in decode-generate-h200.md.
            collecting = gc.isenabled()
            gc.disable()
            try:
                # A layer that syncs with the host (data-dependent MoE routing) cannot be captured: raise before the
                # sync reaches the capturing stream (which would invalidate it), so the capture ends cleanly.
                torch.cuda.set_sync_debug_mode("error")
                with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"), twins():
                    static_logits = forward(ids, positions)
            except Exception as error:
                self.failures.append(f"{type(error).__name__}: {error}")
                if len(self.failures) >= CAPTURE_ATTEMPTS or HOST_SYNC in str(error):
                    self.failure = "; ".join(dict.fromkeys(self.failures))
                return logits
            finally:
                if collecting:
                    gc.enable()
                torch.cuda.set_sync_debug_mode(sync_mode)
                cache.set_host_counters(counters)  # capture ran the Python but none of the kernels
        finally:
            cache.step_real = None
        entry = _Captured(graph, ids, positions, real, static_logits, cache.state_version(), cache.replay_limit())
        self.captured[input_ids.shape] = entry
        return logits


def defer_stop_checks(is_supported):
    """``DeferredStopCheck.is_supported`` that also says yes on CUDA for a method's cache (a cache class with a
    ``stop_check_option``: the config switch, default on, that it reads from its ``config``).

    generate() syncs with the device once per step to read its stopping flag; transformers (5.17-5.24) reads it one
    step late instead, with the host queueing the next step meanwhile, only on MPS. A replayed step (about 4.7 ms for
    CCA on an H200 at 128K) then waits for ~0.35 ms of generate()'s host work every token (benchmarks/results/
    decode-generate-h200.md). Deferred, the host runs one step ahead and a stop costs one extra step, whose token
    transformers drops: the output is the same. A cache that generate() returns (``return_dict_in_generate``, a cache
    passed in) is told to record its past after the prefill and loses that step again with ``crop``, done in place by
    both methods' caches (CCA's takes its speculative slack), so the steps stay on CUDA graphs. Other caches, devices
    and assistant models get transformers' answer."""
    @functools.wraps(is_supported)
    def supported(device, cache, cache_is_returned, is_assistant):
        option = getattr(cache, "stop_check_option", None)
        if (option is not None and torch.device(device).type == "cuda" and not is_assistant
                and (cache.is_croppable or not cache_is_returned)
                and getattr(getattr(cache, "config", None), option, True)):
            return True
        return is_supported(device, cache, cache_is_returned, is_assistant)

    supported.__wrapped_for_graph_decode__ = defer_stop_checks  # (how to put it on again: install_deferred_stop_checks)
    return supported


def install_deferred_stop_checks():
    """Wrap ``DeferredStopCheck.is_supported`` with this module's ``defer_stop_checks``, once: a reload of this
    module replaces its wrapper; other copies' wrappers (another repo's modeling files) stay."""
    try:
        from transformers.generation.utils import DeferredStopCheck
    except ImportError:  # (a transformers without it: every step syncs, as it always did)
        return
    wraps, fn = [], DeferredStopCheck.is_supported
    while hasattr(fn, "__wrapped_for_graph_decode__"):
        wraps.append(fn.__wrapped_for_graph_decode__)
        fn = fn.__wrapped__
    for wrap in reversed(wraps):
        if wrap.__module__ != __name__:
            fn = wrap(fn)
    DeferredStopCheck.is_supported = staticmethod(defer_stop_checks(fn))


install_deferred_stop_checks()


class GraphDecodeMixin:
    """What a method's model class (``CCAModelMixin``, ``DCAModelMixin``) shares to decode from CUDA graphs: its
    ``forward`` calls ``_replayed_decode`` for a step on its cache (``graph_cache``), which replays the step captured
    for this shape or captures it (``DecodeGraphs``, with ``FusedModules``' twins). The cache supplies what a replay
    needs: ``state_version``, ``host_counters`` / ``set_host_counters``, ``advance``, ``reserve``, ``replay_limit``,
    ``token_steps``, ``graphable``, ``graph_step_allowed(real, extended)``, ``step_real``, its first layer's
    ``max_seen`` and its ``stop_check_option``. Config switches: ``<method>_cuda_graphs``, ``<method>_compile_decode``
    and ``<method>_defer_stop_checks`` (default on)."""

    graph_cache = None  # the method's cache class
    defers_rope = True  # a captured step leaves the family's RoPE of q/k to the method's decode kernel

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None, past_key_values=None,
                                      attention_mask=None, inputs_embeds=None, is_first_iteration=False, **kwargs):
        """generate()'s one-token step on the method's cache gets what the stock method returns: the last column of
        the ids (a contiguous copy) and of the position ids, the cache, the 2-D mask, ``use_cache`` and
        ``logits_to_keep``. The stock method spends 60-200 us of host time per step on work that does not apply here
        (a signature inspection for remote-code models, a parameter walk for the device), and the device idles
        meanwhile: generate() syncs on its stopping criteria after every step."""
        cache = given_cache(cache, past_key_values)
        if (next_sequence_length != 1 or not isinstance(cache, self.graph_cache) or is_first_iteration
                or inputs_embeds is not None
                or not kwargs.keys() <= {"use_cache", "position_ids", "logits_to_keep", "tokenizer"}
                or input_ids.dim() != 2 or input_ids.device != self.get_input_embeddings().weight.device):
            return super().prepare_inputs_for_generation(
                input_ids, next_sequence_length=next_sequence_length, attention_mask=attention_mask,
                inputs_embeds=inputs_embeds, is_first_iteration=is_first_iteration, **kwargs, **{CACHE_ARG: cache})
        inputs = {"input_ids": input_ids[:, -1:].clone(memory_format=torch.contiguous_format), CACHE_ARG: cache}
        if (positions := kwargs.pop("position_ids", None)) is not None:
            if positions.shape[-1] != 1:
                positions = positions[..., -1:].clone(memory_format=torch.contiguous_format)
            inputs["position_ids"] = positions
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
            # generate() made it: its last one extended by a column of ones (the cache may skip reading it)
            cache.__dict__["extended_mask"] = attention_mask
        inputs.update(kwargs)
        return inputs

    # What generate() passes to a one-token step that a captured step can take (cache_position: only masks use it)
    # (tokenizer: generate() hands it on to forward when given one, e.g. by transformers serve; the model ignores it)
    GRAPH_INPUTS = {"input_ids", "attention_mask", "position_ids", "return_dict", "output_hidden_states",
                    "logits_to_keep", "cache_position", "tokenizer"}

    def _replayed_decode(self, cache, kwargs):
        """The logits of a one-token step (or a verification pass of speculative decoding, ``cache.token_steps()``)
        replayed from a CUDA graph, or None where this step runs eagerly."""
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        held = vars(cache).pop("extended_mask", None) if hasattr(cache, "__dict__") else None
        extended = held is not None and held is mask  # generate()'s mask (prepare_inputs_for_generation)
        # Checked on every step, before the launch, while the device idles: cheap tests only (the rest on capture).
        if (ids is None or ids.dim() != 2 or not ids.is_cuda or self.training
                or torch.is_grad_enabled() or not isinstance(cache, self.graph_cache)
                or ids.shape[1] > cache.token_steps()
                or not getattr(self.config, f"{self.method}_cuda_graphs", True)
                or getattr(self, "_graph_failure", None)
                or not self.GRAPH_INPUTS.issuperset(kwargs)
                or kwargs.get("output_hidden_states") or kwargs.get("return_dict") is False):
            return None
        n, keep = ids.shape[1], kwargs.get("logits_to_keep")
        if n > 1 and keep is not None and not isinstance(keep, int):
            return None  # (logits of chosen positions: the stock forward picks them)
        keep = n if not keep or keep > n else keep  # (logits of the last ``keep`` tokens; a step's graph has all n)
        positions = kwargs.get("position_ids")
        real = None if mask is None else mask[:, -n:]  # the graph reads the pad columns on the device
        if not cache.graph_step_allowed(real, extended):
            return None
        if positions is None:  # every row's positions continue from the cache's length: written in place on a replay
            positions = cache.get_seq_length()
        graphs = cache.__dict__.get("decode_graphs")
        logits = None if graphs is None else graphs.replay(cache, ids, positions, real)
        if logits is not None:
            return logits if keep == n else logits[:, -keep:]
        if isinstance(positions, int):
            positions = torch.arange(positions, positions + n, device=ids.device).expand_as(ids)
        rope_type = getattr(getattr(self.model, "rotary_emb", None), "rope_type", "default")
        head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
        if "dynamic" in rope_type or rope_type == "longrope" or not cache.graphable(head_dim):  # (these re-plan
            return None  # their tables on the host)
        parent = super().forward

        def step(input_ids, position_ids):
            return parent(input_ids=input_ids, position_ids=position_ids, use_cache=True, **{CACHE_ARG: cache}).logits

        fused = None
        if getattr(self.config, f"{self.method}_compile_decode", True):
            fused = getattr(self, "_fused_modules", None)
            if fused is None:
                fused = self._fused_modules = FusedModules(self)
                fused.defer_rope = self.defers_rope
        graphs = cache.__dict__.setdefault("decode_graphs", DecodeGraphs())
        logits = graphs.capture(step, cache, ids, positions, real, fused)
        logits = logits if logits is None or keep == n else logits[:, -keep:]
        if fused is not None and fused.failure:
            logger.warning_once(f"CUDA-graph decoding captures the stock norms, MLPs and RoPE: compiling them failed "
                                f"({fused.failure})")
        if graphs.failure:
            self._graph_failure = graphs.failure
            logger.warning_once(f"CUDA-graph decoding is off for this model: capturing a step failed "
                                f"({graphs.failure}); decoding runs eagerly")
        return logits
