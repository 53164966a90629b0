"""Recipes: the YAML file that says how a model is converted, finetuned, validated and exported.

The schema is pydantic (unknown keys are errors); every error names the file, the line and the
dotted key, e.g. ``recipes/x.yaml:4: cca.group_size: must be >= 1 (got 0)``.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import re
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, create_model

from . import methods
from .errors import CCAError
from .extend import ExtendSection
from .finetune.config import FinetuneSection
from .schema import Section
from .validate.config import ValidateSection

try:  # installed: pyproject maps recipes/ to cca_convert.recipes
    from . import recipes as _recipes_pkg

    RECIPES_DIR = Path(_recipes_pkg.__file__).parent
except ImportError:  # a source checkout on PYTHONPATH, not installed
    RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


class ExportSection(Section):
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_shard_size: str = Field("5GB", pattern=r"^\d+(\.\d+)?\s*(B|KB|MB|GB|KiB|MiB|GiB)$")
    roundtrip_tokens: int = Field(64, ge=1, description="prompt length of the export round-trip check")
    roundtrip: bool = True
    require_tokenizer: bool = Field(True, description="refuse a source without tokenizer files (the card loads one)")


class RecipeBase(Section):
    """A recipe: ``method``, each known method's section (``methods.METHODS``), extend, finetune, export, validate. The class
    is built per set of known methods (``recipe_model``)."""

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

    def effective(self) -> dict:
        """The recipe as the run reads it: every section but the other methods' (a DCA run never reads ``cca:``), so
        that the saved ``cca_recipe.yaml`` and the card show no settings of a method that did not run."""
        data = self.model_dump(mode="json")
        for name in methods.METHODS:
            if name != self.method:
                data.pop(name, None)
        return data

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.effective(), sort_keys=True).encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.effective(), sort_keys=False)


@functools.cache
def _model_for(names: tuple[str, ...]) -> type[RecipeBase]:
    fields = {"method": (Literal[names], Field(methods.DEFAULT, description="; ".join(
        f"{n}: {m.title}" + (" (training-free)" if m.training_free else " (finetune to adapt)")
        for n, m in methods.METHODS.items())))}
    fields.update({n: (m.section, m.section()) for n, m in methods.METHODS.items()})
    fields.update(extend=(ExtendSection, ExtendSection()), finetune=(FinetuneSection, FinetuneSection()),
                  export=(ExportSection, ExportSection()), validate=(ValidateSection, ValidateSection()))
    with warnings.catch_warnings():  # the `validate:` section shadows pydantic's deprecated BaseModel.validate
        warnings.filterwarnings("ignore", message='Field name "validate"', category=UserWarning)
        return create_model("Recipe", __base__=RecipeBase, **fields)


def recipe_model() -> type[RecipeBase]:
    """The recipe class of the methods known now (one section per method)."""
    return _model_for(tuple(methods.METHODS))


Recipe = recipe_model()  # the built-in methods' recipe (load_recipe asks recipe_model(): a registered method too)


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
        method = methods.get(dict(parse_overrides(list(overrides))).get("method", methods.DEFAULT))
        path = RECIPES_DIR / method.default_recipe(FAMILIES[family])
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
    for pair, (key, value) in zip(overrides, parse_overrides(list(overrides))):
        _set_dotted(data, key, value)
        set_keys[tuple(key.split("."))] = f"--set {key}={pair.partition('=')[2].strip()}"  # as the user typed it
    try:
        model = recipe_model()
        recipe = model.model_validate(data)
    except ValidationError as exc:
        lines = _line_index(text)
        err = exc.errors()[0]
        loc = tuple(str(p) for p in err["loc"])
        dotted = ".".join(loc)
        # a list item's error (finetune.adam_betas.1) belongs to the key that set the list
        heads = [loc[:n] for n in range(len(loc), 0, -1)]
        # the source that wrote the key: a --set at or above it, the file's own line for it, a --set below it (an
        # unknown section that --set a.b=1 created is reported at a), else the file's line of its section
        where = next(itertools.chain(
            (set_keys[h] for h in heads if h in set_keys),
            [f"{path}:{lines[loc]}"] if loc in lines else [],
            (v for k, v in set_keys.items() if k[:len(loc)] == loc),
            (f"{path}:{lines[h]}" for h in heads if h in lines)), str(path))
        msg = f"{where}: {dotted}: {_describe(err)}"
        if err["type"] == "extra_forbidden":
            msg += f"; known keys here: {', '.join(_known_keys(model, loc))}"
        more = len(exc.errors()) - 1
        raise CCAError(msg + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")) from None
    lines = _line_index(text)
    recipe._path = str(path)
    recipe._origins = {loc: f"{path}:{line}" for loc, line in lines.items()}
    recipe._origins.update(set_keys)
    methods.get(recipe.method).check_recipe(recipe)
    return recipe, path
