"""Every supported family through the real CLI, on tiny random checkpoints built from transformers' own configs.

For each family (and the variants that take another path: tied embeddings + llama3 RoPE, Mistral with a sliding
window, Qwen2 with sliding-window layers, Qwen2 / Gemma 3 whose every layer slides under ``layer_types``)
``cca-convert`` exits 0, and the exported repo, loaded as users load it:
- with ``cca_attn_backend="full"`` equals the stock transformers model (fp32, 1e-5);
- with ``cca_local_window >= L`` equals it too (CCA over a window covering the sequence is causal attention);
- with a small window differs from it;
- decodes greedily from its compressed cache exactly like a no-cache argmax loop (batch 2, left padding);
and a LoRA or Q/K/V finetune step runs through the CLI and exports a model that round-trips.
"""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import dynamic_module_utils

from cca_convert.cli import main
from cca_convert.families import FAMILIES
from tests.support.factories import VARIANTS, family_and_overrides, save_base

CASES = list(FAMILIES) + list(VARIANTS)
RECIPE = """
cca: {{group_size: 4, local_window: 8}}
finetune:
  enabled: {finetune}
  method: {method}
  data: {{files: [{data}]}}
  seq_len: 48
  micro_batch_size: 2
  steps: 1
  warmup_steps: 0
  checkpoint_every: 0
  gradient_checkpointing: false
export: {{dtype: float32, roundtrip_tokens: 40}}
validate: {{enabled: false}}
"""


def _convert(tmp_path, case, finetune=False, method="lora"):
    family, overrides = family_and_overrides(case)
    base = tmp_path / "base"
    if not base.exists():
        save_base(base, family=family, **overrides)
    data = tmp_path / "train.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    recipe = tmp_path / f"recipe-{finetune}.yaml"
    recipe.write_text(RECIPE.format(finetune=str(finetune).lower(), method=method, data=data))
    out = tmp_path / f"out-{finetune}"
    assert main([str(base), "--recipe", str(recipe), "--output", str(out)]) == 0
    return base, out


def _load(out, **overrides):
    return transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, **overrides).eval()


def _stock(base):
    return transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="sdpa").eval()


def _ids(bsz=2, length=40, seed=1):
    return torch.randint(3, 96, (bsz, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES)
def test_family_converts_and_keeps_the_base_model(tmp_path, case):
    base, out = _convert(tmp_path, case)
    config = json.loads((out / "config.json").read_text())
    family = FAMILIES[config["model_type"]]
    module, cls = family.module_name("cca"), family.class_name("cca")
    assert config["auto_map"] == {"AutoModelForCausalLM": f"{module}.{cls}"}
    assert (out / f"{module}.py").is_file() and not (out / "modeling_cca.py").exists()

    stock, x = _stock(base), _ids()
    if case == "mistral-swa":  # CCA replaces the window (48 > L = 40: the stock model sees all keys here too)
        assert config["sliding_window"] is None and config["cca_replaced_sliding_window"] == 48
        longer = _ids(length=70)  # past the window: backend "full" is still the base model, window included
        with torch.no_grad():
            torch.testing.assert_close(_load(out, cca_attn_backend="full")(longer, use_cache=False).logits,
                                       stock(longer, use_cache=False).logits, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        want = stock(x, use_cache=False).logits
        full = _load(out, cca_attn_backend="full")(x, use_cache=False).logits
        wide = _load(out, cca_local_window=64)(x, use_cache=False).logits
        cca = _load(out)
        small = cca(x, use_cache=False).logits
    torch.testing.assert_close(full, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wide, want, atol=1e-5, rtol=1e-5)
    assert (small - want).abs().max() > 1e-3

    # Greedy decode from the compressed cache == argmax loop without a cache, batch 2 with left padding.
    prompt, mask = _ids(length=21, seed=2), torch.ones(2, 21, dtype=torch.long)
    mask[1, :6] = 0
    with torch.no_grad():
        got = cca.generate(prompt, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        seq, m, done = prompt, mask, torch.zeros(2, 1, dtype=torch.bool)
        for _ in range(12):  # as generate() does: a row that emitted eos (2) gets pad (0) from then on
            nxt = cca(seq, attention_mask=m, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            nxt = nxt.masked_fill(done, 0)
            done |= nxt == 2
            seq, m = torch.cat([seq, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
    assert torch.equal(got, seq)
    # and the logits themselves (a tiny model's argmax can hide a wrong decode): cached steps == no cache
    with torch.no_grad():
        want = cca(seq, attention_mask=m, use_cache=False).logits[:, 21:]
        cache = cca(seq[:, :21], attention_mask=m[:, :21], use_cache=True).past_key_values
        steps = [cca(seq[:, i:i + 1], attention_mask=m[:, :i + 1], past_key_values=cache, use_cache=True).logits
                 for i in range(21, seq.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case,method", [(f, "qkv" if i % 2 else "lora") for i, f in enumerate(FAMILIES)]
                         + [("phi3", "lora")])  # LoRA on Phi-3's fused qkv_proj too
def test_family_finetune_step_runs_and_exports(tmp_path, case, method):
    base, out = _convert(tmp_path, case, finetune=True, method=method)
    metrics = [json.loads(line) for line in (out / "finetune" / "metrics.jsonl").read_text().splitlines()]
    assert metrics and all(torch.isfinite(torch.tensor(r["loss"])) for r in metrics if "loss" in r)
    stock, tuned = _stock(base), _load(out, cca_attn_backend="full")
    changed = [n for n, p in tuned.state_dict().items() if not torch.equal(p, stock.state_dict()[n])]
    qkv = FAMILIES[json.loads((out / "config.json").read_text())["model_type"]].qkv
    assert changed and all(any(f".{m}." in n for m in qkv) for n in changed), changed


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_family_triton_on_gpu_matches_reference(tmp_path, case):
    """On CUDA ``auto`` runs the Triton kernels through the family's stock attention modules: prefill and every
    cached decode step equal the PyTorch reference (fp32)."""
    _, out = _convert(tmp_path, case)
    triton_model, reference = _load(out).cuda(), _load(out, cca_attn_backend="reference").cuda()
    x = _ids(bsz=3, length=301).cuda()  # not a multiple of g = 4; far past the window s = 8
    mask = torch.ones_like(x)
    mask[2, :37] = 0  # a left-padded row
    with torch.no_grad():
        want = reference(x, attention_mask=mask, use_cache=False).logits
        got = triton_model(x, attention_mask=mask, use_cache=False).logits
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=2e-4, rtol=2e-4)
        steps = triton_model(x, attention_mask=mask, use_cache=True)
        cache, seq = steps.past_key_values, x
        for _ in range(6):
            nxt = steps.logits[:, -1].argmax(-1, keepdim=True)
            seq, mask = torch.cat([seq, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
            steps = triton_model(nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
            full = reference(seq, attention_mask=mask, use_cache=False).logits[:, -1]
            torch.testing.assert_close(steps.logits[:, -1], full, atol=2e-4, rtol=2e-4)


def test_models_from_two_copies_of_the_code_share_a_process(tmp_path):
    """Every exported repo ships its own copy of cca_hf.py and each import re-registers "cca" in transformers'
    one registry. A model must still run its own copy: here the in-process (cca_convert) model decodes after a
    repo's copy was loaded last, and both equal their no-cache loops."""
    from cca_convert import methods, published

    _, out = _convert(tmp_path, "qwen3")
    remote = _load(out)  # transformers_modules' copy registers "cca" last
    local = published.family_class(FAMILIES["qwen3"], methods.get("cca")).from_pretrained(out).eval()
    assert type(remote).__module__ != type(local).__module__
    # (the repo's copy lies in this test process's own modules folder: tests/conftest.py)
    copied = Path(sys.modules[type(remote).__module__].__file__)
    assert Path(dynamic_module_utils.HF_MODULES_CACHE).name.startswith("cca-test-modules-")
    assert copied.is_relative_to(dynamic_module_utils.HF_MODULES_CACHE)
    assert not copied.is_relative_to(Path.home() / ".cache")
    seq = _ids(bsz=1, length=30, seed=3)
    for model in (local, remote):  # logits, not tokens: a tiny model's argmax can hide a wrong decode
        with torch.no_grad():
            want = model(seq, use_cache=False).logits[:, 21:]
            cache = model(seq[:, :21], use_cache=True).past_key_values
            got = torch.cat([model(seq[:, i:i + 1], past_key_values=cache, use_cache=True).logits
                             for i in range(21, 30)], 1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_ships_a_recipe_that_loads(family):
    from cca_convert.recipe import load_recipe

    recipe, path = load_recipe(None, family=family)
    assert path.name == FAMILIES[family].recipe and recipe.validate.enabled
    targets = recipe.finetune.lora.target_modules  # unset: the family's own q/k/v projections
    assert targets is None or set(targets) <= set(FAMILIES[family].qkv)


@pytest.mark.parametrize("kind, finetune", [("gemma3", False), ("gemma3", True), ("mistral3", False)])
def test_a_multimodal_checkpoint_converts_its_language_model(tmp_path, capsys, kind, finetune):
    """The Hub's Gemma 3 4B-27B are Gemma3ForConditionalGeneration, Mistral Small 3.1 Mistral3ForConditionalGeneration:
    the export is the language model with CCA, the vision tower and projector left out and said so; with the full
    backend it gives the multimodal model's own logits on text. After a LoRA finetune, the adapter's README code, run
    as written, rebuilds the export from the base's language model and the deltas."""
    from tests.support.factories import MULTIMODAL, save_multimodal

    text_type = MULTIMODAL[kind][0]
    base = save_multimodal(tmp_path / "base", kind)
    data = tmp_path / "train.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(finetune=str(finetune).lower(), method="lora", data=data))
    out = tmp_path / "out"
    assert main([str(base), "--recipe", str(recipe), "--output", str(out)]) == 0
    log = capsys.readouterr()
    assert re.search(rf"the multimodal checkpoint's language model \({text_type}\) is converted; its "
                     r"multi_modal_projector, vision_tower \(\d+ tensors\) are not part of this export", log.out)
    assert "UNEXPECTED" not in log.out + log.err  # transformers' load report of the vision tensors
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == text_type and config["architectures"] == [FAMILIES[text_type].class_name("cca")]
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.embed_tokens.weight" in names and all(n.startswith(("model.", "lm_head.")) for n in names)
    assert "Text only" in (out / "README.md").read_text()

    stock, x = transformers.AutoModelForImageTextToText.from_pretrained(base).eval(), _ids()
    with torch.no_grad():
        want = stock(input_ids=x).logits
        full = _load(out, cca_attn_backend="full")(x, use_cache=False).logits
        small = _load(out)(x, use_cache=False).logits
    if finetune:  # LoRA deltas merged: not the base any more
        assert (full - want).abs().max() > 1e-4
        readme = (out / "adapter" / "README.md").read_text()
        code = readme.split("```python\n", 1)[1].split("```", 1)[0]
        code = code.replace("BASE (the base model's Hub id or folder)", str(base)).replace('"out"', f'"{out}"')
        scope = {}
        exec(code, scope)  # noqa: S102 - the card's own snippet
        with torch.no_grad():
            got = scope["model"].eval()(x, use_cache=False).logits
        torch.testing.assert_close(got, small, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(full, want, atol=1e-5, rtol=1e-5)
        assert (small - want).abs().max() > 1e-3
