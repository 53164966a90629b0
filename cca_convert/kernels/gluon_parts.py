"""What the Hopper Gluon kernels (``cca_gluon``, ``dca_gluon``) share: the warpgroup register layouts of wgmma, the
TMA descriptors of their tiles, and the check that the running triton and GPU are the ones they were verified on."""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
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
