"""One-token decode steps replayed from CUDA graphs: what ``generate()`` runs once per new token.

An eager step of an 8B model launches hundreds of small kernels from Python; at small batches the GPU waits for the
CPU. A captured step launches them all at once. A replay reads and writes fixed addresses, so it is valid only while
the cache's state tensors are the same objects it was captured with (the cache decodes in place and names them:
``decode_tensors``); anything that replaces one (a prefill, a multi-token pass, a crop, beam reordering, the core
outgrowing its reserve) makes the next step eager and the step after it captured anew. Host-side counters the
captured Python code advanced once are put back, and advanced by the caller at each replay (``advance``).
"""

import torch


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

    def step(self, forward, cache, input_ids, position_ids):
        """Logits of ``forward(input_ids, position_ids)`` (one token per row), replayed from a graph when one matches
        the cache's state; otherwise run eagerly and captured for the next step."""
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
        # Warm-up on the capture stream (kernels compiled, libraries' lazy state set up) is a real step.
        self.stream.wait_stream(torch.cuda.current_stream(input_ids.device))
        with torch.cuda.stream(self.stream):
            logits = forward(ids, positions)
        torch.cuda.current_stream(input_ids.device).wait_stream(self.stream)
        counters, sync_mode = cache.host_counters(), torch.cuda.get_sync_debug_mode()
        graph = torch.cuda.CUDAGraph()
        try:
            # A layer that syncs with the host (data-dependent MoE routing) cannot be captured: raise before the sync
            # reaches the capturing stream (which would invalidate it), so the capture ends cleanly.
            torch.cuda.set_sync_debug_mode("error")
            with torch.cuda.graph(graph, stream=self.stream):
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
