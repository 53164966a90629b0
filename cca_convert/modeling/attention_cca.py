"""CCA attention over whole sequences (no cache): the backend choice, padding handling and the plain causal
attention of backend ``full``. Used by the model (``cca_hf.py``) and by the cache's prefill
(``cache_cca.py``), so both run the same code."""

import os

import torch
import torch.nn.functional as F

from ..kernels.cca_reference import apply_rope, cca_attention_reference, pool_core_tokens

try:
    from ..kernels.cca_triton import cca_attention_triton
except ImportError:  # triton is optional: CPU-only installs use the reference
    cca_attention_triton = None


def cca_attention(q, k, v, cos, sin, config, scale: float, return_core: bool = False, q_rot=None, k_rot=None):
    """CCA over whole sequences whose positions are ``0 .. L-1``; picks the backend (``config`` carries
    ``group_size``, ``local_window``, ``pooling``, ``attn_backend``). With ``return_core``
    also returns the pooled ``(K_core, V_core)`` (a KV cache keeps them), computed once with the attention.
    ``q_rot``/``k_rot``: q and k as the model's own RoPE rotated them, used as given (``q`` may then be None, and ``k``
    too: the pooling then un-rotates ``k_rot``)."""
    use_triton = config.attn_backend == "triton" or (config.attn_backend == "auto" and v.is_cuda)
    if config.attn_backend == "triton" and not v.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attn_backend='triton' needs a CUDA GPU (the model is on the CPU); "
                         "use attn_backend='auto' or 'reference' there")
    if use_triton and cca_attention_triton is None:
        if config.attn_backend == "triton":
            raise ImportError("attn_backend='triton' needs the `triton` package (pip install triton)")
        use_triton = False
    if use_triton and v.shape[2] <= config.local_window:
        # No query is past the window: CCA is exactly causal attention (spec), and SDPA is faster.
        q_rot = apply_rope(q, cos, sin) if q_rot is None else q_rot
        k_rot = apply_rope(k, cos, sin) if k_rot is None else k_rot
        out = full_causal_attention(q_rot, k_rot, v, None, scale)
        if not return_core:
            return out
        return out, *pool_core_tokens(q_rot, k_rot, k, v, cos, sin, config.group_size, config.pooling, scale)
    attend = cca_attention_triton if use_triton else cca_attention_reference
    return attend(q, k, v, cos, sin, config.group_size, config.local_window, config.pooling, scale, return_core,
                  q_rot=q_rot, k_rot=k_rot)


def left_padding(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Per-sequence count of leading pad tokens, or None when no sequence is left-padded.

    CCA groups are counted from each sequence's first real token, so left-padded rows are shifted
    to start at index 0 before attention (right padding needs nothing: pads come after every real
    query and are never seen by one).
    """
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    mask = attention_mask.bool()
    n_pad = (~mask).long().cumprod(-1).sum(-1)
    idx = torch.arange(mask.shape[1], device=mask.device)
    n_real = mask.long().sum(-1)
    expected = (idx[None] >= n_pad[:, None]) & (idx[None] < (n_pad + n_real)[:, None])
    if not torch.equal(mask, expected):
        raise ValueError("CCA attention supports left or right padding only, not holes inside a sequence")
    return n_pad if bool(n_pad.any()) else None


def shift_rows(x: torch.Tensor, shift: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """Roll each batch row of ``x`` left by ``shift[b]`` positions along ``seq_dim``."""
    seq_len = x.shape[seq_dim]
    idx = (torch.arange(seq_len, device=x.device)[None] + shift[:, None]) % seq_len  # (B, L)
    shape = [x.shape[0]] + [1] * (x.dim() - 1)
    shape[seq_dim] = seq_len
    return x.gather(seq_dim, idx.view(shape).expand_as(x))


def full_causal_attention(q, k, v, attention_mask, scale) -> torch.Tensor:
    """Plain causal attention (backend ``full``), with the padding mask if any."""
    q_len, kv_len = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if attention_mask is None and q_len == kv_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    qi = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
    ki = torch.arange(kv_len, device=q.device)[None, :]
    mask = (ki <= qi)[None, None]
    if attention_mask is not None:
        keep = attention_mask[:, None, None, -kv_len:].bool()
        mask = mask & (keep | (ki == qi))  # a pad query still needs one key to avoid NaN rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
