"""Hopper kernels of CCA attention, written in Gluon: FlashAttention-3's warp specialization.

**Forward** (default where it applies): same contract as ``cca_triton._forward``, for whole sequences and for a chunk
after a prefill (rows offset to per-sequence positions; same output, same base-2 logsumexp for the backward). A work
item is 2 x BMP positions of one core head; a program takes two in turn and runs three partitions:

- a load warp streams the key/value tiles (the core tokens, then the raw keys of the window) by TMA into a ring of
  shared-memory stages;
- two consumer warpgroups hold 64 stacked query rows each (HP query heads x BMP positions, as in ``cca_triton``) and
  run the one online softmax over the tiles. They take turns issuing their matmuls (ping-pong), so one's softmax runs
  while the other's matmuls keep the tensor cores busy; within each, the next tile's scores are issued before the
  previous tile's P V has finished (intra-warpgroup overlap).

Triton's own pipeliner does neither on Hopper (its ``warp_specialize`` fails to compile on the CCA kernel or falls
back), and a dense probe on an H200 put this structure at 590 TFLOP/s against 507 for the Triton loop
(``benchmarks/results/attention-h200-kv.md``). Its numbers against the Triton forward's: see ``cca_triton._forward``.

**Backward** (default): ``cca_triton``'s dq pass (each consumer warpgroup holds 64 of the dq kernel's 128 stacked query
rows; the load warp streams its 64-key tiles; it also computes delta, the rows' <o, do>, instead of a pass of its own)
and its two dk/dv passes (raw keys, core tokens; two warpgroups of 64 keys each, where query heads are stacked:
``bwd_applies``), with TMA load warps. Same tiles, same order as the Triton kernels, so the same numbers
(``benchmarks/results/attention-h100-gluon-bwd.md``), except the core tokens' dk/dv: their rows are summed in bands,
top down, for L2's sake (last bits).

Gluon has no interpreter: the CPU tests run ``cca_triton``'s kernels, and the GPU tests hold these to the reference
and to the Triton kernels.
"""

import torch
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
    LOAD_LAYOUT as _LOAD_LAYOUT,
    descriptors as _descriptors,
    hopper_ok,
    key_ring,
    last_pv,
    mma_layout as _mma_layout,
    operand_layout as _operand_layout,
)
from .tma import tma_ok

BLOCK_N = 128
# Work items per program. Against 1, 2 took 1-4% off the forward on an H100 (8K-128K, GQA 4/7, hd 64/128); 3 and 4
# did no better on average, and one program per SM (all items, statically strided) lost 7% at 128K in one run of two
# (benchmarks/results/attention-h100-two-items.md).
ITEMS = 2
STAGES = 3  # 2 x 64 x 128 q rows + 3 x (k, v) tiles of 128 x 128 = 224 KB of the H100/H200's 227


@gluon.constexpr_function
def _delta_layout(block_d):
    """Registers of [64, block_d] o and do rows as Triton lays out ``cca_triton._delta_kernel``'s tiles (16 bytes per
    thread, a row's threads side by side), so that the dq pass's sums <o_t, do_t> are that kernel's, bit for bit."""
    lanes = block_d // 8
    return gl.BlockedLayout([1, 8], [32 // lanes, lanes], [4, 1], [1, 0])


@gluon.jit
def _n_visible(t, G, S):
    return gl.maximum(t + 1 - S, 0) // G


@gluon.jit
def _stacked_rows(i, chunk, t_base, n_stack, L, HP: gl.constexpr, BMP: gl.constexpr):
    """Row i of a stacked tile is query head chunk*HP + i // BMP of the core head's stack, at position
    t_base + i % BMP (``cca_triton._stacked_rows``): (head in the stack, position, whether the row is real)."""
    head = chunk * HP + i // BMP
    t = t_base + i % BMP
    return head, t, (i // BMP < HP) & (head < n_stack) & (t < L)


@gluon.jit
def _fwd_item(x, QPOS, L, R, G, S, n_hb, n_core_heads, n_stack, n_rep, n_chunks, BLOCK_N: gl.constexpr,
              BMP: gl.constexpr, OFFSET: gl.constexpr):
    """Work item x: 2 x BMP positions of a stack of query heads (n_hb: batch x core heads x head chunks); heads
    fastest and the longest (last) position blocks first (``cca_triton._query_tile``'s order), so a program's items
    are neighbours of about the same length and the shortest start last. Returns the batch, core head, head chunk,
    KV head, first row and its position, the raw keys' column offset, the core tokens every row sees (n0) and the
    last row sees (n1), and the counts of core tiles and of all key tiles."""
    hb = x % n_hb
    blk = gl.cdiv(L, 2 * BMP) - 1 - x // n_hb
    b = hb // (n_core_heads * n_chunks)
    c = (hb // n_chunks) % n_core_heads
    chunk = hb % n_chunks
    j = (c * n_stack) // n_rep  # KV head of the raw keys
    if OFFSET:  # a chunk after a prefill: row i sits at position QPOS[b] + i, raw key column u at QPOS[b] - R + u
        q_start = gl.load(QPOS + b)
    else:  # whole sequences: rows and columns are positions
        q_start = blk * 0
    row0 = blk * 2 * BMP
    T0 = row0 + q_start  # positions (the spec's t) of the item's first and last rows
    T1 = gl.minimum(row0 + 2 * BMP, L) - 1 + q_start
    n0 = _n_visible(T0, G, S)
    n1 = _n_visible(T1, G, S)
    n_core = gl.cdiv(n1, BLOCK_N)
    n_tiles = n_core + gl.cdiv(T1 + 1 - n0 * G, BLOCK_N)
    return b, c, chunk, j, row0, T0, q_start - R, n0, n1, n_core, n_tiles


@gluon.jit
def _load_partition(kc_desc, vc_desc, k_desc, v_desc, k_smem, v_smem, ready, empty, QPOS, L, R, G, S, n_hb,
                    n_core_heads, n_stack, n_rep, n_chunks, x_lo, x_hi, BLOCK_N: gl.constexpr, BMP: gl.constexpr,
                    STAGES: gl.constexpr, OFFSET: gl.constexpr):
    it = 0  # tiles loaded by this program so far: the ring's position and phase run on across work items
    for x in range(x_lo, x_hi):
        b, c, chunk, j, row0, T0, kb, n0, n1, n_core, n_tiles = _fwd_item(
            x, QPOS, L, R, G, S, n_hb, n_core_heads, n_stack, n_rep, n_chunks, BLOCK_N, BMP, OFFSET)
        raw_lo = n0 * G
        for i in range(n_tiles):
            s = it % STAGES
            # fresh barriers pass phase 1: the ring starts empty
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), 2 * k_desc.block_type.nbytes)
            k_dst = k_smem.index(s)
            v_dst = v_smem.index(s)
            if i < n_core:
                tma.async_copy_global_to_shared(kc_desc, [b, c, i * BLOCK_N, 0], ready.index(s), k_dst)
                tma.async_copy_global_to_shared(vc_desc, [b, c, i * BLOCK_N, 0], ready.index(s), v_dst)
            else:
                k0 = raw_lo + (i - n_core) * BLOCK_N - kb  # the raw key at position p is column p - kb
                tma.async_copy_global_to_shared(k_desc, [b, j, k0, 0], ready.index(s), k_dst)
                tma.async_copy_global_to_shared(v_desc, [b, j, k0, 0], ready.index(s), v_dst)
            it += 1


@gluon.jit
def _softmax_tile(sc, m_i, l_i, i, n_core, n0, raw_lo, a_end, T0, n_t, lo_t, t, qk_scale,
                  BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Masks tile i's raw scores and folds them, scaled, into the running max and sum; returns p and the rescale."""
    is_core = i < n_core
    col0 = gl.where(is_core, i * BLOCK_N, raw_lo + (i - n_core) * BLOCK_N)
    # a core tile is mask-free below n0 (every row sees it); a raw one past the window starts and before the diagonal
    masked = gl.where(is_core, col0 + BLOCK_N > n0, (col0 < a_end) | (col0 + BLOCK_N - 1 > T0))
    if masked:
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        lo = gl.where(is_core, -1, lo_t)
        hi = gl.where(is_core, n_t - 1, t)
        sc = gl.where((cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None]), sc, float("-inf"))
    # qk_scale > 0, so the scaled row max is the max of the scaled scores, and each p takes one FFMA instead of a
    # multiply and a subtraction: up to 4.5% off the forward on an H100, level at 32K (results/attention-h100-ffma.md)
    m_new = gl.maximum(m_i, gl.max(sc, 1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(gl.fma(sc, qk_scale, -m_new[:, None]))
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _consumer_partition(Q, O, LSE, QPOS, q_smem, k_smem, v_smem, ready, empty, turn, s_qb, s_qh, s_ql, s_ob, s_oh, s_ol,
                        L, R, G, S, n_heads, n_hb, n_core_heads, n_stack, n_rep, n_chunks, x_lo, x_hi, qk_scale,
                        WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_N: gl.constexpr,
                        HP: gl.constexpr, BMP: gl.constexpr, STAGES: gl.constexpr, OFFSET: gl.constexpr):
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(BLOCK_D)
    p_layout: gl.constexpr = _operand_layout(o_layout)
    ld_layout: gl.constexpr = _LOAD_LAYOUT
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_layout))
    d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld_layout))
    rs = gl.arange(0, BLOCK_M, layout=row_s)
    ro = gl.arange(0, BLOCK_M, layout=row_o)
    do = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    q_my = q_smem.index(WG)
    my_turn = turn.index(WG)
    other_turn = turn.index(1 - WG)
    it = 0  # key tiles consumed so far, and turns taken: the ring's and the turns' phases run on across work items
    n_turns = 0
    for x in range(x_lo, x_hi):
        b, c, chunk, j, row0, T0, kb, n0, n1, n_core, n_tiles = _fwd_item(
            x, QPOS, L, R, G, S, n_hb, n_core_heads, n_stack, n_rep, n_chunks, BLOCK_N, BMP, OFFSET)
        raw_lo = n0 * G
        a_end = n1 * G
        b64 = b.to(gl.int64)
        r_base = row0 + WG * BMP  # this warpgroup's first row
        t_base = T0 + WG * BMP  # and its position

        # the previous item's last matmul has finished (waited below), so this warpgroup's q tile is free
        head, tq, ok = _stacked_rows(r, chunk, r_base, n_stack, L, HP, BMP)
        hq = (c * n_stack + head).to(gl.int64)
        q = gl.load(Q + b64 * s_qb + hq[:, None] * s_qh + tq[:, None] * s_ql + d[None, :],
                    mask=ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        q_my.store(q)
        fence_async_shared()
        gl.thread_barrier()  # all 128 threads stored their rows before the wgmma reads the tile

        t = t_base + rs % BMP
        n_t = _n_visible(t, G, S)
        lo_t = n_t * G
        acc = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, o_layout)
        m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, row_s)  # finite: a fully masked tile gives exp2(-inf) = 0
        l_i = gl.zeros([BLOCK_M], gl.float32, row_s)

        # Tile 0: scores only. The warpgroups take turns: warpgroup 1's turn k waits for warpgroup 0's turn k to end
        # (phase k & 1 of its barrier), warpgroup 0's for warpgroup 1's turn k - 1 (a fresh barrier has passed phase 1).
        s0 = it % STAGES
        mbarrier.wait(ready.index(s0), (it // STAGES) & 1)
        mbarrier.wait(my_turn, (n_turns & 1) ^ (1 - WG))
        s_tok = warpgroup_mma(q_my, k_smem.index(s0).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), zero_s,
                              use_acc=False, is_async=True)
        mbarrier.arrive(other_turn, count=1)
        sc = warpgroup_mma_wait(0, deps=(s_tok, ))
        p, m_i, l_i, alpha = _softmax_tile(sc, m_i, l_i, 0, n_core, n0, raw_lo, a_end, T0, n_t, lo_t, t, qk_scale,
                                           BLOCK_N, s_layout)
        p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        for i in range(1, n_tiles):
            g = it + i
            s = g % STAGES
            sp = (g - 1) % STAGES
            mbarrier.wait(ready.index(s), (g // STAGES) & 1)
            mbarrier.wait(my_turn, ((n_turns + i) & 1) ^ (1 - WG))
            s_tok = warpgroup_mma(q_my, k_smem.index(s).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), zero_s,
                                  use_acc=False, is_async=True)
            a_tok = warpgroup_mma(p_op, v_smem.index(sp).reshape([BLOCK_N, BLOCK_D]), acc, is_async=True)
            mbarrier.arrive(other_turn, count=1)
            sc = warpgroup_mma_wait(1, deps=(s_tok, ))  # the scores are in; P V may still run
            p, m_i, l_i, alpha = _softmax_tile(sc, m_i, l_i, i, n_core, n0, raw_lo, a_end, T0, n_t, lo_t, t, qk_scale,
                                               BLOCK_N, s_layout)
            acc, _ = warpgroup_mma_wait(0, deps=(a_tok, p_op))
            mbarrier.arrive(empty.index(sp), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        acc = last_pv(p_op, acc, v_smem, empty, my_turn, other_turn, it, n_turns, n_tiles, WG, BLOCK_N, BLOCK_D, STAGES)
        it += n_tiles
        n_turns += n_tiles + 1

        l_i = gl.where(l_i > 0.0, l_i, 1.0)  # padding rows only: every real row sees itself
        out = acc / gl.convert_layout(l_i, row_o)[:, None]
        if HEAD_DIM == BLOCK_D:
            # through this warpgroup's q tile (free: its last score matmul has finished) into 16-byte row stores
            # instead of the accumulator layout's 4-byte ones: 2-9% off the forward on an H100, but 6% slower with a
            # padded head dim (80), which keeps the direct store (benchmarks/results/attention-h100-ostage.md)
            q_my.store(out.to(O.dtype.element_ty))
            gl.thread_barrier()
            out, row, col = q_my.load(ld_layout), r, d
            gl.thread_barrier()  # every row read before the next item's q overwrites the tile
        else:
            out, row, col = out.to(O.dtype.element_ty), ro, do
        head_o, t_o, ok_o = _stacked_rows(row, chunk, r_base, n_stack, L, HP, BMP)
        hq_o = (c * n_stack + head_o).to(gl.int64)
        gl.store(O + b64 * s_ob + hq_o[:, None] * s_oh + t_o[:, None] * s_ol + col[None, :], out,
                 mask=ok_o[:, None] & (col[None, :] < HEAD_DIM))
        head_s, t_s, ok_s = _stacked_rows(rs, chunk, r_base, n_stack, L, HP, BMP)
        hq_s = (c * n_stack + head_s).to(gl.int64)
        gl.store(LSE + (b64 * n_heads + hq_s) * L + t_s, m_i + gl.log2(l_i), mask=ok_s)


@gluon.jit
def _fwd_kernel(Q, O, LSE, QPOS, kc_desc, vc_desc, k_desc, v_desc, s_qb, s_qh, s_ql, s_ob, s_oh, s_ol,
                L, R, G, S, n_heads, n_hb, n_core_heads, n_stack, n_rep, n_chunks, n_items, qk_scale,
                HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_N: gl.constexpr, HP: gl.constexpr,
                BMP: gl.constexpr, STAGES: gl.constexpr, OFFSET: gl.constexpr, ITEMS: gl.constexpr):
    # ITEMS work items (``_fwd_item``) in turn: the load warp fetches the next item's first tiles while the warpgroups
    # finish the last one's, instead of a new program filling its pipeline from cold (one program fits on an SM).
    q_smem, k_smem, v_smem, ready, empty, turn = key_ring(Q, k_desc, v_desc, BLOCK_D, BLOCK_N, STAGES)
    x_lo = gl.program_id(0) * ITEMS
    x_hi = gl.minimum(x_lo + ITEMS, n_items)

    gl.warp_specialize([
        (_consumer_partition, (Q, O, LSE, QPOS, q_smem, k_smem, v_smem, ready, empty, turn, s_qb, s_qh, s_ql, s_ob,
                               s_oh, s_ol, L, R, G, S, n_heads, n_hb, n_core_heads, n_stack, n_rep, n_chunks, x_lo,
                               x_hi, qk_scale, 0, HEAD_DIM, BLOCK_D, BLOCK_N, HP, BMP, STAGES, OFFSET)),
        (_consumer_partition, (Q, O, LSE, QPOS, q_smem, k_smem, v_smem, ready, empty, turn, s_qb, s_qh, s_ql, s_ob,
                               s_oh, s_ol, L, R, G, S, n_heads, n_hb, n_core_heads, n_stack, n_rep, n_chunks, x_lo,
                               x_hi, qk_scale, 1, HEAD_DIM, BLOCK_D, BLOCK_N, HP, BMP, STAGES, OFFSET)),
        (_load_partition, (kc_desc, vc_desc, k_desc, v_desc, k_smem, v_smem, ready, empty, QPOS, L, R, G, S, n_hb,
                           n_core_heads, n_stack, n_rep, n_chunks, x_lo, x_hi, BLOCK_N, BMP, STAGES, OFFSET)),
    ], [4, 1], [240, 24])


def applies(q, k, v, kc, vc, block_d: int) -> bool:
    """Whether this kernel serves these inputs: triton 3.6, a Hopper GPU (sm_90: wgmma), 16-bit inputs, head dims up to
    128 (padded to 64 or 128), tiles TMA can fetch."""
    if not hopper_ok(q) or block_d not in (64, 128):
        return False
    return tma_ok(k, v, *(x for x in (kc, vc) if x.numel()))


def _key_descriptors(k, v, kc, vc, dims, rows: int) -> list:
    """Descriptors of ``rows``-key tiles: core k, core v, raw k, raw v (with no core tokens the raw ones stand in for
    them, never read)."""
    box = [1, 1, rows, dims.block_d]
    raw = _descriptors(box, k, v)
    return (_descriptors(box, kc, vc) if dims.P else raw) + raw


def forward(q, k, v, kc, vc, dims, hp, bmp, n_chunks, q_pos=None, key_lead=0):
    """CCA forward: (o, base-2 logsumexp), as ``cca_triton._forward``, of whole sequences or (``q_pos``, ``key_lead``)
    of a chunk after a prefill; ``hp``, ``bmp``, ``n_chunks``: the stacking of query heads into BLOCK_M rows
    (``cca_triton._stack``). ``dims.qk_scale`` must be positive (``_softmax_tile``)."""
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((dims.B, dims.H, dims.L), dtype=torch.float32, device=q.device)
    n_hb = dims.B * dims.C * n_chunks
    n_items = n_hb * triton.cdiv(dims.L, 2 * bmp)
    offset = q_pos is not None
    _fwd_kernel[(triton.cdiv(n_items, ITEMS),)](
        q, o, lse, q_pos if offset else lse, *_key_descriptors(k, v, kc, vc, dims, BLOCK_N), *q.stride()[:3],
        *o.stride()[:3], dims.L, key_lead, dims.G, dims.S, dims.H, n_hb, dims.C, dims.n_stack, dims.rep, n_chunks,
        n_items, dims.qk_scale, HEAD_DIM=dims.D, BLOCK_D=dims.block_d, BLOCK_N=BLOCK_N, HP=hp, BMP=bmp, STAGES=STAGES,
        OFFSET=offset, ITEMS=ITEMS, num_warps=4,
    )
    return o, lse


# --------------------------------------------------------------------------------------------------
# Backward: dk/dv of a block of 128 keys (raw keys or core tokens), FlashAttention-3's backward layout
# --------------------------------------------------------------------------------------------------
# One program owns 128 keys: two consumer warpgroups hold 64 keys each (their k/v tiles in shared memory, their dk and
# dv accumulators in registers), and a load warp streams the tiles of stacked query rows (q, do: HP heads x BMP
# positions, by TMA boxes of [1, HP, BMP, d]) that both consume, and the rows' lse and delta beside them in shared
# memory: the consumers' own loads of those cost registers (spills: raw keys 32 bytes against 56, core tokens 72
# against 112 at hd 128) and each tile a load's latency; the whole dk/dv 1.14-1.21x on an H200,
# ``benchmarks/results/attention-h200-row-stats.md``. Same contract as ``cca_triton``'s two dk/dv kernels,
# and for the raw keys the same rows in the same order, so the same numbers. The core tokens' pass splits its rows
# into ``n_split`` bands at fixed positions, the top band first, and walks each from the top down: a band's key blocks
# start together and read its rows in step, out of L2 (10% off the core pass at 128K; the Triton kernel splits each
# block's rows from its first row up, so their sums differ in the last bits). ``cca_triton._backward`` runs the two
# passes side by side, so either fills the SMs the other leaves idle at its end
# (``benchmarks/results/attention-h100-dkdv-bands.md``), or, where the raw keys' programs are few (pooling kv, up to
# ~3 waves), as one launch: the core tokens' programs first, then the raw keys' (1.14-1.56x; the role known at run
# time costs registers, so the long passes keep a launch each; ``benchmarks/results/attention-h100-dkdv-one-launch.md``
# has both).
BWD_KEYS = gl.constexpr(64)  # keys per consumer warpgroup (wgmma's M)
BWD_STAGES = 2  # 4 k/v tiles of 64 x 128 + 2 x (q, do) tiles of 64 x 128 = 128 KB (+ 2 x 2 x 64 fp32 lse, delta)


@gluon.jit
def _bwd_segments(pid, n_programs, L, G, S, n_cols, n_split, RAW: gl.constexpr, BMP: gl.constexpr):
    """This program's (batch x head, split, first key) and its rows as runs of BMP-position tiles. Raw keys: masked,
    mask-free, masked (``cca_triton._dkdv_raw_kernel``'s loops); core tokens: mask-free, masked (the rows of one band,
    walked top down by ``_bwd_tile``)."""
    n_blk = gl.cdiv(n_cols, 2 * BWD_KEYS)
    if RAW:
        n_bh = n_programs // n_blk
        bh = pid % n_bh
        split = pid * 0
        k0 = (pid // n_bh) * 2 * BWD_KEYS
        k_last = gl.minimum(k0 + 2 * BWD_KEYS, L) - 1
        q_hi = gl.minimum(L, (k_last // G + 1) * G + S - 1)
        lim = (k0 // G + 1) * G + S - 1
        a_end = k0 + gl.cdiv(2 * BWD_KEYS - 1, BMP) * BMP
        b_end = a_end + (gl.maximum(lim - a_end, 0) // BMP) * BMP
        m1_lo = k0
        n_m1 = gl.cdiv(gl.maximum(gl.minimum(a_end, q_hi) - k0, 0), BMP)
        f_lo = a_end
        n_f = gl.cdiv(gl.maximum(gl.minimum(b_end, q_hi) - a_end, 0), BMP)
        m2_lo = b_end
        n_m2 = gl.cdiv(gl.maximum(q_hi - b_end, 0), BMP)
    else:  # the core tokens' rows in bands: the top band first, and in a band the first core blocks (most rows) first
        n_bh = n_programs // (n_blk * n_split)
        bh = pid % n_bh
        split = n_split - 1 - pid // (n_bh * n_blk)
        k0 = ((pid // n_bh) % n_blk) * 2 * BWD_KEYS
        t_lo = (k0 + 1) * G + S - 1  # the first row seeing core token k0
        a_end = t_lo + gl.cdiv((2 * BWD_KEYS - 1) * G, BMP) * BMP  # from here on, rows see the whole block
        base = G + S - 1 + gl.cdiv((2 * BWD_KEYS - 1) * G, BMP) * BMP  # block 0's a_end: every block's tile grid
        per = gl.cdiv(gl.cdiv(gl.maximum(L - base, 0), BMP), n_split) * BMP
        band_lo = base + split * per
        band_hi = gl.where(split == n_split - 1, L, gl.minimum(band_lo + per, L))
        f_lo = gl.maximum(a_end, band_lo)
        n_f = gl.cdiv(gl.maximum(band_hi - f_lo, 0), BMP)
        # the masked rows below a_end: in the band holding a_end (the last one where a_end is past L)
        mask_band = gl.minimum(n_split - 1, (a_end - base) // gl.maximum(per, 1))
        m1_lo = t_lo
        n_m1 = gl.where(split == mask_band, gl.cdiv(gl.maximum(gl.minimum(a_end, L) - t_lo, 0), BMP), 0)
        m2_lo = L * 0  # no third run (tensors, not constants: they are warp_specialize arguments)
        n_m2 = L * 0
    return bh, split, k0, m1_lo, n_m1, f_lo, n_f, m2_lo, n_m2


@gluon.jit
def _bwd_tile(i, m1_lo, n_m1, f_lo, n_f, m2_lo, n_m2, step, BMP: gl.constexpr, PASS: gl.constexpr):
    """Row tile i of the program's list (every head chunk walks the runs): (chunk, first position, masked). The raw
    keys' runs go up (``step`` BMP): masked, mask-free, masked. The core tokens' go down from the top: the mask-free
    run, then the masked one below it (PASS 1); in one launch for both passes (PASS 2) ``_dkdv_kernel`` hands them
    over as three runs like the raw keys' (none, mask-free, masked from their top tiles, ``step`` -BMP), so that the
    walk does not branch on the role."""
    per = n_m1 + n_f + n_m2
    chunk = i // per
    k = i % per
    if PASS == 1:
        t0 = gl.where(k < n_f, f_lo + (n_f - 1 - k) * BMP, m1_lo + (n_m1 - 1 - (k - n_f)) * BMP)
        masked = k >= n_f
    else:
        t0 = gl.where(k < n_m1, m1_lo + k * step, gl.where(k < n_m1 + n_f, f_lo + (k - n_m1) * step,
                                                           m2_lo + (k - n_m1 - n_f) * step))
        masked = (k < n_m1) | (k >= n_m1 + n_f)
    return chunk, t0, masked


@gluon.jit
def _bwd_load_partition(q_desc, do_desc, k_desc, v_desc, kc_desc, vc_desc, LSE, DELTA, kv_smem, q_smem, do_smem,
                        stat_smem, kv_bar, ready, empty, b, kv_head, head0, n_heads, L, k0, m1_lo, n_m1, f_lo, n_f,
                        m2_lo, n_m2, step, n_tiles, RAW, PASS: gl.constexpr, HP: gl.constexpr, BMP: gl.constexpr,
                        STAGES: gl.constexpr):
    # The rows' lse and delta by plain loads, not TMA: a TMA box must start 16-byte aligned in its innermost dimension
    # (else an illegal instruction), and the core tokens' rows start anywhere.
    row_layout: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
    r = gl.arange(0, BLOCK_M, layout=row_layout)
    b64 = b.to(gl.int64)
    mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
    for w in gl.static_range(2):
        if RAW:
            tma.async_copy_global_to_shared(k_desc, [b, kv_head, k0 + w * BWD_KEYS, 0], kv_bar, kv_smem.index(w))
            tma.async_copy_global_to_shared(v_desc, [b, kv_head, k0 + w * BWD_KEYS, 0], kv_bar, kv_smem.index(2 + w))
        else:
            tma.async_copy_global_to_shared(kc_desc, [b, kv_head, k0 + w * BWD_KEYS, 0], kv_bar, kv_smem.index(w))
            tma.async_copy_global_to_shared(vc_desc, [b, kv_head, k0 + w * BWD_KEYS, 0], kv_bar,
                                            kv_smem.index(2 + w))
    # the first tile's rows ahead of the loop, then each next tile's while the stage is in use (their latency hidden)
    lse, delta = _bwd_row_stats(LSE, DELTA, 0, r, b64, head0, n_heads, L, m1_lo, n_m1, f_lo, n_f, m2_lo, n_m2, step,
                                HP, BMP, PASS)
    for i in range(n_tiles):
        chunk, t0, _ = _bwd_tile(i, m1_lo, n_m1, f_lo, n_f, m2_lo, n_m2, step, BMP, PASS)
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, head0 + chunk * HP, t0, 0], ready.index(s), q_smem.index(s))
        tma.async_copy_global_to_shared(do_desc, [b, head0 + chunk * HP, t0, 0], ready.index(s), do_smem.index(s))
        stat_smem.index(s).store(lse)
        stat_smem.index(STAGES + s).store(delta)
        mbarrier.arrive(ready.index(s), count=1)  # the second arrival: both rows stored
        lse, delta = _bwd_row_stats(LSE, DELTA, gl.minimum(i + 1, n_tiles - 1), r, b64, head0, n_heads, L, m1_lo,
                                    n_m1, f_lo, n_f, m2_lo, n_m2, step, HP, BMP, PASS)


@gluon.jit
def _bwd_row_stats(LSE, DELTA, i, r, b64, head0, n_heads, L, m1_lo, n_m1, f_lo, n_f, m2_lo, n_m2, step,
                   HP: gl.constexpr, BMP: gl.constexpr, PASS: gl.constexpr):
    chunk, t0, _ = _bwd_tile(i, m1_lo, n_m1, f_lo, n_f, m2_lo, n_m2, step, BMP, PASS)
    head = head0 + chunk * HP + r // BMP
    t = t0 + r % BMP
    # in bounds (the consumers mask the rows of other stacks). A program with no tiles asks for tile 0 too: its
    # indices are garbage then (a division by 0 in _bwd_tile), every load masked into bounds, nothing stored.
    ok = (head >= 0) & (head < n_heads) & (t >= 0) & (t < L)
    stat = (b64 * n_heads + head) * L + t
    return gl.load(LSE + stat, mask=ok, other=0.0), gl.load(DELTA + stat, mask=ok, other=0.0)


@gluon.jit
def _bwd_consumer_partition(DK, DV, DKC, DVC, kv_smem, q_smem, do_smem, stat_smem, kv_bar, ready, empty,
                            n_stack, k0, n_cols, L, G, S, out_row0, s_gl,
                            m1_lo, n_m1, f_lo, n_f, m2_lo, n_m2, step, n_tiles, qk_scale, sm_scale, RAW,
                            PASS: gl.constexpr, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr,
                            HP: gl.constexpr, BMP: gl.constexpr, STAGES: gl.constexpr):
    # Transposed tiles (rows = this warpgroup's 64 keys, columns = 64 stacked query rows), as cca_triton._dkdv_tile.
    st_layout: gl.constexpr = _mma_layout(BLOCK_M)
    acc_layout: gl.constexpr = _mma_layout(BLOCK_D)
    a_layout: gl.constexpr = _operand_layout(acc_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, st_layout)
    col0 = k0 + WG * BWD_KEYS
    keys = col0 + gl.arange(0, BWD_KEYS, layout=gl.SliceLayout(1, st_layout))
    r = gl.arange(0, BLOCK_M, layout=col_s)
    k_my = kv_smem.index(WG).reshape([BWD_KEYS, BLOCK_D])
    v_my = kv_smem.index(2 + WG).reshape([BWD_KEYS, BLOCK_D])
    zero_st = gl.zeros([BWD_KEYS, BLOCK_M], gl.float32, st_layout)
    dk = gl.zeros([BWD_KEYS, BLOCK_D], gl.float32, acc_layout)
    dv = gl.zeros([BWD_KEYS, BLOCK_D], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    if n_tiles > 0:
        mbarrier.wait(ready.index(0), 0)
    # Tile i+1's scores are issued behind tile i's dV and dK (FlashAttention-3's overlap): the tensor cores never wait
    # for this warpgroup to fetch the next tile. (With no tiles, that first product reads an unfilled stage: unused.)
    s_tok = warpgroup_mma(k_my, q_smem.index(0).reshape([BLOCK_M, BLOCK_D]).permute((1, 0)), zero_st, use_acc=False,
                          is_async=True)
    for i in range(n_tiles):
        chunk, t0, masked = _bwd_tile(i, m1_lo, n_m1, f_lo, n_f, m2_lo, n_m2, step, BMP, PASS)
        _, t, ok = _stacked_rows(r, chunk, t0, n_stack, L, HP, BMP)
        s = i % STAGES
        # +inf: rows of other heads or past L get p = 0
        lse = gl.where(ok, stat_smem.index(s).load(col_s), float("inf"))
        delta = gl.where(ok, stat_smem.index(STAGES + s).load(col_s), 0.0)
        q_t = q_smem.index(s).reshape([BLOCK_M, BLOCK_D])
        do_t = do_smem.index(s).reshape([BLOCK_M, BLOCK_D])
        st = warpgroup_mma_wait(0, deps=(s_tok, ))
        dp_tok = warpgroup_mma(v_my, do_t.permute((1, 0)), zero_st, use_acc=False, is_async=True)
        pt = gl.exp2(st * qk_scale - lse[None, :])
        if masked:
            n_t = _n_visible(t, G, S)
            if RAW:  # the window's raw keys: from its first group to the query itself
                seen = (keys[:, None] >= (n_t * G)[None, :]) & (keys[:, None] <= t[None, :])
            else:  # the core tokens of the groups before the window
                seen = keys[:, None] < n_t[None, :]
            pt = gl.where(seen, pt, 0.0)
        pt_op = gl.convert_layout(pt.to(q_smem.dtype), a_layout)
        dv_tok = warpgroup_mma(pt_op, do_t, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=(dp_tok, ))  # dO V^T is in; P^T dO may still run
        dst = pt * (dpt - delta[None, :])
        dst_op = gl.convert_layout(dst.to(q_smem.dtype), a_layout)
        dk_tok = warpgroup_mma(dst_op, q_t, dk, is_async=True)
        # the last tile re-reads its own stage (still held: the loader has nothing left to put there)
        nxt = gl.minimum(i + 1, n_tiles - 1)
        mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1)
        s_tok = warpgroup_mma(k_my, q_smem.index(nxt % STAGES).reshape([BLOCK_M, BLOCK_D]).permute((1, 0)), zero_st,
                              use_acc=False, is_async=True)
        dv, dk, _, _ = warpgroup_mma_wait(1, deps=(dv_tok, dk_tok, pt_op, dst_op))
        mbarrier.arrive(empty.index(s), count=1)
    warpgroup_mma_wait(0, deps=(s_tok, ))

    rows = col0 + gl.arange(0, BWD_KEYS, layout=gl.SliceLayout(1, acc_layout))
    d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, acc_layout))
    mask = (rows[:, None] < n_cols) & (d[None, :] < HEAD_DIM)
    out = out_row0 + rows[:, None].to(gl.int64) * s_gl + d[None, :]
    if RAW:  # dk, dv in the keys' dtype
        gl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=mask)
        gl.store(DV + out, dv.to(DV.dtype.element_ty), mask=mask)
    else:  # fp32 partial sums of this band, added in torch
        gl.store(DKC + out, dk * sm_scale, mask=mask)
        gl.store(DVC + out, dv, mask=mask)


@gluon.jit
def _dkdv_kernel(LSE, DELTA, DK, DV, DKC, DVC, q_desc, do_desc, k_desc, v_desc, kc_desc, vc_desc, s_gb, s_gh, s_gl,
                 L, P, G, S, n_heads, n_kv_heads, n_stack, n_chunks, n_split, n_core, qk_scale, sm_scale,
                 PASS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, HP: gl.constexpr,
                 BMP: gl.constexpr, STAGES: gl.constexpr):
    # PASS 0: the raw keys' programs; 1: the core tokens' (n_core of them); 2 (pooling kv, one launch): the core
    # tokens' programs [0, n_core), then the raw keys'
    pid = gl.program_id(0)
    if PASS == 2:
        RAW = pid >= n_core
        if RAW:
            bh, split, k0, m1_lo, n_m1, f_lo, n_f, m2_lo, n_m2 = _bwd_segments(
                pid - n_core, gl.num_programs(0) - n_core, L, G, S, L, n_split, True, BMP)
            n_cols = L
        else:
            bh, split, k0, m1_lo, n_m1, f_lo, n_f, m2_lo, n_m2 = _bwd_segments(
                pid, n_core, L, G, S, P, n_split, False, BMP)
            n_cols = P
            # as three runs walked down from their top tiles: none, the mask-free rows, the masked rows below them
            m2_lo, n_m2 = m1_lo + (n_m1 - 1) * BMP, n_m1
            f_lo = f_lo + (n_f - 1) * BMP
            m1_lo, n_m1 = pid * 0, pid * 0
        step = gl.where(RAW, BMP, -BMP)
    else:
        RAW: gl.constexpr = PASS == 0
        if RAW:
            n_cols = L
        else:
            n_cols = P
        bh, split, k0, m1_lo, n_m1, f_lo, n_f, m2_lo, n_m2 = _bwd_segments(
            pid, gl.num_programs(0), L, G, S, n_cols, n_split, RAW, BMP)
        step: gl.constexpr = BMP  # PASS 1 walks down by its own formula
    b = bh // n_kv_heads
    kv_head = bh % n_kv_heads  # the KV head (raw keys) or the core head (core tokens) of the keys
    head0 = kv_head * n_stack  # its first query head
    n_tiles = n_chunks * (n_m1 + n_f + n_m2)
    if RAW:
        out_row0 = b.to(gl.int64) * s_gb + kv_head.to(gl.int64) * s_gh
    else:  # partial sums (n_split, B, C, P, d), contiguous
        out_row0 = (split * (n_core // (gl.cdiv(P, 2 * BWD_KEYS) * n_split)) + bh).to(gl.int64) * P * s_gl

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, 1, HP, BMP, BLOCK_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, 1, HP, BMP, BLOCK_D], do_desc.layout)
    kv_smem = gl.allocate_shared_memory(q_desc.dtype, [4, 1, 1, BWD_KEYS, BLOCK_D], k_desc.layout)
    stat_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=2)  # the loader's two arrivals: q and do (with their bytes), lse and delta
        mbarrier.init(empty.index(i), count=2)  # both warpgroups release a stage

    gl.warp_specialize([
        (_bwd_consumer_partition, (DK, DV, DKC, DVC, kv_smem, q_smem, do_smem, stat_smem, kv_bar, ready, empty,
                                   n_stack, k0, n_cols, L, G, S, out_row0, s_gl, m1_lo, n_m1, f_lo, n_f, m2_lo, n_m2,
                                   step, n_tiles, qk_scale, sm_scale, RAW, PASS, 0, HEAD_DIM, BLOCK_D, HP, BMP,
                                   STAGES)),
        (_bwd_consumer_partition, (DK, DV, DKC, DVC, kv_smem, q_smem, do_smem, stat_smem, kv_bar, ready, empty,
                                   n_stack, k0, n_cols, L, G, S, out_row0, s_gl, m1_lo, n_m1, f_lo, n_f, m2_lo, n_m2,
                                   step, n_tiles, qk_scale, sm_scale, RAW, PASS, 1, HEAD_DIM, BLOCK_D, HP, BMP,
                                   STAGES)),
        (_bwd_load_partition, (q_desc, do_desc, k_desc, v_desc, kc_desc, vc_desc, LSE, DELTA, kv_smem, q_smem,
                               do_smem, stat_smem, kv_bar, ready, empty, b, kv_head, head0, n_heads, L, k0, m1_lo,
                               n_m1, f_lo, n_f, m2_lo, n_m2, step, n_tiles, RAW, PASS, HP, BMP, STAGES)),
    ], [4, 1], [240, 24])  # registers: the fewest spills of consumer 224-256 / loader 24-56 compiled for sm_90


# --------------------------------------------------------------------------------------------------
# Backward: dq of a block of stacked query rows, over the tiles ``cca_triton._dq_kernel`` visits
# --------------------------------------------------------------------------------------------------
# One program owns DQ_ROWS stacked query rows (cca_triton's dq tile: HP heads x BMP positions); each consumer
# warpgroup holds 64 of them and their fp32 dq accumulator. The load warp streams 64-key tiles by TMA in the Triton
# kernel's order and with its bounds (core tokens; then the window's raw keys as three runs: masked, mask-free,
# causal-masked), so every row sums the same products in the same order.
DQ_ROWS = 128
DQ_KEYS = gl.constexpr(64)
DQ_STAGES = 3  # 3 x (k, v) tiles of 64 x 128 + 2 x 2 x (q, do) rows of 64 x 128 = 160 KB


@gluon.jit
def _dq_runs(T0, T1, G, S, DQ_KEYS: gl.constexpr):
    """The program's key tiles as counts: core tiles, then raw runs R1 (from n0*g, masked), R2 (mask-free), R3
    (causal-masked), with their first columns (``cca_triton._dq_kernel``'s loops)."""
    n0 = _n_visible(T0, G, S)
    n1 = _n_visible(T1, G, S)
    a_end = n1 * G
    b_end = a_end + (gl.maximum(T0 + 1 - a_end, 0) // DQ_KEYS) * DQ_KEYS
    n_core = gl.cdiv(n1, DQ_KEYS)
    r1_lo = n0 * G
    n_r1 = gl.cdiv(gl.maximum(a_end - r1_lo, 0), DQ_KEYS)
    n_r2 = (b_end - a_end) // DQ_KEYS
    n_r3 = gl.cdiv(gl.maximum(T1 + 1 - b_end, 0), DQ_KEYS)
    return n0, a_end, b_end, n_core, r1_lo, n_r1, n_r2, n_r3


@gluon.jit
def _dq_tile_col(i, n_core, r1_lo, n_r1, a_end, n_r2, b_end, DQ_KEYS: gl.constexpr):
    """Tile i's first column and run: 0 core, 1 R1, 2 R2, 3 R3."""
    k = i - n_core
    run = gl.where(i < n_core, 0, gl.where(k < n_r1, 1, gl.where(k < n_r1 + n_r2, 2, 3)))
    col0 = gl.where(run == 0, i * DQ_KEYS, gl.where(run == 1, r1_lo + k * DQ_KEYS,
                                                   gl.where(run == 2, a_end + (k - n_r1) * DQ_KEYS,
                                                            b_end + (k - n_r1 - n_r2) * DQ_KEYS)))
    return col0, run


@gluon.jit
def _dq_load_partition(kc_desc, vc_desc, k_desc, v_desc, k_smem, v_smem, ready, empty, b, c, j,
                       n_core, r1_lo, n_r1, a_end, n_r2, b_end, n_tiles, STAGES: gl.constexpr):
    for i in range(n_tiles):
        col0, run = _dq_tile_col(i, n_core, r1_lo, n_r1, a_end, n_r2, b_end, DQ_KEYS)
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), 2 * k_desc.block_type.nbytes)
        if run == 0:
            tma.async_copy_global_to_shared(kc_desc, [b, c, col0, 0], ready.index(s), k_smem.index(s))
            tma.async_copy_global_to_shared(vc_desc, [b, c, col0, 0], ready.index(s), v_smem.index(s))
        else:
            tma.async_copy_global_to_shared(k_desc, [b, j, col0, 0], ready.index(s), k_smem.index(s))
            tma.async_copy_global_to_shared(v_desc, [b, j, col0, 0], ready.index(s), v_smem.index(s))


@gluon.jit
def _dq_consumer_partition(Q, O, DO, LSE, DELTA, DQ, q_smem, do_smem, k_smem, v_smem, ready, empty,
                           s_qb, s_qh, s_ql, s_yb, s_yh, s_yl, s_ob, s_oh, s_ol, s_db, s_dh, s_dl, b, c, chunk, T0, L,
                           G, S, n_heads, n_stack, n0, n_core, r1_lo, n_r1, a_end, n_r2, b_end, n_tiles, qk_scale,
                           sm_scale,
                           WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, HP: gl.constexpr,
                           BMP: gl.constexpr, STAGES: gl.constexpr):
    s_layout: gl.constexpr = _mma_layout(DQ_KEYS)
    acc_layout: gl.constexpr = _mma_layout(BLOCK_D)
    a_layout: gl.constexpr = _operand_layout(acc_layout)
    ld_layout: gl.constexpr = _delta_layout(BLOCK_D)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    b64 = b.to(gl.int64)

    # this warpgroup's 64 of the program's stacked rows
    i_ld = WG * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_layout))
    d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld_layout))
    head, t_ld, ok = _stacked_rows(i_ld, chunk, T0, n_stack, L, HP, BMP)
    hq = (c * n_stack + head).to(gl.int64)
    mask = ok[:, None] & (d[None, :] < HEAD_DIM)
    q_my = q_smem.index(WG)
    do_my = do_smem.index(WG)
    q_my.store(gl.load(Q + b64 * s_qb + hq[:, None] * s_qh + t_ld[:, None] * s_ql + d[None, :], mask=mask, other=0.0))
    do_rows = gl.load(DO + b64 * s_ob + hq[:, None] * s_oh + t_ld[:, None] * s_ol + d[None, :], mask=mask, other=0.0)
    o_rows = gl.load(O + b64 * s_yb + hq[:, None] * s_yh + t_ld[:, None] * s_yl + d[None, :], mask=mask, other=0.0)
    do_my.store(do_rows)
    fence_async_shared()
    gl.thread_barrier()  # all 128 threads stored their rows before the wgmma reads the tiles

    # delta_t = <o_t, do_t> (FlashAttention-2's backward preprocessing) of these rows, kept for the dk/dv passes
    delta_ld = gl.sum(o_rows.to(gl.float32) * do_rows.to(gl.float32), 1)
    gl.store(DELTA + (b64 * n_heads + hq) * L + t_ld, delta_ld, mask=ok)
    delta = gl.convert_layout(delta_ld, row_s)

    i_s = WG * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    head_s, t, ok_s = _stacked_rows(i_s, chunk, T0, n_stack, L, HP, BMP)
    stat = (b64 * n_heads + c * n_stack + head_s) * L + t
    lse = gl.load(LSE + stat, mask=ok_s, other=float("inf"))  # +inf: padding rows get p = 0
    n_t = _n_visible(t, G, S)
    lo_t = n_t * G
    zero_s = gl.zeros([BLOCK_M, DQ_KEYS], gl.float32, s_layout)
    dq = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, acc_layout)

    if n_tiles > 0:
        mbarrier.wait(ready.index(0), 0)
    # the next tile's scores are issued behind this tile's dq product (as in the dk/dv kernel)
    s_tok = warpgroup_mma(q_my, k_smem.index(0).reshape([DQ_KEYS, BLOCK_D]).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
    for i in range(n_tiles):
        col0, run = _dq_tile_col(i, n_core, r1_lo, n_r1, a_end, n_r2, b_end, DQ_KEYS)
        s = i % STAGES
        k_t = k_smem.index(s).reshape([DQ_KEYS, BLOCK_D])
        v_t = v_smem.index(s).reshape([DQ_KEYS, BLOCK_D])
        sc = warpgroup_mma_wait(0, deps=(s_tok, ))
        dp_tok = warpgroup_mma(do_my, v_t.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        p = gl.exp2(sc * qk_scale - lse[:, None])
        cols = col0 + gl.arange(0, DQ_KEYS, layout=gl.SliceLayout(0, s_layout))
        if run == 0:
            if col0 + DQ_KEYS > (n0 // DQ_KEYS) * DQ_KEYS:  # cca_triton: core tiles from n0_full on are masked
                p = gl.where(cols[None, :] < n_t[:, None], p, 0.0)
        elif run == 1:
            p = gl.where((cols[None, :] >= lo_t[:, None]) & (cols[None, :] <= t[:, None]) & (cols[None, :] < a_end),
                         p, 0.0)
        elif run == 3:
            p = gl.where(cols[None, :] <= t[:, None], p, 0.0)
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
        ds = p * (dp - delta[:, None])
        ds_op = gl.convert_layout(ds.to(q_smem.dtype), a_layout)
        dq_tok = warpgroup_mma(ds_op, k_t, dq, is_async=True)
        nxt = gl.minimum(i + 1, n_tiles - 1)  # the last tile re-reads its own stage (nothing left to load there)
        mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1)
        s_tok = warpgroup_mma(q_my, k_smem.index(nxt % STAGES).reshape([DQ_KEYS, BLOCK_D]).permute((1, 0)), zero_s,
                              use_acc=False, is_async=True)
        dq, _ = warpgroup_mma_wait(1, deps=(dq_tok, ds_op))
        mbarrier.arrive(empty.index(s), count=1)
    warpgroup_mma_wait(0, deps=(s_tok, ))

    ro = WG * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    do_ = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, acc_layout))
    head_o, t_o, ok_o = _stacked_rows(ro, chunk, T0, n_stack, L, HP, BMP)
    hq_o = (c * n_stack + head_o).to(gl.int64)
    gl.store(DQ + b64 * s_db + hq_o[:, None] * s_dh + t_o[:, None] * s_dl + do_[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=ok_o[:, None] & (do_[None, :] < HEAD_DIM))


@gluon.jit
def _dq_kernel(Q, O, DO, LSE, DELTA, DQ, kc_desc, vc_desc, k_desc, v_desc,
               s_qb, s_qh, s_ql, s_yb, s_yh, s_yl, s_ob, s_oh, s_ol, s_db, s_dh, s_dl,
               L, G, S, n_heads, n_core_heads, n_stack, n_rep, n_chunks, qk_scale, sm_scale,
               HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, HP: gl.constexpr, BMP: gl.constexpr,
               STAGES: gl.constexpr):
    # cca_triton._query_tile: heads fastest, the longest (last) position blocks first
    pid = gl.program_id(0)
    n_blocks = gl.cdiv(L, BMP)
    n_hb = gl.num_programs(0) // n_blocks
    hb = pid % n_hb
    blk = n_blocks - 1 - pid // n_hb
    b = hb // (n_core_heads * n_chunks)
    c = (hb // n_chunks) % n_core_heads
    chunk = hb % n_chunks
    j = (c * n_stack) // n_rep
    T0 = blk * BMP
    T1 = gl.minimum(T0 + BMP, L) - 1
    n0, a_end, b_end, n_core, r1_lo, n_r1, n_r2, n_r3 = _dq_runs(T0, T1, G, S, DQ_KEYS)
    n_tiles = n_core + n_r1 + n_r2 + n_r3

    rows_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], gl.bfloat16)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, BLOCK_M, BLOCK_D], rows_layout)
    do_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, BLOCK_M, BLOCK_D], rows_layout)
    k_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, 1, 1, DQ_KEYS, BLOCK_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, 1, 1, DQ_KEYS, BLOCK_D], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both warpgroups release a stage

    gl.warp_specialize([
        (_dq_consumer_partition, (Q, O, DO, LSE, DELTA, DQ, q_smem, do_smem, k_smem, v_smem, ready, empty,
                                  s_qb, s_qh, s_ql, s_yb, s_yh, s_yl, s_ob, s_oh, s_ol, s_db, s_dh, s_dl, b, c, chunk,
                                  T0, L, G, S, n_heads, n_stack, n0, n_core, r1_lo, n_r1, a_end, n_r2, b_end, n_tiles,
                                  qk_scale, sm_scale, 0, HEAD_DIM, BLOCK_D, HP, BMP, STAGES)),
        (_dq_consumer_partition, (Q, O, DO, LSE, DELTA, DQ, q_smem, do_smem, k_smem, v_smem, ready, empty,
                                  s_qb, s_qh, s_ql, s_yb, s_yh, s_yl, s_ob, s_oh, s_ol, s_db, s_dh, s_dl, b, c, chunk,
                                  T0, L, G, S, n_heads, n_stack, n0, n_core, r1_lo, n_r1, a_end, n_r2, b_end, n_tiles,
                                  qk_scale, sm_scale, 1, HEAD_DIM, BLOCK_D, HP, BMP, STAGES)),
        (_dq_load_partition, (kc_desc, vc_desc, k_desc, v_desc, k_smem, v_smem, ready, empty, b, c, j,
                              n_core, r1_lo, n_r1, a_end, n_r2, b_end, n_tiles, STAGES)),
    ], [4, 1], [240, 24])


def dq(q, k, v, kc, vc, o, do, lse, dims, hp, bmp, n_chunks):
    """(dq, delta): dq as ``cca_triton._dq_kernel`` (same tiles, same order), and delta as ``cca_triton._delta_kernel``
    (the rows' <o, do>, which the dk/dv passes read), computed on the way instead of in a pass of its own; ``hp``,
    ``bmp``, ``n_chunks``: the stacking of query heads into DQ_ROWS rows (``cca_triton._stack``)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    delta = torch.empty_like(lse)
    grid = (dims.B * dims.C * n_chunks * triton.cdiv(dims.L, bmp),)
    _dq_kernel[grid](
        q, o, do, lse, delta, out, *_key_descriptors(k, v, kc, vc, dims, DQ_KEYS.value),
        *q.stride()[:3], *o.stride()[:3], *do.stride()[:3], *out.stride()[:3],
        dims.L, dims.G, dims.S, dims.H, dims.C, dims.n_stack, dims.rep, n_chunks, dims.qk_scale, dims.sm_scale,
        HEAD_DIM=dims.D, BLOCK_D=dims.block_d, HP=hp, BMP=bmp, STAGES=DQ_STAGES, num_warps=4,
    )
    return out, delta


def bwd_applies(stacking, q, do, keys, values) -> bool:
    """Whether the dk/dv kernels serve these keys and this stacking of query heads (``cca_triton._stack``): whole
    64-row tiles (HP heads x BMP positions), everything fetched by TMA. Only asked where the forward applies."""
    hp, bmp, _ = stacking
    # one query head per tile (pooling query, MHA) measured slower than the Triton kernel: 61.8 against 60.6 ms at 128K
    return hp > 1 and hp * bmp == BLOCK_M.value and tma_ok(q, do, keys, values)


def dkdv(q, k, v, kc, vc, do, lse, delta, dims, hp, bmp, n_chunks, raw: bool, n_split: int = 1):
    """dk/dv of the raw keys (``raw``: (dk, dv) in the keys' dtype) or of the core tokens (the (n_split, B, C, P, d)
    fp32 partial sums of ``n_split`` bands of rows), as ``cca_triton``'s ``_dkdv_raw_kernel`` /
    ``_dkdv_core_kernel``."""
    if raw:
        return _dkdv(q, k, v, kc, vc, do, lse, delta, dims, hp, bmp, n_chunks, 0, 1)[:2]
    return _dkdv(q, k, v, kc, vc, do, lse, delta, dims, hp, bmp, n_chunks, 1, n_split)[2:]


def dkdv_one_launch(q, k, v, kc, vc, do, lse, delta, dims, hp, bmp, n_chunks, n_split: int):
    """Both passes in one launch (pooling kv: the core heads stack the raw keys' query heads): (dk, dv, dkc, dvc),
    the same numbers as ``dkdv``'s two calls with the same ``n_split``."""
    if (dims.C, dims.n_stack) != (dims.Hkv, dims.rep):
        raise ValueError("one launch for both dk/dv passes needs pooling kv (the core heads are the KV heads)")
    return _dkdv(q, k, v, kc, vc, do, lse, delta, dims, hp, bmp, n_chunks, 2, n_split)


def _dkdv(q, k, v, kc, vc, do, lse, delta, dims, hp, bmp, n_chunks, passes: int, n_split: int):
    """``_dkdv_kernel``'s PASS 0 (raw keys), 1 (core tokens) or 2 (both): (dk, dv, dkc, dvc), None where not made."""
    raw, core = passes != 1, passes != 0
    q_desc, do_desc = _descriptors([1, hp, bmp, dims.block_d], q, do)
    box = [1, 1, BWD_KEYS.value, dims.block_d]
    k_desc, v_desc = _descriptors(box, *((k, v) if raw else (kc, vc)))
    kc_desc, vc_desc = _descriptors(box, kc, vc) if core else (k_desc, v_desc)  # one pass: not read
    dk = dv = dkc = dvc = None
    if raw:
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(k.shape, dtype=v.dtype, device=v.device)
    if core:
        dkc = torch.empty((n_split, dims.B, dims.C, dims.P, dims.D), dtype=torch.float32, device=q.device)
        dvc = torch.empty_like(dkc)
    n_raw = dims.B * dims.Hkv * triton.cdiv(dims.L, 2 * BWD_KEYS.value) if raw else 0
    n_core = dims.B * dims.C * triton.cdiv(dims.P, 2 * BWD_KEYS.value) * n_split if core else 0
    _dkdv_kernel[(n_core + n_raw,)](
        lse, delta, dk if raw else dkc, dv if raw else dvc, dkc if core else dk, dvc if core else dv,
        q_desc, do_desc, k_desc, v_desc, kc_desc, vc_desc, *(dk.stride()[:3] if raw else (0, 0, dims.D)),
        dims.L, dims.P, dims.G, dims.S, dims.H, dims.Hkv if raw else dims.C, dims.rep if raw else dims.n_stack,
        n_chunks, n_split, n_core, dims.qk_scale, dims.sm_scale,
        PASS=passes, HEAD_DIM=dims.D, BLOCK_D=dims.block_d, HP=hp, BMP=bmp, STAGES=BWD_STAGES, num_warps=4,
    )
    return dk, dv, dkc, dvc
