"""PyTorch reference for Core Context Aware (CCA) attention.

This is the ground truth every kernel is tested against. It follows CCA-SPEC.md to the letter:
groups of ``g`` positions are pooled into one core token each (weights from the group's last
query), and every query attends, in ONE softmax, to the core tokens of the ``n(t)`` oldest
complete groups plus the raw keys of positions ``[n(t)*g, t]``, with
``n(t) = max(0, floor((t + 1 - s) / g))``.

Memory is O(L^2): fine for tests and CPU inference, the Triton kernel is the fast path.
Shapes: ``q`` is (B, H, L, d); ``k`` and ``v`` are (B, Hkv, L, d), ``H = r * Hkv``. ``q`` and ``k`` are
given *before* RoPE; ``cos``/``sin`` are the model's rotary tables for positions ``0 .. L-1``,
shaped (L, d) or (B, L, d) (``rotate_half`` convention, as in transformers' Llama).
"""

import torch

from .cca_params import check_args


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, heads, L, d) with tables (L, d) or (B, L, d)."""
    if cos.dim() == 3:  # per-sequence tables broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def unapply_rope(x_rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` back from ``apply_rope(x, cos, sin)``, in fp32: each pair (i, i + d/2) un-rotated by the inverse of its
    2x2 matrix ``[[c1, -s1], [s2, c2]]``, so scaled tables (YaRN's attention factor) divide out too."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    (c1, c2), (s1, s2), (x1, x2) = (t.float().chunk(2, dim=-1) for t in (cos, sin, x_rot))
    det = c1 * c2 + s1 * s2
    return torch.cat(((x1 * c2 + x2 * s1) / det, (x2 * c1 - x1 * s2) / det), dim=-1)


def check_given(q, k, q_rot, k_rot) -> None:
    if (q is None and q_rot is None) or (k is None and k_rot is None):
        raise ValueError("pass q (before RoPE) or q_rot, and k (before RoPE) or k_rot")


def check_chunk_args(q_rot: torch.Tensor, k_raw: torch.Tensor, key_lead: int, group_size: int,
                     local_window: int) -> None:
    """The chunk entries' shared contract: raw keys are the ``key_lead >= s + g - 1`` positions before the chunk
    (every one a query of it may see raw), then the chunk's own columns."""
    check_args(group_size, local_window, "kv")
    if key_lead < local_window + group_size - 1:
        raise ValueError(f"key_lead must cover the s + g - 1 = {local_window + group_size - 1} positions before the "
                         f"chunk that its queries may see raw, got {key_lead}")
    if k_raw.shape[2] != key_lead + q_rot.shape[2]:
        raise ValueError(f"k_raw must hold the {key_lead} positions before the chunk and its {q_rot.shape[2]} columns, "
                         f"got {k_raw.shape[2]}")


def visible_core_count(t: torch.Tensor, group_size: int, local_window: int) -> torch.Tensor:
    """n(t): how many core tokens (oldest groups) the query at position t sees."""
    return torch.div(t + 1 - local_window, group_size, rounding_mode="floor").clamp_min(0)


def pool_core_tokens(
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    group_size: int,
    pooling: str = "kv",
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Globality-aware pooling of every complete group (spec: "Groups and core tokens").

    ``q_rot``/``k_rot`` are post-RoPE (they give the pooling weights), ``k`` is pre-RoPE (it is
    pooled, then rotated at the group's middle position ``p*g + g//2``); None: ``unapply_rope(k_rot)``.
    Returns ``(K_core, V_core)`` shaped (B, C, P, d) with ``P = L // g`` and ``C = H`` (pooling
    ``query``) or ``Hkv`` (``kv``).
    """
    bsz, n_heads, seq_len, head_dim = q_rot.shape
    n_kv = v.shape[1]
    rep = n_heads // n_kv
    g = group_size
    n_groups = seq_len // g
    scale = head_dim**-0.5 if scale is None else scale
    n_core_heads = n_heads if pooling == "query" else n_kv
    if n_groups == 0:
        empty = q_rot.new_zeros(bsz, n_core_heads, 0, head_dim)
        return empty, empty.clone()

    end = n_groups * g
    # Last query of each group, split per KV head: (B, Hkv, r, P, d).
    q_last = q_rot[:, :, g - 1 : end : g].float().view(bsz, n_kv, rep, n_groups, head_dim)
    k_rot_g = k_rot[:, :, :end].float().view(bsz, n_kv, n_groups, g, head_dim)
    logits = torch.einsum("bjrpd,bjpgd->bjrpg", q_last, k_rot_g) * scale
    if pooling == "kv":
        logits = logits.mean(dim=2, keepdim=True)  # one weight vector per KV head, shared by its r queries
    weights = logits.softmax(dim=-1)  # (B, Hkv, r or 1, P, g), fp32

    k = unapply_rope(k_rot[:, :, :end], cos[..., :end, :], sin[..., :end, :]) if k is None else k[:, :, :end].float()
    k_g = k.view(bsz, n_kv, n_groups, g, head_dim)
    v_g = v[:, :, :end].float().view(bsz, n_kv, n_groups, g, head_dim)
    k_core = torch.einsum("bjrpg,bjpgd->bjrpd", weights, k_g).reshape(bsz, n_core_heads, n_groups, head_dim)
    v_core = torch.einsum("bjrpg,bjpgd->bjrpd", weights, v_g).reshape(bsz, n_core_heads, n_groups, head_dim)

    middle = torch.arange(n_groups, device=v.device) * g + g // 2
    cos_m, sin_m = cos[..., middle, :].float(), sin[..., middle, :].float()
    k_core = apply_rope(k_core, cos_m, sin_m)
    return k_core.to(k_rot.dtype), v_core.to(v.dtype)


def cca_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    group_size: int,
    local_window: int,
    pooling: str = "kv",
    scale: float | None = None,
    return_core: bool = False,
    q_rot: torch.Tensor | None = None,
    k_rot: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CCA attention over whole sequences (no cache). Returns (B, H, L, d) in ``q.dtype``; with
    ``return_core`` also the pooled ``(K_core, V_core)`` of ``pool_core_tokens`` (what a KV cache keeps).
    ``q_rot``/``k_rot``: q and k already rotated with these tables (a model's own RoPE), used as given; ``q`` may then
    be None, and ``k`` (pre-RoPE: what is pooled) too, for ``unapply_rope(k_rot)``."""
    check_args(group_size, local_window, pooling)
    check_given(q, k, q_rot, k_rot)
    q_rot = apply_rope(q, cos, sin) if q_rot is None else q_rot
    k_rot = apply_rope(k, cos, sin) if k_rot is None else k_rot
    bsz, n_heads, seq_len, head_dim = q_rot.shape
    rep = n_heads // v.shape[1]
    scale = head_dim**-0.5 if scale is None else scale

    core = pool_core_tokens(q_rot, k_rot, k, v, cos, sin, group_size, pooling, scale)
    k_core, v_core = core
    if k_core.shape[1] != n_heads:  # pooling "kv": each core token serves its r query heads
        k_core, v_core = k_core.repeat_interleave(rep, 1), v_core.repeat_interleave(rep, 1)
    k_raw, v_raw = k_rot.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    pos = torch.arange(seq_len, device=v.device)
    n_vis = visible_core_count(pos, group_size, local_window)  # (L,)
    raw_ok = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= n_vis[:, None] * group_size)
    core_ok = torch.arange(k_core.shape[2], device=v.device)[None, :] < n_vis[:, None]

    qf = q_rot.float()
    scores = torch.cat(
        (
            (qf @ k_core.float().transpose(-1, -2) * scale).masked_fill(~core_ok, float("-inf")),
            (qf @ k_raw.float().transpose(-1, -2) * scale).masked_fill(~raw_ok, float("-inf")),
        ),
        dim=-1,
    )
    probs = scores.softmax(dim=-1)  # one softmax over core tokens ++ local keys
    out = (probs @ torch.cat((v_core, v_raw), dim=2).float()).to(q_rot.dtype)
    return (out, *core) if return_core else out


def cca_chunk_attention_reference(
    q_rot: torch.Tensor,
    k_raw: torch.Tensor,
    v_raw: torch.Tensor,
    core_k: torch.Tensor,
    core_v: torch.Tensor,
    q_pos: torch.Tensor,
    key_lead: int,
    group_size: int,
    local_window: int,
    scale: float,
    block: int = 2048,
) -> torch.Tensor:
    """CCA attention of a chunk of queries whose row ``b`` starts at position ``q_pos[b]`` (a chunk after a prefill,
    from a KV cache's compressed state).

    ``q_rot`` (B, H, n, d): query ``i`` at position ``t = q_pos[b] + i``. ``k_raw``/``v_raw`` (B, Hkv, key_lead + n,
    d): rotated keys and values, column ``u`` at position ``q_pos[b] - key_lead + u`` (the ``key_lead >= s + g - 1``
    positions before the chunk, then the chunk: every raw key a query of the chunk sees; columns of negative positions
    are never read). ``core_k``/``core_v`` (B, C, P, d): core token ``p`` of group ``p``; query ``t`` sees ``p < n(t)``
    (slots past the last complete group are never read). Same semantics as ``cca_attention_reference`` for those
    queries. SDPA in ``q_rot.dtype`` over ``block`` queries at a time (bounds the visibility mask).
    """
    check_chunk_args(q_rot, k_raw, key_lead, group_size, local_window)
    n_heads, n = q_rot.shape[1:3]
    n_core_slots = core_k.shape[2]

    def per_head(x):  # pooling "kv" (and the raw keys) share a KV head's keys among its r heads
        return (x if x.shape[1] == n_heads else x.repeat_interleave(n_heads // x.shape[1], 1)).to(q_rot.dtype)

    keys = torch.cat((per_head(core_k), per_head(k_raw)), 2)
    vals = torch.cat((per_head(core_v), per_head(v_raw)), 2)
    t = q_pos[:, None] + torch.arange(n, device=q_rot.device)  # (B, n)
    n_vis = visible_core_count(t, group_size, local_window)
    key_pos = (q_pos[:, None] - key_lead) + torch.arange(k_raw.shape[2], device=q_rot.device)  # (B, key_lead + n)
    slots = torch.arange(n_core_slots, device=q_rot.device)
    out = []
    for i in range(0, n, block):
        tb, nb = t[:, i : i + block, None], n_vis[:, i : i + block, None]
        ok = torch.cat((slots[None, None] < nb, (key_pos[:, None] >= nb * group_size) & (key_pos[:, None] <= tb)), -1)
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q_rot[:, :, i : i + block], keys, vals, attn_mask=ok[:, None], scale=scale))
    return torch.cat(out, 2)
