"""The training loss without whole-sequence logits.

A causal LM's forward computes ``lm_head`` over every position, then transformers' ``ForCausalLMLoss`` upcasts
them to fp32: at 32K tokens and a 128K vocabulary that is 8.4 GB of bf16 logits, 16.8 GB in fp32 and as much
again for their gradient; the 8B recipe ran out of memory on an 80 GB card there. While training, the head is
made to pass its input through and the model's ``loss_function`` applies it chunk by chunk: each chunk's logits
are computed, upcast, scored and dropped, and recomputed in the backward pass (activation checkpointing of one
chunk, as Liger-Kernel's fused linear cross-entropy avoids the full logits by computing them blockwise). Per chunk
the operations are exactly those of the unchunked path (same autocast matmul, ``.float()``, softcapping, cross
entropy), so only the order of the final sum differs. Everything happens inside the model's own ``forward``, so
DDP and FSDP see the head's weight used where they expect it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
LOGIT_BYTES = 2**30  # fp32 logits of one chunk: tokens per chunk = LOGIT_BYTES / (4 * vocab)


def chunk_tokens(vocab_size: int) -> int:
    return max(1, LOGIT_BYTES // (4 * vocab_size))


def _chunk_nll(hidden: torch.Tensor, weight: torch.Tensor, bias, labels: torch.Tensor, softcap) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, *, softcap=None,
                          num_items_in_batch=None, shift_labels=None, chunk: int | None = None) -> torch.Tensor:
    """``ForCausalLMLoss(head(hidden), labels)`` computed ``chunk`` positions at a time (see the module doc)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    shift_labels = shift_labels.reshape(-1).to(hidden.device)
    chunk = chunk or chunk_tokens(head.weight.shape[0])
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        h, y = hidden[start:start + chunk], shift_labels[start:start + chunk]
        if torch.is_grad_enabled() and (h.requires_grad or head.weight.requires_grad):
            total = total + checkpoint(_chunk_nll, h, head.weight, head.bias, y, softcap, use_reentrant=False)
        else:
            total = total + _chunk_nll(h, head.weight, head.bias, y, softcap)
    if num_items_in_batch is None:
        count = (shift_labels != IGNORE_INDEX).sum()
    else:
        count = num_items_in_batch
    if torch.is_tensor(count):
        count = count.to(total.device)
    return total / count


def _pass_through(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


class ChunkedLoss:
    """Install on a causal LM (``with ChunkedLoss(model):`` or ``install``/``remove``): its forward then returns the
    final hidden states as ``logits`` and a loss computed without whole-sequence logits. Only for training: the
    trainer reads ``.loss`` alone."""

    def __init__(self, model, chunk: int | None = None):
        self.model, self.chunk = model, chunk
        self.head = model.get_output_embeddings()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self._saved = None

    def _loss(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=IGNORE_INDEX,
              shift_labels=None, **kwargs):
        return chunked_cross_entropy(logits, self.head, labels, softcap=self.softcap,
                                     num_items_in_batch=num_items_in_batch, shift_labels=shift_labels,
                                     chunk=self.chunk)

    def install(self) -> ChunkedLoss:
        model, config = self.model, self.model.config
        self._saved = (model.__dict__.get("_loss_function"), self.head.__dict__.get("forward"))
        model.loss_function = self._loss
        self.head.forward = _pass_through
        if self.softcap is not None:  # the model would cap the hidden states: the loss caps each chunk instead
            config.final_logit_softcapping = None
        return self

    def remove(self) -> None:
        if self._saved is None:
            return
        loss_fn, forward = self._saved
        if loss_fn is None:
            self.model.__dict__.pop("_loss_function", None)
        else:
            self.model.loss_function = loss_fn
        if forward is None:
            self.head.__dict__.pop("forward", None)
        else:
            self.head.forward = forward
        if self.softcap is not None:
            self.model.config.final_logit_softcapping = self.softcap
        self._saved = None

    def __enter__(self) -> ChunkedLoss:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()
