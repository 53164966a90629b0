"""Triton products of a few rows with weight matrices: the linear layers of a decode step.

A decode step multiplies one row per sequence by each weight matrix, so reading the weights is all its work. cuBLAS
launches one kernel per weight, most of them followed by a split-K reduction, and reads a Llama-3.1-8B layer's
small key/value projections at about a third of an H200's bandwidth. Measured on one H200 at batch 1, the q/k/v
projections take 25.7 us as three cuBLAS calls and 12.6 us as one launch here; a gated MLP's gate and up projections
and activation take 68.0 us as cuBLAS calls and an eager SiLU-multiply, 56.0 us here.

- ``skinny_linear(x, weights, biases, residual)``: ``x @ W_i.T (+ b_i)`` for up to three weights that share ``x``, in
  one launch. Each program computes ``BLOCK_N`` output columns of one weight. With one weight it can add a
  residual stream to the product (a decoder layer's ``residual + down(h)``: one launch fewer).
- ``skinny_gated(x, gate, up, act)``: ``act(x @ gate.T) * (x @ up.T)``, a gated MLP's first half, in one launch.
  Each program computes the same columns of both products.

Rows are padded to 16, the smallest tile ``tl.dot`` takes: the tensor cores do the products, and the weight loads
set the pace. Results are rounded as eager code rounds them: each product to the output dtype, then the
activation, then the multiply. Twins: ``skinny_linear_reference`` and ``skinny_gated_reference`` (``F.linear``).
"""

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 16  # rows per launch (one tl.dot tile); more rows are a GEMM, which cuBLAS does well
ACTIVATIONS = ("silu", "gelu_tanh")


def usable(x, *weights) -> bool:
    """Whether these kernels take ``x`` (rows, K) and the weights: CUDA 16-bit tensors (or fp32 CPU ones under
    Triton's interpreter), row-major weights of ``x``'s dtype and width, at most MAX_ROWS rows."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.stride(-1) != 1:
        return False
    if x.is_cuda:
        if x.dtype not in (torch.bfloat16, torch.float16):
            return False  # fp32 models serve exactness tests; their GEMVs are left to cuBLAS
    elif os.environ.get("TRITON_INTERPRET") != "1" or x.dtype != torch.float32:
        return False  # the interpreter's 16-bit tl.dot gives garbage (triton 3.9): CPU tests run fp32
    return all(w is not None and w.dim() == 2 and w.shape[1] == x.shape[1] and w.dtype == x.dtype
               and w.device == x.device and w.is_contiguous() for w in weights)


@triton.jit
def _product(X, W, M, K, n, col0, s_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             IEEE: tl.constexpr):
    """x @ W[col0 : col0 + BLOCK_N].T in fp32: (BLOCK_M, BLOCK_N)."""
    rm = tl.arange(0, BLOCK_M)
    rn = col0 + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        xt = tl.load(X + rm[:, None] * s_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        wt = tl.load(W + rn[:, None].to(tl.int64) * K + kk[None, :], mask=(rn[:, None] < n) & (kk[None, :] < K),
                     other=0.0)
        if IEEE:
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(wt), acc)
    return acc


@triton.jit
def _rounded(v, dt: tl.constexpr):
    """fp32 ``v`` rounded to ``dt`` (nearest, ties to even), kept in fp32. bf16 on the bits: the compiler folds a
    round trip ``v.to(bf16).to(fp32)`` away."""
    if dt == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif dt == tl.float16:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def _store(Y, B, R, acc, M, n, col0, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = col0 + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < n)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < n, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:  # eager code rounds the product, then the sum
        acc = _rounded(acc, Y.dtype.element_ty) + tl.load(R + rm[:, None] * n + rn[None, :], mask=mask).to(tl.float32)
    tl.store(Y + rm[:, None] * n + rn[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _linear_kernel(X, W0, W1, W2, B0, B1, B2, Y0, Y1, Y2, R, M, K, N0, N1, N2, s_xm,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    t0 = tl.cdiv(N0, BLOCK_N)
    t1 = tl.cdiv(N1, BLOCK_N)
    # which weight this program's columns belong to (the launch covers all three, one after another)
    if pid < t0:
        W, B, Y, n, col0 = W0, B0, Y0, N0, pid * BLOCK_N
    elif pid < t0 + t1:
        W, B, Y, n, col0 = W1, B1, Y1, N1, (pid - t0) * BLOCK_N
    else:
        W, B, Y, n, col0 = W2, B2, Y2, N2, (pid - t0 - t1) * BLOCK_N
    acc = _product(X, W, M, K, n, col0, s_xm, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
    _store(Y, B, R, acc, M, n, col0, HAS_BIAS, HAS_RES, BLOCK_M, BLOCK_N)


@triton.jit
def _gated_kernel(X, G, U, Y, M, K, N, s_xm, ACT: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    col0 = tl.program_id(0) * BLOCK_N
    g = _product(X, G, M, K, N, col0, s_xm, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
    u = _product(X, U, M, K, N, col0, s_xm, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
    dt = Y.dtype.element_ty
    g = g.to(dt).to(tl.float32)  # eager code rounds each product, then the activation, then the multiply
    u = u.to(dt).to(tl.float32)
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    else:  # gelu, tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (2.0 / (1.0 + tl.exp(-2.0 * z)))
    a = a.to(dt).to(tl.float32)
    rm = tl.arange(0, BLOCK_M)
    rn = col0 + tl.arange(0, BLOCK_N)
    tl.store(Y + rm[:, None] * N + rn[None, :], (a * u).to(dt), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _tiles(columns: int, K: int) -> dict:
    """Launch settings by total output columns and width, the fastest of 36 measured on an H200 for Llama-3.1-8B's
    products at batch 1 (q/k/v together: 64 columns per program; q or o and the down projection: 32; the K/V
    projections alone: 16). The o projection's stages: 5 of 2-8 (11.0 us against 12.1 with 3, on 32 layers' weights;
    stages do not change the rounding)."""
    if columns >= 6144:
        return dict(BLOCK_N=64, BLOCK_K=256, num_stages=4)
    if columns >= 4096:
        return dict(BLOCK_N=32, BLOCK_K=512, num_stages=4) if K >= 8192 else dict(BLOCK_N=32, BLOCK_K=256, num_stages=5)
    return dict(BLOCK_N=16, BLOCK_K=512, num_stages=4)


def skinny_linear(x: torch.Tensor, weights, biases=None, residual=None) -> list[torch.Tensor]:
    """``[x @ w.T + b for w, b in zip(weights, biases)]`` for x (rows, K), 1-3 weights (N_i, K) and biases (all
    or none), in one launch; check ``usable`` first. ``residual`` (rows, N), one weight only: ``[residual + x @ w.T]``,
    rounded as eager code rounds it."""
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"skinny_linear takes 1-3 weights, got {len(weights)}")
    if residual is not None and (len(weights) != 1 or residual.shape != (x.shape[0], weights[0].shape[0])
                                 or residual.dtype != x.dtype or residual.device != x.device
                                 or not residual.is_contiguous()):
        raise ValueError(f"skinny_linear: a residual is added to one weight's product, as a contiguous "
                         f"({x.shape[0]}, {weights[0].shape[0]}) tensor of x's dtype and device")
    has_bias = biases is not None and biases[0] is not None
    if has_bias and (len(biases) != len(weights) or any(b is None for b in biases)):
        raise ValueError("skinny_linear: give a bias for every weight or for none")
    M, K = x.shape
    ys = [x.new_empty(M, w.shape[0]) for w in weights]
    pad = 3 - len(weights)
    W = list(weights) + [weights[-1]] * pad
    B = list(biases) + [biases[-1]] * pad if has_bias else W
    Y = ys + [ys[-1]] * pad
    N = [w.shape[0] for w in weights] + [0] * pad
    tiles = _tiles(sum(N), K)
    grid = (sum(triton.cdiv(n, tiles["BLOCK_N"]) for n in N),)
    R = ys[0] if residual is None else residual
    _linear_kernel[grid](x, *W, *B, *Y, R, M, K, *N, x.stride(0), HAS_BIAS=has_bias, HAS_RES=residual is not None,
                         IEEE=x.dtype == torch.float32,
                         BLOCK_M=MAX_ROWS, num_warps=4, **tiles)
    return ys


def skinny_gated(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(x @ gate.T) * (x @ up.T)`` (``act``: "silu" or "gelu_tanh"), in one launch; check ``usable`` first."""
    if act not in ACTIVATIONS:
        raise ValueError(f"skinny_gated: activation {act!r} is not one of {ACTIVATIONS}")
    if gate.shape != up.shape:
        raise ValueError(f"skinny_gated: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    M, K = x.shape
    N = gate.shape[0]
    y = x.new_empty(M, N)
    # the fastest of 42 settings on an H200 for Llama-3.1-8B's MLP (56.0 us at 1 row, 57.2 at 16; cuBLAS's gate, up and
    # eager SiLU-multiply: 68.0 and 65.3)
    block_n = 64
    _gated_kernel[(triton.cdiv(N, block_n),)](x, gate, up, y, M, K, N, x.stride(0), ACT=ACTIVATIONS.index(act),
                                              IEEE=x.dtype == torch.float32, BLOCK_M=MAX_ROWS, BLOCK_N=block_n,
                                              BLOCK_K=128, num_warps=4, num_stages=4)
    return y


def skinny_linear_reference(x, weights, biases=None, residual=None) -> list[torch.Tensor]:
    ys = [F.linear(x, w, None if biases is None else b) for w, b in zip(weights, biases or [None] * len(weights))]
    return ys if residual is None else [residual + ys[0]]


def skinny_gated_reference(x, gate, up, act: str) -> torch.Tensor:
    g = F.linear(x, gate)
    a = F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")
    return a * F.linear(x, up)
