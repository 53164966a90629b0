"""Turn a base model's config into a CCA config (no weights are touched: names are identical)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig

from . import published
from .errors import CCAError
from .recipe import Recipe

SUPPORTED = {
    "llama": "Llama 2/3/3.1/3.2 (LlamaForCausalLM)",
    "qwen2": "Qwen2/2.5 (Qwen2ForCausalLM)",
}
AUTO_MAP = {
    "AutoConfig": "configuration_cca.CCAConfig",
    "AutoModel": "modeling_cca.CCAModel",
    "AutoModelForCausalLM": "modeling_cca.CCAForCausalLM",
}
# Fields of the base configs that a CCA model does not use (Qwen2's sliding-window switches,
# bookkeeping that the new config writes itself).
_DROP = {
    "model_type", "architectures", "auto_map", "transformers_version", "_name_or_path",
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
}


def read_base_config(base_dir: Path) -> dict:
    path = base_dir / "config.json"
    if not path.is_file():
        raise CCAError(f"{base_dir} has no config.json: is it a Hugging Face model folder?")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CCAError(f"{path} is not valid JSON: {exc}") from None
    family = raw.get("model_type")
    if family not in SUPPORTED:
        supported = "; ".join(f"{k} ({v})" for k, v in SUPPORTED.items())
        raise CCAError(f"unsupported architecture model_type={family!r}; supported: {supported}")
    return raw


def build_cca_config(base_dir: Path, recipe: Recipe):
    """The CCA config of a base model folder under a recipe."""
    raw = read_base_config(base_dir)
    family = raw["model_type"]
    if raw.get("use_sliding_window"):
        raise CCAError(f"{base_dir}: use_sliding_window=true is not supported (CCA replaces the attention pattern)")
    # AutoConfig normalises legacy fields (rope_theta + rope_scaling -> rope_parameters, ...).
    base = AutoConfig.from_pretrained(base_dir).to_dict()
    fields = {k: v for k, v in base.items() if k not in _DROP}
    if family == "qwen2":  # q/k/v carry a bias, o_proj does not
        fields.update(attention_bias=True, attention_out_bias=False)
    if recipe.cca.rope_theta is not None:
        fields["rope_parameters"] = {**fields["rope_parameters"], "rope_theta": recipe.cca.rope_theta}
    if recipe.cca.max_position_embeddings is not None:
        fields["max_position_embeddings"] = recipe.cca.max_position_embeddings
    if recipe.export.dtype != "auto":
        fields["dtype"] = recipe.export.dtype
    fields.update(
        group_size=recipe.cca.group_size,
        local_window=recipe.cca.local_window,
        pooling=recipe.cca.pooling,
        attn_backend=recipe.cca.attn_backend,
        base_model_type=family,
    )
    config_cls = published.load("configuration_cca").CCAConfig
    try:
        config = config_cls(**fields)
    except (TypeError, ValueError) as exc:
        raise CCAError(f"cannot build a CCA config from {base_dir / 'config.json'}: {exc}") from None
    config.architectures = ["CCAForCausalLM"]
    config.auto_map = dict(AUTO_MAP)
    return config
