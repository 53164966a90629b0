"""Triton kernels for one CCA decoding step against the compressed cache (see ``cache_cca.py``).

``cca_decode_attention_triton``: one query per sequence over its visible core tokens and raw ring slots,
split-K (each program reduces every n-th tile of the core and of the ring; a second kernel merges the partial
softmaxes) and GQA-packed (a program serves the ``r`` query heads of one KV head, so every
key and value is read once). Pooling ``query`` (one core token per query head) reads each head's own
core keys in the same tile. A verification pass of speculative decoding (a few tokens per sequence) runs as
one launch: a tile's rows are the heads of as many of its tokens as fit in 16 rows, which then read each key
once, and every token's numbers are those of its one-token step. Twin: ``cache_cca.cca_decode_attention_torch``.

``cca_decode_append_triton``: RoPE of the new q/k, writes the token into the ring buffers, records the
group middle's rotary tables and, for sequences whose group just completed, pools it into a core token.
Twin: the torch code of ``CCALayerCache._decode``.
"""

import torch
import triton
import triton.language as tl

from .rope_triton import eager_rope

_SM_COUNT = {}
EAGER_ROPE_DTYPES = (torch.bfloat16, torch.float32)  # whose eager RoPE rounding the append kernel reproduces exactly


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def _decode_partial_kernel(
    Q, CK, CV, WK, WV, NCORE, POS, LO, REAL, ACC, ML,
    s_qb, s_qt, s_qh, s_ckb, s_ckh, s_ckn, s_cvb, s_cvh, s_cvn, s_wkb, s_wkh, s_wkn, s_wvb, s_wvh, s_wvn, s_rb, s_rt,
    scale, n_kv, n_tok, n_tb, W, WL, n_splits, G, S,
    R: tl.constexpr, R_PAD: tl.constexpr, TPP: tl.constexpr, R_CORE: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr, DERIVE: tl.constexpr, HAS_REAL: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tb = pid % n_tb
    b = (pid // n_tb // n_kv).to(tl.int64)  # large batches: offsets past 2**31
    j = (pid // n_tb) % n_kv
    # A tile's rows are (token, head) pairs: the R query heads of KV head j for TPP of the pass's tokens. No tile's
    # extent depends on the pass, and a tensor-core product rounds a row alike whatever the other rows (the wrapper
    # keeps TPP = 1 where that does not hold): a pass's token gets the bits of the one-token step it stands for.
    rows = tl.arange(0, R_PAD)
    tok = tb * TPP + rows // R
    head = rows % R
    rmask = (rows < TPP * R) & (tok < n_tok)
    heads = j * R + head
    dd = tl.arange(0, D)
    cols = tl.arange(0, BLOCK_N)
    q = tl.load(Q + b * s_qb + tok[:, None] * s_qt + heads[:, None] * s_qh + dd[None, :], mask=rmask[:, None], other=0.0)
    q = q.to(CK.dtype.element_ty)
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full([R_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    acc = tl.zeros([R_PAD, D], tl.float32)

    # each row's position: the sequence's count of seen tokens plus the pass's real tokens before it
    if HAS_REAL:
        off = tl.zeros([R_PAD], tl.int32)
        for i in range(0, n_tok - 1):
            real_i = (tl.load(REAL + b * s_rb + i * s_rt) != 0).to(tl.int32)
            off += tl.where(tok > i, real_i, 0)
    else:
        off = tok
    t = tl.load(POS + b).to(tl.int32) + off
    if DERIVE:  # CCA's own visibility: the complete groups before the local window, raw keys from the next group on
        n_core = tl.maximum(t + 1 - S, 0) // G
        lo = n_core * G
    else:
        n_core = tl.load(NCORE + b).to(tl.int32) + tl.zeros([R_PAD], tl.int32)
        lo = tl.load(LO + b).to(tl.int32) + tl.zeros([R_PAD], tl.int32)

    # Core tokens, in tiles of BN_C: tile cb in split cb mod n_splits, so that the splits share the core evenly
    # however many slots the cache holds, and a token's tiles do not depend on the pass. Pooling "query": a tile
    # holds BN_C tokens of each of the R heads, row h*BN_C + n; each query row only keeps its own head's columns.
    BN_C: tl.constexpr = BLOCK_N // R_CORE
    col_head = cols // BN_C
    col_tok = cols % BN_C
    c1 = tl.max(tl.where(rmask, n_core, 0), 0)
    for cb in range(split, tl.cdiv(c1, BN_C), n_splits):
        ctok = cb * BN_C + col_tok
        valid = ctok < c1
        if R_CORE == 1:
            kh = j
        else:
            kh = j * R + col_head
            valid = valid & (col_head < R)
        k = tl.load(CK + b * s_ckb + (kh * s_ckh + ctok * s_ckn)[:, None] + dd[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        ok = valid[None, :] & (ctok[None, :] < n_core[:, None])
        if R_CORE > 1:
            ok = ok & (col_head[None, :] == head[:, None])
        sc = tl.where(ok, sc * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(CV + b * s_cvb + (kh * s_cvh + ctok * s_cvn)[:, None] + dd[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # Raw keys: a row sees positions [max(t - WL + 1, lo, 0), t]; position p sits in ring slot p mod W. Tiles are
    # blocks of BLOCK_N absolute positions, block kb in split kb mod n_splits: the same tiles, splits and order for
    # a token whether it is decoded alone or in a pass (a block or core tile a row does not see leaves its numbers
    # exactly as they were), and for a ring with the speculative slack (W > WL) as for one without.
    vis_lo = tl.maximum(tl.maximum(t - (WL - 1), lo), 0)
    p_lo = tl.min(tl.where(rmask, vis_lo, 2147483647), 0)
    p_hi = tl.max(tl.where(rmask, t, -1), 0)
    kb0 = p_lo // BLOCK_N
    first = kb0 + ((split - kb0) % n_splits + n_splits) % n_splits
    for kb in range(first, p_hi // BLOCK_N + 1, n_splits):
        spos = kb * BLOCK_N + cols
        slot = spos % W
        valid = (spos >= p_lo) & (spos <= p_hi)
        k = tl.load(WK + b * s_wkb + j * s_wkh + slot[:, None] * s_wkn + dd[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        ok = (spos[None, :] >= vis_lo[:, None]) & (spos[None, :] <= t[:, None])
        sc = tl.where(ok, sc * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(WV + b * s_wvb + j * s_wvh + slot[:, None] * s_wvn + dd[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    row = ((b * n_tok + tok) * (n_kv * R) + heads) * n_splits + split  # ACC (B*n*H, S, D), ML (B*n*H, S, 2)
    tl.store(ACC + row[:, None] * D + dd[None, :], acc, mask=rmask[:, None])
    tl.store(ML + row * 2, m_i, mask=rmask)
    tl.store(ML + row * 2 + 1, l_i, mask=rmask)


@triton.jit
def _decode_combine_kernel(ACC, ML, OUT, POS, REAL, s_rb, s_rt, n_heads, n_tok, n_splits, S_PAD: tl.constexpr,
                           D: tl.constexpr, ADVANCE: tl.constexpr, HAS_REAL: tl.constexpr):
    pid = tl.program_id(0)  # (b * n_tok + i) * H + h; OUT is (B, n_tok, H, D) contiguous
    if ADVANCE:  # count the pass's real tokens into POS: every program of the first kernel has read it
        if pid % (n_heads * n_tok) == 0:
            b = pid // (n_heads * n_tok)
            if HAS_REAL:
                step = n_tok * 0
                for i in range(0, n_tok):
                    step += (tl.load(REAL + b * s_rb + i * s_rt) != 0).to(tl.int32)
            else:
                step = n_tok
            tl.store(POS + b, tl.load(POS + b) + step)
    ss = tl.arange(0, S_PAD)
    dd = tl.arange(0, D)
    smask = ss < n_splits
    m = tl.load(ML + (pid * n_splits + ss) * 2, mask=smask, other=float("-inf"))
    l = tl.load(ML + (pid * n_splits + ss) * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    denom = tl.sum(w * l, 0)
    acc = tl.load(ACC + (pid * n_splits + ss)[:, None] * D + dd[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(w[:, None] * acc, 0) / denom
    tl.store(OUT + pid * D + dd, out.to(OUT.dtype.element_ty))


def _as_loadable(real):
    return real.view(torch.uint8) if real.dtype == torch.bool else real  # (triton reads a 1-bit pointer as bytes)


def cca_decode_attention_triton(q, core_k, core_v, n_core, win_k, win_v, pos, win_lo, scale, num_splits=None, block_n=64,
                                group_size=None, local_window=None, advance=None):
    """Same contract as ``cache_cca.cca_decode_attention_torch``: ``q`` (B, H, d) one query per sequence at ``pos``;
    returns (B, H, d) in ``q.dtype``. With ``n_core`` and ``win_lo`` None the kernel derives them from ``pos``,
    ``group_size`` and ``local_window`` (CCA's visibility); then ``q`` may also be (B, n, H, d): the n tokens of a
    verification pass, each at ``pos`` plus the pass's real tokens before it, whose keys the ring already holds
    (returns (B, n, H, d): each token's output bit for bit that of its one-token call). ``advance`` (True, or the
    pass's (B,) / (B, n) 0/1 of real tokens, any dtype and strides): then the real tokens are added to ``pos`` in
    place, after every read of it (the cache's count of seen tokens, without a launch of its own)."""
    derive = n_core is None
    if advance is not None and not derive:
        raise ValueError("advance counts the token into pos: only with the visibility derived from pos")
    one = q.dim() == 3
    if not one and not derive:
        raise ValueError("several tokens per row: only with the visibility derived from pos")
    q = q[:, None] if one else q
    bsz, n_tok, n_heads, head_dim = q.shape
    n_kv, window = win_k.shape[1], win_k.shape[2]
    # the positions a query may see raw: s + g - 1 (a ring with the cache's speculative slack holds more)
    visible = min(window, local_window + group_size - 1) if derive else window
    n_core_slots = core_k.shape[2]
    rep = n_heads // n_kv
    query_pool = core_k.shape[1] != n_kv
    r_core = _next_pow2(rep) if query_pool else 1
    block_n = max(block_n, 16 * r_core)
    bn_core = block_n // r_core
    q, core_k, core_v, win_k, win_v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, core_k, core_v, win_k, win_v))
    if num_splits is None:  # (never from the pass's length: a pass splits as its one-token steps do)
        if q.is_cuda:
            dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
            if dev not in _SM_COUNT:
                _SM_COUNT[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
            target = 2 * _SM_COUNT[dev]
        else:
            target = 8
        useful = max(1, triton.cdiv(n_core_slots, 4 * bn_core), triton.cdiv(visible, block_n))
        num_splits = max(1, min(triton.cdiv(target, bsz * n_kv), useful, 128))
    real = _as_loadable(advance) if isinstance(advance, torch.Tensor) else None
    if real is not None and real.dim() == 1:
        real = real[:, None]
    r_pad = max(16, _next_pow2(rep))
    # Tokens per tile: as many as fit. A tensor-core product rounds a row alike wherever it sits in the tile
    # (tests/kernels/test_cca_decode_triton.py checks the bits on a GPU); NumPy's matmul, the interpreter's tl.dot, does not:
    # there each token keeps the rows of its one-token call.
    tpp = r_pad // rep if q.is_cuda else 1
    n_tb = triton.cdiv(n_tok, tpp)
    acc = torch.empty(bsz * n_tok * n_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
    ml = torch.empty(bsz * n_tok * n_heads, num_splits, 2, device=q.device, dtype=torch.float32)
    s_rb, s_rt = real.stride() if real is not None else (0, 0)
    _decode_partial_kernel[(bsz * n_kv * n_tb, num_splits)](
        q, core_k, core_v, win_k, win_v, pos if derive else n_core, pos, pos if derive else win_lo,
        pos if real is None else real, acc, ml,
        q.stride(0), q.stride(1), q.stride(2), core_k.stride(0), core_k.stride(1), core_k.stride(2),
        core_v.stride(0), core_v.stride(1), core_v.stride(2), win_k.stride(0), win_k.stride(1), win_k.stride(2),
        win_v.stride(0), win_v.stride(1), win_v.stride(2), s_rb, s_rt,
        scale, n_kv, n_tok, n_tb, window, visible, num_splits, group_size or 1, local_window or 1,
        R=rep, R_PAD=r_pad, TPP=tpp, R_CORE=r_core, D=head_dim, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, DERIVE=derive, HAS_REAL=real is not None, num_warps=4,
    )
    out = torch.empty(bsz, n_tok, n_heads, head_dim, device=q.device, dtype=q.dtype)
    _decode_combine_kernel[(bsz * n_tok * n_heads,)](acc, ml, out, pos, pos if real is None else real, s_rb, s_rt, n_heads,
                                                     n_tok, num_splits, S_PAD=_next_pow2(num_splits), D=head_dim,
                                                     ADVANCE=advance is not None, HAS_REAL=real is not None,
                                                     num_warps=4)
    return out[:, 0] if one else out


@triton.jit
def _append_pool_kernel(
    Q, K, V, COS, SIN, REAL, SEEN, QROT, WK, WV, GK, MIDC, MIDS, CK, CV,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_cb, s_ct, s_sb, s_st, s_real, s_rt, s_ob, s_ot,
    s_wkb, s_wkh, s_wkn, s_wvb, s_wvh, s_wvn, s_gb, s_gh, s_gn,
    s_ckb, s_ckh, s_ckn, s_cvb, s_cvh, s_cvn,
    scale, n_kv, n_tok, W, G, GW, M,
    R: tl.constexpr, R_P: tl.constexpr, D: tl.constexpr, G_P: tl.constexpr, QUERY_POOL: tl.constexpr,
    ROTATED: tl.constexpr, HAS_REAL: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // n_kv).to(tl.int64)  # large batches: offsets past 2**31
    j = pid % n_kv
    HALF: tl.constexpr = D // 2
    dd = tl.arange(0, D)
    rot = (dd + HALF) % D
    sign = tl.where(dd < HALF, -1.0, 1.0)  # rotate_half(x)[d] = sign[d] * x[rot[d]]
    rr = tl.arange(0, R_P)
    rmask = rr < R
    heads = j * R + rr
    t = tl.load(SEEN + b).to(tl.int32)
    # The tables of the last group middle this program appended: a pass's later token that completes the group reads
    # them here, not from MIDC, which program j == 0 writes (no order between programs within a launch).
    held = t * 0 - 1
    mc_held = tl.zeros([D], tl.float32)
    ms_held = tl.zeros([D], tl.float32)
    # a pass's tokens one after another, each exactly as a one-token launch (the barrier: the next token's pooling
    # reads ring slots that other threads of this program wrote)
    for i in range(0, n_tok):
        if HAS_REAL:
            real = tl.load(REAL + b * s_real + i * s_rt) != 0
        else:
            real = t >= 0
        _append_one(Q + b * s_qb + i * s_qt, K + b * s_kb + i * s_kt, V + b * s_vb + i * s_vt, COS + b * s_cb + i * s_ct,
                    SIN + b * s_sb + i * s_st, QROT + b * s_ob + i * s_ot, WK, WV, GK, MIDC, MIDS, CK, CV, real, t, b, j,
                    held, mc_held, ms_held, s_qh, s_kh, s_vh, s_wkb, s_wkh, s_wkn, s_wvb, s_wvh, s_wvn, s_gb, s_gh, s_gn,
                    s_ckb, s_ckh, s_ckn, s_cvb, s_cvh, s_cvn, scale, W, G, GW, M, rr, rmask, heads, dd, rot, sign,
                    R, D, G_P, QUERY_POOL, ROTATED)
        mid_here = real & ((t % G) == (G // 2))
        held = tl.where(mid_here, t // G, held)
        mc_held = tl.where(mid_here, tl.load(COS + b * s_cb + i * s_ct + dd).to(MIDC.dtype.element_ty).to(tl.float32),
                           mc_held)
        ms_held = tl.where(mid_here, tl.load(SIN + b * s_sb + i * s_st + dd).to(MIDS.dtype.element_ty).to(tl.float32),
                           ms_held)
        t += real.to(tl.int32)
        tl.debug_barrier()


@triton.jit
def _append_one(Q, K, V, COS, SIN, QROT, WK, WV, GK, MIDC, MIDS, CK, CV, real, t, b, j, held, mc_held, ms_held,
                s_qh, s_kh, s_vh, s_wkb, s_wkh, s_wkn, s_wvb, s_wvh, s_wvn, s_gb, s_gh, s_gn,
                s_ckb, s_ckh, s_ckn, s_cvb, s_cvh, s_cvn, scale, W, G, GW, M, rr, rmask, heads, dd, rot, sign,
                R: tl.constexpr, D: tl.constexpr, G_P: tl.constexpr, QUERY_POOL: tl.constexpr, ROTATED: tl.constexpr):
    """One token of sequence ``b``, KV head ``j``, at position ``t`` (its pointers already at the token)."""
    c = tl.load(COS + dd).to(tl.float32)
    s = tl.load(SIN + dd).to(tl.float32)
    dt = WK.dtype.element_ty

    k_in = tl.load(K + j * s_kh + dd)
    k_in_r = tl.load(K + j * s_kh + rot)  # the same vector at rotate_half's indices
    if ROTATED:  # post-RoPE q/k (the family's RoPE, attention scaling included): undo it for the pre-RoPE keys
        c_r = tl.load(COS + rot).to(tl.float32)
        s_r = tl.load(SIN + rot).to(tl.float32)
        if ROTATED == 2:  # pre-RoPE, rotated here as the family would have: then exactly the post-RoPE path
            k_in, k_in_r = eager_rope(k_in, k_in_r, c, s, sign), eager_rope(k_in_r, k_in, c_r, s_r, -sign)
        kf, kf_r = k_in.to(tl.float32), k_in_r.to(tl.float32)
        k = ((kf * c - sign * kf_r * s) / (c * c + s * s)).to(K.dtype.element_ty)
        k_r = ((kf_r * c_r + sign * kf * s_r) / (c_r * c_r + s_r * s_r)).to(K.dtype.element_ty)
        k_rot = k_in.to(dt)
    else:
        k, k_r = k_in, k_in_r
        k_rot = (k.to(tl.float32) * c + k_r.to(tl.float32) * sign * s).to(dt)
    v = tl.load(V + j * s_vh + dd)
    qp = Q + heads[:, None] * s_qh
    if ROTATED == 1:
        q_rot = tl.load(qp + dd[None, :], mask=rmask[:, None], other=0.0).to(QROT.dtype.element_ty)
    elif ROTATED == 2:
        q_rot = eager_rope(tl.load(qp + dd[None, :], mask=rmask[:, None], other=0.0),
                            tl.load(qp + rot[None, :], mask=rmask[:, None], other=0.0),
                            c[None, :], s[None, :], sign[None, :]).to(QROT.dtype.element_ty)
    else:
        q_rot = tl.load(qp + dd[None, :], mask=rmask[:, None], other=0.0).to(tl.float32) * c[None, :]
        q_rot += tl.load(qp + rot[None, :], mask=rmask[:, None], other=0.0).to(tl.float32) * (sign * s)[None, :]
        q_rot = q_rot.to(QROT.dtype.element_ty)
    tl.store(QROT + heads[:, None] * D + dd[None, :], q_rot, mask=rmask[:, None])

    lim = tl.where(real, D, 0)
    on = dd < lim  # (a vector mask: the interpreter rejects scalar & vector masks)
    tl.store(WK + b * s_wkb + j * s_wkh + (t % W) * s_wkn + dd, k_rot, mask=on)
    tl.store(WV + b * s_wvb + j * s_wvh + (t % W) * s_wvn + dd, v, mask=on)
    tl.store(GK + b * s_gb + j * s_gh + (t % GW) * s_gn + dd, k, mask=on)
    cur_mid = (t % G) == (G // 2)
    on_mid = dd < tl.where(cur_mid & (j == 0), lim, 0)
    mid = b * M * D + ((t // G) % M) * D + dd  # the group middle's tables: ring of M groups
    tl.store(MIDC + mid, c.to(MIDC.dtype.element_ty), mask=on_mid)
    tl.store(MIDS + mid, s.to(MIDS.dtype.element_ty), mask=on_mid)

    if real & ((t % G) == G - 1):  # this token completes group t // G: pool it
        if cur_mid:  # the middle is this very position (g <= 2)
            mc, ms = c, s
        else:
            mine = held == t // G  # appended earlier in this launch
            mc = tl.where(mine, mc_held, tl.load(MIDC + mid).to(tl.float32))
            ms = tl.where(mine, ms_held, tl.load(MIDS + mid).to(tl.float32))
        gi = tl.arange(0, G_P)
        old = gi < G - 1
        cur = (gi == G - 1)[:, None]
        gpos = t - (G - 1) + gi
        wsl = (gpos % W)[:, None] * s_wkn
        kr_g = tl.load(WK + b * s_wkb + j * s_wkh + wsl + dd[None, :], mask=old[:, None], other=0.0)
        kr_g = tl.where(cur, k_rot[None, :], kr_g).to(tl.float32)
        v_g = tl.load(WV + b * s_wvb + j * s_wvh + (gpos % W)[:, None] * s_wvn + dd[None, :], mask=old[:, None], other=0.0)
        v_g = tl.where(cur, v[None, :], v_g).to(tl.float32)
        gp = GK + b * s_gb + j * s_gh + (gpos % GW)[:, None] * s_gn
        kp_g = tl.where(cur, k[None, :], tl.load(gp + dd[None, :], mask=old[:, None], other=0.0)).to(tl.float32)
        kq_g = tl.where(cur, k_r[None, :], tl.load(gp + rot[None, :], mask=old[:, None], other=0.0))
        kq_g = kq_g.to(tl.float32) * sign[None, :]  # rotate_half of the pre-RoPE keys (RoPE is linear)
        logits = tl.sum(q_rot.to(tl.float32)[:, None, :] * kr_g[None, :, :], 2) * scale  # (R_P, G_P)
        gvalid = (gi < G)[None, :]
        slot = t // G
        if QUERY_POOL:
            logits = tl.where(gvalid, tl.where(rmask[:, None], logits, 0.0), float("-inf"))
            w = tl.exp(logits - tl.max(logits, 1)[:, None])
            w = w / tl.sum(w, 1)[:, None]
            kc = tl.sum(w[:, :, None] * kp_g[None, :, :], 1)
            kc_r = tl.sum(w[:, :, None] * kq_g[None, :, :], 1)
            vc = tl.sum(w[:, :, None] * v_g[None, :, :], 1)
            kc = kc * mc[None, :] + kc_r * ms[None, :]
            tl.store(CK + b * s_ckb + heads[:, None] * s_ckh + slot * s_ckn + dd[None, :], kc.to(CK.dtype.element_ty), mask=rmask[:, None])
            tl.store(CV + b * s_cvb + heads[:, None] * s_cvh + slot * s_cvn + dd[None, :], vc.to(CV.dtype.element_ty), mask=rmask[:, None])
        else:
            a = tl.sum(tl.where(rmask[:, None], logits, 0.0), 0) / R
            a = tl.where(gi < G, a, float("-inf"))
            w = tl.exp(a - tl.max(a, 0))
            w = w / tl.sum(w, 0)
            kc = tl.sum(w[:, None] * kp_g, 0)
            kc_r = tl.sum(w[:, None] * kq_g, 0)
            vc = tl.sum(w[:, None] * v_g, 0)
            kc = kc * mc + kc_r * ms
            tl.store(CK + b * s_ckb + j * s_ckh + slot * s_ckn + dd, kc.to(CK.dtype.element_ty))
            tl.store(CV + b * s_cvb + j * s_cvh + slot * s_cvn + dd, vc.to(CV.dtype.element_ty))


def cca_decode_append_triton(q, k, v, cos, sin, real, seen, win_k, win_v, grp_k, mid_cos, mid_sin, core_k, core_v, group_size, scale,
                             rotated=False):
    """One decoding step's cache update, in place. ``q`` (B, H, d), ``k``/``v`` (B, Hkv, d) pre-RoPE (``rotated``: after
    the family's RoPE, as transformers' attention modules hand them over; the kernel undoes it for the pre-RoPE keys
    pooling needs; ``"eager"``: pre-RoPE, rotated here with the roundings of the family's eager RoPE in q's dtype,
    then as ``True``: the state of a step that got transformers' rotated tensors, without their launches);
    ``cos``/``sin`` (B, d) of the new position ``seen`` (B,); ``real`` (B,) whether the token is not padding (None:
    all are; any 0/1 dtype and stride: an attention-mask column as it is). Writes ring slots and, where group
    ``seen // g`` completes, its core token. Returns RoPE'd ``q``. The rings may be longer than needed (the cache's
    speculative slack): ``win_k/v`` and ``grp_k`` are indexed by position modulo their length, ``mid_cos/sin`` (B, d)
    or (B, M, d), contiguous, hold the middles' tables of M groups (slot ``group % M``).
    A verification pass's n tokens in one launch, each exactly as its one-token launch: ``q`` (B, H, n, d), ``k``/``v``
    (B, Hkv, n, d), ``cos``/``sin`` (B, n, d), ``real`` (B, n) or None; token i at ``seen`` plus the pass's real
    tokens before it (``seen`` itself is left to the attention to advance). Returns (B, n, H, d).
    """
    if rotated == "eager" and q.dtype not in EAGER_ROPE_DTYPES:
        raise ValueError(f"rotated='eager' emulates RoPE's rounding in {EAGER_ROPE_DTYPES}, not {q.dtype}")
    one = q.dim() == 3
    if one:
        q, k, v, cos, sin = q[:, :, None], k[:, :, None], v[:, :, None], cos[:, None], sin[:, None]
    bsz, n_heads, n_tok, head_dim = q.shape
    n_kv = k.shape[1]
    rep = n_heads // n_kv
    q, k, v, cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, cos, sin))
    q_rot = torch.empty(bsz, n_tok, n_heads, head_dim, device=q.device, dtype=q.dtype)
    has_real = real is not None
    real = seen[:, None] if real is None else _as_loadable(real)  # (not read without has_real)
    real = real[:, None] if real.dim() == 1 else real
    _append_pool_kernel[(bsz * n_kv,)](
        q, k, v, cos, sin, real, seen, q_rot, win_k, win_v, grp_k, mid_cos, mid_sin, core_k, core_v,
        q.stride(0), q.stride(2), q.stride(1), k.stride(0), k.stride(2), k.stride(1), v.stride(0), v.stride(2), v.stride(1),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), real.stride(0), real.stride(1),
        q_rot.stride(0), q_rot.stride(1),
        win_k.stride(0), win_k.stride(1), win_k.stride(2), win_v.stride(0), win_v.stride(1), win_v.stride(2),
        grp_k.stride(0), grp_k.stride(1), grp_k.stride(2),
        core_k.stride(0), core_k.stride(1), core_k.stride(2), core_v.stride(0), core_v.stride(1), core_v.stride(2),
        scale, n_kv, n_tok, win_k.shape[2], group_size, grp_k.shape[2], mid_cos.shape[1] if mid_cos.dim() == 3 else 1,
        R=rep, R_P=_next_pow2(rep), D=head_dim, G_P=_next_pow2(group_size), QUERY_POOL=core_k.shape[1] != n_kv,
        ROTATED={False: 0, True: 1, "eager": 2}[rotated], HAS_REAL=has_real, num_warps=4,
    )
    return q_rot[:, 0] if one else q_rot
