"""Prefill latency and peak memory of one forward pass over L tokens (no KV cache, last-token logits only).

CUDA: wall time around a synchronized forward; peak = ``torch.cuda.max_memory_allocated()`` during it minus
what was allocated before (weights and caches excluded). CPU: wall time; peak = the process's peak resident
set (VmHWM, reset through /proc/self/clear_refs) minus the resident set before, with freed memory handed back
to the OS first (glibc). tracemalloc is not used: it does not see tensor storage, which torch allocates outside
Python's allocator.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from .perplexity import _device, eval_mode


def _rss_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


_LIBC = None


def _release_freed_memory() -> None:
    """Make freed tensor memory go back to the OS, so that RSS measures what a forward really needs: large
    blocks are always mmap'ed (glibc's threshold would otherwise grow and keep them in the heap) and the heap
    is trimmed."""
    global _LIBC
    try:
        import ctypes

        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.mallopt(-3, 256 * 1024)  # M_MMAP_THRESHOLD: fixed, which also stops its dynamic growth
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):
        _LIBC = False


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def prefill(model, input_ids: torch.Tensor, repeats: int = 1) -> dict:
    """Median wall time of ``repeats`` prefills (after one warm-up) and the peak extra memory of one."""
    device = _device(model)
    ids = input_ids.reshape(1, -1).to(device)
    cuda = device.type == "cuda"

    def run():
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
        if cuda:
            torch.cuda.synchronize(device)

    times = []
    with eval_mode(model):
        run()  # warm-up (kernel compilation, allocator)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        else:
            _release_freed_memory()
            before = _rss_kib("VmRSS")
            can_reset = _reset_peak_rss()
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        if cuda:
            peak, kind = torch.cuda.max_memory_allocated(device) - before, "cuda max_memory_allocated"
        else:
            hwm = _rss_kib("VmHWM")
            peak = (hwm - before) * 1024 if (can_reset and hwm is not None and before is not None) else None
            kind = "peak RSS (VmHWM)" if peak is not None else "unavailable"
    times.sort()
    return {"latency_s": times[len(times) // 2], "peak_mem_bytes": peak, "memory": kind, "repeats": repeats}
