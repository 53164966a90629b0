"""Recipes: the YAML file that says how a model is converted, finetuned, validated and exported.

The schema is pydantic (unknown keys are errors); every error names the file, the line and the
dotted key, e.g. ``recipes/x.yaml:4: cca.group_size: must be >= 1 (got 0)``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator

from .errors import CCAError
from .finetune.config import FinetuneSection
from .schema import Section
from .validate.config import ValidateSection

try:  # installed: pyproject maps recipes/ to cca_convert.recipes
    from . import recipes as _recipes_pkg

    RECIPES_DIR = Path(_recipes_pkg.__file__).parent
except ImportError:  # a source checkout on PYTHONPATH, not installed
    RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


class CCASection(Section):
    group_size: int = Field(16, ge=1, description="tokens pooled into one core token (g)")
    local_window: int = Field(1024, ge=1, description="raw keys each query keeps (s)")
    pooling: Literal["kv", "query"] = "kv"
    rope_theta: float | None = Field(None, gt=0, description="override the base RoPE theta (long-context finetunes)")
    max_position_embeddings: int | None = Field(None, ge=1, description="override the base context length")
    attn_backend: Literal["auto", "triton", "reference", "full"] = "auto"


class DCASection(Section):
    """Dual Chunk Attention (DCA-SPEC.md): Qwen2.5-1M's ``dual_chunk_attention_config`` keys. Unset (null) values come
    from the base's own ``dual_chunk_attention_config`` if it has one (used verbatim), else the ChunkLlama default
    ``chunk_size = 3c/4``, ``local_size = c/8`` (``c`` = the base's trained context), temperature off."""

    chunk_size: int | None = Field(None, ge=2, description="C: the largest RoPE position a query gets (not the chunk "
                                                            "length, which is chunk_size - local_size)")
    local_size: int | None = Field(None, ge=0, description="w: queries at in-chunk offset <= w see the previous "
                                                            "chunk at exact distances")
    original_max_position_embeddings: int | None = Field(
        None, ge=1, description="c: the base's trained context (null: its max_position_embeddings); chunk_size <= c; "
                                "also the length past which the temperature applies")
    temperature: bool | None = Field(None, description="multiply logits by (0.1 ln(L/c) + 1)^2 past c (Qwen2.5-1M); "
                                                       "null: as the base's dual_chunk_attention_config, else off")
    max_position_embeddings: int | None = Field(
        None, ge=1, description="the converted model's context (null: 8 x the trained context c)")
    attn_backend: Literal["auto", "triton", "reference"] = "auto"

    @field_validator("local_size")
    @classmethod
    def _local_below_chunk_length(cls, v, info: ValidationInfo):
        chunk = info.data.get("chunk_size")
        if v is not None and chunk is not None and v > (chunk - v) - 1:
            raise ValueError(f"must be < the chunk length chunk_size - local_size = {chunk - v} (chunk_size={chunk}); "
                             "larger values behave exactly like local_size = chunk length - 1")
        return v


class ExportSection(Section):
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_shard_size: str = Field("5GB", pattern=r"^\d+(\.\d+)?\s*(B|KB|MB|GB|KiB|MiB|GiB)$")
    roundtrip_tokens: int = Field(64, ge=1, description="prompt length of the export round-trip check")
    roundtrip: bool = True
    require_tokenizer: bool = Field(True, description="refuse a source without tokenizer files (the card loads one)")


class Recipe(Section):
    method: Literal["cca", "dca"] = Field("cca", description="cca: Core Context Aware attention (finetune to adapt); "
                                                              "dca: Dual Chunk Attention (training-free)")
    cca: CCASection = CCASection()
    dca: DCASection = DCASection()
    finetune: FinetuneSection = FinetuneSection()
    export: ExportSection = ExportSection()
    validate: ValidateSection = ValidateSection()

    _origins: dict = PrivateAttr(default_factory=dict)  # dotted key -> "file:line" or "--set k=v"
    _path: str = PrivateAttr("recipe")

    def where(self, *loc: str) -> str:
        """Where a key's value came from, for errors found after parsing (e.g. against the base's config)."""
        origin = self._origins.get(loc) or f"{self._path} ({'.'.join(loc)} unset: default)"
        return f"{origin}: {'.'.join(loc)}"

    @property
    def file(self) -> Path | None:
        """The YAML file this recipe was read from (None: built in code)."""
        return Path(self._path) if self._path != "recipe" else None

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _line_index(text: str) -> dict[tuple, int]:
    """Map each dotted key path of a YAML mapping to its 1-based line number."""
    lines: dict[tuple, int] = {}

    def walk(node, path):
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                sub = path + (key.value,)
                lines[sub] = key.start_mark.line + 1
                walk(value, sub)

    try:
        walk(yaml.compose(text), ())
    except yaml.YAMLError:
        pass
    return lines


def _describe(err: dict) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown key"
    msg = err["msg"].removeprefix("Value error, ")  # our validators' own words, without pydantic's label
    if "input" in err and not isinstance(err["input"], dict):
        msg += f" (got {err['input']!r})"
    return msg


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return []
        model = field.annotation
    return list(model.model_fields)


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise CCAError(f"--set {dotted}: '{key}' is not a section")
    node[keys[-1]] = value


def parse_overrides(pairs: list[str]) -> list[tuple[str, Any]]:
    out = []
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key.strip()):
            raise CCAError(f"--set expects KEY=VALUE with a dotted key, e.g. cca.group_size=8 (got {pair!r})")
        if not raw.strip():
            raise CCAError(f"--set {key.strip()}= has no value: give one (e.g. --set cca.group_size=8), "
                           "or null to unset an optional key")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        out.append((key.strip(), value))
    return out


def load_recipe(path: Path | None, overrides: list[str] = (), family: str | None = None) -> tuple[Recipe, Path]:
    """Read a recipe (or the family's default for the method ``--set method=...`` names), apply ``--set``
    overrides, validate. Raises CCAError."""
    if path is None:
        from .families import FAMILIES

        if family not in FAMILIES:
            raise CCAError(f"no default recipe for model family {family!r}; pass --recipe FILE")
        method = dict(parse_overrides(list(overrides))).get("method", "cca")
        path = RECIPES_DIR / (FAMILIES[family].dca_recipe if method == "dca" else FAMILIES[family].recipe)
    path = Path(path)
    if not path.is_file():
        raise CCAError(f"recipe file not found: {path}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CCAError(f"{path}: not a UTF-8 text file (byte {raw[exc.start]:#04x} at offset {exc.start}): a recipe is "
                       "YAML text; check the --recipe path") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise CCAError(f"{where}: malformed YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise CCAError(f"{path}:1: a recipe must be a mapping of sections (cca:, export:, ...)")
    set_keys = {}
    for key, value in parse_overrides(list(overrides)):
        _set_dotted(data, key, value)
        set_keys[tuple(key.split("."))] = f"--set {key}={value}"
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        lines = _line_index(text)
        err = exc.errors()[0]
        loc = tuple(str(p) for p in err["loc"])
        dotted = ".".join(loc)
        where = set_keys.get(loc) or (f"{path}:{lines[loc]}" if loc in lines else str(path))
        msg = f"{where}: {dotted}: {_describe(err)}"
        if err["type"] == "extra_forbidden":
            msg += f"; known keys here: {', '.join(_known_keys(Recipe, loc))}"
        more = len(exc.errors()) - 1
        raise CCAError(msg + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")) from None
    lines = _line_index(text)
    recipe._path = str(path)
    recipe._origins = {loc: f"{path}:{line}" for loc, line in lines.items()}
    recipe._origins.update(set_keys)
    if recipe.method == "dca" and recipe.finetune.enabled:
        raise CCAError(f"{recipe.where('finetune', 'enabled')}: method dca is training-free (its Triton kernel has no "
                       "backward): set finetune.enabled: false, or use method: cca to adapt a model with a finetune")
    return recipe, path
