"""CCA's settings, their defaults and their ranges: one home, read by the kernels, the model (``cca_hf.py``) and
cca-convert's recipe. Plain Python (no torch), so the recipe can use it without loading a model."""

DEFAULTS = {"group_size": 16, "local_window": 1024, "pooling": "kv", "attn_backend": "auto"}
CHOICES = {"pooling": ("kv", "query"), "attn_backend": ("auto", "triton", "reference", "full")}
MINIMUM = {"group_size": 1, "local_window": 1}  # g tokens per core token; s raw keys per query


def check_args(group_size: int, local_window: int, pooling: str) -> None:
    """ValueError for a group size, local window or pooling mode CCA cannot run."""
    for name, value in (("group_size", group_size), ("local_window", local_window)):
        if not isinstance(value, int) or isinstance(value, bool) or value < MINIMUM[name]:
            raise ValueError(f"{name} must be an integer >= {MINIMUM[name]}, got {value!r}")
    if pooling not in CHOICES["pooling"]:
        raise ValueError(f"pooling must be one of {CHOICES['pooling']}, got {pooling!r}")


__all__ = ["CHOICES", "DEFAULTS", "MINIMUM", "check_args"]
