"""Key/value tiles fetched by the copy engine (TMA: Hopper and newer GPUs) in the attention kernels.

A tile load from a host-side tensor descriptor needs no per-element address arithmetic, which frees the registers
the attention loops are short of (the DCA prefill runs 18% faster at 32K on an H200). It reads zeros past the
tensor's bounds, so the kernels' masks stay as they are. The kernels keep the pointer loads for older GPUs and rows
that are not 16-byte aligned.
"""

import torch
from triton.tools.tensor_descriptor import TensorDescriptor


def tma_ok(*tensors) -> bool:
    """Whether TMA can fetch tiles of these (B, heads, rows, d) tensors: 16-bit ones on a Hopper or newer GPU (or the
    interpreter's CPU tensors, any dtype), non-empty (a sequence shorter than a group has no core tokens), with rows at
    16-byte aligned addresses."""
    device = tensors[0].device
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        return False
    for x in tensors:
        size = x.element_size()
        # 16-bit tiles only on GPUs: the measured ones (fp32 inputs serve exactness tests, where speed does not matter)
        if x.device != device or (device.type == "cuda" and size != 2):
            return False
        if not x.numel() or x.stride(-1) != 1 or x.data_ptr() % 16 or any(st * size % 16 for st in x.stride()[:-1]):
            return False
    return True


def use_tma(requested, caller: str, block_d: int, *tensors) -> bool:
    """``requested`` None: TMA where it applies on a GPU (head dims up to 128: the ones measured); True: TMA or a clear
    error; False: pointer loads."""
    if requested is None:
        return tensors[0].device.type == "cuda" and block_d <= 128 and tma_ok(*tensors)
    if requested and not tma_ok(*tensors):
        raise ValueError(f"{caller}: use_tma=True needs a Hopper or newer GPU and non-empty 16-bit "
                         f"keys/values with 16-byte aligned rows")
    return bool(requested)


def descriptors(block_rows: int, block_d: int, *tensors) -> list:
    """One descriptor per (B, heads, rows, d) tensor, fetching [1, 1, block_rows, block_d] tiles."""
    return [TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, block_rows, block_d]) for x in tensors]
