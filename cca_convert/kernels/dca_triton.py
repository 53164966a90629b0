"""Triton kernel for Dual Chunk Attention (forward: prefill, chunked prefill and decode). ``dca_reference.py`` is its
twin; DCA-SPEC.md the contract.

One FlashAttention-2 style pass with ONE online softmax per query row. A query's keys split into three contiguous
position ranges, ``inter [0, (n-1)s)``, ``succ [(n-1)s, ns)`` and ``intra [ns, i]`` (``n`` its chunk), and each range
is read with its own rotation of the query (at ``min(2s-1, C)``, ``min(o+s, C)``, ``o``). So a program walks the key
tiles of each range with that range's query tile: no per-element choice between three dot products, no three-call
LSE merge. A key tile straddling a chunk boundary is visited by both ranges with complementary masks (one extra dot
per boundary). Keys come rotated once at ``j % s`` (the cache layout). Queries arrive before RoPE and are rotated in
the prologue from a cos/sin table of the positions ``0..C`` (every query position DCA uses lies there), then scaled by
``scale * T * log2(e)``: no (3, B, H, L, d) pre-rotated copy in memory, no extra launches. Row tiles run heaviest
first (the causal tail is the short tiles).

Key/value tiles come by TMA (``tma.py``) on Hopper and newer GPUs, decode's small split tiles included. On a Hopper GPU
with triton 3.6, prefill passes with query rows enough to fill the GPU without splitting the keys run ``dca_gluon``
instead: the same algorithm, warp-specialized (a TMA load warp, two ping-pong consumer warpgroups), as
FlashAttention-3.

GQA-native: a program owns one KV head and stacks ``HP`` of its query heads as rows of one tile (all ``r`` of them
for decode), so a key/value tile is loaded once for all of them; no ``repeat_kv``.
Left padding: keys of sequence ``b`` sit at columns ``kstart[b]..`` (pads first, as transformers lays them out);
key position = column - kstart[b]. Decode splits the key columns over more programs (flash-decoding); a second small
kernel merges the splits by their log-sum-exps. Forward only: a DCA model is used training-free (the PyTorch twin
is differentiable).
"""

import functools

import torch
import triton
import triton.language as tl

from .dca_params import check_params
from .rope_triton import eager_rope
from .tma import descriptors, use_tma as _use_tma

try:  # the Hopper prefill kernel (Gluon: triton 3.6); without it this file's kernel serves every GPU. The first line's
    # spelling matters: transformers fetches from the Hub, and save_pretrained copies, only the files a module imports
    # as `from .name import ...` (not `from . import name`).
    from .dca_gluon import applies as _gluon_applies  # noqa: F401
    from . import dca_gluon
except ImportError:
    dca_gluon = None

_LOG2E = 1.4426950408889634


@triton.jit
def _tile(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, b, g, n0, lo, hi, Lk, stride_kn, stride_vn, d, dmask,
          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
          PREC: tl.constexpr, TMA: tl.constexpr):
    """One key tile into the running softmax. Interior tiles (every row sees every column) skip the masks."""
    cols = n0 + tl.arange(0, BLOCK_N)
    k_ptr = k_base + cols[:, None] * stride_kn + d[None, :]
    v_ptr = v_base + cols[:, None] * stride_vn + d[None, :]
    if TMA:  # the copy engine fetches the tiles (zeros past Lk and past the head dim): no address math, fewer registers
        k = k_desc.load([b, g, n0, 0]).reshape(BLOCK_N, BLOCK_D)
        v = v_desc.load([b, g, n0, 0]).reshape(BLOCK_N, BLOCK_D)
    elif MASKED:
        cmask = cols < Lk
        k = tl.load(k_ptr, mask=cmask[:, None] & dmask[None, :], other=0.0)
        v = tl.load(v_ptr, mask=cmask[:, None] & dmask[None, :], other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptr)
        v = tl.load(v_ptr)
    else:
        k = tl.load(k_ptr, mask=dmask[None, :], other=0.0)
        v = tl.load(v_ptr, mask=dmask[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if MASKED:
        inside = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        s = tl.where(inside, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: no NaN
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if TMA:  # the accumulating form: 1-2% faster prefill (the pointer path keeps the other)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _dca_fwd(Q, K, V, K_DESC, V_DESC, O, LSE, QPOS, KSTART, ROPE, TEMP, qk_scale,
             stride_qb, stride_qh, stride_qm,
             stride_kb, stride_kh, stride_kn,
             stride_vb, stride_vh, stride_vn,
             stride_os, stride_ob, stride_oh, stride_om,
             stride_ls, stride_lb, stride_lh,
             Hkv, Lq, Lk, REP, N_CHUNKS, S_LEN, CHUNK, SPLIT_COLS,
             SPLIT_BY_SPAN: tl.constexpr,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROT_HALF: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, HP: tl.constexpr, BMP: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr):
    pid_bh, pid_s = tl.program_id(0), tl.program_id(2)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)  # heaviest row tiles first: the tail of the grid is short
    chunk = pid_bh % N_CHUNKS
    g = (pid_bh // N_CHUNKS) % Hkv
    b = pid_bh // (N_CHUNKS * Hkv)
    i = tl.arange(0, BLOCK_M)
    hr = chunk * HP + i // BMP  # query head within the KV group
    t = pid_m * BMP + i % BMP  # query row
    ok = (hr < REP) & (t < Lq) & (i // BMP < HP)
    head = g * REP + hr
    qpos = tl.load(QPOS + b * Lq + t, mask=ok, other=-1)
    ok = ok & (qpos >= 0)  # pad queries: no keys, output 0
    pos = tl.where(ok, qpos, 0)
    kstart = tl.load(KSTART + b)
    # key-column ranges of the three parts, per row (empty for pad rows), clipped to this split's columns
    intra_lo = (pos // S_LEN) * S_LEN
    succ_lo = tl.maximum(intra_lo - S_LEN, 0)
    split_cols = SPLIT_COLS
    if SPLIT_BY_SPAN:  # the splits share the columns the rows attend to (device-side: a cache's spare room is skipped)
        span = tl.max(tl.where(ok, pos, -1), 0) + 1 + kstart
        split_cols = ((span + tl.num_programs(2) - 1) // tl.num_programs(2) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    col_lo = pid_s * split_cols
    col_hi = col_lo + split_cols

    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    b64 = b.to(tl.int64)
    k_base = K + b64 * stride_kb + g.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + g.to(tl.int64) * stride_vh
    # the query before RoPE and its NeoX partner (rotate_half: -x[d + r/2] below r/2, x[d - r/2] above), fp32
    rot = d < 2 * ROT_HALF
    partner = tl.where(d < ROT_HALF, d + ROT_HALF, d - ROT_HALF)
    q_row = Q + b64 * stride_qb + head.to(tl.int64)[:, None] * stride_qh + t[:, None] * stride_qm
    x = tl.load(q_row + d[None, :], mask=ok[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    xp = tl.load(q_row + partner[None, :], mask=ok[:, None] & rot[None, :], other=0.0).to(tl.float32)
    xp = tl.where((d < ROT_HALF)[None, :], -xp, xp)
    freq = tl.where(rot, d % ROT_HALF, 0)
    mult = qk_scale
    if TEMP is not None:
        mult = mult * tl.load(TEMP + b)
    o_i = pos % S_LEN

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for part in tl.static_range(3):  # 0 inter, 1 succ, 2 intra
        if part == 0:
            lo, hi = tl.zeros_like(pos), succ_lo
            qrope = tl.zeros_like(pos) + tl.minimum(2 * S_LEN - 1, CHUNK)
        elif part == 1:
            lo, hi = succ_lo, intra_lo
            qrope = tl.minimum(o_i + S_LEN, CHUNK)
        else:
            lo, hi = intra_lo, pos + 1
            qrope = o_i
        lo = tl.maximum(lo + kstart, col_lo)
        hi = tl.where(ok, tl.minimum(hi + kstart, col_hi), 0)
        live = hi > lo
        start = (tl.min(tl.where(live, lo, Lk), 0) // BLOCK_N) * BLOCK_N
        end = tl.max(tl.where(live, hi, 0), 0)
        if end > start:
            # this part's rotation of the query: table rows [cos | sin] at its RoPE position (0..C)
            tab = ROPE + qrope[:, None] * (2 * ROT_HALF) + freq[None, :]
            cos = tl.load(tab, mask=rot[None, :], other=1.0)
            sin = tl.load(tab + ROT_HALF, mask=rot[None, :], other=0.0)
            q = ((x * cos + xp * sin) * mult).to(K.dtype.element_ty)
            # tiles every live row sees whole: [inner_lo, inner_hi) without masks; the edges with them
            inner_lo = tl.minimum(((tl.max(tl.where(live, lo, 0), 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, end)
            inner_hi = tl.maximum((tl.min(tl.where(live, hi, Lk), 0) // BLOCK_N) * BLOCK_N, inner_lo)
            if tl.min(tl.where(ok, live.to(tl.int32), 1), 0) == 0:  # a real row without keys here: mask all
                inner_lo = end
                inner_hi = end
            for n0 in range(start, inner_lo, BLOCK_N):
                acc, m_i, l_i = _tile(acc, m_i, l_i, q, k_base, v_base, K_DESC, V_DESC, b, g, n0, lo, hi, Lk,
                                      stride_kn, stride_vn, d, dmask, BLOCK_N, BLOCK_D, True, HEAD_DIM == BLOCK_D,
                                      PREC, TMA)
            for n0 in range(inner_lo, inner_hi, BLOCK_N):
                acc, m_i, l_i = _tile(acc, m_i, l_i, q, k_base, v_base, K_DESC, V_DESC, b, g, n0, lo, hi, Lk,
                                      stride_kn, stride_vn, d, dmask, BLOCK_N, BLOCK_D, False, HEAD_DIM == BLOCK_D,
                                      PREC, TMA)
            for n0 in range(inner_hi, end, BLOCK_N):
                acc, m_i, l_i = _tile(acc, m_i, l_i, q, k_base, v_base, K_DESC, V_DESC, b, g, n0, lo, hi, Lk,
                                      stride_kn, stride_vn, d, dmask, BLOCK_N, BLOCK_D, True, HEAD_DIM == BLOCK_D,
                                      PREC, TMA)
    has = (l_i > 0) & ok  # pad rows may have run interior tiles (with q = 0): their output is defined as 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    o_ptr = O + pid_s * stride_os + b64 * stride_ob + head.to(tl.int64)[:, None] * stride_oh + t[:, None] * stride_om
    wmask = (hr < REP) & (t < Lq) & (i // BMP < HP)
    tl.store(o_ptr + d[None, :], out.to(O.dtype.element_ty), mask=wmask[:, None] & dmask[None, :])
    if LSE is not None:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(LSE + pid_s * stride_ls + b64 * stride_lb + head * stride_lh + t, lse, mask=wmask)


@triton.jit
def _merge_splits(PARTS, LSE, O, n_splits, H, Lq,
                  stride_ps, stride_pb, stride_ph, stride_pm, stride_ls, stride_lb, stride_lh,
                  stride_ob, stride_oh, stride_om,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One output row from the splits' normalised partial outputs, weighted by their log2-sum-exps (-inf: empty)."""
    row = tl.program_id(0)
    t = row % Lq
    h = (row // Lq) % H
    b = row // (Lq * H)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(LSE + sp * stride_ls + b * stride_lb + h * stride_lh + t, mask=sp < n_splits, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.math.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    w = w / tl.maximum(tl.sum(w, 0), 1e-30)
    parts = tl.load(PARTS + sp[:, None] * stride_ps + b * stride_pb + h * stride_ph + t * stride_pm + d[None, :],
                    mask=(sp < n_splits)[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(w[:, None] * parts, 0)
    tl.store(O + b * stride_ob + h * stride_oh + t * stride_om + d, out.to(O.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _family_round_trip(row, fcos, fsin, icos, isin, hmask, h, ROT_HALF: tl.constexpr):
    """Rows of q or k before the family's RoPE -> its RoPE (tables ``fcos``, ``fsin`` at the rows' tokens) in their
    dtype -> its inverse (``icos``, ``isin``: ``attention_hooks.inverse_rope``'s) in fp32, each op rounded as the eager
    op (``attention_hooks.unrope`` of the rotated rows; the launch keeps products out of the sums): both halves, fp32."""
    x1 = tl.load(row + h[None, :], mask=hmask, other=0.0)
    x2 = tl.load(row + ROT_HALF + h[None, :], mask=hmask, other=0.0)
    c1 = tl.load(fcos, mask=hmask, other=0.0).to(tl.float32)
    c2 = tl.load(fcos + ROT_HALF, mask=hmask, other=0.0).to(tl.float32)
    s1 = tl.load(fsin, mask=hmask, other=0.0).to(tl.float32)
    s2 = tl.load(fsin + ROT_HALF, mask=hmask, other=0.0).to(tl.float32)
    r1 = eager_rope(x1, x2, c1, s1, -1.0).to(tl.float32)
    r2 = eager_rope(x2, x1, c2, s2, 1.0).to(tl.float32)
    c1, c2 = tl.load(icos, mask=hmask, other=0.0), tl.load(icos + ROT_HALF, mask=hmask, other=0.0)
    s1, s2 = tl.load(isin, mask=hmask, other=0.0), tl.load(isin + ROT_HALF, mask=hmask, other=0.0)
    return eager_rope(r1, r2, c1, s1, -1.0), eager_rope(r2, r1, c2, s2, 1.0)


@triton.jit
def _rotate_keys(K, OUT, KPOS, ROPE, COLS, V, V_OUT, POS_OUT, VALID, VALID_OUT, Q, Q_OUT, FCOS, FSIN, ICOS, ISIN,
                 stride_kb, stride_kh, stride_kn, stride_ob, stride_oh, stride_on,
                 stride_vb, stride_vh, stride_vn, stride_wb, stride_wh, stride_wn, stride_pb, stride_qb, stride_rb,
                 stride_xb, stride_xh, stride_xn, stride_yb, stride_yh, stride_yn, stride_fb, stride_fn,
                 stride_ib, stride_in,
                 Hkv, Lk, S_LEN, REP, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROT_HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, APPEND: tl.constexpr,
                 UNROPE: tl.constexpr):
    """Keys rotated at ``j % s`` (``dca_reference.rotate_keys``) from the same cos/sin table as the queries, by halves
    (x1, x2 -> x1 cos - x2 sin, x2 cos + x1 sin: each table entry and key element read once); dims past the rotary
    ones copied. APPEND: written at the cache columns ``COLS`` instead, with the values, positions and validity beside
    them (what ``DCALayerCache.append`` does in four index copies). UNROPE: ``K`` and the queries ``Q`` are a captured
    step's, which the family's RoPE left un-rotated; they first take the family's RoPE and its inverse as the eager
    step computes them (``_family_round_trip``), and the queries are written to ``Q_OUT``."""
    pid_bh, pid_n = tl.program_id(0), tl.program_id(1)
    b, g = pid_bh // Hkv, pid_bh % Hkv
    n = pid_n * BLOCK + tl.arange(0, BLOCK)
    rows = n < Lk
    h = tl.arange(0, BLOCK_H)
    hmask = rows[:, None] & (h < ROT_HALF)[None, :]
    k_row = K + b.to(tl.int64) * stride_kb + g * stride_kh + n.to(tl.int64)[:, None] * stride_kn
    if UNROPE:
        n64 = n.to(tl.int64)[:, None]
        fcos = FCOS + b.to(tl.int64) * stride_fb + n64 * stride_fn + h[None, :]
        fsin = FSIN + b.to(tl.int64) * stride_fb + n64 * stride_fn + h[None, :]
        icos = ICOS + b.to(tl.int64) * stride_ib + n64 * stride_in + h[None, :]
        isin = ISIN + b.to(tl.int64) * stride_ib + n64 * stride_in + h[None, :]
        x1, x2 = _family_round_trip(k_row, fcos, fsin, icos, isin, hmask, h, ROT_HALF)
        for r in range(REP):  # the KV head's query heads, back before the RoPE, in the values' dtype
            head = (g * REP + r).to(tl.int64)
            q1, q2 = _family_round_trip(Q + b.to(tl.int64) * stride_xb + head * stride_xh + n64 * stride_xn,
                                        fcos, fsin, icos, isin, hmask, h, ROT_HALF)
            y_row = Q_OUT + b.to(tl.int64) * stride_yb + head * stride_yh + n64 * stride_yn
            tl.store(y_row + h[None, :], q1.to(Q_OUT.dtype.element_ty), mask=hmask)
            tl.store(y_row + ROT_HALF + h[None, :], q2.to(Q_OUT.dtype.element_ty), mask=hmask)
    else:
        x1 = tl.load(k_row + h[None, :], mask=hmask, other=0.0).to(tl.float32)
        x2 = tl.load(k_row + ROT_HALF + h[None, :], mask=hmask, other=0.0).to(tl.float32)
    kpos = tl.load(KPOS + b * Lk + n, mask=rows, other=0)
    tab = ROPE + (tl.maximum(kpos, 0) % S_LEN)[:, None] * (2 * ROT_HALF) + h[None, :]
    cos = tl.load(tab, mask=hmask, other=1.0)
    sin = tl.load(tab + ROT_HALF, mask=hmask, other=0.0)
    col = n.to(tl.int64)
    if APPEND:
        col = tl.load(COLS + n, mask=rows, other=0).to(tl.int64)
    o_row = OUT + b.to(tl.int64) * stride_ob + g * stride_oh + col[:, None] * stride_on
    # the twin's x * cos + rotate_half(x) * sin, term for term
    tl.store(o_row + h[None, :], (x1 * cos + (-x2) * sin).to(OUT.dtype.element_ty), mask=hmask)
    tl.store(o_row + ROT_HALF + h[None, :], (x2 * cos + x1 * sin).to(OUT.dtype.element_ty), mask=hmask)
    if BLOCK_R > 0:  # partial rotary: the dims past the rotary ones pass through
        r = 2 * ROT_HALF + tl.arange(0, BLOCK_R)
        rmask = rows[:, None] & (r < HEAD_DIM)[None, :]
        tl.store(o_row + r[None, :], tl.load(k_row + r[None, :], mask=rmask).to(OUT.dtype.element_ty), mask=rmask)
    if APPEND:
        d = tl.arange(0, BLOCK_D)
        dmask = rows[:, None] & (d < HEAD_DIM)[None, :]
        v_row = V + b.to(tl.int64) * stride_vb + g * stride_vh + n.to(tl.int64)[:, None] * stride_vn
        w_row = V_OUT + b.to(tl.int64) * stride_wb + g * stride_wh + col[:, None] * stride_wn
        tl.store(w_row + d[None, :], tl.load(v_row + d[None, :], mask=dmask), mask=dmask)
        if g == 0:
            tl.store(POS_OUT + b.to(tl.int64) * stride_pb + col, kpos.to(POS_OUT.dtype.element_ty), mask=rows)
            valid = tl.load(VALID + b * stride_qb + n, mask=rows)
            tl.store(VALID_OUT + b.to(tl.int64) * stride_rb + col, valid, mask=rows)


# (BLOCK_M, BLOCK_N, num_warps, num_stages); interpreter: small tiles so that tests cross many tile borders.
# prefill: the fastest of benchmarks/dca.py --sweep on an H200 at 32K (then 31.2 ms; 64-key tiles 31.6, 64-row 32.4);
# with TMA fetches (exp sweep, 2026-11-24): 128x128 17.45 ms, 128x64 19.25, 128x128 2 stages 20.45.
# decode: the fastest of benchmarks/dca.py --decode-sweep (in CUDA graphs, 2026-11-28), "decode_wide" where a split
# holds >= _WIDE_SPLIT columns (batch 16 at 32K and 128K: 552 -> 502 us, 2139 -> 1909 us; batch 1 keeps 64-key tiles).
_CONFIGS = {"prefill": (128, 128, 8, 3), "decode": (16, 64, 4, 3), "decode_wide": (16, 128, 4, 3),
            "fp32": (64, 32, 4, 1), "interpret": (16, 16, 4, 1)}
_WIDE_SPLIT = 8192
_MIN_ROWS_PER_HEAD = 128  # prefill: one query head per tile (stacking two 64-row heads measured no faster)
# decode (flash-decoding): key columns split until there are _DECODE_WAVES programs per SM, at most one split per
# _SPLIT_COLUMNS columns (512: 25.1 -> 18.8 us at 8K, batch 1; the same splits as 1024 from 16K on)
_DECODE_WAVES, _SPLIT_COLUMNS = 2, 512


def rope_table(inv_freq, chunk_size, attention_factor=1.0):
    """(C + 1, rotary_dim) fp32: rows ``[cos | sin]`` (each ``rotary_dim / 2`` wide, times ``attention_factor``) at
    the positions ``0..C``, the only ones DCA rotates a query to; computed as ``dca_reference.rope_at`` does."""
    ang = torch.arange(chunk_size + 1, device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq.float()
    return torch.cat([ang.cos(), ang.sin()], -1).mul_(attention_factor).contiguous()


def rotate_keys_triton(k, kpos, chunk_size, local_size, table, dtype=None):
    """``dca_reference.rotate_keys`` in one launch: ``k`` (B, Hkv, Lk, d) rotated at ``kpos % s`` (pads: any
    position), returned in ``dtype`` (default ``k``'s); ``table`` = ``rope_table(inv_freq, chunk_size, ...)``."""
    out = torch.empty(k.shape, device=k.device, dtype=dtype or k.dtype)
    _launch_rotate(k, kpos.to(torch.int32).contiguous(), chunk_size, local_size, table, out)
    return out


def append_rotated_triton(k, v, pos, valid, columns, chunk_size, local_size, table, buffers, deferred=None):
    """A cache pass in one launch: ``k`` (B, Hkv, n, d) rotated at ``pos % s`` into ``buffers[0]`` at the columns
    ``columns`` (n,), and ``v``, ``pos`` (B, n) and ``valid`` (B, n) into ``buffers[1..3]`` there: what
    ``rotate_keys_triton`` then four ``index_copy_`` do (``DCALayerCache.append``).

    deferred: ``(q, cos, sin, icos, isin)`` for a captured step's q (B, H, n, d) and k, which the family's RoPE left
    un-rotated (``decode_graph._deferring``), its tables (B, n, d) and their inverse (``inverse_rope(cos, sin)``):
    both first take what the eager step computes from them, the family's RoPE then its inverse in fp32
    (``decode_graph.rope_round_trip``, bit for bit), in this launch; returns the queries in ``v``'s dtype."""
    keys, values, positions, validity = buffers
    if (v.dtype != values.dtype or keys.shape[:2] != k.shape[:2] or values.shape[:2] != v.shape[:2]
            or pos.shape != valid.shape or any(x.stride(-1) != 1 for x in (keys, values, positions, validity))):
        raise ValueError("append_rotated_triton: the pass's tensors do not match the cache's buffers")
    pos = pos if pos.stride(-1) == 1 else pos.contiguous()
    valid = valid if valid.stride(-1) == 1 else valid.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    q_out = None
    if deferred is not None:
        q, cos, sin, icos, isin = deferred
        bsz, _, n, head_dim = k.shape
        if (q.shape[0] != bsz or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1] or q.dtype != k.dtype
                or table.shape[1] != head_dim or icos.dtype != torch.float32):
            raise ValueError("append_rotated_triton: a deferred RoPE needs q/k of one dtype, full-width tables and "
                             "fp32 inverse tables")
        # (1, n, d) tables (one set of positions) serve every row
        cos, sin, icos, isin = (t.expand(bsz, n, head_dim) for t in (cos, sin, icos, isin))
        if cos.stride() != sin.stride() or cos.stride(-1) != 1:
            cos, sin = cos.contiguous(), sin.contiguous()
        if icos.stride() != isin.stride() or icos.stride(-1) != 1:
            icos, isin = icos.contiguous(), isin.contiguous()
        q = q if q.stride(-1) == 1 else q.contiguous()
        q_out = torch.empty(bsz, n, q.shape[1], head_dim, device=q.device, dtype=v.dtype).transpose(1, 2)
        deferred = (q, q_out, cos, sin, icos, isin)
    _launch_rotate(k, pos, chunk_size, local_size, table, keys, columns.contiguous(), v, values, positions,
                   valid, validity, deferred)
    return q_out


def _launch_rotate(k, kpos, chunk_size, local_size, table, out, columns=None, v=None, v_out=None, pos_out=None,
                   valid=None, valid_out=None, deferred=None):
    bsz, n_kv, k_len, head_dim = k.shape
    k = k if k.stride(-1) == 1 else k.contiguous()
    append = columns is not None
    v_strides = (*v.stride()[:3], *v_out.stride()[:3]) if append else (0,) * 6
    m_strides = (pos_out.stride(0), valid.stride(0), valid_out.stride(0)) if append else (0,) * 3
    q, q_out, cos, sin, icos, isin = deferred or (None,) * 6
    q_strides = (*q.stride()[:3], *q_out.stride()[:3], *cos.stride()[:2], *icos.stride()[:2]) if deferred else (0,) * 10
    block = 16 if k.device.type != "cuda" else 64
    rot_half = table.shape[1] // 2
    rest = head_dim - 2 * rot_half
    # enable_fp_fusion=False: each product rounded before its sum, as eager ops round (a deferred RoPE's round trip
    # then gives the eager step's numbers)
    _rotate_keys[(bsz * n_kv, triton.cdiv(k_len, block))](
        k, out, kpos, table, columns, v, v_out, pos_out, valid, valid_out, q, q_out, cos, sin, icos, isin,
        *k.stride()[:3], *out.stride()[:3], *v_strides, *m_strides, *q_strides, n_kv, k_len, chunk_size - local_size,
        q.shape[1] // n_kv if deferred else 1, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), ROT_HALF=rot_half,
        BLOCK_H=max(16, triton.next_power_of_2(rot_half)), BLOCK_R=triton.next_power_of_2(rest) if rest else 0,
        BLOCK=block, APPEND=append, UNROPE=deferred is not None, num_warps=4, enable_fp_fusion=False)


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def dca_attention_triton(q, k_rot, v, qpos, kstart, chunk_size, local_size, inv_freq, scale, temp=None,
                         attention_factor=1.0, splits: int | None = None, table=None, use_tma: bool | None = None,
                         split_by_span: bool = False, use_gluon: bool | None = None):
    """DCA attention output (B, H, Lq, d) in ``v``'s dtype.

    q (B, H, Lq, d) before RoPE; k_rot (B, Hkv, Lk, d) keys rotated at ``j % s`` (``dca_reference.rotate_keys``);
    v (B, Hkv, Lk, d);
    qpos (B, Lq) absolute query positions, -1 for pad queries; kstart (B,) the number of leading pad columns of each
    sequence (key position = column - kstart); temp (B,) the temperature T per sequence (None: 1);
    table: ``rope_table(inv_freq, chunk_size, attention_factor)``, which a caller running many layers computes once.
    use_tma: fetch key/value tiles with TMA descriptors (default: on a Hopper or newer GPU when the rows are 16-byte
    aligned. On an H200 the prefill at 32K: 20.5 -> 17.4 ms; decode per layer at batch 1: 42.2 -> 41.1 us at 32K,
    133.1 -> 131.6 at 128K, batch 64 at 8K: 510 -> 484). Both give the same numbers.
    split_by_span: decode tiles split the columns their rows attend to, found on the device, instead of ``k_rot``'s
    columns: for keys in a buffer longer than the sequence (a DCA cache's spare room, read whole by a CUDA-graph step).
    Where the keys end at the last query it gives the static splits' numbers.
    use_gluon: the Hopper kernel (``dca_gluon``) for a prefill pass with query rows enough to fill the GPU without
    splitting the keys (default: where ``dca_gluon.applies``, unless ``use_tma`` is False; the kernel at 32K: 17.6 ->
    15.0 ms on an H200); True: it or a clear error; False: this file's kernel.
    """
    check_params(chunk_size, local_size)
    bsz, n_heads, q_len, head_dim = q.shape
    n_kv, k_len = k_rot.shape[1], k_rot.shape[2]
    if n_heads % n_kv or v.shape != k_rot.shape or k_rot.dtype != v.dtype:
        raise ValueError(f"dca_attention_triton: bad shapes/dtypes q {tuple(q.shape)}, k {tuple(k_rot.shape)} "
                         f"{k_rot.dtype}, v {tuple(v.shape)} {v.dtype}")
    rep = n_heads // n_kv
    dtype = v.dtype
    if table is None:
        table = rope_table(inv_freq, chunk_size, attention_factor)
    if table.shape != (chunk_size + 1, 2 * inv_freq.shape[0]) or table.dtype != torch.float32:
        raise ValueError(f"dca_attention_triton: the RoPE table must be rope_table(inv_freq, {chunk_size}, ...), "
                         f"got {tuple(table.shape)} {table.dtype}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_rot = k_rot if k_rot.stride(-1) == 1 else k_rot.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if q.device.type != "cuda":
        config = "interpret"
    elif dtype == torch.float32:
        config = "fp32"
    else:
        config = "decode" if q_len * rep <= 16 else "prefill"
    block_m, block_n, warps, stages = _CONFIGS[config]
    if q_len * rep <= block_m:  # decode / short passes: every query head of the group in one tile
        hp = min(rep, block_m)
        bmp = block_m // hp
    else:
        hp = max(1, min(rep, block_m // min(_MIN_ROWS_PER_HEAD, block_m)))
        bmp = block_m // hp
    n_chunks = triton.cdiv(rep, hp)
    m_tiles = triton.cdiv(q_len, bmp)
    programs = m_tiles * bsz * n_kv * n_chunks
    if splits is None:  # flash-decoding: enough programs to fill the GPU when there are few query tiles
        sms = _sm_count(q.device)
        splits = max(1, min(triton.cdiv(_DECODE_WAVES * sms, programs), triton.cdiv(k_len, _SPLIT_COLUMNS)))
    split_cols = triton.cdiv(triton.cdiv(k_len, splits), block_n) * block_n
    if config == "decode" and split_cols >= _WIDE_SPLIT:
        block_m, block_n, warps, stages = _CONFIGS["decode_wide"]
        split_cols = triton.cdiv(triton.cdiv(k_len, splits), block_n) * block_n
    by_span = split_by_span and q_len * rep <= 16 and splits > 1
    if not by_span:
        splits = triton.cdiv(k_len, split_cols) if k_len else 1
    qpos32, kstart32 = qpos.to(torch.int32).contiguous(), kstart.to(torch.int32).contiguous()
    temp = None if temp is None else temp.to(device=q.device, dtype=torch.float32).contiguous()
    out = torch.empty(bsz, q_len, n_heads, head_dim, device=q.device, dtype=dtype).transpose(1, 2)
    gluon = (dca_gluon is not None and use_gluon is not False and use_tma is not False and config == "prefill"
             and dca_gluon.applies(q, k_rot, v, inv_freq.shape[0], splits))
    if use_gluon and not gluon:
        raise ValueError("dca_attention_triton: use_gluon=True needs triton 3.6's Gluon, a Hopper (sm_90) GPU, 16-bit "
                         "inputs, head_dim 64 or 128 rotated whole, query rows enough for one split (>= 2 programs "
                         "per SM), TMA-fetchable keys")
    if gluon:
        return dca_gluon.forward(q, k_rot, v, out, qpos32, kstart32, table, temp, scale * _LOG2E, chunk_size,
                                 local_size)
    if splits == 1:
        o_arg, lse = out.unsqueeze(0), None
        lse_strides = (0, 0, 0)
    else:
        o_arg = torch.empty(splits, bsz, n_heads, q_len, head_dim, device=q.device, dtype=torch.float32)
        lse = torch.empty(splits, bsz, n_heads, q_len, device=q.device, dtype=torch.float32)
        lse_strides = lse.stride()[:3]
    block_d = max(16, triton.next_power_of_2(head_dim))
    grid = (bsz * n_kv * n_chunks, m_tiles, splits)
    use_tma = _use_tma(use_tma, "dca_attention_triton", block_d, k_rot, v)
    k_desc, v_desc = descriptors(block_n, block_d, k_rot, v) if use_tma else (None, None)
    _dca_fwd[grid](
        q, k_rot, v, k_desc, v_desc, o_arg, lse, qpos32, kstart32, table, temp, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        *k_rot.stride()[:3], *v.stride()[:3],
        *o_arg.stride()[:4], *lse_strides,
        n_kv, q_len, k_len, rep, n_chunks, chunk_size - local_size, chunk_size, split_cols,
        SPLIT_BY_SPAN=by_span,
        HEAD_DIM=head_dim, BLOCK_D=block_d, ROT_HALF=inv_freq.shape[0], BLOCK_M=block_m, BLOCK_N=block_n,
        HP=hp, BMP=bmp, PREC="ieee" if dtype == torch.float32 else "tf32", TMA=use_tma,
        num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        _merge_splits[(bsz * n_heads * q_len,)](
            o_arg, lse, out, splits, n_heads, q_len, *o_arg.stride()[:4], *lse.stride()[:3], *out.stride()[:3],
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(splits)), num_warps=4)
    return out


__all__ = ["append_rotated_triton", "dca_attention_triton", "rope_table", "rotate_keys_triton"]
