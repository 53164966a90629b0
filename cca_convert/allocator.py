"""The CUDA caching allocator's settings for long sequences, applied by the CLI before CUDA starts.

Training at 32K+ tokens allocates and frees tensors of many sizes; with the default allocator the freed blocks
fragment, and the 8B recipe's backward once failed to find one 15.66 GiB block on an 80 GB card that had the
room in pieces. Expandable segments map memory into growing segments instead (PyTorch's documented remedy for
fragmentation), so freed space is reusable whatever the sizes. A value the user set is never touched.
"""

from __future__ import annotations

import os

DEFAULT = "expandable_segments:True"
VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # the current name, and the one before torch 2.9


def configure_allocator() -> str | None:
    """Set expandable segments unless the user configured the allocator; returns the setting in force (None: the
    user's own). Must run before the first CUDA allocation of the process (the allocator reads it once)."""
    if any(os.environ.get(v) for v in VARIABLES):
        return None
    os.environ["PYTORCH_ALLOC_CONF"] = DEFAULT
    return DEFAULT
