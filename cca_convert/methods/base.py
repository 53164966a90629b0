"""What an attention method is to cca-convert: everything the pipeline, the validation, the card and the CLI ask
about one. A method is one module in this package holding one ``Method`` subclass; ``register`` makes it known."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path

from ..errors import CCAError
from ..schema import Section


class Method(ABC):
    name: str  # the recipe's `method:` value, its section's key and the model's config prefix (``<name>_*``)
    label: str  # in reports and logs: "CCA"
    title: str  # "Core Context Aware attention"
    module: str  # the published module (``cca_convert/modeling/<module>.py``) that defines the mixin
    mixin_name: str  # the class put in front of the family's stock causal LM
    what: str  # the rest of the exported modeling file's one-line docstring
    section: type[Section]  # the recipe section ``<name>:``
    tags: tuple[str, ...] = ()  # model card tags
    training_free: str = ""  # why a finetune cannot run with it (a recipe enabling one is refused); "": it can
    base_note: str = ""  # how the base is run in the validation, e.g. "(the same weights with attn_backend=full)"
    gpu_speed_note: str = ""  # quoted under a report's CPU speed rows (where the reference implementation runs)

    def __repr__(self) -> str:
        return f"<method {self.name}>"

    # -- the recipe -------------------------------------------------------------------------------------------------
    def settings(self, recipe) -> Section:
        """This method's section of a recipe."""
        return getattr(recipe, self.name)

    def default_recipe(self, family) -> str:
        """The recipes/ file used when no --recipe is given."""
        return family.recipe

    def check_recipe(self, recipe) -> None:
        if self.training_free and recipe.finetune.enabled:
            raise CCAError(f"{recipe.where('finetune', 'enabled')}: method {self.name} is training-free "
                           f"({self.training_free}): set finetune.enabled: false, or use method: cca to adapt a model "
                           "with a finetune")

    # -- converting -------------------------------------------------------------------------------------------------
    @abstractmethod
    def build_config(self, base_dir: Path, family, config, recipe) -> None:
        """Turn the base's config (a transformers config, changed in place) into this method's."""

    def trained_context(self, config) -> int | None:
        """c, the context relative validation lengths ("2c") count in; None: the base's max_position_embeddings.
        An extended export (``extend.factor``) keeps the base's in ``context_extension``."""
        return (getattr(config, "context_extension", None) or {}).get("trained_context")

    def describe(self, config) -> str:
        """The settings, for the convert stage's log line."""
        return ""

    # -- before any weight is loaded --------------------------------------------------------------------------------
    def check_ranges(self, job, problems) -> None:
        """Settings against the converted config, the device and the validation lengths: errors and warnings are
        appended to ``problems`` (``preflight.Problems``)."""
        context = job.config.max_position_embeddings
        if job.recipe.export.roundtrip and job.recipe.export.roundtrip_tokens > context:
            problems.errors.append(f"export.roundtrip_tokens={job.recipe.export.roundtrip_tokens} exceeds the context "
                                   f"({context}); lower it")
        backend = self.settings(job.recipe).attn_backend
        if backend == "triton" and not str(job.device).startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
            problems.errors.append(f"{self.name}.attn_backend=triton needs a CUDA GPU and this run is on the CPU: use "
                                   "auto (Triton on CUDA, the reference elsewhere) or reference")

    # the memory of its PyTorch attention (``memory.finetune_estimate``'s ``reference_attention``): "scores", an
    # (L x L) matrix per head
    reference_memory = "scores"

    def uses_reference_attention(self, recipe, device) -> bool:
        """The PyTorch attention (memory: ``reference_memory``) runs: asked for, or auto on a CPU."""
        backend = self.settings(recipe).attn_backend
        return backend == "reference" or (backend == "auto" and not str(device).startswith("cuda"))

    # -- an exported model ------------------------------------------------------------------------------------------
    @abstractmethod
    def detects(self, config: dict) -> bool:
        """Whether a config.json (as a dict) is this method's export."""

    def backend(self, config) -> str:
        """The attention backend a converted config asks for."""
        return getattr(config, f"{self.name}_attn_backend", "auto")

    def run_as_base(self, config) -> tuple[str, object]:
        """``(field, value)`` of a converted config that makes the model run as its base (same weights)."""
        return f"{self.name}_attn_backend", "full"

    @abstractmethod
    def mixin(self) -> type:
        """The class ``mixin_name`` of the published module (imported only when a model is built)."""

    def module_file(self) -> Path:
        """The published module's source: the export ships it and every published file it imports."""
        from ..published import MODELING_DIR

        return MODELING_DIR / f"{self.module}.py"

    # -- reports and cards ------------------------------------------------------------------------------------------
    def model_info(self, config) -> dict:
        """The method's settings of a converted config, for the report's ``model`` entry."""
        return {}

    def settings_text(self, info: dict) -> str:
        """One line of the settings in a report's ``model`` entry."""
        return self.label

    @abstractmethod
    def card_body(self, config, family, finetuned: bool, **fields) -> str:
        """The model card's body. ``fields``: name, base, repo, extra, recipe, local_note."""


def base_context(job) -> int | None:
    """The base model's own context (its config.json's max_position_embeddings), None where unreadable."""
    import json

    from ..multimodal import text_view

    try:
        raw = json.loads((Path(job.base_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return text_view(raw).get("max_position_embeddings") if isinstance(raw, dict) else None
