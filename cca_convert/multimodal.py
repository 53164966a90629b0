"""Multimodal checkpoints whose language model a family converts: the Hub's Gemma 3 4B/12B/27B are
``Gemma3ForConditionalGeneration`` (model_type ``gemma3``: a ``gemma3_text`` model, a vision tower and a projector),
Mistral Small 3.1/3.2 ``Mistral3ForConditionalGeneration`` (``mistral3``: a ``mistral`` model, Pixtral's vision).
cca-convert reads such a folder as its text model: the config's ``text_config``, the language model's weights
under the text model's names; the vision tower and the projector are left out of the export (the converted repo is a
text-only causal LM, as a ``gemma3_text`` base gives).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TextPart:
    text_type: str  # the text model's model_type (a FAMILIES row)
    renames: tuple[tuple[str, str], ...]  # checkpoint name prefix -> the text model's; a name matching none is dropped

    def text_name(self, name: str) -> str | None:
        """The text model's name of a checkpoint tensor, None for the parts left out (vision tower, projector)."""
        for old, new in self.renames:
            if name.startswith(old):
                return new + name[len(old):]
        return None

    def left_out(self, names) -> str:
        """What the export leaves out of a checkpoint holding tensors ``names``, in words (the log, the card)."""
        dropped = [n for n in names if self.text_name(n) is None]
        parts = sorted({n.split(".", 1)[0] for n in dropped})
        return (f"the multimodal checkpoint's language model ({self.text_type}) is converted; its "
                f"{', '.join(parts) or 'other parts'} ({len(dropped)} tensors) are not part of this export")

    def key_mapping(self, names=None) -> dict[str, str]:
        """The renames as transformers' ``from_pretrained(key_mapping=...)`` takes them (regex -> replacement); with
        ``names`` (a checkpoint's tensors), only those it needs."""
        return {"^" + re.escape(old): new for old, new in self.renames if old != new
                and (names is None or any(n.startswith(old) for n in names))}

    def text_config(self, raw: dict) -> dict:
        """The text model's config.json fields: ``text_config`` with what the checkpoint gives only at its top (the
        dtype), or at its top for the whole model (whether lm_head is tied: transformers reads the top-level flag)."""
        text = dict(raw.get("text_config") or {})
        text["model_type"] = self.text_type
        for key in ("dtype", "torch_dtype"):
            if key in raw and text.get(key) is None:
                text[key] = raw[key]
        if "tie_word_embeddings" in raw:
            text["tie_word_embeddings"] = raw["tie_word_embeddings"]
        return text


# Three spellings of the language model's weights: the Hub's (transformers 4.50's), transformers >= 4.52's in memory,
# and a text-only class's own (lm_head, where not tied).
_LANGUAGE_MODEL = (("language_model.model.", "model."), ("model.language_model.", "model."),
                   ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))
PARTS = {"gemma3": TextPart("gemma3_text", _LANGUAGE_MODEL), "mistral3": TextPart("mistral", _LANGUAGE_MODEL)}


def text_part(raw: dict) -> TextPart | None:
    """The text part of a multimodal base config (as a dict), None for a text model."""
    return PARTS.get(raw.get("model_type")) if isinstance(raw.get("text_config"), dict) else None


def text_view(raw: dict) -> dict:
    """A base config.json (as a dict) as cca-convert reads it: the text model's fields for a multimodal checkpoint."""
    part = text_part(raw)
    return part.text_config(raw) if part else raw


def folder_part(folder: Path) -> TextPart | None:
    """``text_part`` of a folder's config.json; None where it is missing or unreadable (checked elsewhere)."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return text_part(raw) if isinstance(raw, dict) else None


def from_pretrained(cls, folder: Path, **kwargs):
    """``cls.from_pretrained(folder, **kwargs)``; for a multimodal folder the language model's weights under the text
    model's names, and without transformers' load report (a table of every vision tensor as UNEXPECTED: what is
    left out is logged once, in words, by the convert stage)."""
    part = folder_part(folder)
    if part is None:
        return cls.from_pretrained(folder, **kwargs)
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        return cls.from_pretrained(folder, key_mapping=part.key_mapping(), **kwargs)
    finally:
        logging.set_verbosity(verbosity)


def load_causal_lm(folder: Path, **kwargs):
    """A stock causal LM from ``folder``: ``AutoModelForCausalLM``'s, or a multimodal checkpoint's language model as
    its text class (transformers' auto class would build the whole multimodal model)."""
    import transformers

    from .families import FAMILIES

    part = folder_part(folder)
    if part is None:
        return transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    config = transformers.AutoConfig.from_pretrained(folder).get_text_config()
    return from_pretrained(getattr(transformers, FAMILIES[part.text_type].causal_lm), folder, config=config, **kwargs)
