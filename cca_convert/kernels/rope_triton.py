"""RoPE inside Triton kernels, rounded as PyTorch's eager code rounds it: how a captured decode step's kernels rotate
the q/k that the family's RoPE left to them (``decode_graph._deferring``), so that the step gives the eager step's
numbers bit for bit."""

import triton
import triton.language as tl


@triton.jit
def round_bf16(v):
    """fp32 ``v`` rounded to bf16's precision (nearest, ties to even), kept in fp32: done on the bits, because the
    compiler folds a bf16 round trip (``v.to(bf16).to(fp32)``) away."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def eager_rope(x, x_r, c, s, sign):
    """x * cos + rotate_half(x) * sin (``x_r``: x at rotate_half's indices, ``sign``: -1 below the half, 1 above)
    rounded as eager PyTorch rounds it in x's dtype (bf16 or fp32): each product, then the sum. (fp32 is eager's only
    in a launch with ``enable_fp_fusion=False``: otherwise the compiler fuses a product into the sum.)"""
    a = x.to(tl.float32) * c
    b = x_r.to(tl.float32) * sign * s
    if x.dtype == tl.bfloat16:
        a, b = round_bf16(a), round_bf16(b)
    return (a + b).to(x.dtype)
