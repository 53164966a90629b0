"""Dual Chunk Attention (DCA): the PyTorch reference twin (docs/DCA-SPEC.md is the contract).

DCA changes only the RoPE positions of queries and keys: a key ``j`` is rotated once at ``j % s``; a query ``i`` at
``i % s`` against keys of its own chunk (intra), at ``min(i % s + s, C)`` against the previous chunk (succ), and at
``min(2s - 1, C)`` against older chunks (inter), with ``s = C - w`` (``C`` = ``chunk_size``, ``w`` = ``local_size``).
Attention stays full causal with ONE softmax per query over all its keys (the three-call LSE merge of ChunkLlama and
vLLM is the same number: ``tests/support/naive_dca.py`` has it, to test this one against).

Tensors: ``q`` (B, H, Lq, d) and ``k``, ``v`` (B, Hkv, Lk, d) before RoPE (``k``/``v`` hold every key of the
sequences, a cache's included); ``qpos`` (B, Lq), ``kpos`` (B, Lk) absolute positions (left padding: the first real
token is 0); ``kvalid`` (B, Lk) False for pad keys; ``qvalid`` (B, Lq) False for pad queries (their output is 0).
RoPE here is the NeoX/Llama layout over the first ``rotary_dim`` channels with the model's ``inv_freq`` and
``attention_factor``.
"""


import torch

from .dca_params import check_params

def positions(i: torch.Tensor, j: torch.Tensor, chunk_size: int, local_size: int):
    """RoPE positions ``(P_q, P_k)`` for query positions ``i`` and key positions ``j`` (broadcast), ``j <= i``."""
    s = chunk_size - local_size
    diff = i // s - j // s
    o_i = i % s
    succ = torch.clamp(o_i + s, max=chunk_size)
    pq = torch.where(diff == 0, o_i, torch.where(diff == 1, succ, torch.full_like(o_i, min(2 * s - 1, chunk_size))))
    return pq, j % s


def temperature(length: torch.Tensor | int, c_orig: int) -> torch.Tensor:
    """The logit multiplier ``T = m(L)^2``, ``m(L) = max(1, 0.1 ln(L / c_orig) + 1)`` (1 when ``c_orig`` is 0)."""
    length = torch.as_tensor(length, dtype=torch.float64)
    if not c_orig:
        return torch.ones_like(length)
    return torch.clamp(0.1 * torch.log(length / c_orig) + 1, min=1.0) ** 2


def rope_at(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0):
    """``x`` (..., L, d) rotated at integer positions ``pos`` (..., L); angles in fp32 (or fp64 for fp64 ``x``)."""
    rot = 2 * inv_freq.shape[0]
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    ang = pos.to(dtype)[..., None] * inv_freq.to(dtype)
    cos = torch.cat([ang.cos(), ang.cos()], -1) * attention_factor
    sin = torch.cat([ang.sin(), ang.sin()], -1) * attention_factor
    xr, rest = x[..., :rot].to(dtype), x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], -1)
    return torch.cat([(xr * cos + rotated * sin).to(x.dtype), rest], -1)


def rotate_keys(k, kpos, chunk_size, local_size, inv_freq, attention_factor=1.0):
    """Keys rotated once at ``j % s`` (what a DCA cache holds); ``kpos`` (B, Lk), pads may be any value."""
    s = chunk_size - local_size
    return rope_at(k, (kpos.clamp_min(0) % s)[:, None].expand(-1, k.shape[1], -1), inv_freq, attention_factor)


def temperature_per_sequence(kstart, k_len: int, c_orig: int) -> torch.Tensor:
    """``T = m(L_b)^2`` per sequence (float32), ``L_b`` = its keys after its ``kstart`` leading pads."""
    return temperature((k_len - kstart).clamp_min(1), c_orig).to(torch.float32)


def _batch_length(kpos, kvalid):
    """Tokens each sequence's pass sees (for the temperature): 1 + its largest real key position."""
    return (torch.where(kvalid, kpos, torch.full_like(kpos, -1)).amax(-1) + 1).clamp_min(1)


def _scores(q, k, qpos, kpos, chunk_size, local_size, inv_freq, scale, attention_factor, keys_rotated=False):
    """Per (query, key) DCA logits (B, H, Lq, Lk) in fp32 (fp64 for fp64 inputs), before masking: the query is
    rotated three times and each key once (``keys_rotated``: ``k`` already is, as a DCA cache holds it); the part of
    each pair picks which product counts."""
    s = chunk_size - local_size
    bsz, n_heads, q_len, head_dim = q.shape
    n_kv = k.shape[1]
    rep = n_heads // n_kv
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    o_i = qpos % s
    rot_pos = (o_i, torch.clamp(o_i + s, max=chunk_size), torch.full_like(o_i, min(2 * s - 1, chunk_size)))
    k_rot = k if keys_rotated else rope_at(k, (kpos % s)[:, None].expand(-1, n_kv, -1), inv_freq, attention_factor)
    k_rot = k_rot.to(dtype).repeat_interleave(rep, 1)
    parts = [torch.einsum("bhqd,bhkd->bhqk",
                          rope_at(q, p[:, None].expand(-1, n_heads, -1), inv_freq, attention_factor).to(dtype), k_rot)
             for p in rot_pos]
    diff = (qpos[:, :, None] // s - kpos[:, None, :] // s)[:, None]  # (B, 1, Lq, Lk)
    scores = torch.where(diff == 0, parts[0], torch.where(diff == 1, parts[1], parts[2]))
    return scores * scale, diff


def _visible(qpos, kpos, kvalid, qvalid):
    return (kpos[:, None, :] <= qpos[:, :, None]) & kvalid[:, None, :] & qvalid[:, :, None]  # (B, Lq, Lk)


def dca_attention_reference(q, k, v, qpos, kpos, kvalid, qvalid, chunk_size, local_size, inv_freq, scale,
                            c_orig=0, attention_factor=1.0, keys_rotated=False):
    """DCA with one softmax per query (key-vectorised twin of the spec's per-query loop,
    ``tests/support/naive_dca.py``); differentiable.
    ``keys_rotated``: ``k`` holds the keys already rotated at ``j % s`` (a DCA cache)."""
    check_params(chunk_size, local_size)
    scores, _ = _scores(q, k, qpos, kpos, chunk_size, local_size, inv_freq, scale, attention_factor, keys_rotated)
    t_mult = temperature(_batch_length(kpos, kvalid), c_orig).to(scores.dtype)[:, None, None, None]
    visible = _visible(qpos, kpos, kvalid, qvalid)[:, None]
    scores = (scores * t_mult).masked_fill(~visible, float("-inf"))
    # a pad query (or one with no visible key) has an all -inf row: its output is defined as 0, never NaN
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    rep = q.shape[1] // v.shape[1]
    out = torch.einsum("bhqk,bhkd->bhqd", probs, v.to(probs.dtype).repeat_interleave(rep, 1))
    return out.to(q.dtype)


def dca_attention_blocked(q, k, v, qpos, kpos, kvalid, qvalid, chunk_size, local_size, inv_freq, scale,
                          c_orig=0, attention_factor=1.0, keys_rotated=False, block=1024):
    """``dca_attention_reference`` for long inputs (a DCA model's path on CPU and under autograd) through torch's fused
    ``scaled_dot_product_attention``: no (queries x keys) score matrix in memory, and differentiable.

    The three rotations of a query sit side by side, ``q' = [q at o | q at min(o + s, C) | q at min(2s - 1, C)]``
    (3d wide), and each key ``k'`` holds its rotated key in the slot of its part (intra, succ, inter) and zeros in
    the other two, so ``q' . k'`` is the pair's DCA logit, exactly one product and adds of zero, and ONE softmax
    covers every part. A key's slot depends on the query's chunk, so query blocks never cross a chunk boundary of
    any row. ``v`` is zero-padded to 3d because SDPA's fused CPU kernel needs equal head dims (the extra output
    columns are dropped). Pad queries get one dummy visible key (no NaN, forwards or backwards), then output 0."""
    check_params(chunk_size, local_size)
    s = chunk_size - local_size
    bsz, n_heads, q_len, head_dim = q.shape
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if not keys_rotated:
        k = rope_at(k, (kpos % s)[:, None].expand(-1, k.shape[1], -1), inv_freq, attention_factor)
    k, v = k.to(dtype), v.to(dtype)
    o_i = qpos.clamp_min(0) % s
    rotations = (o_i, torch.clamp(o_i + s, max=chunk_size), torch.full_like(o_i, min(2 * s - 1, chunk_size)))
    wide_q = torch.cat([rope_at(q, r[:, None].expand(-1, n_heads, -1), inv_freq, attention_factor).to(dtype)
                        for r in rotations], -1)
    if c_orig:  # T multiplies the logits: folded into the queries
        wide_q = wide_q * temperature(_batch_length(kpos, kvalid), c_orig).to(dtype)[:, None, None, None]
    wide_v = torch.cat([v, v.new_zeros(v.shape[:-1] + (2 * head_dim,))], -1)
    q_chunk = torch.where(qvalid, qpos // s, -1)
    k_chunk = kpos.clamp_min(0) // s
    # a block starts where some row's real query is in another chunk than that row's previous real query
    cols = torch.arange(q_len, device=q.device)
    last_real = torch.where(qvalid, cols, -1).cummax(1).values
    prev_chunk = torch.where(last_real >= 0, q_chunk.gather(1, last_real.clamp_min(0)), -1)[:, :-1]
    starts = (qvalid[:, 1:] & (prev_chunk >= 0) & (q_chunk[:, 1:] != prev_chunk)).any(0)
    edges = [0, *(torch.nonzero(starts).flatten() + 1).tolist(), q_len]
    outs = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        for a in range(lo, hi, block):
            qp, qv = qpos[:, a:min(hi, a + block)], qvalid[:, a:min(hi, a + block)]
            n = qp.shape[1]
            reach = kvalid & (kpos <= torch.where(qv, qp, -1).amax(1, keepdim=True))
            if not bool(reach.any()):  # no real query here (or none sees a key): the output is 0
                outs.append(q.new_zeros(bsz, n_heads, n, head_dim, dtype=dtype))
                continue
            width = int(torch.nonzero(reach.any(0)).max()) + 1  # key columns any query of the block can see
            diff = q_chunk[:, a:a + n].amax(1, keepdim=True) - k_chunk[:, :width]  # (B, width); -1: no real query
            kw = k[:, :, :width]
            wide_k = torch.cat([torch.where(part[:, None, :, None], kw, 0.0)
                                for part in (diff == 0, diff == 1, diff >= 2)], -1)
            visible = (kpos[:, None, :width] <= qp[:, :, None]) & kvalid[:, None, :width] & qv[:, :, None]
            seen = visible.any(-1, keepdim=True)
            visible = visible | (~seen & (torch.arange(width, device=q.device) == 0))
            out = torch.nn.functional.scaled_dot_product_attention(
                wide_q[:, :, a:a + n], wide_k, wide_v[:, :, :width], attn_mask=visible[:, None], scale=scale,
                enable_gqa=True)[..., :head_dim]
            outs.append(torch.where(seen[:, None], out, 0.0))
    return torch.cat(outs, 2).to(q.dtype)


__all__ = ["check_params", "dca_attention_blocked", "dca_attention_reference", "positions", "rope_at", "rotate_keys",
           "temperature", "temperature_per_sequence"]
