"""DCA's sizes, their default and their ranges (docs/DCA-SPEC.md): one home, read by the kernels, the model
(``dca_hf.py``) and cca-convert's converter. Plain Python (no torch)."""

BACKENDS = ("auto", "triton", "reference")


def default_sizes(trained_context: int) -> tuple[int, int]:
    """ChunkLlama's default ``(chunk_size, local_size) = (3c/4, c/8)`` for a base trained on ``c`` tokens."""
    return 3 * trained_context // 4, trained_context // 8


def check_params(chunk_size, local_size, trained_context: int | None = None) -> None:
    """ValueError for sizes the spec rejects: ``0 <= w < s = C - w`` and, given the trained context c, ``C <= c``."""
    for name, value in (("chunk_size", chunk_size), ("local_size", local_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"dca {name} must be an integer, got {value!r}")
    s = chunk_size - local_size
    if local_size < 0:
        raise ValueError(f"dca local_size must be >= 0, got {local_size}")
    if s < 1:
        raise ValueError(f"dca chunk_size={chunk_size} must exceed local_size={local_size} (the chunk length is "
                         f"chunk_size - local_size = {s})")
    if local_size > s - 1:
        raise ValueError(f"dca local_size={local_size} must be < the chunk length chunk_size - local_size = {s} "
                         "(larger values behave exactly like local_size = chunk length - 1)")
    if trained_context is not None and chunk_size > trained_context:
        raise ValueError(f"dca chunk_size={chunk_size} exceeds the base model's trained context {trained_context}: "
                         "RoPE would see distances it was never trained on")


__all__ = ["BACKENDS", "check_params", "default_sizes"]
