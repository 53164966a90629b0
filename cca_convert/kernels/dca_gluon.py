"""Hopper kernel of DCA prefill attention, written in Gluon: FlashAttention-3's warp specialization.

Same contract as ``dca_triton._dca_fwd`` for a pass of whole row tiles (no column splits), and the same algorithm:
one online softmax per query row over three key ranges (inter, succ, intra), each read with its own rotation of the
query, which the kernel computes from the pre-RoPE query and the cos/sin table of positions ``0..C``. The structure
is ``cca_gluon``'s forward:

- a work item is 128 consecutive query rows of one head (heads fastest, the longest row blocks first); a program
  takes two in turn;
- a load warp streams the item's key/value tiles (the three ranges' tiles, one after the other) by TMA into a ring
  of shared-memory stages;
- two consumer warpgroups hold 64 rows each and take turns issuing their matmuls (ping-pong); within each, a tile's
  scores are issued before the previous tile's P V has finished. Where the range changes, a warpgroup writes the
  next rotation of its query rows into its shared-memory tile; the other warpgroup's next turn waits for it, so the
  rotation's global loads are issued ahead (``_rotate_rows``).

Gluon has no interpreter: the CPU tests run ``dca_triton``'s kernel, and the GPU tests hold this one to the fp32 twin
with the Triton kernel's tolerance.
"""

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gluon_parts import (
    BLOCK_M,
    LOAD_LAYOUT,
    descriptors,
    hopper_ok,
    key_ring,
    last_pv,
    mma_layout,
    operand_layout,
)
from .tma import tma_ok

BLOCK_N = 128
ITEMS = 2  # work items per program (as cca_gluon: the load warp fills the next item's stages during the last's tail)
STAGES = 3  # 2 x 64 x 128 query rows + 3 x (k, v) tiles of 128 x 128 = 224 KB of the H100/H200's 227
ROT_ROWS = 8  # query rows rotated at a time (registers: the pipeline's accumulators stay live); _rotate_rows
# loads its 8 blocks' positions up front, written out for 64 / 8 blocks


@gluon.jit
def _item(x, n_hb, n_heads, rep, Lq):
    """Work item x: (batch, query head, KV head, first row)."""
    hb = x % n_hb
    blk = gl.cdiv(Lq, 2 * BLOCK_M) - 1 - x // n_hb
    h = hb % n_heads
    return hb // n_heads, h, h // rep, blk * 2 * BLOCK_M


@gluon.jit
def _edges(pos, ok, kstart, S):
    """The key columns where the succ and intra ranges of rows at positions ``pos`` start, and where intra ends: the
    ranges are inter [kstart, e1), succ [e1, e2), intra [e2, e3); all 0 for pad rows (every range empty)."""
    intra = (pos // S) * S + kstart
    succ = gl.maximum(intra - S, kstart)
    return gl.where(ok, succ, 0), gl.where(ok, intra, 0), gl.where(ok, pos + 1 + kstart, 0)


@gluon.jit
def _span(lo, hi, BLOCK_N: gl.constexpr):
    """The key tiles a range's rows read together: first column (tile-aligned) and tile count (dca_triton's)."""
    live = hi > lo
    start = (gl.min(gl.where(live, lo, 1 << 30), 0) // BLOCK_N) * BLOCK_N
    end = gl.max(gl.where(live, hi, 0), 0)
    return start, gl.where(end > start, gl.cdiv(end - start, BLOCK_N), 0)


@gluon.jit
def _item_tiles(QPOS, b, row0, Lq, kstart, S, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """The tiles of an item's 128 rows, range by range: (start, count) of inter, succ, intra. An item of pad rows only
    reads one tile (fully masked), so every item runs the same pipeline."""
    t = row0 + gl.arange(0, 2 * BLOCK_M, layout=layout)
    pos = gl.load(QPOS + b * Lq + t, mask=t < Lq, other=-1)
    ok = pos >= 0
    e1, e2, e3 = _edges(gl.where(ok, pos, 0), ok, kstart, S)
    s0, n0 = _span(kstart + 0 * e1, e1, BLOCK_N)
    s1, n1 = _span(e1, e2, BLOCK_N)
    s2, n2 = _span(e2, e3, BLOCK_N)
    none = n0 + n1 + n2 == 0
    return s0, n0, s1, n1, gl.where(none, 0, s2), gl.where(none, 1, n2)


@gluon.jit
def _tile_column(i, s0, n0, s1, n1, s2, BLOCK_N: gl.constexpr):
    return gl.where(i < n0, s0 + i * BLOCK_N, gl.where(i < n0 + n1, s1 + (i - n0) * BLOCK_N,
                                                      s2 + (i - n0 - n1) * BLOCK_N))


@gluon.jit
def _load_partition(k_desc, v_desc, k_smem, v_smem, ready, empty, QPOS, KSTART, Lq, S, n_hb, n_heads, rep, x_lo, x_hi,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
    it = 0  # tiles loaded by this program so far: the ring's position and phase run on across work items
    for x in range(x_lo, x_hi):
        b, h, g, row0 = _item(x, n_hb, n_heads, rep, Lq)
        s0, n0, s1, n1, s2, n2 = _item_tiles(QPOS, b, row0, Lq, gl.load(KSTART + b), S, BLOCK_N, layout)
        for i in range(n0 + n1 + n2):
            s = it % STAGES
            # fresh barriers pass phase 1: the ring starts empty
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), 2 * k_desc.block_type.nbytes)
            col = _tile_column(i, s0, n0, s1, n1, s2, BLOCK_N)
            tma.async_copy_global_to_shared(k_desc, [b, g, col, 0], ready.index(s), k_smem.index(s))
            tma.async_copy_global_to_shared(v_desc, [b, g, col, 0], ready.index(s), v_smem.index(s))
            it += 1


@gluon.jit
def _rotation_loads(Q, ROPE, base, pos, t, Lq, d, partner, freq, part, S, CHUNK, s_ql, HEAD_DIM: gl.constexpr):
    """The loads of one block of rows' rotation (``_rotate_rows``): the rows ``t`` and their NeoX partners before
    RoPE, and the cos/sin table entries of the range's positions. Only the table's depend on a loaded value (``pos``)."""
    half: gl.constexpr = HEAD_DIM // 2
    row = base + t.to(gl.int64)[:, None] * s_ql
    o = gl.where(pos >= 0, pos, 0) % S
    at = gl.where(part == 0, gl.minimum(2 * S - 1, CHUNK) + 0 * o, gl.where(part == 1, gl.minimum(o + S, CHUNK), o))
    inside = (t < Lq)[:, None]  # a pad row's query is read as it is: every score of it is masked
    tab = ROPE + at[:, None] * HEAD_DIM + freq[None, :]
    return (gl.load(row + d[None, :], mask=inside, other=0.0), gl.load(row + partner[None, :], mask=inside, other=0.0),
            gl.load(tab), gl.load(tab + half))


@gluon.jit
def _rotate_rows(q_my, Q, QPOS, ROPE, b, h, t_base, Lq, s_qb, s_qh, s_ql, part, S, CHUNK, mult,
                 HEAD_DIM: gl.constexpr, ROT_ROWS: gl.constexpr):
    """This warpgroup's 64 query rows rotated for range ``part`` (at min(2s-1, C), min(o+s, C), o: o = pos % s), scaled
    by ``mult`` and rounded to the keys' dtype, into its shared-memory tile: ``dca_triton._dca_fwd``'s prologue.

    The tensor cores mostly wait while it runs (the other warpgroup's next turn waits for this one's), so its global
    loads are issued ahead: every block's positions first, then each block's rows and table entries three blocks
    before its arithmetic. Loaded block after block (two dependent round trips each), the range switches cost 1.9-4.6%
    of the prefill at 32K on an H200 (a variant without them, in two runs); loaded ahead, the prefill ran 15.08 ms
    against 15.18 (faster in 6 of 7 paired rounds) with the same outputs bit for bit.
    """
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    half: gl.constexpr = HEAD_DIM // 2
    NB: gl.constexpr = BLOCK_M // ROT_ROWS
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    partner = gl.where(d < half, d + half, d - half)
    sign = gl.where(d < half, -1.0, 1.0)
    freq = d % half
    t0 = t_base + gl.arange(0, ROT_ROWS, layout=rows_l)
    base = Q + b.to(gl.int64) * s_qb + h.to(gl.int64) * s_qh
    gl.static_assert(NB == 8, "the position loads below are written out for 8 blocks")
    p0 = gl.load(QPOS + b * Lq + t0 + 0 * ROT_ROWS, mask=t0 + 0 * ROT_ROWS < Lq, other=-1)
    p1 = gl.load(QPOS + b * Lq + t0 + 1 * ROT_ROWS, mask=t0 + 1 * ROT_ROWS < Lq, other=-1)
    p2 = gl.load(QPOS + b * Lq + t0 + 2 * ROT_ROWS, mask=t0 + 2 * ROT_ROWS < Lq, other=-1)
    p3 = gl.load(QPOS + b * Lq + t0 + 3 * ROT_ROWS, mask=t0 + 3 * ROT_ROWS < Lq, other=-1)
    p4 = gl.load(QPOS + b * Lq + t0 + 4 * ROT_ROWS, mask=t0 + 4 * ROT_ROWS < Lq, other=-1)
    p5 = gl.load(QPOS + b * Lq + t0 + 5 * ROT_ROWS, mask=t0 + 5 * ROT_ROWS < Lq, other=-1)
    p6 = gl.load(QPOS + b * Lq + t0 + 6 * ROT_ROWS, mask=t0 + 6 * ROT_ROWS < Lq, other=-1)
    p7 = gl.load(QPOS + b * Lq + t0 + 7 * ROT_ROWS, mask=t0 + 7 * ROT_ROWS < Lq, other=-1)
    gl.thread_barrier()  # every warp's last score matmul has read the tile
    b0 = _rotation_loads(Q, ROPE, base, p0, t0, Lq, d, partner, freq, part, S, CHUNK, s_ql, HEAD_DIM)
    b1 = _rotation_loads(Q, ROPE, base, p1, t0 + ROT_ROWS, Lq, d, partner, freq, part, S, CHUNK, s_ql, HEAD_DIM)
    b2 = _rotation_loads(Q, ROPE, base, p2, t0 + 2 * ROT_ROWS, Lq, d, partner, freq, part, S, CHUNK, s_ql, HEAD_DIM)
    for j in gl.static_range(NB):  # three blocks' loads in flight ahead of the arithmetic
        x, xp, cos, sin = b0
        b0 = b1
        b1 = b2
        if j + 3 < NB:
            pos = p3 if j == 0 else (p4 if j == 1 else (p5 if j == 2 else (p6 if j == 3 else p7)))
            b2 = _rotation_loads(Q, ROPE, base, pos, t0 + (j + 3) * ROT_ROWS, Lq, d, partner, freq, part, S, CHUNK,
                                 s_ql, HEAD_DIM)
        q = (x.to(gl.float32) * cos + xp.to(gl.float32) * sign[None, :] * sin) * mult
        q_my.slice(j * ROT_ROWS, ROT_ROWS).store(q.to(q_my.dtype))
    fence_async_shared()
    gl.thread_barrier()  # all rows stored before a wgmma reads the tile


@gluon.jit
def _softmax_tile(sc, m_i, l_i, col0, part, kstart, e1, e2, e3, lmax0, lmax1, lmax2, hmin0, hmin1, hmin2,
                  BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Masks a tile's scores to its range's columns (where some row does not see all of them) and folds them into the
    running max and sum (the queries carry the scale): returns p, the new max and sum, and the rescale."""
    lmax = gl.where(part == 0, lmax0, gl.where(part == 1, lmax1, lmax2))
    hmin = gl.where(part == 0, hmin0, gl.where(part == 1, hmin1, hmin2))
    if (col0 < lmax) | (col0 + BLOCK_N > hmin):
        lo = gl.where(part == 0, kstart, gl.where(part == 1, e1, e2))
        hi = gl.where(part == 0, e1, gl.where(part == 1, e2, e3))
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        sc = gl.where((cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None]), sc, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _consumer_partition(Q, O, QPOS, KSTART, ROPE, TEMP, q_smem, k_smem, v_smem, ready, empty, turn,
                        s_qb, s_qh, s_ql, s_ob, s_oh, s_ol, Lq, S, CHUNK, n_hb, n_heads, rep, x_lo, x_hi, qk_scale,
                        WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        HAS_TEMP: gl.constexpr, ROT_ROWS: gl.constexpr):
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(HEAD_DIM)
    p_layout: gl.constexpr = operand_layout(o_layout)
    ld_layout: gl.constexpr = LOAD_LAYOUT
    item_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_layout))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld_layout))
    rs = gl.arange(0, BLOCK_M, layout=row_s)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    q_my = q_smem.index(WG)
    my_turn = turn.index(WG)
    other_turn = turn.index(1 - WG)
    it = 0  # key tiles consumed so far, and turns taken: the ring's and the turns' phases run on across work items
    n_turns = 0
    for x in range(x_lo, x_hi):
        b, h, g, row0 = _item(x, n_hb, n_heads, rep, Lq)
        kstart = gl.load(KSTART + b)
        # the load warp computes the same tiles (128 positions, once per item): no hand-over through shared memory
        s0, n0, s1, n1, s2, n2 = _item_tiles(QPOS, b, row0, Lq, kstart, S, BLOCK_N, item_layout)
        n_tiles = n0 + n1 + n2
        mult = qk_scale
        if HAS_TEMP:
            mult = mult * gl.load(TEMP + b)
        t_base = row0 + WG * BLOCK_M  # this warpgroup's first row
        t = t_base + rs
        pos = gl.load(QPOS + b * Lq + t, mask=t < Lq, other=-1)
        ok = pos >= 0
        e1, e2, e3 = _edges(gl.where(ok, pos, 0), ok, kstart, S)
        # a tile needs masks unless every row of this warpgroup sees all its columns (a pad row sees none)
        lmax0, lmax1, lmax2 = kstart, gl.max(e1, 0), gl.max(e2, 0)
        hmin0, hmin1, hmin2 = gl.min(e1, 0), gl.min(e2, 0), gl.min(e3, 0)

        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, row_s)  # finite: a fully masked tile gives exp2(-inf) = 0
        l_i = gl.zeros([BLOCK_M], gl.float32, row_s)

        # Tile 0: scores only (turns as in cca_gluon: warpgroup 1's turn k waits for warpgroup 0's turn k to end,
        # warpgroup 0's for warpgroup 1's turn k - 1; a fresh barrier has passed phase 1)
        part = (n0 == 0).to(gl.int32) + (n0 + n1 == 0).to(gl.int32)
        _rotate_rows(q_my, Q, QPOS, ROPE, b, h, t_base, Lq, s_qb, s_qh, s_ql, part, S, CHUNK, mult, HEAD_DIM, ROT_ROWS)
        s0_ = it % STAGES
        mbarrier.wait(ready.index(s0_), (it // STAGES) & 1)
        mbarrier.wait(my_turn, (n_turns & 1) ^ (1 - WG))
        s_tok = warpgroup_mma(q_my, k_smem.index(s0_).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                              use_acc=False, is_async=True)
        mbarrier.arrive(other_turn, count=1)
        sc = warpgroup_mma_wait(0, deps=(s_tok, ))
        p, m_i, l_i, alpha = _softmax_tile(sc, m_i, l_i, _tile_column(0, s0, n0, s1, n1, s2, BLOCK_N), part,
                                           kstart, e1, e2, e3, lmax0, lmax1, lmax2, hmin0, hmin1, hmin2,
                                           BLOCK_N, s_layout)
        p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        for i in range(1, n_tiles):
            gi = it + i
            s = gi % STAGES
            sp = (gi - 1) % STAGES
            now = (i >= n0).to(gl.int32) + (i >= n0 + n1).to(gl.int32)
            if now != part:  # a new range: its rotation of the rows (no matmul of this warpgroup is in flight)
                _rotate_rows(q_my, Q, QPOS, ROPE, b, h, t_base, Lq, s_qb, s_qh, s_ql, now, S, CHUNK, mult, HEAD_DIM,
                             ROT_ROWS)
            part = now
            mbarrier.wait(ready.index(s), (gi // STAGES) & 1)
            mbarrier.wait(my_turn, ((n_turns + i) & 1) ^ (1 - WG))
            s_tok = warpgroup_mma(q_my, k_smem.index(s).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                                  use_acc=False, is_async=True)
            a_tok = warpgroup_mma(p_op, v_smem.index(sp).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
            mbarrier.arrive(other_turn, count=1)
            sc = warpgroup_mma_wait(1, deps=(s_tok, ))  # the scores are in; P V may still run
            p, m_i, l_i, alpha = _softmax_tile(sc, m_i, l_i, _tile_column(i, s0, n0, s1, n1, s2, BLOCK_N), part,
                                               kstart, e1, e2, e3, lmax0, lmax1, lmax2, hmin0, hmin1, hmin2,
                                               BLOCK_N, s_layout)
            acc, _ = warpgroup_mma_wait(0, deps=(a_tok, p_op))
            mbarrier.arrive(empty.index(sp), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        acc = last_pv(p_op, acc, v_smem, empty, my_turn, other_turn, it, n_turns, n_tiles, WG, BLOCK_N, HEAD_DIM,
                      STAGES)
        it += n_tiles
        n_turns += n_tiles + 1

        # pad rows saw no key (l = 0, acc = 0): their output is 0, as the Triton kernel's
        out = acc / gl.convert_layout(gl.where(l_i > 0.0, l_i, 1.0), row_o)[:, None]
        # through this warpgroup's q tile (free: its last score matmul has finished) into 16-byte row stores
        q_my.store(out.to(O.dtype.element_ty))
        gl.thread_barrier()
        out = q_my.load(ld_layout)
        gl.thread_barrier()  # every row read before the next item's rotation overwrites the tile
        t_o = t_base + r
        o_row = O + b.to(gl.int64) * s_ob + h.to(gl.int64) * s_oh + t_o.to(gl.int64)[:, None] * s_ol
        gl.store(o_row + d[None, :], out, mask=(t_o < Lq)[:, None])


@gluon.jit
def _fwd_kernel(Q, O, QPOS, KSTART, ROPE, TEMP, k_desc, v_desc, s_qb, s_qh, s_ql, s_ob, s_oh, s_ol,
                Lq, S, CHUNK, n_hb, n_heads, rep, n_items, qk_scale,
                HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, ITEMS: gl.constexpr,
                HAS_TEMP: gl.constexpr, ROT_ROWS: gl.constexpr):
    q_smem, k_smem, v_smem, ready, empty, turn = key_ring(Q, k_desc, v_desc, HEAD_DIM, BLOCK_N, STAGES)
    x_lo = gl.program_id(0) * ITEMS
    x_hi = gl.minimum(x_lo + ITEMS, n_items)

    gl.warp_specialize([
        (_consumer_partition, (Q, O, QPOS, KSTART, ROPE, TEMP, q_smem, k_smem, v_smem, ready, empty, turn, s_qb, s_qh,
                               s_ql, s_ob, s_oh, s_ol, Lq, S, CHUNK, n_hb, n_heads, rep, x_lo, x_hi, qk_scale, 0,
                               HEAD_DIM, BLOCK_N, STAGES, HAS_TEMP, ROT_ROWS)),
        (_consumer_partition, (Q, O, QPOS, KSTART, ROPE, TEMP, q_smem, k_smem, v_smem, ready, empty, turn, s_qb, s_qh,
                               s_ql, s_ob, s_oh, s_ol, Lq, S, CHUNK, n_hb, n_heads, rep, x_lo, x_hi, qk_scale, 1,
                               HEAD_DIM, BLOCK_N, STAGES, HAS_TEMP, ROT_ROWS)),
        (_load_partition, (k_desc, v_desc, k_smem, v_smem, ready, empty, QPOS, KSTART, Lq, S, n_hb, n_heads, rep,
                           x_lo, x_hi, BLOCK_N, STAGES)),
    ], [4, 1], [240, 24])


def applies(q, k_rot, v, rot_half: int, splits: int) -> bool:
    """Whether this kernel serves a ``dca_triton.dca_attention_triton`` call: triton 3.6 on a Hopper GPU, 16-bit
    inputs, head dim 64 or 128 rotated whole (rotary_dim = head_dim), at least one item of query rows, no column
    splits, tiles TMA can fetch."""
    head_dim = q.shape[-1]
    return (hopper_ok(q) and head_dim in (64, 128) and 2 * rot_half == head_dim and q.shape[2] >= 2 * BLOCK_M.value
            and splits == 1 and tma_ok(k_rot, v))


def forward(q, k_rot, v, out, qpos, kstart, table, temp, qk_scale, chunk_size, local_size):
    """``dca_triton._dca_fwd`` for one split: ``out`` (B, H, Lq, d) from the pre-RoPE ``q`` (B, H, Lq, d) and the keys
    rotated at ``j % s``; ``qpos`` (B, Lq) int32 (-1: pad), ``kstart`` (B,) int32, ``table`` the cos/sin rows of
    positions 0..C, ``temp`` (B,) fp32 or None, ``qk_scale`` = scale * log2(e)."""
    bsz, n_heads, q_len, head_dim = q.shape
    k_desc, v_desc = descriptors([1, 1, BLOCK_N, head_dim], k_rot, v)
    n_hb = bsz * n_heads
    n_items = n_hb * triton.cdiv(q_len, 2 * BLOCK_M.value)
    _fwd_kernel[(triton.cdiv(n_items, ITEMS),)](
        q, out, qpos, kstart, table, table if temp is None else temp, k_desc, v_desc, *q.stride()[:3],
        *out.stride()[:3], q_len, chunk_size - local_size, chunk_size, n_hb, n_heads, n_heads // k_rot.shape[1],
        n_items, qk_scale, HEAD_DIM=head_dim, BLOCK_N=BLOCK_N, STAGES=STAGES, ITEMS=ITEMS, HAS_TEMP=temp is not None,
        ROT_ROWS=ROT_ROWS, num_warps=4,
    )
    return out


__all__ = ["applies", "forward"]
