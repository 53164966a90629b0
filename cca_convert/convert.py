"""Turn a base model's config into its CCA config: the base's own config class and fields, plus the ``cca_*``
settings, the CCA class in ``architectures`` and its ``auto_map`` (no weights are touched: names are identical)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig

from .errors import CCAError
from .families import config_problems, family_of, replaces_sliding_window
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
    try:
        family_of(raw)
    except ValueError as exc:
        raise CCAError(str(exc)) from None
    problems = config_problems(raw)
    if problems:
        raise CCAError(f"{path}: CCA cannot convert this model without changing it: {'; '.join(problems)}")
    return raw


def build_cca_config(base_dir: Path, recipe: Recipe):
    """The CCA config of a base model folder under a recipe."""
    family = family_of(read_base_config(base_dir))
    try:
        # AutoConfig normalises legacy fields (rope_theta + rope_scaling -> rope_parameters, ...).
        config = AutoConfig.from_pretrained(base_dir)
    except (OSError, TypeError, ValueError) as exc:
        raise CCAError(f"cannot read {base_dir / 'config.json'} as a {family.causal_lm} config: {exc}") from None
    if replaces_sliding_window(config):
        config.cca_replaced_sliding_window = config.sliding_window
        config.sliding_window = None
    if recipe.cca.rope_theta is not None:
        rope = dict(config.rope_parameters)
        if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3): CCA's layers are the full ones
            rope["full_attention"] = {**rope["full_attention"], "rope_theta": recipe.cca.rope_theta}
        else:
            rope["rope_theta"] = recipe.cca.rope_theta
        config.rope_parameters = rope
    if recipe.cca.max_position_embeddings is not None:
        config.max_position_embeddings = recipe.cca.max_position_embeddings
    if recipe.export.dtype != "auto":
        config.dtype = recipe.export.dtype
    config.cca_group_size = recipe.cca.group_size
    config.cca_local_window = recipe.cca.local_window
    config.cca_pooling = recipe.cca.pooling
    config.cca_attn_backend = recipe.cca.attn_backend
    config.architectures = [family.cca_class]
    config.auto_map = {"AutoModelForCausalLM": f"{family.module}.{family.cca_class}"}
    return config
