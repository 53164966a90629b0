"""Triton kernels for one CCA decoding step against the compressed cache (see ``cache_cca.py``).

``cca_decode_attention_triton``: one query per sequence over its visible core tokens and raw ring slots,
split-K (each program reduces one slice of the core and one slice of the ring; a second kernel merges
the partial softmaxes) and GQA-packed (a program serves the ``r`` query heads of one KV head, so every
key and value is read once). Pooling ``query`` (one core token per query head) reads each head's own
core keys in the same tile. Twin: ``cache_cca.cca_decode_attention_torch``.

``cca_decode_append_triton``: RoPE of the new q/k, writes the token into the ring buffers, records the
group middle's rotary tables and, for sequences whose group just completed, pools it into a core token.
Twin: the torch code of ``CCALayerCache._decode``.
"""

import torch
import triton
import triton.language as tl

_SM_COUNT = {}
EAGER_ROPE_DTYPES = (torch.bfloat16, torch.float32)  # whose eager RoPE rounding the append kernel reproduces exactly


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def _decode_partial_kernel(
    Q, CK, CV, WK, WV, NCORE, POS, LO, ACC, ML,
    s_qb, s_qh, s_ckb, s_ckh, s_ckn, s_cvb, s_cvh, s_cvn, s_wkb, s_wkh, s_wkn, s_wvb, s_wvh, s_wvn,
    scale, n_kv, W, WL, core_per_split, win_per_split, n_splits, G, S,
    R: tl.constexpr, R_PAD: tl.constexpr, R_CORE: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr, DERIVE: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // n_kv).to(tl.int64)  # large batches: offsets past 2**31
    j = pid % n_kv
    rr = tl.arange(0, R_PAD)
    dd = tl.arange(0, D)
    cols = tl.arange(0, BLOCK_N)
    rmask = rr < R
    heads = j * R + rr
    q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + dd[None, :], mask=rmask[:, None], other=0.0)
    q = q.to(CK.dtype.element_ty)
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full([R_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    acc = tl.zeros([R_PAD, D], tl.float32)

    # Core tokens [c0, c1). Pooling "query": a tile holds BN_C tokens of each of the R heads, row h*BN_C + n;
    # each query row only keeps the columns of its own head.
    BN_C: tl.constexpr = BLOCK_N // R_CORE
    col_head = cols // BN_C
    col_tok = cols % BN_C
    t = tl.load(POS + b).to(tl.int32)
    if DERIVE:  # CCA's own visibility: the complete groups before the local window, raw keys from the next group on
        n_core = tl.maximum(t + 1 - S, 0) // G
        lo = n_core * G
    else:
        n_core = tl.load(NCORE + b).to(tl.int32)
        lo = tl.load(LO + b).to(tl.int32)
    c0 = split * core_per_split
    c1 = tl.minimum(c0 + core_per_split, n_core)
    for start in range(c0, c1, BN_C):
        tok = start + col_tok
        valid = tok < c1
        if R_CORE == 1:
            kh = j
        else:
            kh = j * R + col_head
            valid = valid & (col_head < R)
        k = tl.load(CK + b * s_ckb + (kh * s_ckh + tok * s_ckn)[:, None] + dd[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        ok = valid[None, :]
        if R_CORE > 1:
            ok = ok & (col_head[None, :] == rr[:, None])
        sc = tl.where(ok, sc * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(CV + b * s_cvb + (kh * s_cvh + tok * s_cvn)[:, None] + dd[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # Raw keys: the last WL positions (WL <= W), oldest first, split [w0, w1) of them; position p sits in ring slot
    # p mod W; visible when >= lo. Splitting positions, not slots, keeps the splits (and so the roundings) of a ring
    # with the speculative slack (W > WL) those of a ring without it.
    w0 = split * win_per_split
    w1 = tl.minimum(w0 + win_per_split, WL)
    for start in range(w0, w1, BLOCK_N):
        off = start + cols
        spos = t - (WL - 1) + off
        slot = ((spos % W) + W) % W
        valid = (off < w1) & (spos >= lo) & (spos >= 0)
        k = tl.load(WK + b * s_wkb + j * s_wkh + slot[:, None] * s_wkn + dd[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = tl.where(valid[None, :], sc * qk_scale, float("-inf"))
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

    row = (b * n_kv * R + heads) * n_splits + split  # ACC (B*H, S, D), ML (B*H, S, 2)
    tl.store(ACC + row[:, None] * D + dd[None, :], acc, mask=rmask[:, None])
    tl.store(ML + row * 2, m_i, mask=rmask)
    tl.store(ML + row * 2 + 1, l_i, mask=rmask)


@triton.jit
def _decode_combine_kernel(ACC, ML, OUT, POS, REAL, s_real, n_heads, n_splits, S_PAD: tl.constexpr, D: tl.constexpr,
                           ADVANCE: tl.constexpr, HAS_REAL: tl.constexpr):
    pid = tl.program_id(0)  # b * H + h; OUT is (B, H, D) contiguous
    if ADVANCE:  # count the token into POS: every program of the first kernel has read it (the cache's seen += real)
        if pid % n_heads == 0:
            b = pid // n_heads
            step = (tl.load(REAL + b * s_real) != 0).to(tl.int32) if HAS_REAL else 1
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
    """Same contract as ``cache_cca.cca_decode_attention_torch``: returns (B, H, d) in ``q.dtype``. With ``n_core`` and
    ``win_lo`` None the kernel derives them from ``pos``, ``group_size`` and ``local_window`` (CCA's visibility).
    ``advance`` (True, or (B,) 0/1 of real tokens, any dtype and stride): then added to ``pos`` in place, after every
    read of it (the cache's count of seen tokens, without a launch of its own)."""
    derive = n_core is None
    if advance is not None and not derive:
        raise ValueError("advance counts the token into pos: only with the visibility derived from pos")
    bsz, n_heads, head_dim = q.shape
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
    if num_splits is None:
        if q.is_cuda:
            dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
            if dev not in _SM_COUNT:
                _SM_COUNT[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
            target = 2 * _SM_COUNT[dev]
        else:
            target = 8
        useful = max(1, triton.cdiv(n_core_slots, 4 * bn_core), triton.cdiv(visible, block_n))
        num_splits = max(1, min(triton.cdiv(target, bsz * n_kv), useful, 128))
    core_per_split = triton.cdiv(triton.cdiv(n_core_slots, num_splits), bn_core) * bn_core
    win_per_split = triton.cdiv(visible, num_splits)
    acc = torch.empty(bsz * n_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
    ml = torch.empty(bsz * n_heads, num_splits, 2, device=q.device, dtype=torch.float32)
    _decode_partial_kernel[(bsz * n_kv, num_splits)](
        q, core_k, core_v, win_k, win_v, pos if derive else n_core, pos, pos if derive else win_lo, acc, ml,
        q.stride(0), q.stride(1), core_k.stride(0), core_k.stride(1), core_k.stride(2),
        core_v.stride(0), core_v.stride(1), core_v.stride(2), win_k.stride(0), win_k.stride(1), win_k.stride(2),
        win_v.stride(0), win_v.stride(1), win_v.stride(2),
        scale, n_kv, window, visible, core_per_split, win_per_split, num_splits, group_size or 1, local_window or 1,
        R=rep, R_PAD=max(16, _next_pow2(rep)), R_CORE=r_core, D=head_dim, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, DERIVE=derive, num_warps=4,
    )
    out = torch.empty(bsz, n_heads, head_dim, device=q.device, dtype=q.dtype)
    real = _as_loadable(advance) if isinstance(advance, torch.Tensor) else pos
    _decode_combine_kernel[(bsz * n_heads,)](acc, ml, out, pos, real, real.stride(0), n_heads, num_splits,
                                             S_PAD=_next_pow2(num_splits), D=head_dim, ADVANCE=advance is not None,
                                             HAS_REAL=isinstance(advance, torch.Tensor), num_warps=4)
    return out


@triton.jit
def _round_bf16(v):
    """fp32 ``v`` rounded to bf16's precision (nearest, ties to even), kept in fp32: done on the bits, because the
    compiler folds a bf16 round trip (``v.to(bf16).to(fp32)``) away."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _eager_rope(x, x_r, c, s, sign):
    """x * cos + rotate_half(x) * sin (``x_r``: x at rotate_half's indices) rounded as eager PyTorch rounds it in x's
    dtype (bf16 or fp32): each product, then the sum."""
    a = x.to(tl.float32) * c
    b = x_r.to(tl.float32) * sign * s
    if x.dtype == tl.bfloat16:
        a, b = _round_bf16(a), _round_bf16(b)
    return (a + b).to(x.dtype)


@triton.jit
def _append_pool_kernel(
    Q, K, V, COS, SIN, REAL, SEEN, QROT, WK, WV, GK, MIDC, MIDS, CK, CV,
    s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_cb, s_sb, s_real,
    s_wkb, s_wkh, s_wkn, s_wvb, s_wvh, s_wvn, s_gb, s_gh, s_gn,
    s_ckb, s_ckh, s_ckn, s_cvb, s_cvh, s_cvn,
    scale, n_kv, W, G, GW, M,
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
    t = tl.load(SEEN + b).to(tl.int32)
    if HAS_REAL:
        real = tl.load(REAL + b * s_real) != 0
    else:
        real = t >= 0
    c = tl.load(COS + b * s_cb + dd).to(tl.float32)
    s = tl.load(SIN + b * s_sb + dd).to(tl.float32)
    dt = WK.dtype.element_ty

    k_in = tl.load(K + b * s_kb + j * s_kh + dd)
    k_in_r = tl.load(K + b * s_kb + j * s_kh + rot)  # the same vector at rotate_half's indices
    if ROTATED:  # post-RoPE q/k (the family's RoPE, attention scaling included): undo it for the pre-RoPE keys
        c_r = tl.load(COS + b * s_cb + rot).to(tl.float32)
        s_r = tl.load(SIN + b * s_sb + rot).to(tl.float32)
        if ROTATED == 2:  # pre-RoPE, rotated here as the family would have: then exactly the post-RoPE path
            k_in, k_in_r = _eager_rope(k_in, k_in_r, c, s, sign), _eager_rope(k_in_r, k_in, c_r, s_r, -sign)
        kf, kf_r = k_in.to(tl.float32), k_in_r.to(tl.float32)
        k = ((kf * c - sign * kf_r * s) / (c * c + s * s)).to(K.dtype.element_ty)
        k_r = ((kf_r * c_r + sign * kf * s_r) / (c_r * c_r + s_r * s_r)).to(K.dtype.element_ty)
        k_rot = k_in.to(dt)
    else:
        k, k_r = k_in, k_in_r
        k_rot = (k.to(tl.float32) * c + k_r.to(tl.float32) * sign * s).to(dt)
    v = tl.load(V + b * s_vb + j * s_vh + dd)
    rr = tl.arange(0, R_P)
    rmask = rr < R
    heads = j * R + rr
    qp = Q + b * s_qb + heads[:, None] * s_qh
    if ROTATED == 1:
        q_rot = tl.load(qp + dd[None, :], mask=rmask[:, None], other=0.0).to(QROT.dtype.element_ty)
    elif ROTATED == 2:
        q_rot = _eager_rope(tl.load(qp + dd[None, :], mask=rmask[:, None], other=0.0),
                            tl.load(qp + rot[None, :], mask=rmask[:, None], other=0.0),
                            c[None, :], s[None, :], sign[None, :]).to(QROT.dtype.element_ty)
    else:
        q_rot = tl.load(qp + dd[None, :], mask=rmask[:, None], other=0.0).to(tl.float32) * c[None, :]
        q_rot += tl.load(qp + rot[None, :], mask=rmask[:, None], other=0.0).to(tl.float32) * (sign * s)[None, :]
        q_rot = q_rot.to(QROT.dtype.element_ty)
    tl.store(QROT + b * n_kv * R * D + heads[:, None] * D + dd[None, :], q_rot, mask=rmask[:, None])

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
            mc = tl.load(MIDC + mid).to(tl.float32)
            ms = tl.load(MIDS + mid).to(tl.float32)
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
    """
    if rotated == "eager" and q.dtype not in EAGER_ROPE_DTYPES:
        raise ValueError(f"rotated='eager' emulates RoPE's rounding in {EAGER_ROPE_DTYPES}, not {q.dtype}")
    bsz, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    rep = n_heads // n_kv
    q, k, v, cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, cos, sin))
    q_rot = torch.empty(bsz, n_heads, head_dim, device=q.device, dtype=q.dtype)
    real = seen if real is None else _as_loadable(real)
    _append_pool_kernel[(bsz * n_kv,)](
        q, k, v, cos, sin, real, seen, q_rot, win_k, win_v, grp_k, mid_cos, mid_sin, core_k, core_v,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0), real.stride(0),
        win_k.stride(0), win_k.stride(1), win_k.stride(2), win_v.stride(0), win_v.stride(1), win_v.stride(2),
        grp_k.stride(0), grp_k.stride(1), grp_k.stride(2),
        core_k.stride(0), core_k.stride(1), core_k.stride(2), core_v.stride(0), core_v.stride(1), core_v.stride(2),
        scale, n_kv, win_k.shape[2], group_size, grp_k.shape[2], mid_cos.shape[1] if mid_cos.dim() == 3 else 1,
        R=rep, R_P=_next_pow2(rep), D=head_dim, G_P=_next_pow2(group_size), QUERY_POOL=core_k.shape[1] != n_kv,
        ROTATED={False: 0, True: 1, "eager": 2}[rotated], HAS_REAL=real is not seen, num_warps=4,
    )
    return q_rot
