"""Validation before upload: perplexity, passkey retrieval and prefill speed of the base model and the
CCA model at several context lengths, gates from the recipe, and the report (JSON, Markdown, PNG).

``config`` is imported by ``recipe.py`` and must stay light; the rest imports torch lazily.
"""

from .config import HeldoutData, ValidateSection

__all__ = ["HeldoutData", "ValidateSection"]
