"""One-token decode steps replayed from CUDA graphs: what ``generate()`` runs once per new token.

An eager step of an 8B model launches hundreds of small kernels from Python; at small batches the GPU waits for the
CPU. A captured step launches them all at once. A replay reads and writes fixed addresses, so it is valid only while
the cache's state tensors are the same objects it was captured with (the cache decodes in place and names them:
``decode_tensors``); anything that replaces one (a prefill, a multi-token pass, a crop, beam reordering, the core
outgrowing its reserve) makes the next step eager and the step after it captured anew. Host-side counters the
captured Python code advanced once are put back, and advanced by the caller at each replay (``advance``).

While a step is warmed up and captured, the model's norms, dense MLPs and RoPE run as ``torch.compile`` twins of
transformers' own code (``FusedModules``): one fused kernel where eager code launches one per elementwise op.
Prefill, training and eager steps keep the stock code.
"""

import functools
import sys
from contextlib import contextmanager, nullcontext

import torch


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


def _compiled(fn):
    """One ``torch.compile`` of ``fn`` per process, so every model (and layer) reuses its compiled shapes."""
    if fn not in _COMPILED:
        # emulate_precision_casts: round where eager rounds (bf16 between ops), so a twin gives eager's numbers
        _COMPILED[fn] = torch.compile(fn, dynamic=False, fullgraph=True, options={"emulate_precision_casts": True})
    return _COMPILED[fn]


class FusedModules:
    """``torch.compile``'d twins of a model's norms, dense MLPs and RoPE function, switched on only inside
    ``active()``. One twin per function (a module class's ``forward``, the modeling file's ``apply_rotary_pos_emb``,
    which it stands in for while active), shared by all layers and models: Dynamo compiles it once per shape.
    A twin that fails to compile or run makes every twin eager again: they are pure functions, so the call is simply
    redone."""

    RECOMPILES = 64  # shapes per twin (Qwen3's RMSNorm forward sees 3 per batch size: hidden, q-norm, k-norm)

    def __init__(self, model):
        self.modules = list(_fusable(model))
        self.families = _rope_families(model)
        self.failure = None
        self._twins = {}

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
        ropes = [(f, f.apply_rotary_pos_emb) for f in self.families]
        try:
            for module in modules:
                module._compiled_call_impl = functools.partial(self._twin(type(module).forward), module)
            for family, rope in ropes:
                family.apply_rotary_pos_emb = self._twin(rope)
            yield
        finally:
            for module in modules:
                module._compiled_call_impl = None
            for family, rope in ropes:
                family.apply_rotary_pos_emb = rope


class _Captured:
    def __init__(self, graph, ids, positions, logits, tensors):
        self.graph, self.ids, self.positions, self.logits, self.tensors = graph, ids, positions, logits, tensors

    def matches(self, tensors) -> bool:
        return len(tensors) == len(self.tensors) and all(a is b for a, b in zip(tensors, self.tensors))


class DecodeGraphs:
    """Per-cache captured decode steps, one per batch size (``cache.decode_graphs``)."""

    def __init__(self):
        self.captured = {}
        self.stream = None
        self.failure = None  # why a capture failed: the model then decodes eagerly
        self.replays = 0
        self.unreplayed = 0  # captures not replayed since (beam search reorders the cache every step: stop capturing)

    def step(self, forward, cache, input_ids, position_ids, fused: FusedModules | None = None):
        """Logits of ``forward(input_ids, position_ids)`` (one token per row), replayed from a graph when one matches
        the cache's state; otherwise run eagerly and captured for the next step (with ``fused``'s twins active)."""
        tensors = cache.decode_tensors(steps=2)  # this step and, if it is captured now, the first replay
        entry = self.captured.get(input_ids.shape[0])
        if entry is not None and entry.matches(tensors):
            entry.ids.copy_(input_ids)
            entry.positions.copy_(position_ids)
            entry.graph.replay()
            cache.advance(1)
            self.unreplayed = 0
            self.replays += 1
            return entry.logits.clone()  # the next replay overwrites the static buffer
        self.captured.pop(input_ids.shape[0], None)  # release the stale graph and what it holds first
        if self.unreplayed >= 2:
            return forward(input_ids, position_ids)
        if self.stream is None:
            self.stream = torch.cuda.Stream(input_ids.device)
        ids, positions = input_ids.clone(), position_ids.clone()
        twins = fused.active if fused is not None else nullcontext
        # Warm-up on the capture stream (kernels compiled, libraries' lazy state set up) is a real step.
        self.stream.wait_stream(torch.cuda.current_stream(input_ids.device))
        with torch.cuda.stream(self.stream), twins():
            logits = forward(ids, positions)
        torch.cuda.current_stream(input_ids.device).wait_stream(self.stream)
        counters, sync_mode = cache.host_counters(), torch.cuda.get_sync_debug_mode()
        graph = torch.cuda.CUDAGraph()
        try:
            # A layer that syncs with the host (data-dependent MoE routing) cannot be captured: raise before the sync
            # reaches the capturing stream (which would invalidate it), so the capture ends cleanly.
            torch.cuda.set_sync_debug_mode("error")
            with torch.cuda.graph(graph, stream=self.stream), twins():
                static_logits = forward(ids, positions)
        except Exception as error:
            self.failure = f"{type(error).__name__}: {error}"
            return logits
        finally:
            torch.cuda.set_sync_debug_mode(sync_mode)
            cache.set_host_counters(counters)  # capture ran the Python but none of the kernels
        self.captured[input_ids.shape[0]] = _Captured(graph, ids, positions, static_logits, tensors)
        self.unreplayed += 1
        return logits
