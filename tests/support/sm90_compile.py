"""Compile the Hopper Gluon forwards (``cca_gluon``, ``dca_gluon``) and the DCA Triton kernel's decode form for
sm_90 on a machine without a GPU: triton's own front end and its bundled ptxas, with a stand-in for the CUDA driver
that names the target and launches nothing. Run as ``python -m tests.support.sm90_compile`` (a process of its own:
the stand-in replaces triton's active driver) without ``TRITON_INTERPRET``; prints one line per kernel and shape,
exits non-zero on a compile error."""

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class CompileOnlyDriver:
    """What ``JITFunction.warmup`` asks of the active driver, for an sm_90 target."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def is_active(self):
        return True

    def map_python_to_cpp_type(self, ty):
        from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)


def compile_dca(head_dim: int, temp: bool):
    from cca_convert.kernels import dca_gluon as dg

    B, H, Hkv, L = 2, 32, 8, 4096
    q = torch.empty(B, H, L, head_dim, dtype=torch.bfloat16)
    k = torch.empty(B, Hkv, L, head_dim, dtype=torch.bfloat16)
    qpos, kstart = torch.empty(B, L, dtype=torch.int32), torch.empty(B, dtype=torch.int32)
    table, t = torch.empty(6145, head_dim), torch.empty(B)
    return dg._fwd_kernel.warmup(
        q, q, qpos, kstart, table, t if temp else table, *dg.descriptors([1, 1, dg.BLOCK_N, head_dim], k, k),
        *q.stride()[:3], *q.stride()[:3], L, 5120, 6144, B * H, H, H // Hkv, 64, 0.1, HEAD_DIM=head_dim,
        BLOCK_N=dg.BLOCK_N, STAGES=dg.STAGES, ITEMS=dg.ITEMS, HAS_TEMP=temp, ROT_ROWS=dg.ROT_ROWS, num_warps=4,
        grid=(1,))


def compile_dca_decode(temp: bool, tma: bool = True):
    """The DCA Triton kernel's decode form (``dca_triton._dca_fwd``, flash-decoding splits by span; key/value tiles by
    TMA as on a Hopper GPU, or by pointer loads): the interpreter runs it on the CPU, but does not type-check it as the
    compiler does."""
    from cca_convert.kernels import dca_triton as tri
    from cca_convert.kernels.tma import descriptors

    B, H, Hkv, L, d, splits = 1, 32, 8, 32768, 128, 32
    q = torch.empty(B, H, 1, d, dtype=torch.bfloat16)
    k = torch.empty(B, Hkv, L, d, dtype=torch.bfloat16)
    o, lse = torch.empty(splits, B, H, 1, d), torch.empty(splits, B, H, 1)
    i32 = torch.empty(B, dtype=torch.int32)
    table, t = torch.empty(6145, d), torch.empty(B)
    block_m, block_n, warps, stages = tri._CONFIGS["decode"]
    k_desc, v_desc = descriptors(block_n, d, k, k) if tma else (None, None)
    return tri._dca_fwd.warmup(
        q, k, k, k_desc, v_desc, o, lse, i32, i32, table, t if temp else None, 0.1, *q.stride()[:3], *k.stride()[:3],
        *k.stride()[:3], *o.stride()[:4], *lse.stride()[:3], Hkv, 1, L, H // Hkv, 1, 5120, 6144, 1024,
        SPLIT_BY_SPAN=True, HEAD_DIM=d, BLOCK_D=d, ROT_HALF=d // 2, BLOCK_M=block_m, BLOCK_N=block_n, HP=H // Hkv,
        BMP=block_m // (H // Hkv), PREC="tf32", TMA=tma, num_warps=warps, num_stages=stages, grid=(1,))


def compile_cca(head_dim: int):
    from cca_convert.kernels import cca_gluon as cg

    B, H, Hkv, L, G = 1, 32, 8, 4096, 16
    q = torch.empty(B, H, L, head_dim, dtype=torch.bfloat16)
    k = torch.empty(B, Hkv, L, head_dim, dtype=torch.bfloat16)
    kc = torch.empty(B, Hkv, L // G, head_dim, dtype=torch.bfloat16)
    lse = torch.empty(B, H, L)
    return cg._fwd_kernel.warmup(
        q, q, lse, lse, *cg._descriptors([1, 1, cg.BLOCK_N, head_dim], kc, kc, k, k), *q.stride()[:3],
        *q.stride()[:3], L, 0, G, 1024, H, B * Hkv, Hkv, H // Hkv, H // Hkv, 1, 64, 0.1, HEAD_DIM=head_dim,
        BLOCK_D=head_dim, BLOCK_N=cg.BLOCK_N, HP=1, BMP=64, STAGES=cg.STAGES, OFFSET=False, ITEMS=cg.ITEMS,
        num_warps=4, grid=(1,))


def main() -> None:
    driver.set_active(CompileOnlyDriver())
    builds = [("dca d128", lambda: compile_dca(128, False)), ("dca d64 temperature", lambda: compile_dca(64, True)),
              ("dca decode (Triton)", lambda: compile_dca_decode(False)),
              ("dca decode (Triton) temperature", lambda: compile_dca_decode(True)),
              ("dca decode (Triton) pointer loads", lambda: compile_dca_decode(False, tma=False)),
              ("cca d128", lambda: compile_cca(128)), ("cca d64", lambda: compile_cca(64))]
    for name, build in builds:
        kernel = build()
        print(f"{name}: sm_90 cubin {len(kernel.asm['cubin'])} bytes, {kernel.metadata.shared} bytes of shared memory",
              flush=True)
    print(f"triton {triton.__version__}: compiled")


if __name__ == "__main__":
    main()
