"""Recipes: every shipped YAML loads; property-based fuzz of parsing and `--set` (random YAML and values give a recipe
or one clear CCAError, never another exception)."""

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cca_convert.errors import CCAError
from cca_convert.recipe import load_recipe, parse_overrides


KEYS = ["cca.group_size", "cca.local_window", "cca.pooling", "cca.attn_backend", "cca.rope_theta", "export.dtype",
        "export.max_shard_size", "finetune.enabled", "finetune.steps", "finetune.method", "finetune.data.files",
        "validate.context_lengths", "validate.max_ppl_ratio", "validate.data.files", "nope.key", "cca"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=st.dictionaries(st.sampled_from(["cca", "export", "finetune", "validate", "other"]), values, max_size=4),
       pairs=st.lists(st.tuples(st.sampled_from(KEYS) | st.text(max_size=10), st.text(max_size=12)), max_size=3))
def test_fuzzed_recipes_and_overrides_give_a_clear_error_or_a_recipe(doc, pairs, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    try:
        load_recipe(path, [f"{k}={v}" for k, v in pairs])
    except CCAError as exc:
        assert str(exc).strip()


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=80))
def test_fuzzed_recipe_text_gives_a_clear_error_or_a_recipe(text, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_text(text)
    try:
        load_recipe(path, [])
    except CCAError as exc:
        assert str(exc).strip()
    try:
        parse_overrides([text])
    except CCAError:
        pass


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_recipe_loads(path):
    """Configs are code: each YAML in recipes/ validates as shipped (CCA and DCA alike)."""
    recipe, _ = load_recipe(path)
    assert recipe.method in ("cca", "dca") and recipe.validate.context_lengths


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_each_familys_dca_default_loads(family):
    from cca_convert.families import FAMILIES

    recipe, path = load_recipe(None, ["method=dca"], family=family)
    assert path.name == FAMILIES[family].dca_recipe and recipe.method == "dca" and not recipe.finetune.enabled


@pytest.mark.parametrize("method,other", [("dca", "cca"), ("cca", "dca")])
def test_the_saved_recipe_holds_only_the_method_that_ran(method, other, tmp_path):
    """``cca_recipe.yaml`` (and the card's copy) leaves out the other methods' sections: a DCA export shows no CCA
    group size. Read back, it is the same recipe (same digest), the method's own settings kept."""
    recipe, _ = load_recipe(None, [f"method={method}", f"{method}.attn_backend=reference"], family="llama")
    saved = yaml.safe_load(recipe.to_yaml())
    assert saved["method"] == method and other not in saved and saved[method]["attn_backend"] == "reference"
    path = tmp_path / "cca_recipe.yaml"
    path.write_text(recipe.to_yaml())
    again, _ = load_recipe(path)
    assert again.digest() == recipe.digest() and again.to_yaml() == recipe.to_yaml()
