"""The methods registry's proof: a third attention method, written in this file alone (its ``Method`` and its
published model module), converts, validates and exports through the real CLI, and its exported repo loads as users
load it. No other module of cca-convert knows it exists.

The toy method scales every attention logit by ``toy_scale`` (a temperature), through an attention function registered
with transformers; its base is the same weights with SDPA."""

import importlib.util
import json
import sys
from typing import Literal

import pytest
import torch
import transformers
from pydantic import Field

from cca_convert import methods
from cca_convert.cli import main
from cca_convert.schema import Section
from tests.support.factories import save_base

TOY_MODULE = '''"""Toy attention: the stock attention with every logit scaled by config.toy_scale."""

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def toy_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    scaling = (scaling if scaling is not None else query.shape[-1] ** -0.5) * module.config.toy_scale
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


AttentionInterface.register("toy", toy_attention)


class ToyModelMixin:
    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        if attn_implementation is None or attn_implementation == "toy":
            return "toy"
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)
'''


class ToySection(Section):
    scale: float = Field(1.0, gt=0, description="attention logits are multiplied by this")
    attn_backend: Literal["auto", "reference"] = "auto"


class Toy(methods.Method):
    name, label, title = "toy", "TOY", "toy attention"
    module, mixin_name = "toy_hf", "ToyModelMixin"
    what = "whose attention logits are scaled by toy_scale (toy_hf.py)"
    section = ToySection
    tags = ("toy-attention",)
    training_free = "no training path for a toy"
    base_note = "(the same weights with attn_implementation=sdpa)"

    def __init__(self, folder):
        self.folder = folder
        (folder / "toy_hf.py").write_text(TOY_MODULE)

    def module_file(self):
        return self.folder / "toy_hf.py"

    def mixin(self):
        if "toy_hf" not in sys.modules:
            spec = importlib.util.spec_from_file_location("toy_hf", self.module_file())
            sys.modules["toy_hf"] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules["toy_hf"])
        return sys.modules["toy_hf"].ToyModelMixin

    def build_config(self, base_dir, family, config, recipe):
        config.toy_scale = recipe.toy.scale

    def detects(self, config):
        return "toy_scale" in config

    def run_as_base(self, config):
        return "_attn_implementation", "sdpa"

    def model_info(self, config):
        return {"scale": config.toy_scale}

    def settings_text(self, info):
        return f"toy scale {info['scale']}"

    def card_body(self, config, family, finetuned, **fields):
        return (f"\n# {fields['name']}\n\n{fields['base']} with toy attention (scale {config.toy_scale}).\n\n"
                f"{fields['extra']}\n## Recipe\n\n```yaml\n{fields['recipe']}```\n")


@pytest.fixture
def toy(tmp_path, monkeypatch):
    method = Toy(tmp_path)
    monkeypatch.setitem(methods.METHODS, "toy", method)
    yield method
    sys.modules.pop("toy_hf", None)


def test_a_third_method_converts_validates_and_exports_through_the_cli(tmp_path, toy, capsys):
    base = save_base(tmp_path / "base", family="llama")
    text = tmp_path / "heldout.txt"
    text.write_text("".join(chr(97 + (i * 7) % 26) for i in range(3000)))
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(f"method: toy\ntoy:\n  scale: 0.5\nvalidate:\n  data: {{files: [{text}]}}\n"
                      "  context_lengths: [32, 64]\n  windows: 1\n  passkey_trials: 0\n  speed: true\n"
                      "  max_ppl_ratio: null\nexport:\n  dtype: float32\n  roundtrip_tokens: 32\n")
    out = tmp_path / "out"
    assert main([str(base), "--recipe", str(recipe), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "TOY" in printed and "max |logit diff|" in printed  # validated, exported, reloaded in a clean process

    config = json.loads((out / "config.json").read_text())
    assert config["toy_scale"] == 0.5
    assert config["auto_map"] == {"AutoModelForCausalLM": "modeling_toy_llama.TOYLlamaForCausalLM"}
    assert {p.name for p in out.glob("*.py")} == {"toy_hf.py", "modeling_toy_llama.py"}  # only what it uses
    assert "toy-attention" in (out / "README.md").read_text()

    report = json.loads((out / "validation" / "report.json").read_text())
    assert report["model"]["method"] == "toy" and report["model"]["scale"] == 0.5
    assert report["models"] == ["base", "toy"] and set(report["speed"]["64"]) == {"base", "toy"}
    ppl = {k: report["results"][k]["perplexity"]["64"]["ppl"] for k in ("base", "toy")}
    assert ppl["toy"] != pytest.approx(ppl["base"], rel=1e-6)  # the scale changed the attention (a random model: a little)

    # as users load it: the exported code alone; the base's attention is the stock model's
    model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    stock = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, stock(ids).logits, atol=1e-3)
        model.config.toy_scale = 1.0
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, atol=1e-4, rtol=1e-4)

    # and `cca-convert validate` re-runs it on the exported folder
    assert main(["validate", str(out), "--output", str(tmp_path / "again"), "--set", "validate.speed=false"]) == 0
    again = json.loads((tmp_path / "again" / "validation" / "report.json").read_text())
    assert again["model"]["method"] == "toy" and again["results"]["toy"]["perplexity"]["64"]["ppl"] == \
        pytest.approx(ppl["toy"], rel=1e-4)
