"""Triton globality-aware pooling for CCA (spec: "Groups and core tokens"), forward and backward.

Twin of ``cca_reference.pool_core_tokens``. One program pools one group of one KV head for all its
query heads, so the group's keys and values are read once: weights from the group's last (rotated)
query against its rotated keys, softmax over the group, weighted sums of the pre-RoPE keys and the
values, then RoPE at the group's middle position. Pooling ``kv`` averages the r heads' logits, which
is the logit of their mean query, so it needs one weight vector per KV head.

Vectors are handled as two halves (RoPE's ``rotate_half`` pairs element i with i + d/2), which keeps
the rotation in registers and lets head dims such as 80 pad each half to a power of two.
The backward recomputes the weights (O(g*d) per group) and *adds* its gradients into the attention
kernels' dq, dk_rot and dv, in place: each row it touches belongs to exactly one program.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _load_halves(ptr, mask, HALF: tl.constexpr):
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32), tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _group_index(P, G, n_kv, BLOCK_G: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """This program's group p of batch b, KV head j; its rows, and masks for (rows, half) and half tiles."""
    pid = tl.program_id(0)
    p = pid % P
    b = (pid // P // n_kv).to(tl.int64)
    j = (pid // P % n_kv).to(tl.int64)
    i = tl.arange(0, BLOCK_H)
    gi = tl.arange(0, BLOCK_G)
    row_ok = gi < G
    return p, b, j, i, p * G + gi, row_ok, row_ok[:, None] & (i[None, :] < HALF), i < HALF


@triton.jit
def _row_rotations(COS, SIN, b, rows, i, m2, s_cb, s_cl, HALF: tl.constexpr):
    """The rows' RoPE tables as halves, and each pair's determinant (for the exact inverse; 1 unless scaled)."""
    at = b * s_cb + rows[:, None] * s_cl + i[None, :]
    c1, c2 = _load_halves(COS + at, m2, HALF)
    s1, s2 = _load_halves(SIN + at, m2, HALF)
    return c1, c2, s1, s2, tl.where(m2, c1 * c2 + s1 * s2, 1.0)


@triton.jit
def _group_tiles(KR, K, V, COS, SIN, b, j, rows, i, m2, s_rb, s_rh, s_rl, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl,
                 s_cb, s_cl, HALF: tl.constexpr, FROM_ROT: tl.constexpr):
    """The group's rotated keys, pre-RoPE keys and values, each as two (rows, half) fp32 tiles. ``FROM_ROT``: no
    pre-RoPE keys are given; they are the rotated ones un-rotated (``cca_reference.unapply_rope``), in registers."""
    kr1, kr2 = _load_halves(KR + b * s_rb + j * s_rh + rows[:, None] * s_rl + i[None, :], m2, HALF)
    if FROM_ROT:
        c1, c2, s1, s2, det = _row_rotations(COS, SIN, b, rows, i, m2, s_cb, s_cl, HALF)
        k1, k2 = (kr1 * c2 + kr2 * s1) / det, (kr2 * c1 - kr1 * s2) / det
    else:
        k1, k2 = _load_halves(K + b * s_kb + j * s_kh + rows[:, None] * s_kl + i[None, :], m2, HALF)
    v1, v2 = _load_halves(V + b * s_vb + j * s_vh + rows[:, None] * s_vl + i[None, :], m2, HALF)
    return kr1, kr2, k1, k2, v1, v2


@triton.jit
def _pooling_query(q_row, s_qh, j, h, hm, scale, N_REP: tl.constexpr, KV_POOL: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """The query whose logits pool core head c (its h-th), the logits' scale, and c."""
    if KV_POOL:  # mean of the r heads' logits == logit of the summed query, scaled by 1/r
        q1 = tl.zeros([BLOCK_H], tl.float32)
        q2 = tl.zeros([BLOCK_H], tl.float32)
        for r in tl.static_range(N_REP):
            a1, a2 = _load_halves(q_row + (j * N_REP + r) * s_qh, hm, HALF)
            q1 += a1
            q2 += a2
        eff = scale / N_REP
        c = j
    else:
        q1, q2 = _load_halves(q_row + (j * N_REP + h) * s_qh, hm, HALF)
        eff = scale
        c = j * N_REP + h
    return q1, q2, eff, c


@triton.jit
def _group_weights(q1, q2, kr1, kr2, row_ok, scale):
    logits = (tl.sum(kr1 * q1[None, :], 1) + tl.sum(kr2 * q2[None, :], 1)) * scale
    logits = tl.where(row_ok, logits, float("-inf"))
    w = tl.exp(logits - tl.max(logits, 0))
    return w / tl.sum(w, 0)


@triton.jit
def _pool_fwd_kernel(QR, KR, K, V, COS, SIN, KC, VC, START,
                     s_qb, s_qh, s_ql, s_rb, s_rh, s_rl, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_cb, s_cl,
                     L, P, G, n_kv, n_core, scale,
                     N_REP: tl.constexpr, KV_POOL: tl.constexpr, HALF: tl.constexpr, BLOCK_G: tl.constexpr,
                     BLOCK_H: tl.constexpr, FROM_ROT: tl.constexpr, HAS_START: tl.constexpr):
    p, b, j, i, rows, row_ok, m2, hm = _group_index(P, G, n_kv, BLOCK_G, BLOCK_H, HALF)
    first = p * G
    if HAS_START:  # row b's groups start at its column START[b]; a group running past the end reads the last
        first += tl.load(START + b)  # column again (finite values in a slot no query reads)
        rows = tl.minimum(first + (rows - p * G), L - 1)
    kr1, kr2, k1, k2, v1, v2 = _group_tiles(KR, K, V, COS, SIN, b, j, rows, i, m2, s_rb, s_rh, s_rl, s_kb, s_kh, s_kl,
                                            s_vb, s_vh, s_vl, s_cb, s_cl, HALF, FROM_ROT)
    mid = tl.minimum(first + G // 2, L - 1) * s_cl + b * s_cb  # the core token's RoPE position
    c1, c2 = _load_halves(COS + mid + i, hm, HALF)
    s1, s2 = _load_halves(SIN + mid + i, hm, HALF)
    q_row = QR + b * s_qb + tl.minimum(first + G - 1, L - 1) * s_ql + i  # each head's last query of the group

    for h in tl.static_range(1 if KV_POOL else N_REP):  # unrolled: the heads are independent
        q1, q2, eff, c = _pooling_query(q_row, s_qh, j, h, hm, scale, N_REP, KV_POOL, HALF, BLOCK_H)
        w = _group_weights(q1, q2, kr1, kr2, row_ok, eff)
        kp1 = tl.sum(w[:, None] * k1, 0)
        kp2 = tl.sum(w[:, None] * k2, 0)
        out = ((b * n_core + c) * P + p) * (2 * HALF) + i
        tl.store(KC + out, (kp1 * c1 - kp2 * s1).to(KC.dtype.element_ty), mask=hm)
        tl.store(KC + out + HALF, (kp2 * c2 + kp1 * s2).to(KC.dtype.element_ty), mask=hm)
        tl.store(VC + out, tl.sum(w[:, None] * v1, 0).to(VC.dtype.element_ty), mask=hm)
        tl.store(VC + out + HALF, tl.sum(w[:, None] * v2, 0).to(VC.dtype.element_ty), mask=hm)


@triton.jit
def _pool_bwd_kernel(QR, KR, K, V, COS, SIN, DKC, DVC, DQ, DKR, DK, DV,
                     s_qb, s_qh, s_ql, s_rb, s_rh, s_rl, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_cb, s_cl,
                     s_gb, s_gh, s_gl,  # dq
                     s_db, s_dh, s_dl,  # dk_rot, dk and dv (same shape, contiguous)
                     P, G, n_kv, n_core, n_split, s_split, scale,
                     N_REP: tl.constexpr, KV_POOL: tl.constexpr, HALF: tl.constexpr, BLOCK_G: tl.constexpr,
                     BLOCK_H: tl.constexpr, FROM_ROT: tl.constexpr):
    p, b, j, i, rows, row_ok, m2, hm = _group_index(P, G, n_kv, BLOCK_G, BLOCK_H, HALF)
    kr1, kr2, k1, k2, v1, v2 = _group_tiles(KR, K, V, COS, SIN, b, j, rows, i, m2, s_rb, s_rh, s_rl, s_kb, s_kh, s_kl,
                                            s_vb, s_vh, s_vl, s_cb, s_cl, HALF, FROM_ROT)
    mid = (p * G + G // 2) * s_cl + b * s_cb  # the core token's RoPE position
    c1, c2 = _load_halves(COS + mid + i, hm, HALF)
    s1, s2 = _load_halves(SIN + mid + i, hm, HALF)
    last = p * G + G - 1
    q_row = QR + b * s_qb + last * s_ql + i
    dq_row = DQ + b * s_gb + last * s_gl + i

    dk1 = tl.zeros([BLOCK_G, BLOCK_H], tl.float32)
    dk2 = tl.zeros([BLOCK_G, BLOCK_H], tl.float32)
    dv1 = tl.zeros([BLOCK_G, BLOCK_H], tl.float32)
    dv2 = tl.zeros([BLOCK_G, BLOCK_H], tl.float32)
    dr1 = tl.zeros([BLOCK_G, BLOCK_H], tl.float32)
    dr2 = tl.zeros([BLOCK_G, BLOCK_H], tl.float32)
    for h in tl.static_range(1 if KV_POOL else N_REP):  # unrolled: the heads are independent
        q1, q2, eff, c = _pooling_query(q_row, s_qh, j, h, hm, scale, N_REP, KV_POOL, HALF, BLOCK_H)
        w = _group_weights(q1, q2, kr1, kr2, row_ok, eff)
        core = ((b * n_core + c) * P + p) * (2 * HALF) + i
        g1, g2 = _load_halves(DKC + core, hm, HALF)  # d loss / d k_core (after RoPE)
        dvc1, dvc2 = _load_halves(DVC + core, hm, HALF)
        for sp in range(1, n_split):  # the attention kernels' partial sums, added in order
            part = core + sp * s_split.to(tl.int64)
            a1, a2 = _load_halves(DKC + part, hm, HALF)
            g1, g2 = g1 + a1, g2 + a2
            a1, a2 = _load_halves(DVC + part, hm, HALF)
            dvc1, dvc2 = dvc1 + a1, dvc2 + a2
        dkp1 = g1 * c1 + g2 * s2  # transpose of the RoPE at the middle position
        dkp2 = g2 * c2 - g1 * s1
        dw = tl.sum(k1 * dkp1[None, :] + k2 * dkp2[None, :] + v1 * dvc1[None, :] + v2 * dvc2[None, :], 1)
        dl = w * (dw - tl.sum(w * dw, 0)) * eff  # softmax backward, times the logits' scale
        dk1 += w[:, None] * dkp1[None, :]
        dk2 += w[:, None] * dkp2[None, :]
        dv1 += w[:, None] * dvc1[None, :]
        dv2 += w[:, None] * dvc2[None, :]
        dr1 += dl[:, None] * q1[None, :]
        dr2 += dl[:, None] * q2[None, :]
        dq1 = tl.sum(dl[:, None] * kr1, 0)
        dq2 = tl.sum(dl[:, None] * kr2, 0)
        for r in tl.static_range(N_REP if KV_POOL else 1):  # kv: every head of the mean gets the same share
            hq = j * N_REP + (r if KV_POOL else h)
            ptr = dq_row + hq * s_gh
            a1, a2 = _load_halves(ptr, hm, HALF)
            tl.store(ptr, (a1 + dq1).to(DQ.dtype.element_ty), mask=hm)
            tl.store(ptr + HALF, (a2 + dq2).to(DQ.dtype.element_ty), mask=hm)

    if FROM_ROT:  # the pre-RoPE keys were un-rotated from k_rot: their gradient goes back through that map
        rc1, rc2, rs1, rs2, det = _row_rotations(COS, SIN, b, rows, i, m2, s_cb, s_cl, HALF)
        dr1 += (dk1 * rc2 - dk2 * rs2) / det
        dr2 += (dk1 * rs1 + dk2 * rc1) / det
    grp = b * s_db + j * s_dh + rows[:, None] * s_dl + i[None, :]
    a1, a2 = _load_halves(DKR + grp, m2, HALF)
    tl.store(DKR + grp, (a1 + dr1).to(DKR.dtype.element_ty), mask=m2)
    tl.store(DKR + grp + HALF, (a2 + dr2).to(DKR.dtype.element_ty), mask=m2)
    a1, a2 = _load_halves(DV + grp, m2, HALF)
    tl.store(DV + grp, (a1 + dv1).to(DV.dtype.element_ty), mask=m2)
    tl.store(DV + grp + HALF, (a2 + dv2).to(DV.dtype.element_ty), mask=m2)
    if not FROM_ROT:
        tl.store(DK + grp, dk1.to(DK.dtype.element_ty), mask=m2)
        tl.store(DK + grp + HALF, dk2.to(DK.dtype.element_ty), mask=m2)


def _meta(q_rot, v, group_size, pooling, from_rot, backward=False):
    B, H, L, D = q_rot.shape
    n_kv = v.shape[1]
    block_g, block_h = triton.next_power_of_2(group_size), triton.next_power_of_2(D // 2)
    # Tiny programs are latency-bound: on an H200 (g=16, d=128, 128K) one warp per group beat 2, 4 and 8
    # (fwd 0.23 vs 0.30/0.81/1.39 ms), except the query-pooling backward, which holds r heads' partial
    # sums and liked two (2.1 vs 2.5 ms). Bigger groups get proportionally more warps.
    warps = max(1, min(8, block_g * block_h // 1024)) * (2 if backward and pooling == "query" else 1)
    return dict(P=L // group_size, G=group_size, n_kv=n_kv, N_REP=H // n_kv, n_core=H if pooling == "query" else n_kv,
                KV_POOL=pooling == "kv", HALF=D // 2, BLOCK_G=block_g, BLOCK_H=block_h, FROM_ROT=from_rot,
                num_warps=warps)


def _strides(x):
    return x.stride(0), x.stride(1), x.stride(2)


def table_strides(cos):
    """(batch, position) strides of a rotary table shaped (L, d), (1, L, d) or (B, L, d). A table shared by
    the batch gets batch stride 0: transformers' rotary embedding returns (1, L, d) for one row of
    position ids, and reading it with its own stride(0) at b > 0 runs past its end."""
    shared = cos.dim() == 2 or cos.shape[0] == 1
    return (0 if shared else cos.stride(0)), cos.stride(-2)


def pool_forward(q_rot, k_rot, k, v, cos, sin, group_size, pooling, scale, start=None):
    """``(K_core, V_core)`` shaped (B, C, L // g, d), as ``pool_core_tokens``. Inputs: last dim contiguous,
    cos/sin contiguous. Head dim must be even (RoPE). ``k`` None: the pre-RoPE keys are ``unapply_rope(k_rot)``,
    computed in registers (never stored). ``start`` (B,) int, each in [0, g): row b's groups are its columns
    ``start_b + p*g ..`` (a chunk whose rows start at different offsets in a group); its last group may then run past
    the end: that slot holds finite values of no meaning (forward only)."""
    meta = _meta(q_rot, v, group_size, pooling, k is None)
    B, L, D = q_rot.shape[0], q_rot.shape[2], q_rot.shape[-1]
    kc = torch.empty((B, meta["n_core"], meta["P"], D), dtype=k_rot.dtype, device=v.device)
    vc = torch.empty(kc.shape, dtype=v.dtype, device=v.device)
    k = k_rot if k is None else k  # (FROM_ROT: never read)
    if meta["P"]:
        _pool_fwd_kernel[(B * meta["n_kv"] * meta["P"],)](
            q_rot, k_rot, k, v, cos, sin, kc, vc, kc if start is None else start.to(torch.int32),
            *_strides(q_rot), *_strides(k_rot), *_strides(k), *_strides(v), *table_strides(cos), L,
            scale=scale, HAS_START=start is not None, **meta,
        )
    return kc, vc


def pool_backward(dkc, dvc, q_rot, k_rot, k, v, cos, sin, dq, dk_rot, dv, group_size, pooling, scale):
    """Adds the pooling's gradients into ``dq``/``dk_rot``/``dv`` (in place, contiguous) and returns the
    gradient w.r.t. the pre-RoPE ``k`` through the pooled keys; ``k`` None (pooled from ``unapply_rope(k_rot)``):
    that gradient goes into ``dk_rot`` too, and None is returned. ``dkc``/``dvc``: any float dtype, (B, C, P, d) or
    (n_split, B, C, P, d) partial sums (added up here in fp32, in order: no pass of their own)."""
    meta = _meta(q_rot, v, group_size, pooling, k is None, backward=True)
    dkc, dvc = dkc.contiguous(), dvc.contiguous()
    if dkc.shape != dvc.shape or dkc.dim() not in (4, 5):
        raise ValueError(f"dkc/dvc must both be (B, C, P, d) or (n_split, B, C, P, d), got {tuple(dkc.shape)} and "
                         f"{tuple(dvc.shape)}")
    n_split = dkc.shape[0] if dkc.dim() == 5 else 1
    # rows past the last group get no gradient from the pooling
    dk = None if k is None else torch.zeros(dk_rot.shape, dtype=dk_rot.dtype, device=dk_rot.device)
    k_in, dk_out = (k_rot, dk_rot) if k is None else (k, dk)  # (FROM_ROT: neither is read nor written)
    if meta["P"]:
        _pool_bwd_kernel[(q_rot.shape[0] * meta["n_kv"] * meta["P"],)](
            q_rot, k_rot, k_in, v, cos, sin, dkc, dvc, dq, dk_rot, dk_out, dv,
            *_strides(q_rot), *_strides(k_rot), *_strides(k_in), *_strides(v), *table_strides(cos),
            *_strides(dq), *_strides(dk_rot), n_split=n_split, s_split=dkc[0].numel(),
            scale=scale, **meta,
        )
    return dk
