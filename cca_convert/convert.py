"""Turn a base model's config into its converted config: the base's own config class and fields, plus the method's
settings (``methods``), the method's class in ``architectures`` and its ``auto_map`` (no weights are touched: names
are identical)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig

from . import extend, methods
from .errors import CCAError
from .families import config_problems, family_of
from .multimodal import PARTS, text_part, text_view
from .recipe import Recipe


def read_base_config(base_dir: Path) -> dict:
    path = base_dir / "config.json"
    if not path.is_file():
        raise CCAError(f"{base_dir} has no config.json: is it a Hugging Face model folder?")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CCAError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CCAError(f"{path} is not a JSON object")
    if raw.get("model_type") in PARTS and text_part(raw) is None:
        raise CCAError(f"{path}: a multimodal {raw['model_type']} config without a text_config object: its language "
                       "model cannot be read (the file is incomplete: download the model again)")
    raw = text_view(raw)  # a multimodal checkpoint's language model is the base
    try:
        family_of(raw)
    except ValueError as exc:
        raise CCAError(str(exc)) from None
    problems = config_problems(raw)
    if problems:
        raise CCAError(f"{path}: CCA cannot convert this model without changing it: {'; '.join(problems)}")
    return raw


def _base_config(base_dir: Path):
    family = family_of(read_base_config(base_dir))
    try:
        # AutoConfig normalises legacy fields (rope_theta + rope_scaling -> rope_parameters, ...).
        config = AutoConfig.from_pretrained(base_dir)
    except (OSError, TypeError, ValueError) as exc:
        raise CCAError(f"cannot read {base_dir / 'config.json'} as a {family.causal_lm} config: {exc}") from None
    if config.model_type == family.model_type:
        return family, config
    text = config.get_text_config()  # a multimodal checkpoint's language model
    if getattr(text, "dtype", None) is None:
        text.dtype = config.dtype
    # transformers ties the multimodal model's lm_head by the top-level flag (a class default where config.json has
    # none), not text_config's: the export computes what the checkpoint does
    text.tie_word_embeddings = config.tie_word_embeddings
    return family, text


def build_config(base_dir: Path, recipe: Recipe):
    """The converted config of a base model folder under a recipe: the method (``recipe.method``) changes the base's
    config; its class goes into ``architectures`` and ``auto_map``."""
    method = methods.get(recipe.method)
    family, config = _base_config(base_dir)
    trained = config.max_position_embeddings  # the base's, before the method's settings
    method.build_config(base_dir, family, config, recipe)
    extend.apply(config, recipe, method, method.trained_context(config) or trained)
    if recipe.export.dtype != "auto":
        config.dtype = recipe.export.dtype
    cls, module = family.class_name(method.name), family.module_name(method.name)
    config.architectures = [cls]
    config.auto_map = {"AutoModelForCausalLM": f"{module}.{cls}"}
    return config
