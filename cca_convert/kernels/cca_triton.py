"""Triton kernels for Core Context Aware (CCA) attention: prefill and training.

Same semantics and signature as ``cca_attention_reference`` (see CCA-SPEC.md), in O(L*d) memory.
RoPE is one fused Triton pass (torch's version was ~half the forward time at 32K). Pooling and
attention form one ``autograd.Function``: the pooling kernels of ``cca_pool_triton``, then the
attention (core tokens ++ local raw keys, ONE online softmax, FlashAttention-2 style, logsumexp
saved) as a forward kernel, a dq kernel, and one dk/dv kernel each for the raw keys (a key block
only meets the ~s+g queries of its window) and the core tokens; the pooling's backward adds its
share into those gradients.

On Hopper and newer GPUs the forward fetches its key/value tiles by TMA (``tma.py``). On an sm_90 GPU with triton
3.6 the passes run in ``cca_gluon`` (warp-specialized, TMA load warps): the forward (whole sequences and chunks after
a prefill), and the backward's (dk/dv where heads are stacked) with the Triton kernels' tiles and order.

GQA is native: a program owns one *core head* and stacks several of its query heads as rows of one
tile, so each key/value tile is loaded once for all of them. Pooling ``kv`` has one core head per KV
head (its r query heads stacked); pooling ``query`` has one core head per query head.
"""

import math

import torch
import triton
import triton.language as tl

from .cca_pool_triton import pool_backward, pool_forward, table_strides
from .cca_params import check_args
from .cca_reference import check_chunk_args, check_given
from .tma import descriptors, use_tma as _use_tma

try:  # the Hopper kernels (Gluon: triton >= 3.6); without them the Triton kernels serve every GPU. The first line's
    # spelling matters: transformers fetches from the Hub, and save_pretrained copies, only the files a module imports
    # as `from .name import ...` (not `from . import name`): without it exported repos ran without these kernels.
    from .cca_gluon import applies as _gluon_applies  # noqa: F401
    from . import cca_gluon
except ImportError:
    cca_gluon = None

_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------------
# Helpers (inlined by Triton)
# --------------------------------------------------------------------------------------------------
@triton.jit
def _n_visible(t, G, S):
    # n(t) = max(0, floor((t + 1 - s) / g)); clamping first keeps the integer division non-negative.
    return tl.maximum(t + 1 - S, 0) // G


@triton.jit
def _stacked_rows(t0, chunk, n_stack, L, BLOCK_M: tl.constexpr, HP: tl.constexpr, BMP: tl.constexpr):
    """Row i of a tile is query head ``chunk*HP + i // BMP`` (of the program's stack) at position ``t0 + i % BMP``."""
    i = tl.arange(0, BLOCK_M)
    head = chunk * HP + i // BMP
    t = t0 + i % BMP
    ok = (i // BMP < HP) & (head < n_stack) & (t < L)
    return head, t, ok


@triton.jit
def _query_tile(L, n_core, n_stack, n_rep, n_chunks, BLOCK_M: tl.constexpr, HP: tl.constexpr, BMP: tl.constexpr):
    """This program's query tile (forward and dq): batch, core head c, KV head j, positions [t0, t1],
    and per row its query head hq, position t and validity ok."""
    # 1-D grid, heads fastest and the longest (last) position blocks first: better tail balance.
    pid = tl.program_id(0)
    n_hb = tl.num_programs(0) // tl.cdiv(L, BMP)  # batch x core heads x head chunks
    hb = pid % n_hb
    blk = tl.cdiv(L, BMP) - 1 - pid // n_hb
    b = hb // (n_core * n_chunks)
    c = (hb // n_chunks) % n_core
    chunk = hb % n_chunks
    j = (c * n_stack) // n_rep  # KV head of the raw keys
    t0 = blk * BMP
    t1 = tl.minimum(t0 + BMP, L) - 1
    head, t, ok = _stacked_rows(t0, chunk, n_stack, L, BLOCK_M, HP, BMP)
    hq = (c * n_stack + head).to(tl.int64)  # query head of each row
    return b.to(tl.int64), c, j, t0, t1, hq, t, ok


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, k_base, v_base, s_kl, s_vl, cols, n_cols, valid, qk_scale, k_desc, v_desc, b, h, col0,
              MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
              BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    if TMA:  # the copy engine fetches the tiles (zeros past n_cols and the head dim): no address math, fewer registers
        kt = tl.trans(k_desc.load([b.to(tl.int32), h, col0, 0]).reshape(BLOCK_N, BLOCK_D))
        v = v_desc.load([b.to(tl.int32), h, col0, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        col_ok = cols < n_cols
        kt = tl.load(k_base + cols[None, :] * s_kl + d[:, None], mask=col_ok[None, :] & (d[:, None] < HEAD_DIM),
                     other=0.0)
        v = tl.load(v_base + cols[:, None] * s_vl + d[None, :], mask=col_ok[:, None] & (d[None, :] < HEAD_DIM),
                    other=0.0)
    s = tl.dot(q, kt, input_precision=PREC) * qk_scale
    if MASKED:
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _dq_tile(dq, q, do, lse, delta, k_base, v_base, s_kl, s_vl, cols, n_cols, valid, qk_scale,
             MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    col_ok = cols < n_cols
    k = tl.load(k_base + cols[:, None] * s_kl + d[None, :], mask=col_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    vt = tl.load(v_base + cols[None, :] * s_vl + d[:, None], mask=col_ok[None, :] & (d[:, None] < HEAD_DIM), other=0.0)
    p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse[:, None])
    if MASKED:
        p = tl.where(valid, p, 0.0)
    ds = p * (tl.dot(do, vt, input_precision=PREC) - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PREC)


@triton.jit
def _dkdv_tile(dk, dv, k, v, LSE, DELTA, q_base, do_base, s_qh, s_ql, s_oh, s_ol, stat_base,
               head, t, ok, L, valid, qk_scale,
               MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    """Transposed tile (rows = keys, columns = stacked query rows). Invalid rows get lse=+inf, so p=0."""
    d = tl.arange(0, BLOCK_D)
    qmask = ok[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(q_base + head[:, None] * s_qh + t[:, None] * s_ql + d[None, :], mask=qmask, other=0.0)
    do = tl.load(do_base + head[:, None] * s_oh + t[:, None] * s_ol + d[None, :], mask=qmask, other=0.0)
    stat = stat_base + head.to(tl.int64) * L + t
    lse = tl.load(LSE + stat, mask=ok, other=float("inf"))
    delta = tl.load(DELTA + stat, mask=ok, other=0.0)
    pt = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale - lse[None, :])
    if MASKED:
        pt = tl.where(valid, pt, 0.0)
    dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
    dst = pt * (tl.dot(v, tl.trans(do), input_precision=PREC) - delta[None, :])
    dk += tl.dot(dst.to(q.dtype), q, input_precision=PREC)
    return dk, dv


# --------------------------------------------------------------------------------------------------
# Forward and dq: one program = (core head, stacked query heads chunk, block of BMP positions)
# --------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_kernel(Q, K, V, KC, VC, K_DESC, V_DESC, KC_DESC, VC_DESC, O, LSE, QPOS,
                s_qb, s_qh, s_ql, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl,
                s_cb, s_ch, s_cl, s_wb, s_wh, s_wl, s_ob, s_oh, s_ol,
                L, LK, R, P, G, S, n_heads, n_core, n_stack, n_rep, n_chunks, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HP: tl.constexpr, BMP: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr, OFFSET: tl.constexpr):
    b64, c, j, tq0, tq1, hq, tq, ok = _query_tile(L, n_core, n_stack, n_rep, n_chunks, BLOCK_M, HP, BMP)
    d = tl.arange(0, BLOCK_D)
    dmask = d[None, :] < HEAD_DIM
    q = tl.load(Q + b64 * s_qb + hq[:, None] * s_qh + tq[:, None] * s_ql + d[None, :], mask=ok[:, None] & dmask,
                other=0.0)
    if OFFSET:  # a chunk after a prefill: query row i sits at position QPOS[b] + i, raw key column u at QPOS[b] - R + u
        q_start = tl.load(QPOS + b64)
        kb = q_start - R
    else:  # whole sequences: rows and columns are positions
        q_start = 0
        kb = 0
    t, t0, t1 = tq + q_start, tq0 + q_start, tq1 + q_start  # positions (the spec's t)

    n_t = _n_visible(t, G, S)
    n0 = _n_visible(t0, G, S)
    n1 = _n_visible(t1, G, S)
    # Finite init: a fully masked tile then gives exp2(-inf) = 0, never NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_N)

    # Core tokens [0, n0) are seen by every row; [n0, n1) only by rows with p < n(t).
    kc_base = KC + b64 * s_cb + c.to(tl.int64) * s_ch
    vc_base = VC + b64 * s_wb + c.to(tl.int64) * s_wh
    n0_full = (n0 // BLOCK_N) * BLOCK_N
    for p0 in range(0, n0_full, BLOCK_N):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, kc_base, vc_base, s_cl, s_wl, p0 + offs, P, 0, qk_scale,
                                  KC_DESC, VC_DESC, b64, c, p0, False, HEAD_DIM, BLOCK_D, PREC, BLOCK_N, TMA)
    for p0 in range(n0_full, n1, BLOCK_N):
        cols = p0 + offs
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, kc_base, vc_base, s_cl, s_wl, cols, P,
                                  cols[None, :] < n_t[:, None], qk_scale, KC_DESC, VC_DESC, b64, c, p0,
                                  True, HEAD_DIM, BLOCK_D, PREC, BLOCK_N, TMA)

    # Raw keys [n(t)*g, t]: masked start [n0*g, n1*g), mask-free middle, masked causal end.
    k_base = K + b64 * s_kb + j.to(tl.int64) * s_kh
    v_base = V + b64 * s_vb + j.to(tl.int64) * s_vh
    lo_t = n_t * G
    a_end = n1 * G
    for k0 in range(n0 * G, a_end, BLOCK_N):
        cols = k0 + offs
        valid = (cols[None, :] >= lo_t[:, None]) & (cols[None, :] <= t[:, None]) & (cols[None, :] < a_end)
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, s_kl, s_vl, cols - kb, LK, valid, qk_scale,
                                  K_DESC, V_DESC, b64, j, k0 - kb, True, HEAD_DIM, BLOCK_D, PREC, BLOCK_N, TMA)
    b_end = a_end + (tl.maximum(t0 + 1 - a_end, 0) // BLOCK_N) * BLOCK_N
    for k0 in range(a_end, b_end, BLOCK_N):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, s_kl, s_vl, k0 - kb + offs, LK, 0, qk_scale,
                                  K_DESC, V_DESC, b64, j, k0 - kb, False, HEAD_DIM, BLOCK_D, PREC, BLOCK_N, TMA)
    for k0 in range(b_end, t1 + 1, BLOCK_N):
        cols = k0 + offs
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, s_kl, s_vl, cols - kb, LK,
                                  cols[None, :] <= t[:, None], qk_scale, K_DESC, V_DESC, b64, j, k0 - kb,
                                  True, HEAD_DIM, BLOCK_D, PREC, BLOCK_N, TMA)

    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # padding rows only: every real row sees itself
    out = acc / l_i[:, None]
    tl.store(O + b64 * s_ob + hq[:, None] * s_oh + tq[:, None] * s_ol + d[None, :], out.to(O.dtype.element_ty),
             mask=ok[:, None] & dmask)
    tl.store(LSE + (b64 * n_heads + hq) * L + tq, m_i + tl.math.log2(l_i), mask=ok)  # base-2 logsumexp


@triton.jit
def _dq_kernel(Q, K, V, KC, VC, DO, LSE, DELTA, DQ,
               s_qb, s_qh, s_ql, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl,
               s_cb, s_ch, s_cl, s_wb, s_wh, s_wl, s_ob, s_oh, s_ol, s_db, s_dh, s_dl,
               L, P, G, S, n_heads, n_core, n_stack, n_rep, n_chunks, qk_scale, sm_scale,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HP: tl.constexpr, BMP: tl.constexpr, PREC: tl.constexpr):
    b64, c, j, t0, t1, hq, t, ok = _query_tile(L, n_core, n_stack, n_rep, n_chunks, BLOCK_M, HP, BMP)
    d = tl.arange(0, BLOCK_D)
    rmask = ok[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(Q + b64 * s_qb + hq[:, None] * s_qh + t[:, None] * s_ql + d[None, :], mask=rmask, other=0.0)
    do = tl.load(DO + b64 * s_ob + hq[:, None] * s_oh + t[:, None] * s_ol + d[None, :], mask=rmask, other=0.0)
    stat = (b64 * n_heads + hq) * L + t
    lse = tl.load(LSE + stat, mask=ok, other=float("inf"))  # +inf: padding rows get p = 0
    delta = tl.load(DELTA + stat, mask=ok, other=0.0)

    n_t = _n_visible(t, G, S)
    n0 = _n_visible(t0, G, S)
    n1 = _n_visible(t1, G, S)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_N)

    kc_base = KC + b64 * s_cb + c.to(tl.int64) * s_ch
    vc_base = VC + b64 * s_wb + c.to(tl.int64) * s_wh
    n0_full = (n0 // BLOCK_N) * BLOCK_N
    for p0 in range(0, n0_full, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse, delta, kc_base, vc_base, s_cl, s_wl, p0 + offs, P, 0, qk_scale,
                      False, HEAD_DIM, BLOCK_D, PREC)
    for p0 in range(n0_full, n1, BLOCK_N):
        cols = p0 + offs
        dq = _dq_tile(dq, q, do, lse, delta, kc_base, vc_base, s_cl, s_wl, cols, P,
                      cols[None, :] < n_t[:, None], qk_scale, True, HEAD_DIM, BLOCK_D, PREC)

    k_base = K + b64 * s_kb + j.to(tl.int64) * s_kh
    v_base = V + b64 * s_vb + j.to(tl.int64) * s_vh
    lo_t = n_t * G
    a_end = n1 * G
    for k0 in range(n0 * G, a_end, BLOCK_N):
        cols = k0 + offs
        valid = (cols[None, :] >= lo_t[:, None]) & (cols[None, :] <= t[:, None]) & (cols[None, :] < a_end)
        dq = _dq_tile(dq, q, do, lse, delta, k_base, v_base, s_kl, s_vl, cols, L, valid, qk_scale,
                      True, HEAD_DIM, BLOCK_D, PREC)
    b_end = a_end + (tl.maximum(t0 + 1 - a_end, 0) // BLOCK_N) * BLOCK_N
    for k0 in range(a_end, b_end, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse, delta, k_base, v_base, s_kl, s_vl, k0 + offs, L, 0, qk_scale,
                      False, HEAD_DIM, BLOCK_D, PREC)
    for k0 in range(b_end, t1 + 1, BLOCK_N):
        cols = k0 + offs
        dq = _dq_tile(dq, q, do, lse, delta, k_base, v_base, s_kl, s_vl, cols, L,
                      cols[None, :] <= t[:, None], qk_scale, True, HEAD_DIM, BLOCK_D, PREC)

    dq = dq * sm_scale
    tl.store(DQ + b64 * s_db + hq[:, None] * s_dh + t[:, None] * s_dl + d[None, :], dq.to(DQ.dtype.element_ty), mask=rmask)


# --------------------------------------------------------------------------------------------------
# dk/dv of the raw keys: one program = (KV head, block of BLOCK_N keys), all r query heads stacked.
# Key tau is seen raw by queries t in [tau, ((tau//g)+1)*g + s - 2]: a window of ~s+g rows.
# --------------------------------------------------------------------------------------------------
@triton.jit
def _dkdv_raw_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                     s_qb, s_qh, s_ql, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_ob, s_oh, s_ol,
                     s_gb, s_gh, s_gl,  # dk and dv (contiguous, same shape)
                     L, G, S, n_heads, n_kv, n_rep, n_chunks, qk_scale, sm_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HP: tl.constexpr, BMP: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    n_bh = tl.num_programs(0) // tl.cdiv(L, BLOCK_N)
    bj = pid % n_bh
    k0 = (pid // n_bh) * BLOCK_N
    b = bj // n_kv
    j = bj % n_kv
    b64 = b.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    cols = k0 + tl.arange(0, BLOCK_N)
    kmask = (cols[:, None] < L) & (d[None, :] < HEAD_DIM)
    k = tl.load(K + b64 * s_kb + j.to(tl.int64) * s_kh + cols[:, None] * s_kl + d[None, :], mask=kmask, other=0.0)
    v = tl.load(V + b64 * s_vb + j.to(tl.int64) * s_vh + cols[:, None] * s_vl + d[None, :], mask=kmask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    k_last = tl.minimum(k0 + BLOCK_N, L) - 1
    q_hi = tl.minimum(L, (k_last // G + 1) * G + S - 1)  # past the last query seeing any key of the block raw
    lim = (k0 // G + 1) * G + S - 1                      # rows t < lim see every key >= k0 raw (if causal)
    a_end = k0 + tl.cdiv(BLOCK_N - 1, BMP) * BMP           # rows t >= a_end are causal for the whole block
    b_end = a_end + (tl.maximum(lim - a_end, 0) // BMP) * BMP
    q_base = Q + b64 * s_qb + (j * n_rep).to(tl.int64) * s_qh
    do_base = DO + b64 * s_ob + (j * n_rep).to(tl.int64) * s_oh
    stat_base = (b64 * n_heads + j * n_rep) * L
    for chunk in range(0, n_chunks):
        for t0 in range(k0, tl.minimum(a_end, q_hi), BMP):
            head, t, ok = _stacked_rows(t0, chunk, n_rep, L, BLOCK_M, HP, BMP)
            valid = (cols[:, None] <= t[None, :]) & (cols[:, None] >= (_n_visible(t, G, S) * G)[None, :])
            dk, dv = _dkdv_tile(dk, dv, k, v, LSE, DELTA, q_base, do_base, s_qh, s_ql, s_oh, s_ol, stat_base,
                                head, t, ok, L, valid, qk_scale, True, HEAD_DIM, BLOCK_D, PREC)
        for t0 in range(a_end, tl.minimum(b_end, q_hi), BMP):
            head, t, ok = _stacked_rows(t0, chunk, n_rep, L, BLOCK_M, HP, BMP)
            dk, dv = _dkdv_tile(dk, dv, k, v, LSE, DELTA, q_base, do_base, s_qh, s_ql, s_oh, s_ol, stat_base,
                                head, t, ok, L, 0, qk_scale, False, HEAD_DIM, BLOCK_D, PREC)
        for t0 in range(b_end, q_hi, BMP):
            head, t, ok = _stacked_rows(t0, chunk, n_rep, L, BLOCK_M, HP, BMP)
            valid = (cols[:, None] <= t[None, :]) & (cols[:, None] >= (_n_visible(t, G, S) * G)[None, :])
            dk, dv = _dkdv_tile(dk, dv, k, v, LSE, DELTA, q_base, do_base, s_qh, s_ql, s_oh, s_ol, stat_base,
                                head, t, ok, L, valid, qk_scale, True, HEAD_DIM, BLOCK_D, PREC)

    out = b64 * s_gb + j.to(tl.int64) * s_gh + cols[:, None] * s_gl + d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=kmask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kmask)


# --------------------------------------------------------------------------------------------------
# dk/dv of the core tokens: one program = (core head, block of BLOCK_N core tokens, slice of queries).
# Core token p is seen by every query t >= (p+1)*g + s - 1. The query range is split over N_SPLIT
# programs (partial sums in fp32, added in torch): a core block has up to L rows to visit but there
# are only ~L/(g*BLOCK_N) blocks, too few programs to fill the GPU otherwise.
# --------------------------------------------------------------------------------------------------
@triton.jit
def _dkdv_core_kernel(Q, KC, VC, DO, LSE, DELTA, DKC, DVC,
                      s_qb, s_qh, s_ql, s_cb, s_ch, s_cl, s_wb, s_wh, s_wl, s_ob, s_oh, s_ol,
                      L, P, G, S, n_heads, n_core, n_stack, n_chunks, n_split, qk_scale, sm_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      HP: tl.constexpr, BMP: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    n_bc = tl.num_programs(0) // (tl.cdiv(P, BLOCK_N) * n_split)
    bc = pid % n_bc
    split = (pid // n_bc) % n_split
    p0 = (pid // (n_bc * n_split)) * BLOCK_N  # first core blocks (most rows) first
    b = bc // n_core
    c = bc % n_core
    b64 = b.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    cols = p0 + tl.arange(0, BLOCK_N)
    kmask = (cols[:, None] < P) & (d[None, :] < HEAD_DIM)
    kc = tl.load(KC + b64 * s_cb + c.to(tl.int64) * s_ch + cols[:, None] * s_cl + d[None, :], mask=kmask, other=0.0)
    vc = tl.load(VC + b64 * s_wb + c.to(tl.int64) * s_wh + cols[:, None] * s_wl + d[None, :], mask=kmask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    t_lo = (p0 + 1) * G + S - 1                   # first query seeing core token p0
    t_full = (p0 + BLOCK_N) * G + S - 1           # from here on, rows see the whole block
    a_end = t_lo + tl.cdiv(tl.maximum(t_full - t_lo, 0), BMP) * BMP
    # This program's share of the mask-free rows [a_end, L), in whole BMP blocks.
    n_blk = tl.cdiv(tl.maximum(L - a_end, 0), BMP)
    per = tl.cdiv(n_blk, n_split)
    u_lo = a_end + split * per * BMP
    u_hi = tl.minimum(u_lo + per * BMP, L)
    q_base = Q + b64 * s_qb + (c * n_stack).to(tl.int64) * s_qh
    do_base = DO + b64 * s_ob + (c * n_stack).to(tl.int64) * s_oh
    stat_base = (b64 * n_heads + c * n_stack) * L
    for chunk in range(0, n_chunks):
        if split == 0:
            for t0 in range(t_lo, tl.minimum(a_end, L), BMP):
                head, t, ok = _stacked_rows(t0, chunk, n_stack, L, BLOCK_M, HP, BMP)
                valid = cols[:, None] < _n_visible(t, G, S)[None, :]
                dk, dv = _dkdv_tile(dk, dv, kc, vc, LSE, DELTA, q_base, do_base, s_qh, s_ql, s_oh, s_ol,
                                    stat_base, head, t, ok, L, valid, qk_scale, True, HEAD_DIM, BLOCK_D, PREC)
        for t0 in range(u_lo, u_hi, BMP):
            head, t, ok = _stacked_rows(t0, chunk, n_stack, L, BLOCK_M, HP, BMP)
            dk, dv = _dkdv_tile(dk, dv, kc, vc, LSE, DELTA, q_base, do_base, s_qh, s_ql, s_oh, s_ol,
                                stat_base, head, t, ok, L, 0, qk_scale, False, HEAD_DIM, BLOCK_D, PREC)

    # Partial sums: (n_split, B, C, P, d) fp32, contiguous.
    out = ((split * n_bc + bc).to(tl.int64) * P + cols[:, None]) * HEAD_DIM + d[None, :]
    tl.store(DKC + out, dk * sm_scale, mask=kmask)
    tl.store(DVC + out, dv, mask=kmask)


@triton.jit
def _delta_kernel(O, DO, DELTA, s_ob, s_oh, s_ol, s_db, s_dh, s_dl, L, n_heads,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr):
    # delta_t = <o_t, do_t> (FlashAttention-2 backward preprocessing), fp32.
    pid_bh = tl.program_id(0)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, BLOCK_D)
    m = (t[:, None] < L) & (d[None, :] < HEAD_DIM)
    o = tl.load(O + b * s_ob + h * s_oh + t[:, None] * s_ol + d[None, :], mask=m, other=0.0).to(tl.float32)
    do = tl.load(DO + b * s_db + h * s_dh + t[:, None] * s_dl + d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(DELTA + pid_bh.to(tl.int64) * L + t, tl.sum(o * do, 1), mask=t < L)


@triton.jit
def _rope_kernel(X, COS, SIN, Y, s_xb, s_xh, s_xl, s_cb, s_cl, s_yb, s_yh, s_yl, L, n_heads,
                 INVERSE: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr):
    # y = x*cos + rotate_half(x)*sin in one pass (torch's version takes ~5 passes over q);
    # INVERSE applies the transpose, i.e. the backward: dx = dy*cos + rotate_half^T(dy*sin).
    pid_bh = tl.program_id(0)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    t = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    i = tl.arange(0, BLOCK_H)
    m = (t[:, None] < L) & (i[None, :] < HALF)
    xp = X + b * s_xb + h * s_xh + t[:, None] * s_xl + i[None, :]
    cp = b * s_cb + t[:, None] * s_cl + i[None, :]
    x1 = tl.load(xp, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(COS + cp, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cp + HALF, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cp, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cp + HALF, mask=m, other=0.0).to(tl.float32)
    if INVERSE:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    yp = Y + b * s_yb + h * s_yh + t[:, None] * s_yl + i[None, :]
    tl.store(yp, y1.to(Y.dtype.element_ty), mask=m)
    tl.store(yp + HALF, y2.to(Y.dtype.element_ty), mask=m)


def _rope_launch(x, cos, sin, inverse):
    B, H, L, D = x.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid = (B * H, triton.cdiv(L, 64))
    _rope_kernel[grid](x, cos, sin, y, *_strides(x), *table_strides(cos), *_strides(y), L, H,
                       INVERSE=inverse, HALF=D // 2, BLOCK_H=triton.next_power_of_2(D // 2), BLOCK_L=64)
    return y


class _RopeFn(torch.autograd.Function):
    """``apply_rope`` fused into one pass; differentiable w.r.t. x only (the tables are constants)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rope_launch(_last_dim_contiguous(x), cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rope_launch(_last_dim_contiguous(dy), cos, sin, inverse=True), None, None


# --------------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------------
# (BLOCK_M stacked query rows, BLOCK_N keys, num_warps, num_stages) per kernel and padded head dim.
# Hopper hd128: the fastest of a sweep on an H200 at L=32K, 32/8 heads (benchmarks/attention.py --sweep); the forward
# again with TMA fetches (2026-11-24, kv pooling: 64x64 2.27 ms, 128x64 2.59, 128x128 2.59; pointers 2.58 at 64x64);
# the dk/dv kernels keep two fp32 [BLOCK_N, d] accumulators in registers: 4 warps hold only small tiles, 8 warps hold
# 64 rows x 128 keys. The raw keys' and the core tokens' dk/dv kernels have a config each (a raw key block meets ~s+g
# query rows with masked ends, a core block up to L mask-free rows); both take 64 x 128 with 8 warps (2026-11-25, two
# sweeps on an H200: the whole backward at 128K 87.6-89.6 ms against 88.3-94.4 with 32 x 64 and 4 warps, at 32K
# within the spread; dk and dv in two launches with larger tiles were 17-76% slower).
# head_dim 256 (Gemma-style): smaller tiles so that q, k and v tiles fit shared memory, not tuned.
# Ampere: same tiles, fewer stages (less shared memory). Interpreter (CPU tensors): small tiles so
# that the tests cross many tile borders.
_CONFIGS = {
    "hopper": {
        "fwd": {64: (64, 64, 4, 3), 128: (64, 64, 4, 3), 256: (64, 32, 4, 2)},
        "dq": {64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 4, 2)},
        "dkdv_raw": {64: (32, 64, 4, 3), 128: (64, 128, 8, 3), 256: (16, 32, 4, 2)},
        "dkdv_core": {64: (32, 64, 4, 3), 128: (64, 128, 8, 3), 256: (16, 32, 4, 2)},
    },
    "ampere": {
        "fwd": {64: (64, 64, 4, 2), 128: (64, 64, 4, 2), 256: (64, 32, 4, 2)},
        "dq": {64: (128, 64, 4, 2), 128: (128, 64, 8, 2), 256: (64, 32, 4, 2)},
        "dkdv_raw": {64: (32, 64, 4, 2), 128: (32, 64, 4, 2), 256: (16, 32, 4, 2)},
        "dkdv_core": {64: (32, 64, 4, 2), 128: (32, 64, 4, 2), 256: (16, 32, 4, 2)},
    },
    "interpret": {"fwd": (32, 16, 4, 1), "dq": (32, 16, 4, 1), "dkdv_raw": (32, 16, 4, 1), "dkdv_core": (32, 16, 4, 1)},
    # fp32 inputs (tests, exactness checks) double every tile's shared memory: the bf16 tiles above
    # would ask for up to 288 KB on Hopper. Speed does not matter here, fitting does.
    "fp32": {"fwd": (64, 32, 4, 1), "dq": (64, 32, 4, 1), "dkdv_raw": (32, 32, 4, 1), "dkdv_core": (32, 32, 4, 1)},
}
_MIN_ROWS_PER_HEAD = 16  # stack at most BLOCK_M // 16 query heads per tile


def _config(kind: str, block_d: int, device: torch.device, dtype: torch.dtype):
    if device.type != "cuda":
        return _CONFIGS["interpret"][kind]
    if dtype == torch.float32:
        return _CONFIGS["fp32"][kind]
    arch = "hopper" if torch.cuda.get_device_capability(device)[0] >= 9 else "ampere"
    return _CONFIGS[arch][kind][max(64, block_d)]


def _stack(n_stack: int, block_m: int):
    hp = max(1, min(n_stack, block_m // _MIN_ROWS_PER_HEAD))
    return hp, block_m // hp, triton.cdiv(n_stack, hp)


def _strides(x):
    return x.stride(0), x.stride(1), x.stride(2)


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


class _Dims:
    def __init__(self, q, k, kc, group_size, local_window, scale):
        self.B, self.H, self.L, self.D = q.shape
        self.Hkv, self.C, self.P = k.shape[1], kc.shape[1], kc.shape[2]
        self.rep = self.H // self.Hkv
        self.n_stack = self.H // self.C  # query heads per core head: r (pooling kv) or 1 (query)
        self.G, self.S = group_size, local_window
        self.block_d = max(16, triton.next_power_of_2(self.D))
        self.sm_scale = scale
        self.qk_scale = scale * _LOG2E
        # fp32 inputs are for tests: keep them exact instead of tf32.
        self.prec = "ieee" if q.dtype == torch.float32 else "tf32"


def _forward(q, k, v, kc, vc, dims, use_tma=None, q_pos=None, key_lead=0, use_gluon=None):
    # The Gluon forward walks 128-key tiles shared by two warpgroups of 64 rows, the Triton one 64-key tiles per 64
    # rows: the same softmax, rounded in another order. Its gradients are as close to fp32 as the Triton forward's:
    # on 16 tiny qwen2 checkpoints, with and without LoRA, the model-level check's worst gradient error/limit averaged
    # 0.699 against 0.698 and each forward went past 1 on 2-3 of the 32 (benchmarks/gradient_sweep.py; results/).
    # That sweep predates the Gluon softmax's FFMA (eb70f96), which left its errors against fp32 unchanged at four
    # shapes (results/attention-h100-ffma.md) and takes a positive scale (it scales each row's max of the raw scores).
    gluon = (cca_gluon is not None and use_tma is not False and dims.qk_scale > 0
             and cca_gluon.applies(q, k, v, kc, vc, dims.block_d))
    if use_gluon and not gluon:
        raise ValueError("use_gluon=True needs triton's Gluon, a Hopper (sm_90) GPU, 16-bit inputs, head_dim <= 128, "
                         "a positive scale and TMA-aligned keys/values (its tiles come by TMA: not with use_tma=False)")
    if gluon and use_gluon is not False:
        return cca_gluon.forward(q, k, v, kc, vc, dims, *_stack(dims.n_stack, cca_gluon.BLOCK_M.value), q_pos, key_lead)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((dims.B, dims.H, dims.L), dtype=torch.float32, device=q.device)
    bm, bn, warps, stages = _config("fwd", dims.block_d, q.device, q.dtype)
    hp, bmp, n_chunks = _stack(dims.n_stack, bm)
    grid = (dims.B * dims.C * n_chunks * triton.cdiv(dims.L, bmp),)
    tma = _use_tma(use_tma, "cca_attention_triton", dims.block_d, k, v, kc, vc)
    descs = descriptors(bn, dims.block_d, k, v, kc, vc) if tma else (None,) * 4
    offset = q_pos is not None
    _fwd_kernel[grid](
        q, k, v, kc, vc, *descs, o, lse, q_pos if offset else lse,
        *_strides(q), *_strides(k), *_strides(v), *_strides(kc), *_strides(vc), *_strides(o),
        dims.L, k.shape[2], key_lead, dims.P, dims.G, dims.S, dims.H, dims.C, dims.n_stack, dims.rep, n_chunks,
        dims.qk_scale,
        HEAD_DIM=dims.D, BLOCK_D=dims.block_d, BLOCK_M=bm, BLOCK_N=bn, HP=hp, BMP=bmp, PREC=dims.prec, TMA=tma,
        OFFSET=offset, num_warps=warps, num_stages=stages,
    )
    return o, lse


_SIDE_STREAMS = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The backward's second stream on this device (high priority: the pass on it is the one with long programs)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index, priority=-1)
    return _SIDE_STREAMS[index]


def _core_splits(n_blocks: int, L: int, bmp: int, device: torch.device, waves: float = 4) -> int:
    """How many splits (bands, in the Gluon kernel) of their rows the core tokens' dk/dv pass takes: enough programs
    for ~``waves`` waves of ``n_blocks`` key blocks, each split still >= 16 row blocks of ``bmp`` positions."""
    if device.type != "cuda":  # interpreter: always take the split path, so the tests cover it
        return 2
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(math.ceil(waves * n_sm / n_blocks), triton.cdiv(L, 16 * bmp)))


# Up to this many waves of the raw keys' dk/dv programs, the Gluon backward runs both dk/dv passes in one launch: two
# launches side by side measured 1.14-1.56x slower with <= 256 raw programs, one launch 1.09-1.20x slower with 512
# (H100s; benchmarks/results/attention-h100-dkdv-one-launch.md).
_ONE_LAUNCH_WAVES = 3


def _one_launch(dims, device: torch.device) -> bool:
    n_raw = dims.B * dims.Hkv * triton.cdiv(dims.L, 2 * cca_gluon.BWD_KEYS.value)
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count
    return (dims.C, dims.n_stack) == (dims.Hkv, dims.rep) and n_raw <= _ONE_LAUNCH_WAVES * n_sm


def _backward(do, q, k, v, kc, vc, o, lse, dims, use_gluon=None):
    B, H, L, D = q.shape
    common = dict(HEAD_DIM=D, BLOCK_D=dims.block_d, PREC=dims.prec)

    # The Gluon kernels (default, unless use_gluon=False) where they apply; the Triton ones elsewhere.
    gluon = use_gluon is not False and cca_gluon is not None and cca_gluon.applies(q, k, v, kc, vc, dims.block_d)
    bm, bn, warps, stages = _config("dq", dims.block_d, q.device, q.dtype)
    hp, bmp, n_chunks = _stack(dims.n_stack, bm)
    if gluon and (bm, bn) == (cca_gluon.DQ_ROWS, cca_gluon.DQ_KEYS.value):  # its tiles are the Triton kernel's
        dq, delta = cca_gluon.dq(q, k, v, kc, vc, o, do, lse, dims, hp, bmp, n_chunks)  # delta on the way
    else:
        delta = torch.empty_like(lse)
        _delta_kernel[(B * H, triton.cdiv(L, 64))](
            o, do, delta, *_strides(o), *_strides(do), L, H, HEAD_DIM=D, BLOCK_D=dims.block_d, BLOCK=64
        )
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        _dq_kernel[(B * dims.C * n_chunks * triton.cdiv(L, bmp),)](
            q, k, v, kc, vc, do, lse, delta, dq, *_strides(q), *_strides(k), *_strides(v), *_strides(kc),
            *_strides(vc), *_strides(do), *_strides(dq),
            L, dims.P, dims.G, dims.S, H, dims.C, dims.n_stack, dims.rep, n_chunks, dims.qk_scale, dims.sm_scale,
            BLOCK_M=bm, BLOCK_N=bn, HP=hp, BMP=bmp, num_warps=warps, num_stages=stages, **common,
        )

    raw_stack = _stack(dims.rep, cca_gluon.BLOCK_M.value) if gluon else None
    core_stack = _stack(dims.n_stack, cca_gluon.BLOCK_M.value) if gluon else None
    gluon_raw = gluon and cca_gluon.bwd_applies(raw_stack, q, do, k, v)
    gluon_core = gluon and dims.P > 0 and cca_gluon.bwd_applies(core_stack, q, do, kc, vc)
    n_core_blocks = B * dims.C * triton.cdiv(dims.P, 2 * cca_gluon.BWD_KEYS.value) if gluon_core else 0
    if gluon_core and gluon_raw and _one_launch(dims, q.device):  # the core tokens' programs first, then the raw keys'
        n_split = _core_splits(n_core_blocks, L, core_stack[1], q.device, waves=1.5)
        return dq, *cca_gluon.dkdv_one_launch(q, k, v, kc, vc, do, lse, delta, dims, *raw_stack, n_split=n_split)
    if gluon_core:
        # The core tokens' pass on a high-priority side stream, launched first, beside the raw keys' pass: its long
        # programs start first and the raw keys' fill the SMs it leaves idle at its end (and the other way round).
        n_split = _core_splits(n_core_blocks, L, core_stack[1], q.device)
        main, side = torch.cuda.current_stream(q.device), _side_stream(q.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            dkc, dvc = cca_gluon.dkdv(q, k, v, kc, vc, do, lse, delta, dims, *core_stack, raw=False, n_split=n_split)
    if gluon_raw:
        dk, dv = cca_gluon.dkdv(q, k, v, kc, vc, do, lse, delta, dims, *raw_stack, raw=True)
    else:
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(k.shape, dtype=v.dtype, device=v.device)
        bm, bn, warps, stages = _config("dkdv_raw", dims.block_d, q.device, q.dtype)
        hp, bmp, n_chunks = _stack(dims.rep, bm)
        _dkdv_raw_kernel[(B * dims.Hkv * triton.cdiv(L, bn),)](
            q, k, v, do, lse, delta, dk, dv, *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk),
            L, dims.G, dims.S, H, dims.Hkv, dims.rep, n_chunks, dims.qk_scale, dims.sm_scale,
            BLOCK_M=bm, BLOCK_N=bn, HP=hp, BMP=bmp, num_warps=warps, num_stages=stages, **common,
        )
    if gluon_core:
        main.wait_stream(side)
        for x in (dkc, dvc):  # made on the side stream, used and freed on this one
            x.record_stream(main)
        return dq, dk, dv, dkc, dvc

    if dims.P == 0:
        return dq, dk, dv, kc.float(), vc.float()
    bm, bn, warps, stages = _config("dkdv_core", dims.block_d, q.device, q.dtype)
    hp, bmp, n_chunks = _stack(dims.n_stack, bm)
    n_blocks = B * dims.C * triton.cdiv(dims.P, bn)
    n_split = _core_splits(n_blocks, L, bmp, q.device)
    dkc = torch.empty((n_split, B, dims.C, dims.P, D), dtype=torch.float32, device=q.device)
    dvc = torch.empty_like(dkc)
    _dkdv_core_kernel[(n_blocks * n_split,)](
        q, kc, vc, do, lse, delta, dkc, dvc, *_strides(q), *_strides(kc), *_strides(vc), *_strides(do),
        L, dims.P, dims.G, dims.S, H, dims.C, dims.n_stack, n_chunks, n_split, dims.qk_scale, dims.sm_scale,
        BLOCK_M=bm, BLOCK_N=bn, HP=hp, BMP=bmp, num_warps=warps, num_stages=stages, **common,
    )
    return dq, dk, dv, dkc, dvc  # the core tokens' fp32 partial sums: the pooling backward adds them up


class _CCAAttentionFn(torch.autograd.Function):
    """Pooling + fused CCA attention: (q_rot, k_rot, k, v) -> (out, k_core, v_core), ``k`` pre-RoPE (it is
    what is pooled); ``k`` None: the pooling un-rotates ``k_rot`` in registers, and its backward rotates that share
    of the gradient back into dk_rot."""

    @staticmethod
    def forward(ctx, q, k_rot, k, v, cos, sin, group_size, local_window, pooling, scale, use_tma, use_gluon):
        q, k_rot, k, v = (None if x is None else _last_dim_contiguous(x) for x in (q, k_rot, k, v))
        cos, sin = cos.contiguous(), sin.contiguous()
        kc, vc = pool_forward(q, k_rot, k, v, cos, sin, group_size, pooling, scale)
        dims = _Dims(q, k_rot, kc, group_size, local_window, scale)
        o, lse = _forward(q, k_rot, v, kc, vc, dims, use_tma, use_gluon=use_gluon)
        ctx.save_for_backward(q, k_rot, k, v, cos, sin, kc, vc, o, lse)
        # use_tma=False keeps every tile fetch a pointer load: the Gluon backward (TMA throughout) too
        ctx.dims, ctx.pooling, ctx.use_gluon = dims, pooling, False if use_tma is False else use_gluon
        ctx.mark_non_differentiable(kc, vc)  # returned for KV caches only
        return o, kc, vc

    @staticmethod
    def backward(ctx, do, _dkc, _dvc):
        q, k_rot, k, v, cos, sin, kc, vc, o, lse = ctx.saved_tensors
        dims = ctx.dims
        dq, dk_rot, dv, dkc, dvc = _backward(_last_dim_contiguous(do), q, k_rot, v, kc, vc, o, lse, dims,
                                             ctx.use_gluon)
        dk = pool_backward(dkc, dvc, q, k_rot, k, v, cos, sin, dq, dk_rot, dv, dims.G, ctx.pooling, dims.sm_scale)
        return dq, dk_rot, dk, dv, None, None, None, None, None, None, None, None


def cca_attention_triton(
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
    use_tma: bool | None = None,
    q_rot: torch.Tensor | None = None,
    k_rot: torch.Tensor | None = None,
    use_gluon: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CCA attention over whole sequences; same contract as ``cca_attention_reference``.

    ``q`` (B, H, L, d), ``k``/``v`` (B, Hkv, L, d), pre-RoPE; ``cos``/``sin`` (L, d), (1, L, d) or (B, L, d).
    Differentiable w.r.t. q, k, v. Inputs fp16/bf16 (fp32 accumulation) or fp32; any strides with
    a contiguous last dim; even head_dim <= 256 (padded to a power of two inside the kernels).
    ``use_tma``: the forward fetches key/value tiles with TMA descriptors (``tma.py``; default: on a Hopper or newer
    GPU, head dims <= 128, aligned rows); the Triton kernels give the same numbers both ways. False also keeps the
    forward and the backward off the Gluon kernels (they fetch by TMA).
    ``q_rot``/``k_rot``: q and k already rotated with these tables (a model's own RoPE), used as given (no RoPE pass);
    ``q`` may then be None, and ``k`` too: the pooling then un-rotates ``k_rot`` itself (``unapply_rope``, in
    registers), so a model that rotated both needs no pass to undo its RoPE.
    ``use_gluon``: ``cca_gluon``'s warp-specialized Hopper kernels (an sm_90 GPU, triton 3.6, TMA-aligned 16-bit
    tensors, head_dim <= 128). None (default): wherever they apply (the forward; the backward's dq, and its dk/dv where
    GQA heads are stacked, with the Triton kernels' numbers); True: the same, and an error where the forward cannot
    run; False: Triton kernels only.
    """
    check_args(group_size, local_window, pooling)
    check_given(q, k, q_rot, k_rot)
    shape = (q if q_rot is None else q_rot).shape
    head_dim = shape[-1]
    if head_dim % 2 or head_dim > 256:
        raise ValueError(f"the Triton CCA kernel supports even head_dim <= 256, got {head_dim}; "
                         "use attn_backend='reference' for this model")
    if cos.shape[-2:] != (shape[2], head_dim) or (cos.dim() == 3 and cos.shape[0] not in (1, shape[0])):
        raise ValueError(f"cos/sin must be (L, d), (1, L, d) or (B, L, d) for q {tuple(shape)}, got {tuple(cos.shape)}")
    scale = head_dim**-0.5 if scale is None else scale
    q_rot = _RopeFn.apply(q, cos, sin) if q_rot is None else q_rot
    k_rot = _RopeFn.apply(k, cos, sin) if k_rot is None else k_rot
    out, k_core, v_core = _CCAAttentionFn.apply(q_rot, k_rot, k, v, cos, sin, group_size, local_window, pooling, scale,
                                                use_tma, use_gluon)
    return (out, k_core, v_core) if return_core else out


def cca_chunk_attention_triton(
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
    use_tma: bool | None = None,
) -> torch.Tensor:
    """CCA attention of a chunk of queries that starts at a per-row position (a chunk after a prefill); same contract
    as ``cca_chunk_attention_reference``. Forward only (inference); the forward kernel of whole sequences, with its
    rows and raw key columns offset (the Gluon one where it applies, as for whole sequences: a chunk starting on a
    multiple of 128 positions then gives one pass's numbers)."""
    check_chunk_args(q_rot, k_raw, key_lead, group_size, local_window)
    if q_rot.shape[-1] % 2 or q_rot.shape[-1] > 256:
        raise ValueError(f"the Triton CCA kernel supports even head_dim <= 256, got {q_rot.shape[-1]}")
    q_rot, k_raw, v_raw, core_k, core_v = (_last_dim_contiguous(x) for x in (q_rot, k_raw, v_raw, core_k, core_v))
    dims = _Dims(q_rot, k_raw, core_k, group_size, local_window, scale)
    return _forward(q_rot, k_raw, v_raw, core_k, core_v, dims, use_tma, q_pos.to(torch.int32).contiguous(), key_lead)[0]
