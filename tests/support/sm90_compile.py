"""Compile the Hopper Gluon forwards (``cca_gluon``, ``dca_gluon``) for sm_90 on a machine without a GPU: triton's
own front end and its bundled ptxas, with a stand-in for the CUDA driver that names the target and launches nothing.
Run as ``python -m tests.support.sm90_compile`` (a process of its own: the stand-in replaces triton's active driver)
without ``TRITON_INTERPRET``; prints one line per kernel and shape, exits non-zero on a compile error."""

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
              ("cca d128", lambda: compile_cca(128)), ("cca d64", lambda: compile_cca(64))]
    for name, build in builds:
        kernel = build()
        print(f"{name}: sm_90 cubin {len(kernel.asm['cubin'])} bytes, {kernel.metadata.shared} bytes of shared memory",
              flush=True)
    print(f"triton {triton.__version__}: compiled")


if __name__ == "__main__":
    main()
