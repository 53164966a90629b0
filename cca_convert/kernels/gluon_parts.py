"""What the Hopper Gluon kernels (``cca_gluon``, ``dca_gluon``) share: the warpgroup register layouts of wgmma, the
TMA descriptors of their tiles, and the check that the running triton and GPU are the ones they were verified on."""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_M = gl.constexpr(64)  # query rows per consumer warpgroup (the smallest wgmma M)

# Gluon is experimental and its API moves between releases (3.7+ renamed the TMA copy and the CTA barrier used here):
# the kernels serve the triton minor version they were verified on, on a GPU; others run the Triton kernels.
VERIFIED_TRITON = "3.6"


@gluon.constexpr_function
def mma_layout(n):
    """Registers of a warpgroup's [64, n] wgmma accumulator (4 warps, one 16-row slice each)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def operand_layout(acc_layout):
    """A 16-bit A operand held in registers (P, dS) for a wgmma into ``acc_layout``."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)


# Coalesced pointer loads of [64, d] rows: 8 contiguous elements (16 bytes) per thread.
LOAD_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))


def hopper_ok(q) -> bool:
    """Whether the Gluon kernels can serve ``q``'s device and dtype: triton 3.6, a Hopper GPU (sm_90: wgmma), 16-bit."""
    if ".".join(triton.__version__.split(".")[:2]) != VERIFIED_TRITON:
        return False
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    return q.dtype in (torch.bfloat16, torch.float16)


def descriptors(box, *tensors) -> list:
    """A TMA descriptor per (B, heads, rows, d) tensor, fetching ``box``-shaped tiles into the NVMMA shared layout."""
    layout = gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16 if tensors[0].dtype == torch.bfloat16
                                                  else gl.float16)
    return [TensorDescriptor(x, list(x.shape), list(x.stride()), box, layout) for x in tensors]


@gluon.jit
def key_ring(Q, k_desc, v_desc, BLOCK_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The forward kernels' shared memory: each consumer warpgroup's [64, d] query tile, a ring of STAGES key/value
    tiles (the descriptors' [1, 1, BLOCK_N, d] boxes; the matmuls view each as [BLOCK_N, d]) with their ready/empty
    barriers (both warpgroups release a stage), and the two warpgroups' turn barriers; in ``Q``'s dtype."""
    dtype: gl.constexpr = Q.dtype.element_ty
    smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], gl.bfloat16)
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_D], smem_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, BLOCK_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, BLOCK_D], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    return q_smem, k_smem, v_smem, ready, empty, turn


@gluon.jit
def last_pv(p_op, acc, v_smem, empty, my_turn, other_turn, it, n_turns, n_tiles, WG: gl.constexpr,
            BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr):
    """A work item's last P V in the warpgroups' turns (the loop issues each tile's P V with the next tile's scores),
    then its stage released: the finished accumulator."""
    sl = (it + n_tiles - 1) % STAGES
    mbarrier.wait(my_turn, ((n_turns + n_tiles) & 1) ^ (1 - WG))
    a_tok = warpgroup_mma(p_op, v_smem.index(sl).reshape([BLOCK_N, BLOCK_D]), acc, is_async=True)
    mbarrier.arrive(other_turn, count=1)
    acc, _ = warpgroup_mma_wait(0, deps=(a_tok, p_op))
    mbarrier.arrive(empty.index(sl), count=1)
    return acc
