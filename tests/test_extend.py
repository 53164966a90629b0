"""extend.factor: the exported context, the RoPE each method gets, what follows, and the clear refusals."""

import math

import pytest
from transformers import Gemma3TextConfig, LlamaConfig

from cca_convert import extend, methods
from cca_convert.errors import CCAError
from cca_convert.recipe import load_recipe

TINY = "recipes/tiny-demo.yaml"


def _recipe(*sets, path=TINY):
    return load_recipe(path, list(sets))[0]


def _llama(**kw):
    return LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                       **kw)


def test_cca_gets_ntk_theta_scaling_and_the_context():
    config, recipe = _llama(), _recipe("extend.factor=4")
    done = extend.apply(config, recipe, methods.get("cca"), 2048)
    d = 32  # head_dim
    assert config.max_position_embeddings == 8192
    assert config.rope_parameters["rope_theta"] == pytest.approx(10000.0 * 4 ** (d / (d - 2)))
    assert done["rope"]["rope_theta_before"] == 10000.0 and config.context_extension == done
    assert "extended x4 to 8,192" in extend.card_line(config)
    # relative lengths ("2c") and the growth gate of the export count in the base's c, not the extended context
    assert methods.get("cca").trained_context(config) == 2048 and methods.get("cca").trained_context(_llama()) is None


def test_yarn_where_asked_and_refused_where_it_would_drop_the_base_s_own_scaling():
    config = _llama()
    extend.apply(config, _recipe("extend.factor=2", "extend.rope=yarn"), methods.get("cca"), 2048)
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 2.0
    assert config.rope_parameters["original_max_position_embeddings"] == 2048
    llama3 = _llama(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 256})
    with pytest.raises(CCAError, match="use --set extend.rope=theta"):
        extend.apply(llama3, _recipe("extend.factor=2", "extend.rope=yarn"), methods.get("cca"), 2048)
    extend.apply(llama3, _recipe("extend.factor=2"), methods.get("cca"), 2048)  # theta keeps llama3's own factor
    assert llama3.rope_parameters["rope_type"] == "llama3" and llama3.rope_parameters["factor"] == 8.0
    assert llama3.rope_parameters["rope_theta"] > 500000.0


def test_gemma3_stretches_only_the_full_attention_layers_rope():
    config = Gemma3TextConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                              max_position_embeddings=2048, num_hidden_layers=2)
    local = dict(config.rope_parameters["sliding_attention"])
    extend.apply(config, _recipe("extend.factor=2"), methods.get("cca"), 2048)
    assert config.rope_parameters["sliding_attention"] == local
    assert config.rope_parameters["full_attention"]["rope_theta"] > 10000.0


def test_dca_keeps_its_rope_and_claims_the_context():
    config, recipe = _llama(), _recipe("method=dca", "extend.factor=8", path="recipes/dca-tiny-demo.yaml")
    before = dict(config.rope_parameters)
    done = extend.apply(config, recipe, methods.get("dca"), 2048)
    assert config.rope_parameters == before and done["rope"] is None and config.max_position_embeddings == 16384
    assert "RoPE unchanged" in extend.card_line(config)


def test_clashes_and_unstretchable_ropes_are_one_clear_error():
    with pytest.raises(CCAError, match="drop cca.rope_theta"):
        extend.apply(_llama(), _recipe("extend.factor=2", "cca.rope_theta=50000"), methods.get("cca"), 2048)
    longrope = _llama(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 16,
                                       "long_factor": [1.0] * 16, "original_max_position_embeddings": 2048})
    with pytest.raises(CCAError, match="'longrope'"):
        extend.apply(longrope, _recipe("extend.factor=2"), methods.get("cca"), 2048)
    with pytest.raises(CCAError, match="extend.factor"):
        _recipe("extend.factor=0.5")
    with pytest.raises(CCAError, match="extend.factor"):
        _recipe("extend.factor=.nan")


def test_factor_one_changes_nothing_and_what_follows_unless_set():
    config = _llama()
    assert extend.apply(config, _recipe(), methods.get("cca"), 2048) is None and config.max_position_embeddings == 2048
    logs = []
    r = extend.follow(_recipe("extend.factor=2"), 2048, logs.append)
    assert r.finetune.seq_len == 4096 and r.validate.context_lengths == [256, 512, 1024, 2048, 4096]
    assert len(logs) == 2
    kept = extend.follow(_recipe("extend.factor=2", "finetune.seq_len=512", "validate.context_lengths=[512]"), 2048)
    assert kept.finetune.seq_len == 512 and kept.validate.context_lengths == [512]
    assert math.isclose(extend.context(1.5, 2048), 3072)
    # lengths past the exported context go (DCA's default 8c with factor 2)
    dca = load_recipe("recipes/dca-default.yaml", ["extend.factor=2"])[0]
    dca = dca.model_copy(update={"validate": dca.validate.resolved(2048)})
    assert extend.follow(dca, 2048, logs.append).validate.context_lengths == [2048, 4096]
    assert "- [8192, 16384] (past 4096)" in logs[-1]
