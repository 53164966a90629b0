"""The README.md model card of an exported repo (front matter through huggingface_hub)."""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from . import methods
from .extend import card_line
from .families import FAMILIES
from .hub import is_hub_id
from .recipe import Recipe


def retarget(readme: Path, repo_id: str) -> bool:
    """Point an exported card at the Hub repo it is pushed to: every ``from_pretrained("...")`` snippet, the title
    and the model-index name (an export names its folder until it is pushed). Returns whether the card changed."""
    if not readme.is_file():
        return False
    text = readme.read_text()
    card = ModelCard(text)
    body = re.sub(r'from_pretrained\("[^"]*"', f'from_pretrained("{repo_id}"', card.text)
    body = re.sub(r"^# .*$", f"# {repo_id}", body, count=1, flags=re.MULTILINE)
    body = body.replace(LOCAL_NOTE, "")
    if getattr(card.data, "model_name", None):
        card.data.model_name = repo_id
    new = f"---\n{card.data.to_yaml()}\n---\n{body}"
    if new != text:
        readme.write_text(new)
    return new != text


# the export's usage snippets load the folder by its name; a pushed card loads the Hub id (``retarget``)
LOCAL_NOTE = ("# (this card is in a local folder: give its path; `cca-convert push` rewrites these lines with the "
              "Hub repo id)\n")


def build_model_card(
    config, recipe: Recipe, base_model: str, repo_name: str, *, finetuned: bool = False, extra: str = "",
    card_data: dict | None = None,
) -> str:
    """Render README.md. ``extra`` is inserted before the recipe (e.g. validation results);
    ``card_data`` adds front-matter keys (e.g. ``model-index``)."""
    # base_model must be a Hub id; a local folder is only named in the text.
    method = methods.get(recipe.method)
    on_hub = is_hub_id(base_model)
    data = ModelCardData(
        base_model=base_model if on_hub else None,
        base_model_relation="finetune" if on_hub else None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=[*method.tags, "long-context", "custom_code", config.model_type],
        **(card_data or {}),
    )
    extended = card_line(config)
    if extended:
        extra = f"**Context**: {extended}.\n\n{extra}"
    body = method.card_body(
        config, FAMILIES[config.model_type], finetuned, name=repo_name, base=base_model, repo=repo_name, extra=extra,
        recipe=recipe.to_yaml(), local_note="" if is_hub_id(repo_name) else LOCAL_NOTE)
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n{body}"))
