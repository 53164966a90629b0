"""Where a Triton test module runs: a CUDA GPU, or Triton's CPU interpreter (``TRITON_INTERPRET=1``, read by triton
when kernels are decorated: set before triton is imported, as CI does). Any other machine skips the whole module."""

import os

import pytest
import torch


def triton_device(what: str = "Triton kernels") -> tuple[bool, bool, str]:
    """``(INTERPRET, HAS_CUDA, DEVICE)`` for a module's tests; skips the module (call it at import) where neither."""
    pytest.importorskip("triton")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    has_cuda = torch.cuda.is_available() and not interpret
    if not (has_cuda or interpret):
        pytest.skip(f"{what} need a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)
    return interpret, has_cuda, "cuda" if has_cuda else "cpu"
