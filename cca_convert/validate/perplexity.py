"""Perplexity over full-length windows of a held-out token stream.

Windows and stride (what ``ppl @ L`` means): the held-out documents form one token stream; candidate
windows are the slices ``[k*stride, k*stride + L)`` that fit entirely in it (``stride`` defaults to L:
non-overlapping windows; a shorter tail is never scored). Up to ``windows`` of them, evenly spread over
the stream, are used, the same ones for every model. Each window is one independent forward pass from an
empty context; every one of its L-1 next-token predictions is scored. ``ppl = exp(sum NLL / number of
scored tokens)``: a token-weighted mean over all windows, not a mean of per-window perplexities.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .. import methods
from ..errors import CCAError

LOGIT_BYTES = 2**28  # fp32 logits materialized at once: positions per chunk = LOGIT_BYTES / (4 * vocab)


@contextmanager
def attention_backend(model, backend: str | None):
    """Temporarily run a converted model with its method's attention backend set to ``backend`` ("full": the base
    model's attention with the same weights, as the method says how). ``None`` leaves the model as it is."""
    swap = {}
    if backend is not None:
        seen = set()
        for module in model.modules():  # the modules share one config object (Gemma 3: one per text model)
            config = getattr(module, "config", None)
            if config is None or id(config) in seen:
                continue
            seen.add(id(config))
            method = methods.of_config(config)
            if method is not None:
                field, value = method.run_as_base(config) if backend == "full" else (f"{method.name}_attn_backend",
                                                                                     backend)
                swap[id(config)] = (config, field, value)
        if not swap:
            raise ValueError(f"{type(model).__name__} is not a converted model: no attention backend to set to "
                             f"{backend!r}")
    unset = object()
    old = {key: getattr(config, field, unset) for key, (config, field, _) in swap.items()}
    try:
        for config, field, value in swap.values():
            setattr(config, field, value)
        yield model
    finally:
        for key, (config, field, _) in swap.items():
            if old[key] is unset:  # a field the config did not have goes again (its default applies)
                delattr(config, field)
            else:
                setattr(config, field, old[key])


@contextmanager
def eval_mode(model):
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def hidden_states(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Last hidden states (B, L, D) of a causal LM, without materializing the logits."""
    return model.base_model(input_ids=input_ids.to(_device(model)), use_cache=False).last_hidden_state


def select_windows(n_tokens: int, length: int, windows: int, stride: int | None = None) -> list[int]:
    """Start offsets of up to ``windows`` full windows of ``length`` tokens, evenly spread (see module doc)."""
    stride = stride or length
    candidates = (n_tokens - length) // stride + 1 if n_tokens >= length else 0
    if candidates <= 0:
        raise CCAError(f"validation: the held-out text has {n_tokens} tokens, fewer than context length {length}: "
                       "give more held-out text or drop that length")
    k = min(windows, candidates)
    picks = [0] if k == 1 else [round(i * (candidates - 1) / (k - 1)) for i in range(k)]
    return [p * stride for p in picks]


def window_nll(model, input_ids: torch.Tensor) -> tuple[float, int]:
    """Summed next-token NLL (float64) and the number of scored tokens of a batch of sequences (B, L)."""
    input_ids = input_ids.to(_device(model))
    hidden = hidden_states(model, input_ids)
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0]
    chunk = max(1, LOGIT_BYTES // (4 * vocab * input_ids.shape[0]))
    total, count = 0.0, 0
    length = input_ids.shape[1]
    for start in range(0, length - 1, chunk):
        end = min(start + chunk, length - 1)
        logits = head(hidden[:, start:end]).float()
        targets = input_ids[:, start + 1:end + 1]
        total += F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), reduction="sum").double().item()
        count += targets.numel()
    return total, count


def perplexity(model, stream: torch.Tensor, length: int, windows: int, stride: int | None = None,
               batch_size: int = 1) -> dict:
    """Token-weighted perplexity of ``model`` at context ``length`` over the stream (see module doc)."""
    offsets = select_windows(stream.numel(), length, windows, stride)
    total, count = 0.0, 0
    with eval_mode(model):
        for i in range(0, len(offsets), batch_size):
            batch = torch.stack([stream[o:o + length] for o in offsets[i:i + batch_size]])
            nll, n = window_nll(model, batch)
            total, count = total + nll, count + n
    mean = total / count
    ppl = math.exp(mean) if mean < 700 else math.inf  # nan stays nan; exp() of a huge mean would raise
    return {"ppl": ppl, "nll": mean, "tokens": count, "windows": len(offsets), "offsets": offsets}
