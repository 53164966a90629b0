"""The shipped accelerate configs (``cca_convert/finetune/accelerate_*.yaml``) are code: they parse, name no model
class and no process count, and FSDP's wrap policy finds the decoder layers of every family's exported class (and of
its LoRA wrapper) from the model itself. The launches themselves run in tests/finetune/test_multigpu.py (2 GPUs)."""

from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils.dataclasses import get_module_class_from_name

from cca_convert.families import FAMILIES
from tests.support.factories import cca_hf_model_from, family_and_overrides, tiny_base_model

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "cca_convert" / "finetune").glob("accelerate_*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_parses_and_hard_codes_no_class_or_process_count(path):
    config = load_config_from_file(str(path))
    raw = yaml.safe_load(path.read_text())
    assert "num_processes" not in raw and config.num_processes == -1  # given as --num_processes N at launch
    assert "fsdp_transformer_layer_cls_to_wrap" not in (raw.get("fsdp_config") or {})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fsdp_wraps_the_families_own_decoder_layers(family):
    from peft import LoraConfig, get_peft_model

    fam, overrides = family_and_overrides(family)
    model = cca_hf_model_from(tiny_base_model(fam, **overrides), group_size=4, local_window=8)
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=list(FAMILIES[family].qkv)))
    for m in (model, wrapped):
        names = list(m._no_split_modules)  # what accelerate reads when the yaml names no class
        assert names, family
        classes = [get_module_class_from_name(m, n) for n in names]
        assert all(c is not None for c in classes), (family, names)
        layers = [mod for mod in m.modules() if isinstance(mod, tuple(classes))]
        assert len(layers) == model.config.num_hidden_layers, (family, names)
