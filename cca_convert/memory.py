"""Peak memory per device of a run's stages, estimated from the config and the weights' headers before any weight
is loaded, and the settings that would fit when a stage does not.

The model is bytes, term by term (see ``docs/MEMORY.md`` for the derivation and the check against measured peaks):

- weights in their dtype (FSDP: the fp32 flat copy, sharded over the processes, plus one gathered layer);
- trained parameters: an fp32 master copy, its fp32 gradient and AdamW's two fp32 moments (sharded under FSDP);
- activations of ``seq_len x micro_batch`` tokens: with gradient checkpointing one residual-stream tensor per layer
  plus one layer's recomputed intermediates and their gradients; without, every layer's intermediates;
- the loss over one chunk of logits (``finetune/chunked_loss.py``: never the whole sequence's);
- validation (no gradients, no KV cache: one forward pass per window): the weights plus one layer's intermediates
  at the longest length, and the logits of one chunk; the base model's full attention runs on the same weights;
- the PyTorch reference attention (CPU) holds a (heads, L, L) score matrix: O(L^2); DCA's PyTorch path runs
  through SDPA instead: wide (3 x head_dim) fp32 queries, keys and values and one query block's mask, O(L);
- a fixed reserve for the CUDA context, kernels' workspaces and allocator slack.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .families import kept_sliding_window

GiB = 2**30
CUDA_RESERVE = 2 * GiB  # context (~0.5 GiB), cuBLAS/Triton workspaces, allocator rounding
CPU_RESERVE = 1 * GiB  # the Python process, tokenizers, datasets' buffers
# Bytes per token of one decoder layer's intermediates kept for the backward pass, as multiples of the widths
# (bf16 activations; RMSNorm's fp32 upcasts counted): see docs/MEMORY.md.
PER_TOKEN_HIDDEN = 28  # x hidden_size: two RMSNorms (fp32 copies), attention output, o_proj, residual adds
PER_TOKEN_QKV = 8  # x (q width + k/v widths): projections and their RoPE'd copies
PER_TOKEN_MLP = 10  # x intermediate width (per token: MoE counts the active experts): gate, up, act, product
BACKWARD_FACTOR = 1.0  # one layer's recomputed intermediates while their gradients form (fit: H100, 8B at 32K/64K)
LOGIT_CHUNK_COPIES = 3.5  # one chunk's fp32 logits, their bf16 matmul output, softmax and gradient


@dataclass
class Shape:
    """What the estimate needs of a model: from its config and the element count in its weight files."""

    params: int
    layers: int
    hidden: int
    q_width: int
    kv_width: int
    mlp_width: int  # per token (MoE: active experts x expert width + shared experts)
    vocab: int
    heads: int
    layer_params: int  # one decoder layer's parameters (FSDP gathers one at a time)
    qkv_params: int  # q/k/v projection weights over all layers (finetune.method qkv)
    lora_params_per_rank: int  # LoRA A+B elements per unit of rank over all layers, for q/k/v targets
    sliding: bool = False  # some layers are sliding-window layers kept as they are (an explicit mask)
    window: int = 0  # their window (config.sliding_window)

    @classmethod
    def of(cls, config, params: int) -> Shape:
        text = getattr(config, "text_config", None) or config
        hidden = text.hidden_size
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        layers = text.num_hidden_layers
        experts = getattr(text, "num_experts_per_tok", None) or 0
        if experts and getattr(text, "moe_intermediate_size", None):  # the active experts' widths per token
            mlp = experts * text.moe_intermediate_size + (getattr(text, "shared_expert_intermediate_size", 0) or 0)
        else:
            mlp = text.intermediate_size
        q, kv = heads * head_dim, kv_heads * head_dim
        embed = text.vocab_size * hidden * (1 if getattr(text, "tie_word_embeddings", False) else 2)
        window = kept_sliding_window(text)
        return cls(params=params, layers=layers, hidden=hidden, q_width=q, kv_width=kv, mlp_width=mlp,
                   sliding=window > 0, window=window,
                   vocab=text.vocab_size, heads=heads, layer_params=max(1, (params - embed) // max(1, layers)),
                   qkv_params=layers * hidden * (q + 2 * kv), lora_params_per_rank=layers * (3 * hidden + q + 2 * kv))


@dataclass
class Estimate:
    stage: str
    parts: dict[str, float] = field(default_factory=dict)  # name -> bytes

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        big = sorted(self.parts.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{name} {b / GiB:.1f}" for name, b in big if b >= 0.05 * GiB)


def layer_activation_bytes(shape: Shape, tokens: int, act_bytes: int = 2) -> float:
    per_token = (PER_TOKEN_HIDDEN * shape.hidden + PER_TOKEN_QKV * (shape.q_width + 2 * shape.kv_width)
                 + PER_TOKEN_MLP * shape.mlp_width) * act_bytes / 2
    return per_token * tokens


def sliding_mask_bytes(shape: Shape, batch: int, length: int) -> float:
    """Models with sliding-window layers (Gemma 3) give SDPA an explicit mask (bool, its additive bf16 form and a
    copy: 8 bytes an entry, measured on Gemma 3 12B at 32K on an H100): (L, L) up to 4 windows, beyond that one
    block's, 2w queries by the 3w - 1 keys they reach (``cca_hf._sliding_attention``). Full causal layers need none."""
    if not shape.sliding:
        return 0
    w = shape.window or length
    rows, cols = (length, length) if length <= 4 * w else (2 * w, 3 * w - 1)
    return 8 * batch * rows * cols


def reference_attention_bytes(shape: Shape, batch: int, length: int) -> float:
    """The PyTorch reference's scores: (batch, heads, L, L) fp32, and the softmax beside them."""
    return 2 * 4 * batch * shape.heads * length * length


def dca_attention_bytes(shape: Shape, batch: int, length: int, block: int = 1024) -> float:
    """DCA's PyTorch attention (``dca_attention_blocked``): fp32 queries, keys and values three head dims wide with
    their rotation temporaries, and one block of queries' (block x L) mask with SDPA's float copy of it."""
    head_dim = shape.q_width // shape.heads
    kv_heads = shape.kv_width // head_dim
    return batch * length * head_dim * (24 * shape.heads + 48 * kv_heads) + 5 * batch * min(block, length) * length


def _reference_part(kind: str | None, shape: Shape, batch: int, length: int) -> tuple[str, float] | None:
    """``kind``: None (the kernels run), "scores" (the (heads, L, L) reference), "dca" (``dca_attention_bytes``)."""
    if kind is None:
        return None
    if kind == "scores":
        return "reference attention scores", reference_attention_bytes(shape, batch, length)
    if kind == "dca":
        return "DCA's PyTorch attention", dca_attention_bytes(shape, batch, length)
    raise ValueError(f"reference_attention={kind!r}: expected None, 'scores' or 'dca'")


def finetune_estimate(shape: Shape, *, method: str, seq_len: int, micro_batch: int, checkpointing: bool,
                      weight_bytes: int, lora_rank: int = 16, world: int = 1, fsdp: bool = False,
                      reference_attention: str | None = None, cuda: bool = True) -> Estimate:
    tokens = seq_len * micro_batch
    trained = {"full": shape.params, "qkv": shape.qkv_params, "lora": lora_rank * shape.lora_params_per_rank}[method]
    e = Estimate("finetune")
    if fsdp:  # the flat parameters are fp32 (the trainer casts before wrapping), sharded; one layer gathered in bf16
        e.parts["weights (fp32, sharded)"] = 4 * shape.params / world
        e.parts["gathered layers"] = 2 * 2 * shape.layer_params
        e.parts["gradients + AdamW (sharded)"] = 12 * trained / world
    else:
        e.parts["weights"] = weight_bytes * (shape.params - (trained if method != "lora" else 0))
        e.parts["trained (fp32) + gradients + AdamW"] = 16 * trained
    act_bytes = 4 if method == "full" and not fsdp else 2  # an fp32 residual stream when the embeddings train fp32
    one_layer = layer_activation_bytes(shape, tokens, act_bytes)
    chunk = max(1, 2**30 // (4 * shape.vocab))  # finetune/chunked_loss.py's LOGIT_BYTES
    loss = LOGIT_CHUNK_COPIES * 4 * shape.vocab * min(chunk, tokens) + 12 * tokens * shape.hidden
    # the loss (after the last layer) and a layer's backward happen at different moments: the larger one counts
    if checkpointing:
        e.parts["activations (checkpointed)"] = shape.layers * tokens * shape.hidden * act_bytes
        e.parts["one layer's backward, or the loss"] = max(BACKWARD_FACTOR * one_layer, loss)
    else:
        e.parts["activations"] = shape.layers * one_layer
        e.parts["the loss (one chunk of logits)"] = loss
    if shape.sliding:
        e.parts["sliding-window mask"] = sliding_mask_bytes(shape, micro_batch, seq_len)
    if part := _reference_part(reference_attention, shape, micro_batch, seq_len):  # forward and backward
        e.parts[part[0]] = 2 * part[1]
    e.parts["reserve"] = CUDA_RESERVE if cuda else CPU_RESERVE
    return e


def validate_estimate(shape: Shape, *, length: int, batch: int, weight_bytes: int,
                      reference_attention: str | None = None, cuda: bool = True, generate: bool = False) -> Estimate:
    """``generate``: the validation's tasks decode after a prefill of ``length`` tokens (one prompt at a time), so the
    base's full KV cache is held too."""
    e = Estimate("validate")
    e.parts["weights"] = weight_bytes * shape.params
    if generate:
        e.parts[f"KV cache of {length} tokens (tasks)"] = 2 * shape.layers * shape.kv_width * length * weight_bytes
    # inference keeps no intermediates: the widest moment of one layer (MLP: gate, up, act, product in bf16; the
    # residual and one fp32 norm copy); fit: Llama-3.1-8B to 128K, Qwen3-8B, Phi-4, Qwen3-30B-A3B on an H100
    e.parts[f"one layer at {length} tokens"] = batch * length * (4 * shape.mlp_width * 2 + 2 * shape.hidden * 4)
    if shape.sliding:
        e.parts["sliding-window mask"] = sliding_mask_bytes(shape, batch, length)
    e.parts["logits (one chunk)"] = 2 * 2**28  # validate/perplexity.py's LOGIT_BYTES, and its bf16 source
    if part := _reference_part(reference_attention, shape, batch, length):
        e.parts[part[0]] = part[1]
    e.parts["reserve"] = CUDA_RESERVE if cuda else CPU_RESERVE
    return e


def device_memory(device: str) -> tuple[int, str]:
    """(bytes this process may use, what they are) on ``device``: a GPU's free memory, or the RAM available."""
    if str(device).startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return free, f"{torch.cuda.get_device_name(torch.device(device))} ({total / GiB:.1f} GiB, {free / GiB:.1f} free)"
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"], f"CPU RAM ({info['MemTotal'] / GiB:.1f} GiB, {info['MemAvailable'] / GiB:.1f} available)"
    except (OSError, KeyError, ValueError):
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages, f"CPU RAM ({pages / GiB:.1f} GiB)"


def fitting_seq_lens(seq_len: int) -> list[int]:
    """Halvings of ``seq_len`` down to 1024 (best first)."""
    out, n = [], seq_len // 2
    while n >= 1024:
        out.append(n)
        n //= 2
    return out


def gpus_needed(estimate_for_world, budget: float, most: int = 64) -> int | None:
    for world in (2, 4, 8, 16, 32, 64):
        if world <= most and estimate_for_world(world).total <= budget:
            return world
    return None


def gib(b: float) -> str:
    return f"{b / GiB:.1f} GiB"


__all__ = ["Shape", "Estimate", "finetune_estimate", "validate_estimate", "device_memory", "gib"]
