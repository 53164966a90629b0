"""Per-token times read inside one real ``generate()`` call (benchmarks/decode.py, benchmarks/dca.py --model)."""

import statistics
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from cca_convert.modeling.attention_hooks import given_cache


class StepClock(LogitsProcessor):
    """Stamps every generation step: generate calls its logits processors once per new token, after that token's
    forward. Only the first stamp waits for the device (it ends the prefill). Later stamps do not: generate itself
    waits for the device once per step (its stopping check reads a device flag; with a CCA cache on CUDA the flag
    of the step before, the host one step ahead), so in steady state the stamps keep the period of that loop, the
    real time per token. A sync here would add one: the host would stop queueing the step's sampling and
    bookkeeping behind the forward, which no user's generate() does (``sync_steps=True`` does it anyway: the clock
    of the results before 2026-11-24, kept to compare)."""

    def __init__(self, device, sync_steps=False):
        self.device, self.stamps, self.sync_steps = torch.device(device), [], sync_steps

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda" and (self.sync_steps or not self.stamps):
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def timed_generate(model, ids, new_tokens, skip=4, sync_steps=False, **kwargs) -> dict:
    """``model.generate`` of exactly ``new_tokens`` greedy tokens after ``ids``, called as users most often call it
    (the token ids back, not a dict with the cache). ``prefill_s``: start to the first token; ``ms_per_token``: median step after the
    first ``skip`` (compilation, graph capture); ``steps_ms``: all; ``graph_replays``: steps a CCA cache replayed
    from a CUDA graph (its cache is seen by a forward pre-hook, on the first call only)."""
    clock = StepClock(ids.device, sync_steps)
    caches = []

    def first_cache(module, args, call_kwargs):
        if not caches:
            caches.append(given_cache(call_kwargs.get("cache"), call_kwargs.get("past_key_values")))

    hook = model.register_forward_pre_hook(first_cache, with_kwargs=True)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False,
                                 logits_processor=LogitsProcessorList([clock]), **kwargs)
    finally:
        hook.remove()
    if out.shape != (ids.shape[0], ids.shape[1] + new_tokens):
        raise RuntimeError(f"generate returned {tuple(out.shape)}, expected {new_tokens} new tokens per row")
    graphs = getattr(caches[0] if caches else None, "decode_graphs", None)  # a CCA cache's CUDA-graph record
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    if not steps:
        raise ValueError("timed_generate needs new_tokens >= 2")
    ms = statistics.median(steps[min(skip, len(steps) - 1):]) * 1e3
    return {"ms_per_token": ms, "prefill_s": clock.stamps[0] - start, "total_s": time.perf_counter() - start,
            "steps_ms": [round(x * 1e3, 3) for x in steps], "graph_replays": graphs.replays if graphs else 0}
