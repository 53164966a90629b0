"""The read floor under decode: how fast this GPU reads a cache's bytes when nothing else is done to them.

A decode step's attention must read every key and value of its cache once; a model step must also read every weight.
The datasheet bandwidth (``decode.py``'s BANDWIDTH) is a bound no kernel reaches; this is the measured one: a plain
streaming read (``_read_kv``: one Triton launch that sums what it loads, so nothing is skipped), the fastest of
READ_CONFIGS. ``benchmarks/dca.py`` times it over the decode rows' own caches ("K/V read"), ``benchmarks/decode.py``
over a buffer of several GiB (the GPU's read bandwidth, for a floor at that speed).
"""

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _read_kv(K, V, OUT, L, Hkv, cols_per_program, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
             D: tl.constexpr, BLOCK_N: tl.constexpr):
    """One (batch, KV head)'s keys and values of one column range, read once; their fp32 sum is stored."""
    pid_bh, pid_s = tl.program_id(0), tl.program_id(1)
    b, g = pid_bh // Hkv, pid_bh % Hkv
    k_base = K + b.to(tl.int64) * stride_kb + g.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + g.to(tl.int64) * stride_vh
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    lo = pid_s * cols_per_program
    for n0 in range(lo, tl.minimum(lo + cols_per_program, L), BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        m = (cols < L)[:, None]
        k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kn + d[None, :], mask=m, other=0.0)
        v = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vn + d[None, :], mask=m, other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(OUT + pid_bh * tl.num_programs(1) + pid_s, tl.sum(acc))


# (BLOCK_N, warps, stages, programs per SM): the floor is the fastest of these
READ_CONFIGS = [(64, 4, 3, 2), (64, 4, 4, 4), (128, 4, 3, 2), (128, 8, 3, 4), (128, 8, 4, 2), (256, 8, 2, 2)]


def read_kv(k, v, block_n=128, warps=8, stages=3, per_sm=2, sms=None):
    """Per-program fp32 sums of ``k`` and ``v`` (B, Hkv, L, d; any strides, d a power of two) over their L columns:
    one launch of ``_read_kv``, one program per (batch, KV head) x column range, ``per_sm`` programs per SM."""
    B, Hkv, L, d = k.shape
    sms = sms or (torch.cuda.get_device_properties(k.device).multi_processor_count if k.is_cuda else 1)
    splits = max(1, math.ceil(sms * per_sm / (B * Hkv)))
    cols = math.ceil(math.ceil(L / splits) / block_n) * block_n
    splits = math.ceil(L / cols)
    out = torch.empty(B * Hkv * splits, device=k.device, dtype=torch.float32)
    _read_kv[(B * Hkv, splits)](k, v, out, L, Hkv, cols, k.stride(0), k.stride(1), k.stride(2), v.stride(0),
                                v.stride(1), v.stride(2), D=d, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return out


def fastest_read(views, measure) -> float:
    """ms of the fastest READ_CONFIGS read over every (keys, values) of ``views`` one after another, each config
    timed by ``measure(fn)`` (e.g. in CUDA graphs)."""
    best = float("inf")
    for cfg in READ_CONFIGS:
        def call(cfg=cfg):
            for k, v in views:
                out = read_kv(k, v, *cfg)
            return out
        best = min(best, measure(call))
    return best


def read_bandwidth(device, gib: float = 4.0) -> float:
    """Bytes/s of the fastest plain read of ``gib`` GiB of bf16 on ``device`` (far past any L2), in CUDA graphs."""
    cols = int(gib * 2**30 / (2 * 2 * 64 * 128))  # keys + values, 64 "heads" of d 128, bf16
    k = torch.ones(1, 64, cols, 128, device=device, dtype=torch.bfloat16)
    v = torch.ones_like(k)

    def measure(fn):
        fn()  # compile outside the capture
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")

    ms = fastest_read([(k, v)], measure)
    nbytes = 2 * k.numel() * k.element_size()
    del k, v
    torch.cuda.empty_cache()
    return nbytes / (ms * 1e-3)
