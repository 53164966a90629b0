"""The export as users meet it: transformers' pipeline, the LoRA adapter as its README says to load it, reports
without machine paths, CPU speed rows labelled."""

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from cca_convert.cli import main
from tests.support.factories import save_base


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


def test_the_adapter_loads_as_its_readme_says_and_gives_the_exports_logits(export):
    """The adapter's README snippet, run as written (base path filled in): base weights in the CCA model + the LoRA
    deltas through peft = the merged export."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, base_path = export / "out", export / "base"
    readme = (out / "adapter" / "README.md").read_text()
    assert "[More Information Needed]" not in readme and "already merged" in readme
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] is None  # a local source: no machine path in a pushed repo
    repo = str(out)
    model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)
    model.load_state_dict(AutoModelForCausalLM.from_pretrained(str(base_path)).state_dict())
    ids = torch.arange(3, 83)[None]
    with torch.no_grad():
        without = model.eval()(ids, use_cache=False).logits  # CCA with the base's weights, no deltas
    model = PeftModel.from_pretrained(model, repo, subfolder="adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True).eval()
    with torch.no_grad():
        got, want = model(ids, use_cache=False).logits, merged(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (without - want).abs().max() > 1e-3  # the deltas matter: the test can fail


def test_reports_and_card_hold_no_machine_paths_and_label_cpu_speed(export):
    out = export / "out"
    for name in ("validation/report.json", "validation/report.md", "README.md"):
        text = (out / name).read_text()
        assert str(export) not in text, name  # the held-out file and the output are named portably
    assert "held.txt" in (out / "validation" / "report.md").read_text()
    card = (out / "README.md").read_text()
    assert "runs its PyTorch reference implementation" in card and "1.40x" in card and "2.72x" in card


def test_save_pretrained_of_a_loaded_export_keeps_every_published_file(export, tmp_path):
    """transformers copies a remote-code module's relative imports on save (and fetches them on load from the Hub):
    every file the model can use must be reachable that way, the optional Hopper kernels (cca_gluon.py) included."""
    from transformers import AutoModelForCausalLM

    out = export / "out"
    model = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True)
    model.save_pretrained(tmp_path / "resaved")
    shipped = {p.name for p in out.glob("*.py")}
    assert "cca_gluon.py" in shipped
    assert shipped <= {p.name for p in (tmp_path / "resaved").glob("*.py")}, shipped - {
        p.name for p in (tmp_path / "resaved").glob("*.py")}


GLUON_PROBE = """
import sys, torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.bfloat16).cuda().eval()
gluon = [m for name, m in sys.modules.items() if name.endswith(".cca_gluon")]
assert gluon, "cca_gluon.py was not loaded with the model"
calls = []
forward = gluon[0].forward
gluon[0].forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
with torch.no_grad():
    model(torch.randint(0, 1000, (1, 4096), device="cuda"), use_cache=False)
print("gluon forward calls:", len(calls))
assert calls, "the Hopper kernels did not run"
"""


@pytest.mark.gpu
def test_the_hopper_kernels_run_after_save_pretrained_and_reload(tmp_path):
    """On an H100/H200 (sm_90): an export re-saved with save_pretrained and loaded back in a fresh process runs
    cca_gluon's forward (before the import spelling fix the re-saved repo had no cca_gluon.py, silently)."""
    import subprocess
    import sys

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are Hopper's (sm_90)")
    base = save_base(tmp_path / "base", vocab_size=1024, hidden_size=1024, intermediate_size=2048,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"cca": {"group_size": 16, "local_window": 256},
                                      "export": {"dtype": "bfloat16", "roundtrip": False},
                                      "finetune": {"enabled": False}, "validate": {"enabled": False}}))
    assert main([str(base), "--recipe", str(recipe), "--output", str(tmp_path / "out")]) == 0
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), trust_remote_code=True).save_pretrained(
        tmp_path / "resaved")
    proc = subprocess.run([sys.executable, "-c", GLUON_PROBE, str(tmp_path / "resaved")], capture_output=True,
                          text=True, cwd=tmp_path, env={**__import__("os").environ,
                                                        "HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    print(proc.stdout.strip().splitlines()[-1])
