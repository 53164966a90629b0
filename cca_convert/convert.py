"""Turn a base model's config into its converted config: the base's own config class and fields, plus the method's
settings (``cca_*``, or DCA's ``dual_chunk_attention_config``), the method's class in ``architectures`` and its
``auto_map`` (no weights are touched: names are identical)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from transformers import AutoConfig

logger = logging.getLogger("cca_convert")
from .errors import CCAError
from .families import config_problems, dca_problems, family_of, replaces_sliding_window
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


def _base_config(base_dir: Path):
    family = family_of(read_base_config(base_dir))
    try:
        # AutoConfig normalises legacy fields (rope_theta + rope_scaling -> rope_parameters, ...).
        return family, AutoConfig.from_pretrained(base_dir)
    except (OSError, TypeError, ValueError) as exc:
        raise CCAError(f"cannot read {base_dir / 'config.json'} as a {family.causal_lm} config: {exc}") from None


def build_config(base_dir: Path, recipe: Recipe):
    """The converted config of a base model folder under a recipe (its ``method``)."""
    return build_dca_config(base_dir, recipe) if recipe.method == "dca" else build_cca_config(base_dir, recipe)


def build_cca_config(base_dir: Path, recipe: Recipe):
    """The CCA config of a base model folder under a recipe."""
    family, config = _base_config(base_dir)
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


def build_dca_config(base_dir: Path, recipe: Recipe):
    """The DCA config: the base's, plus ``dual_chunk_attention_config`` (Qwen2.5-1M's keys) and ``dca_attn_backend``.
    A base's own ``dual_chunk_attention_config`` (Qwen2.5-1M) is used verbatim: the recipe's sizes apply to bases
    without one (a warning names any that were set and not applied)."""
    from .published import load

    family, config = _base_config(base_dir)
    problems = dca_problems(config)
    if problems:
        raise CCAError(f"{base_dir / 'config.json'}: DCA cannot convert this model: {'; '.join(problems)}")
    dca = recipe.dca
    own = dict(getattr(config, "dual_chunk_attention_config", None) or {})
    if own:  # Qwen2.5-1M style: the checkpoint's own settings, verbatim (DCA-SPEC.md); keys the spec does not use stay
        chunk, local = own.get("chunk_size"), own.get("local_size")
        c_orig = own.get("original_max_position_embeddings") or 0
        trained = c_orig or config.max_position_embeddings
        ignored = [k for k in ("chunk_size", "local_size", "original_max_position_embeddings", "temperature",
                               "max_position_embeddings") if getattr(dca, k) is not None]
        if ignored:
            logger.warning(f"{base_dir / 'config.json'} has its own dual_chunk_attention_config, used verbatim: "
                           + ", ".join(recipe.where("dca", k) for k in ignored) + " not applied")
    else:  # the spec's default: ChunkLlama's C = 3c/4, w = c/8, no temperature
        trained = dca.original_max_position_embeddings or config.max_position_embeddings
        chunk = dca.chunk_size or 3 * trained // 4
        local = dca.local_size if dca.local_size is not None else trained // 8
        c_orig = trained if dca.temperature else 0
    try:
        load("dca_reference").check_params(chunk, local, trained)
    except ValueError as exc:
        key = "chunk_size" if "exceeds" in str(exc) else "local_size"
        where = f"{base_dir / 'config.json'}: dual_chunk_attention_config" if own else recipe.where("dca", key)
        raise CCAError(f"{where}: {exc} (c = {trained}: the base's max_position_embeddings, or "
                       "dca.original_max_position_embeddings)") from None
    config.dual_chunk_attention_config = {**own, "chunk_size": chunk, "local_size": local,
                                          "original_max_position_embeddings": c_orig}
    config.dca_attn_backend = dca.attn_backend
    config.dca_trained_context = trained  # c: what the validation compares longer inputs with
    # The context the converted model claims (Qwen2.5-1M writes its longest input there). Only where the RoPE tables
    # do not read it: longrope/yarn derive their scaling from max_position_embeddings.
    rope = config.rope_parameters if isinstance(getattr(config, "rope_parameters", None), dict) else {}
    if not own and rope.get("rope_type", "default") in ("default", "linear", "llama3"):
        config.max_position_embeddings = max(config.max_position_embeddings,
                                             dca.max_position_embeddings or 8 * trained)
    if recipe.export.dtype != "auto":
        config.dtype = recipe.export.dtype
    config.architectures = [family.class_name("dca")]
    config.auto_map = {"AutoModelForCausalLM": f"{family.module_name('dca')}.{family.class_name('dca')}"}
    return config
