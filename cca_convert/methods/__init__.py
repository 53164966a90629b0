"""The attention methods a model can be converted to, by name. Each is one module here (``cca.py``, ``dca.py``) with
one ``Method``; the pipeline, the validation, the card and the CLI ask this registry, never ``method == "..."``."""

from __future__ import annotations

from ..errors import CCAError
from .base import Method
from .cca import CCA
from .dca import DCA

METHODS: dict[str, Method] = {}
DEFAULT = "cca"


def register(method: Method) -> Method:
    """Make a method known (recipes may name it, exports of it are recognised). Returns it."""
    METHODS[method.name] = method
    return method


def get(name: str) -> Method:
    if name not in METHODS:
        raise CCAError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    return METHODS[name]


def of_config(config) -> Method | None:
    """The method of a converted config (a transformers config, or config.json as a dict); None for a base model."""
    raw = config if isinstance(config, dict) else vars(config)
    implementation = None if isinstance(config, dict) else getattr(config, "_attn_implementation", None)
    return next((m for m in METHODS.values() if m.detects(raw) or implementation == m.name), None)


for _method in (CCA(), DCA()):
    register(_method)

__all__ = ["DEFAULT", "METHODS", "Method", "get", "of_config", "register"]
