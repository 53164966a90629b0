"""A multimodal checkpoint read as its language model (``cca_convert/multimodal.py``): names, config, loading. The
CLI's conversion of one is in tests/test_families.py."""

import json

import pytest
import torch
import transformers

from cca_convert import export, multimodal
from cca_convert.convert import read_base_config
from tests.support.factories import save_multimodal


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_multimodal(tmp_path_factory.mktemp("mm") / "base", "gemma3")


def test_every_spelling_of_the_language_model_is_renamed_and_the_rest_left_out():
    part = multimodal.PARTS["gemma3"]
    assert part.text_name("language_model.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert part.text_name("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert part.text_name("language_model.lm_head.weight") == "lm_head.weight"
    assert part.text_name("lm_head.weight") == "lm_head.weight"
    for other in ("vision_tower.vision_model.post_layernorm.weight", "model.vision_tower.encoder.x",
                  "multi_modal_projector.mm_input_projection_weight", "model.multi_modal_projector.mm_soft_emb_norm"):
        assert part.text_name(other) is None
    assert multimodal.text_part({"model_type": "gemma3"}) is None  # no text_config: not the multimodal layout
    assert multimodal.text_part({"model_type": "gemma3_text", "text_config": {}}) is None


def test_the_base_is_read_as_its_language_model(base):
    raw = json.loads((base / "config.json").read_text())
    assert raw["model_type"] == "gemma3" and "vision_config" in raw
    text = read_base_config(base)
    assert text["model_type"] == "gemma3_text" and text["num_hidden_layers"] == 3 and "vision_config" not in text
    assert text["dtype"] == raw["dtype"]  # given only at the top of the multimodal config
    shapes = export.weight_shapes(base)
    assert set(shapes) == set(export.base_tensor_names(base)) == {n for n, _ in export.stream_base_tensors(base)}
    stock = transformers.AutoModelForCausalLM.from_pretrained(base)
    lm = {multimodal.PARTS["gemma3"].text_name(n): t for n, t in stock.state_dict().items()}
    assert shapes == {n: tuple(t.shape) for n, t in lm.items() if n is not None and n != "lm_head.weight"}  # tied
    for name, tensor in export.stream_base_tensors(base):
        assert torch.equal(tensor, lm[name]), name


def test_the_stock_base_of_a_validation_is_the_language_model_with_the_checkpoints_logits(base):
    stock = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    text = multimodal.load_causal_lm(base).eval()
    assert type(stock).__name__ == "Gemma3ForConditionalGeneration" and type(text).__name__ == "Gemma3ForCausalLM"
    x = torch.randint(3, 90, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(text(input_ids=x).logits, stock(input_ids=x).logits, rtol=0, atol=0)
