"""Hopper forward of CCA attention, written in Gluon: FlashAttention-3's warp specialization.

Same contract as ``cca_triton._forward`` for whole sequences (same output, same base-2 logsumexp for the backward).
One program owns 2 x BMP positions of one core head and runs three partitions:

- a load warp streams the key/value tiles (the core tokens, then the raw keys of the window) by TMA into a ring of
  shared-memory stages;
- two consumer warpgroups hold 64 stacked query rows each (HP query heads x BMP positions, as in ``cca_triton``) and
  run the one online softmax over the tiles. They take turns issuing their matmuls (ping-pong), so one's softmax runs
  while the other's matmuls keep the tensor cores busy; within each, the next tile's scores are issued before the
  previous tile's P V has finished (intra-warpgroup overlap).

Triton's own pipeliner does neither on Hopper (its ``warp_specialize`` fails to compile on the CCA kernel or falls
back), and a dense probe on an H200 put this structure at 590 TFLOP/s against 507 for the Triton loop
(``benchmarks/results/attention-h200-kv.md``). Gluon has no interpreter: the CPU tests run ``cca_triton``'s kernel,
and the GPU tests hold this one to the reference. Opt-in (``use_gluon=True``): see ``cca_triton._forward``.
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
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .tma import tma_ok

BLOCK_M = gl.constexpr(64)  # stacked query rows per consumer warpgroup (the smallest wgmma M)
BLOCK_N = 128
STAGES = 3  # 2 x 64 x 128 q rows + 3 x (k, v) tiles of 128 x 128 = 224 KB of the H100/H200's 227


@gluon.jit
def _n_visible(t, G, S):
    return gl.maximum(t + 1 - S, 0) // G


@gluon.jit
def _load_partition(kc_desc, vc_desc, k_desc, v_desc, k_smem, v_smem, ready, empty, b, c, j, n_core, raw_lo, n_tiles,
                    BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr):
    for i in range(n_tiles):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1: the ring starts empty
        mbarrier.expect(ready.index(s), 2 * k_desc.block_type.nbytes)
        k_dst = k_smem.index(s)
        v_dst = v_smem.index(s)
        if i < n_core:
            tma.async_copy_global_to_shared(kc_desc, [b, c, i * BLOCK_N, 0], ready.index(s), k_dst)
            tma.async_copy_global_to_shared(vc_desc, [b, c, i * BLOCK_N, 0], ready.index(s), v_dst)
        else:
            k0 = raw_lo + (i - n_core) * BLOCK_N
            tma.async_copy_global_to_shared(k_desc, [b, j, k0, 0], ready.index(s), k_dst)
            tma.async_copy_global_to_shared(v_desc, [b, j, k0, 0], ready.index(s), v_dst)


@gluon.jit
def _softmax_tile(sc, m_i, l_i, i, n_core, n0, raw_lo, a_end, T0, n_t, lo_t, t, qk_scale,
                  BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Scales and masks tile i's scores and folds them into the running max and sum; returns p and the rescale."""
    sc = sc * qk_scale
    is_core = i < n_core
    col0 = gl.where(is_core, i * BLOCK_N, raw_lo + (i - n_core) * BLOCK_N)
    # a core tile is mask-free below n0 (every row sees it); a raw one past the window starts and before the diagonal
    masked = gl.where(is_core, col0 + BLOCK_N > n0, (col0 < a_end) | (col0 + BLOCK_N - 1 > T0))
    if masked:
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        lo = gl.where(is_core, -1, lo_t)
        hi = gl.where(is_core, n_t - 1, t)
        sc = gl.where((cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None]), sc, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _consumer_partition(Q, O, LSE, q_smem, k_smem, v_smem, ready, empty, turn,
                        s_qb, s_qh, s_ql, s_ob, s_oh, s_ol, b, c, chunk, T0, L, G, S, n_heads, n_stack,
                        n_core, n0, raw_lo, a_end, n_tiles, qk_scale,
                        WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_N: gl.constexpr,
                        HP: gl.constexpr, BMP: gl.constexpr, STAGES: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    b64 = b.to(gl.int64)
    t_base = T0 + WG * BMP  # this warpgroup's first position

    # Stacked rows (cca_triton._stacked_rows): row r is query head chunk*HP + r // BMP at position t_base + r % BMP.
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_layout))
    d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld_layout))
    head = chunk * HP + r // BMP
    tq = t_base + r % BMP
    ok = (r // BMP < HP) & (head < n_stack) & (tq < L)
    hq = (c * n_stack + head).to(gl.int64)
    q = gl.load(Q + b64 * s_qb + hq[:, None] * s_qh + tq[:, None] * s_ql + d[None, :],
                mask=ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    q_my = q_smem.index(WG)
    q_my.store(q)
    fence_async_shared()
    gl.thread_barrier()  # all 128 threads stored their rows before the wgmma reads the tile

    rs = gl.arange(0, BLOCK_M, layout=row_s)
    t = t_base + rs % BMP
    n_t = _n_visible(t, G, S)
    lo_t = n_t * G
    my_turn = turn.index(WG)
    other_turn = turn.index(1 - WG)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, row_s)  # finite: a fully masked tile gives exp2(-inf) = 0, not NaN
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)

    # Tile 0: scores only. Warpgroup 1 waits for warpgroup 0's turn to end (its barrier's phase 0); warpgroup 0's
    # first wait is on phase 1, which a fresh barrier has already passed.
    mbarrier.wait(ready.index(0), 0)
    mbarrier.wait(my_turn, 1 - WG)
    s_tok = warpgroup_mma(q_my, k_smem.index(0).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.arrive(other_turn, count=1)
    sc = warpgroup_mma_wait(0, deps=(s_tok, ))
    p, m_i, l_i, alpha = _softmax_tile(sc, m_i, l_i, 0, n_core, n0, raw_lo, a_end, T0, n_t, lo_t, t, qk_scale,
                                       BLOCK_N, s_layout)
    p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
    for i in range(1, n_tiles):
        s = i % STAGES
        sp = (i - 1) % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        mbarrier.wait(my_turn, (i & 1) ^ (1 - WG))
        s_tok = warpgroup_mma(q_my, k_smem.index(s).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        a_tok = warpgroup_mma(p_op, v_smem.index(sp).reshape([BLOCK_N, BLOCK_D]), acc, is_async=True)
        mbarrier.arrive(other_turn, count=1)
        sc = warpgroup_mma_wait(1, deps=(s_tok, ))  # the scores are in; P V may still run
        p, m_i, l_i, alpha = _softmax_tile(sc, m_i, l_i, i, n_core, n0, raw_lo, a_end, T0, n_t, lo_t, t, qk_scale,
                                           BLOCK_N, s_layout)
        acc, _ = warpgroup_mma_wait(0, deps=(a_tok, p_op))
        mbarrier.arrive(empty.index(sp), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
    sl = (n_tiles - 1) % STAGES
    mbarrier.wait(my_turn, (n_tiles & 1) ^ (1 - WG))
    a_tok = warpgroup_mma(p_op, v_smem.index(sl).reshape([BLOCK_N, BLOCK_D]), acc, is_async=True)
    mbarrier.arrive(other_turn, count=1)
    acc, _ = warpgroup_mma_wait(0, deps=(a_tok, p_op))
    mbarrier.arrive(empty.index(sl), count=1)

    l_i = gl.where(l_i > 0.0, l_i, 1.0)  # padding rows only: every real row sees itself
    out = acc / gl.convert_layout(l_i, row_o)[:, None]
    ro = gl.arange(0, BLOCK_M, layout=row_o)
    do = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    head_o = chunk * HP + ro // BMP
    t_o = t_base + ro % BMP
    ok_o = (ro // BMP < HP) & (head_o < n_stack) & (t_o < L)
    hq_o = (c * n_stack + head_o).to(gl.int64)
    gl.store(O + b64 * s_ob + hq_o[:, None] * s_oh + t_o[:, None] * s_ol + do[None, :], out.to(O.dtype.element_ty),
             mask=ok_o[:, None] & (do[None, :] < HEAD_DIM))
    head_s = chunk * HP + rs // BMP
    ok_s = (rs // BMP < HP) & (head_s < n_stack) & (t < L)
    hq_s = (c * n_stack + head_s).to(gl.int64)
    gl.store(LSE + (b64 * n_heads + hq_s) * L + t, m_i + gl.log2(l_i), mask=ok_s)


@gluon.jit
def _fwd_kernel(Q, O, LSE, kc_desc, vc_desc, k_desc, v_desc, s_qb, s_qh, s_ql, s_ob, s_oh, s_ol,
                L, G, S, n_heads, n_core_heads, n_stack, n_rep, n_chunks, qk_scale,
                HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_N: gl.constexpr, HP: gl.constexpr,
                BMP: gl.constexpr, STAGES: gl.constexpr):
    # 1-D grid, heads fastest and the longest (last) position blocks first (cca_triton._query_tile)
    pid = gl.program_id(0)
    n_blocks = gl.cdiv(L, 2 * BMP)
    n_hb = gl.num_programs(0) // n_blocks
    hb = pid % n_hb
    blk = n_blocks - 1 - pid // n_hb
    b = hb // (n_core_heads * n_chunks)
    c = (hb // n_chunks) % n_core_heads
    chunk = hb % n_chunks
    j = (c * n_stack) // n_rep  # KV head of the raw keys
    T0 = blk * 2 * BMP
    T1 = gl.minimum(T0 + 2 * BMP, L) - 1
    n0 = _n_visible(T0, G, S)
    n1 = _n_visible(T1, G, S)
    n_core = gl.cdiv(n1, BLOCK_N)
    raw_lo = n0 * G
    n_tiles = n_core + gl.cdiv(T1 + 1 - raw_lo, BLOCK_N)

    smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], gl.bfloat16)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, BLOCK_M, BLOCK_D], smem_layout)
    # the ring holds the descriptors' [1, 1, BLOCK_N, BLOCK_D] boxes; the matmuls view each as [BLOCK_N, BLOCK_D]
    k_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, 1, 1, BLOCK_N, BLOCK_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, 1, 1, BLOCK_N, BLOCK_D], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both warpgroups release a stage
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)

    a_end = n1 * G
    gl.warp_specialize([
        (_consumer_partition, (Q, O, LSE, q_smem, k_smem, v_smem, ready, empty, turn, s_qb, s_qh, s_ql, s_ob, s_oh,
                               s_ol, b, c, chunk, T0, L, G, S, n_heads, n_stack, n_core, n0, raw_lo, a_end, n_tiles,
                               qk_scale, 0, HEAD_DIM, BLOCK_D, BLOCK_N, HP, BMP, STAGES)),
        (_consumer_partition, (Q, O, LSE, q_smem, k_smem, v_smem, ready, empty, turn, s_qb, s_qh, s_ql, s_ob, s_oh,
                               s_ol, b, c, chunk, T0, L, G, S, n_heads, n_stack, n_core, n0, raw_lo, a_end, n_tiles,
                               qk_scale, 1, HEAD_DIM, BLOCK_D, BLOCK_N, HP, BMP, STAGES)),
        (_load_partition, (kc_desc, vc_desc, k_desc, v_desc, k_smem, v_smem, ready, empty, b, c, j, n_core, raw_lo,
                           n_tiles, BLOCK_N, BLOCK_D, STAGES)),
    ], [4, 1], [240, 24])


# Gluon is experimental and its API moves between releases (3.7+ renamed the TMA copy and the CTA barrier used here):
# the kernel serves the triton minor version it was verified on, on a GPU; others run the Triton forward.
VERIFIED_TRITON = "3.6"


def applies(q, k, v, kc, vc, block_d: int) -> bool:
    """Whether this kernel serves these inputs: triton 3.6, a Hopper GPU (sm_90: wgmma), 16-bit inputs, head dims up to
    128 (padded to 64 or 128), tiles TMA can fetch."""
    if ".".join(triton.__version__.split(".")[:2]) != VERIFIED_TRITON:
        return False
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or block_d not in (64, 128):
        return False
    return tma_ok(k, v, *(x for x in (kc, vc) if x.numel()))


def forward(q, k, v, kc, vc, dims, hp, bmp, n_chunks):
    """CCA forward of whole sequences: (o, base-2 logsumexp), as ``cca_triton._forward``; ``hp``, ``bmp``,
    ``n_chunks``: the stacking of query heads into BLOCK_M rows (``cca_triton._stack``)."""
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((dims.B, dims.H, dims.L), dtype=torch.float32, device=q.device)
    dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    box = [1, 1, BLOCK_N, dims.block_d]
    layout = gl.NVMMASharedLayout.get_default_for(box, dtype)
    raw = [TensorDescriptor(x, list(x.shape), list(x.stride()), box, layout) for x in (k, v)]
    core = [TensorDescriptor(x, list(x.shape), list(x.stride()), box, layout) for x in (kc, vc)] if dims.P else raw
    grid = (dims.B * dims.C * n_chunks * triton.cdiv(dims.L, 2 * bmp),)
    _fwd_kernel[grid](
        q, o, lse, *core, *raw, q.stride(0), q.stride(1), q.stride(2), o.stride(0), o.stride(1), o.stride(2),
        dims.L, dims.G, dims.S, dims.H, dims.C, dims.n_stack, dims.rep, n_chunks, dims.qk_scale,
        HEAD_DIM=dims.D, BLOCK_D=dims.block_d, BLOCK_N=BLOCK_N, HP=hp, BMP=bmp, STAGES=STAGES, num_warps=4,
    )
    return o, lse
