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
family's RoPE of the step's q/k is left to the CCA decode kernel, which rotates them as it writes the cache
(``_deferring``; other RoPE calls run a compiled twin). The
linear layers of up to 16 rows run as Triton products (``skinny_triton.py``, ``SkinnyLinears``): one launch for a
layer's q/k/v projections, one for a gated MLP's gate and up projections with its activation. Prefill, training and
eager steps keep the stock code.
"""

import functools
import sys
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F

try:
    from .cca_decode_triton import EAGER_ROPE_DTYPES
    from .skinny_triton import skinny_gated, skinny_linear, usable as skinny_usable
except ImportError:  # triton is optional (without it no step is captured)
    skinny_gated = skinny_linear = skinny_usable = None
    EAGER_ROPE_DTYPES = ()


def _fusable(model):
    """The stock modules whose decode-step work is mostly elementwise launches: RMS norms, dense MLPs; not those
    with hooks or a patched ``forward`` (accelerate's offloading), which a compiled class ``forward`` would skip."""
    for name, module in model.named_modules():
        kind = type(module).__name__
        if not (kind.endswith("RMSNorm") or (kind.endswith("MLP") and name.endswith(".mlp"))):
            continue
        if "forward" in module.__dict__ or module._forward_hooks or module._forward_pre_hooks:
            continue
        yield module


def _rope_families(model):
    """The modeling files whose attention modules call their module-level ``apply_rotary_pos_emb`` (~10 launches)."""
    attention = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    files = {sys.modules[type(m).__module__] for m in attention}
    return [f for f in files if callable(getattr(f, "apply_rotary_pos_emb", None))]


_COMPILED = {}
_UNROTATED = {}  # id(k) -> (q, k): one-token q/k a family handed over un-rotated (``_deferring``), strong references


DEFERRED_TOKENS = 32  # the most tokens per row whose RoPE a captured step leaves to the decode kernel (a
# verification pass of speculative decoding: its tokens then round exactly as the one-token steps they stand for)


def _deferring(rope):
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
    return call


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


def _compiled(fn):
    """One ``torch.compile`` of ``fn`` per process, so every model (and layer) reuses its compiled shapes."""
    if fn not in _COMPILED:
        # emulate_precision_casts: round where eager rounds (bf16 between ops), so a twin gives eager's numbers
        _COMPILED[fn] = torch.compile(fn, dynamic=False, fullgraph=True, options={"emulate_precision_casts": True})
    return _COMPILED[fn]


def _plain_linear(module) -> bool:
    """A stock ``nn.Linear`` whose call is its ``forward`` (no LoRA wrapper, hook, patch or user's compile)."""
    return (type(module) is torch.nn.Linear and "forward" not in module.__dict__ and not module._forward_hooks
            and not module._forward_pre_hooks and module._compiled_call_impl is None)


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
        """``mlp``'s call: the Triton gated product and down projection where they apply, else ``twin``."""
        act = _activation(mlp)
        linears = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if skinny_linear is None or act is None or not all(_plain_linear(x) and x.bias is None for x in linears):
            return twin
        gate, up, down = (x.weight for x in linears)

        def call(x):
            rows = _rows(x)
            kind = type(mlp)
            if self.owner.failure is None and self.checked.get(kind, True) and skinny_usable(rows, gate, up):
                capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
                if kind not in self.checked and capturing:
                    return twin(x)  # checked on the warm-up step (a capture cannot compare on the host)
                try:
                    h = skinny_gated(rows, gate, up, act)
                    y = skinny_linear(h, [down])[0] if skinny_usable(h, down) else F.linear(h, down)
                    y = y.view(*x.shape[:-1], -1)
                except Exception as error:
                    self._failed(error)
                    return twin(x)
                if kind not in self.checked:
                    stock = twin(x)
                    self.checked[kind] = bool((y - stock).abs().max() <= 0.05 * stock.abs().max() + 1e-3)
                    return y if self.checked[kind] else stock
                return y
            return twin(x)

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
        modules = [m for m in self.modules if m._compiled_call_impl is None]  # a user's own compile stays
        linears = [(m, call) for m, call in self.skinny.calls if _plain_linear(m)]  # (hooks added since are kept)
        ropes = [(f, f.apply_rotary_pos_emb) for f in self.families]
        try:
            for module in modules:
                twin = functools.partial(self._twin(type(module).forward), module)
                is_mlp = not type(module).__name__.endswith("RMSNorm")
                module._compiled_call_impl = self.skinny.mlp_call(module, twin) if is_mlp else twin
            for module, call in linears:
                module._compiled_call_impl = call
            for family, rope in ropes:
                twin = self._twin(rope)
                family.apply_rotary_pos_emb = _deferring(twin) if self.defer_rope else twin
            yield
        finally:
            _UNROTATED.clear()
            for module in modules:
                module._compiled_call_impl = None
            for module, _ in linears:
                module._compiled_call_impl = None
            for family, rope in ropes:
                family.apply_rotary_pos_emb = rope
            self.skinny.release()


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
        self.failure = None  # why a capture failed: the model then decodes eagerly
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
            try:
                # A layer that syncs with the host (data-dependent MoE routing) cannot be captured: raise before the
                # sync reaches the capturing stream (which would invalidate it), so the capture ends cleanly.
                torch.cuda.set_sync_debug_mode("error")
                with torch.cuda.graph(graph, stream=self.stream), twins():
                    static_logits = forward(ids, positions)
            except Exception as error:
                self.failure = f"{type(error).__name__}: {error}"
                return logits
            finally:
                torch.cuda.set_sync_debug_mode(sync_mode)
                cache.set_host_counters(counters)  # capture ran the Python but none of the kernels
        finally:
            cache.step_real = None
        entry = _Captured(graph, ids, positions, real, static_logits, cache.state_version(), cache.replay_limit())
        self.captured[input_ids.shape] = entry
        return logits
