"""The export as users meet it: transformers' pipeline, the LoRA adapter as its README says to load it, reports
without machine paths, CPU speed rows labelled."""

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from cca_convert.cli import main
from tests.factories import save_base


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    base = save_base(root / "base", max_position_embeddings=512)
    (root / "train.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    (root / "held.txt").write_text("a lazy dog sleeps while the quick fox runs. " * 400)
    recipe = root / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "cca": {"group_size": 4, "local_window": 16}, "export": {"dtype": "float32", "roundtrip": False},
        "finetune": {"enabled": True, "method": "lora", "seq_len": 64, "steps": 3, "gradient_accumulation_steps": 1,
                     "warmup_steps": 0, "learning_rate": 1e-2, "checkpoint_every": 0, "tensorboard": False,
                     "lora": {"r": 4},
                     "data": {"files": [str(root / "train.txt")]}},
        "validate": {"data": {"files": [str(root / "held.txt")]}, "context_lengths": [64], "windows": 1,
                     "passkey_trials": 0, "max_ppl_ratio": 10.0}}))
    assert main([str(base), "--recipe", str(recipe), "--output", str(root / "out")]) == 0
    return root


def test_text_generation_pipeline_runs_without_the_not_supported_error(export, caplog):
    from transformers import pipeline

    with caplog.at_level(logging.ERROR):
        pipe = pipeline("text-generation", model=str(export / "out"), trust_remote_code=True, device="cpu")
        out = pipe("abc", max_new_tokens=3, do_sample=False)[0]["generated_text"]
    assert out.startswith("abc")
    assert not [r for r in caplog.records if "is not supported for text-generation" in r.getMessage()]
