"""DCA through the real CLI (``method: dca``), on tiny random checkpoints of every family it supports.

For each: ``cca-convert BASE --set method=dca --set dca.chunk_size=C --set dca.local_size=w`` exits 0; the exported
repo carries ``dual_chunk_attention_config`` and only DCA's files; loaded as users load it
(``AutoModelForCausalLM``, ``trust_remote_code``) it equals the stock model up to ``C + 1`` tokens and differs after
(DCA-SPEC.md "Must test" 1-2 at model level), and decodes greedily from its cache like a no-cache argmax loop
(batch 2, left padding). A Qwen2.5-1M-style checkpoint converts with its own config verbatim; bad values are recipe
errors with file:line; what DCA cannot convert is refused with the reason.
"""

import json
from pathlib import Path

import pytest
import torch
import transformers

from cca_convert.cli import main
from cca_convert.families import FAMILIES
from tests.support.child_env import checkout_env
from tests.support.factories import TINY, save_base

C, W = 24, 8  # s = 16
DCA_FAMILIES = [f for f in FAMILIES if f != "gemma3_text"]  # Gemma 3's sliding layers: refused (test below)
ARGS = ["--set", "method=dca", "--set", f"dca.chunk_size={C}", "--set", f"dca.local_size={W}",
        "--set", "validate.enabled=false", "--set", "export.dtype=float32", "--set", "export.roundtrip_tokens=60"]


def _base(tmp_path, family="llama", **overrides):
    return save_base(tmp_path / "base", family=family, **{**TINY.get(family, {}), **overrides})


def _load(out, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, **kw).eval()


def _ids(bsz=2, length=40, seed=1):
    return torch.randint(3, 96, (bsz, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", DCA_FAMILIES)
def test_family_converts_with_dca(tmp_path, family):
    base, out = _base(tmp_path, family), tmp_path / "out"
    assert main([str(base), "--output", str(out), *ARGS]) == 0
    config = json.loads((out / "config.json").read_text())
    fam = FAMILIES[family]
    assert config["model_type"] == family and config["architectures"] == [fam.class_name("dca")]
    assert config["dual_chunk_attention_config"] == {"chunk_size": C, "local_size": W,
                                                     "original_max_position_embeddings": 0}
    assert config["auto_map"] == {"AutoModelForCausalLM": f"modeling_dca_{family}.{fam.class_name('dca')}"}
    files = {p.name for p in out.iterdir()}
    assert {"dca_hf.py", "dca_reference.py", "dca_triton.py", "attention_hooks.py", f"modeling_dca_{family}.py"} <= files
    assert not {"cca_hf.py", "cache_cca.py", "modeling_cca.py"} & files

    stock = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="sdpa").eval()
    model = _load(out)
    x = _ids(length=70)
    with torch.no_grad():
        got, want = model(x, use_cache=False).logits, stock(x, use_cache=False).logits
        short = model(x[:, : C + 1], use_cache=False).logits
    torch.testing.assert_close(short, want[:, : C + 1], atol=1e-5, rtol=1e-5)  # L <= C + 1: the base model
    torch.testing.assert_close(got[:, : C + 1], want[:, : C + 1], atol=1e-5, rtol=1e-5)  # rows i <= C: too
    assert ((got[:, C + 1:] - want[:, C + 1:]).abs().amax(-1) > 1e-4).all()  # every later row differs

    # cached greedy decode == a no-cache argmax loop (left padding, across chunk boundaries)
    prompt, mask = _ids(length=20, seed=2), torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0
    with torch.no_grad():
        gen = model.generate(prompt, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
        seq, m, done = prompt, mask, torch.zeros(2, 1, dtype=torch.bool)
        for _ in range(30):  # generate() pads a row that produced EOS (2) with pad_token_id (0)
            nxt = model(seq, attention_mask=m, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            nxt = torch.where(done, 0, nxt)
            done |= nxt == 2
            seq, m = torch.cat([seq, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
    assert torch.equal(gen, seq)


def test_default_sizes_and_the_dca_demo_recipe_shape(tmp_path):
    """Without sizes: ChunkLlama's default from c = max_position_embeddings (C = 3c/4, w = c/8); the converted
    model claims 8c; the card says what DCA is."""
    base, out = _base(tmp_path, max_position_embeddings=128), tmp_path / "out"
    assert main([str(base), "--output", str(out), "--set", "method=dca", "--set", "validate.enabled=false"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["dual_chunk_attention_config"] == {"chunk_size": 96, "local_size": 16,
                                                     "original_max_position_embeddings": 0}
    assert config["max_position_embeddings"] == 1024 and config["dca_trained_context"] == 128
    card = (out / "README.md").read_text()
    assert "Dual Chunk Attention" in card and "| `chunk_size` `C` | 96 |" in card and "- dca" in card


def test_qwen_1m_style_checkpoint_uses_its_own_config_verbatim(tmp_path, capsys):
    own = {"chunk_size": 48, "local_size": 8, "original_max_position_embeddings": 48,
           "sparse_attention_enabled": True, "sparse_attention_threshold": 32}  # vLLM's extra keys: kept, unused
    base, out = _base(tmp_path, "qwen2", dual_chunk_attention_config=own), tmp_path / "out"
    assert main([str(base), "--output", str(out), "--set", "method=dca", "--set", "validate.enabled=false",
                 "--set", "export.dtype=float32", "--set", "export.roundtrip_tokens=120"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["dual_chunk_attention_config"] == own
    assert config["max_position_embeddings"] == 512  # the checkpoint's own claim is kept
    assert "temperature past 48" in capsys.readouterr().out
    model = _load(out)
    x = _ids(length=100)
    ref = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="sdpa").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x[:, :48], use_cache=False).logits, ref(x[:, :48], use_cache=False).logits,
                                   atol=1e-5, rtol=1e-5)  # L <= C + 1 and T = 1 (L <= c_orig): the base model


@pytest.mark.parametrize("recipe,sets,expect", [
    ("method: dca\ndca:\n  chunk_size: 20\n  local_size: 12\n", [],
     r"recipe.yaml:4: dca.local_size: .*must be < the chunk length chunk_size - local_size = 8"),
    ("method: dca\n", ["dca.chunk_size=600"],
     r"--set dca.chunk_size=600: dca.chunk_size: dca chunk_size=600 exceeds the base model's trained context 512"),
    ("method: dca\nfinetune:\n  enabled: true\n  data: {files: [x.txt]}\n", [],
     r"recipe.yaml:3: finetune.enabled: method dca is training-free"),
    ("method: dca\ndca:\n  chunk_size: 1\n", [], r"recipe.yaml:3: dca.chunk_size: .*greater than or equal to 2"),
    ("method: dcaa\n", [], r"recipe.yaml:1: method: .*'cca' or 'dca'"),
    ("method: dca\nvalidate:\n  context_lengths: [c, 3k]\n", [],
     r"recipe.yaml:3: validate.context_lengths: .*'3k' is not a length: give tokens"),
])
def test_bad_dca_values_are_recipe_errors_with_file_and_line(tmp_path, capsys, recipe, sets, expect):
    import re

    base = _base(tmp_path)
    (tmp_path / "recipe.yaml").write_text(recipe)
    argv = [str(base), "--recipe", str(tmp_path / "recipe.yaml"), "--output", str(tmp_path / "out")]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert re.search(expect, err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family,overrides,expect", [
    ("mistral", dict(sliding_window=48), "sliding_window=48: DCA re-indexes full attention"),
    ("gemma3_text", {}, "sliding_window=16: DCA re-indexes full attention"),
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
     "rope_type='dynamic'"),
])
def test_what_dca_cannot_convert_is_refused(tmp_path, capsys, family, overrides, expect):
    base = _base(tmp_path, family, **overrides)
    assert main([str(base), "--output", str(tmp_path / "out"), *ARGS]) != 0
    assert expect in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_validate_reports_dca_against_plain_rope(tmp_path, capsys):
    """The pipeline's validation of a DCA model: base = the same weights with plain RoPE (sdpa), the DCA rows
    named DCA, the growth gate against the trained context."""
    base = _base(tmp_path, max_position_embeddings=64)
    text = tmp_path / "heldout.txt"
    text.write_text("".join(chr(97 + (i * 7) % 26) for i in range(3000)))
    out = tmp_path / "out"
    assert main([str(base), "--output", str(out), "--set", "method=dca", "--set", "validate.data.dataset=null",
                 "--set", f"validate.data.files=[{text}]",
                 "--set", "validate.context_lengths=[c/2,c,4c]", "--set", "validate.windows=1",
                 "--set", "validate.passkey_trials=0", "--set", "validate.speed=false", "--set", "export.dtype=float32",
                 "--set", "validate.max_ppl_ratio=null", "--set", "validate.max_ppl_growth=1000", "--force"]) == 0
    report = json.loads((out / "validation" / "report.json").read_text())
    assert report["model"]["method"] == "dca" and report["model"]["trained_context"] == 64
    assert report["context_lengths"] == [32, 64, 256]  # "c/2", "c", "4c" of the base's c = 64
    gates = [g for g in report["gates"] if g["gate"] == "max_ppl_growth"]
    assert [g["length"] for g in gates] == [256] and gates[0]["passed"]
    ppl = report["results"]
    assert ppl["base"]["perplexity"]["32"]["ppl"] == pytest.approx(ppl["dca"]["perplexity"]["32"]["ppl"], rel=1e-5)
    assert ppl["base"]["perplexity"]["256"]["ppl"] != pytest.approx(ppl["dca"]["perplexity"]["256"]["ppl"], rel=1e-7)
    assert "| context | base ppl | DCA ppl | DCA / base |" in (out / "validation" / "report.md").read_text()
    # and `cca-convert validate` re-runs it on the exported folder (base = the same weights with plain RoPE)
    assert main(["validate", str(out), "--output", str(tmp_path / "again"), "--set", "validate.context_lengths=[32,256]",
                 "--set", "validate.speed=true"]) == 0
    printed = capsys.readouterr().out
    assert "prefill @     32: base" in printed  # the speed lines name the method that ran: DCA, never CCA
    assert all("DCA" in ln and "CCA" not in ln for ln in printed.splitlines() if "prefill @" in ln), printed
    again = json.loads((tmp_path / "again" / "validation" / "report.json").read_text())
    assert again["model"]["method"] == "dca"
    assert [g["length"] for g in again["gates"] if g["gate"] == "max_ppl_growth"] == [256]


def test_the_exported_tokenizer_claims_the_converted_context(tmp_path):
    """examples/tiny-llama's tokenizer says model_max_length 2048; its DCA export reads 8 x 2048 tokens, and so does
    its tokenizer (no "indexing errors" warning, truncation at the real context)."""
    from transformers import AutoTokenizer

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "out"
    assert main([str(repo / "examples" / "tiny-llama"), "--output", str(out), "--set", "method=dca",
                 "--set", "validate.enabled=false", "--set", "export.roundtrip=false"]) == 0
    context = json.loads((out / "config.json").read_text())["max_position_embeddings"]
    assert context == 16384
    assert AutoTokenizer.from_pretrained(out).model_max_length == context


@pytest.mark.slow
def test_the_readme_dca_run_on_the_embedded_model_passes_the_family_recipe(tmp_path):
    """The README's DCA run, as written: the embedded model (trained at c = 2048) with the Llama family's DCA recipe
    and only a local held-out file reads c..8c = 2048..16384, passes every gate and exits 0, and every line it prints
    names DCA (no line calls the model CCA)."""
    import re
    import shlex
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    line = re.search(r"`(cca-convert examples/tiny-llama --set method=dca [^`]*)`", (repo / "README.md").read_text())
    assert line, "the README no longer shows the DCA run on examples/tiny-llama"
    for name in ("examples", "recipes"):
        (tmp_path / name).symlink_to(repo / name)
    proc = subprocess.run([sys.executable, "-m", "cca_convert.cli", *shlex.split(line.group(1))[1:]], cwd=tmp_path,
                          capture_output=True, text=True, env=checkout_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "lengths 2048, 4096, 8192, 16384" in proc.stdout
    assert "CCA" not in proc.stdout + proc.stderr, proc.stdout
    measured = [x for x in proc.stdout.splitlines() if " @ " in x]
    assert len(measured) == 12 and all(x.split()[0] in ("base", "DCA", "prefill") for x in measured), measured
    (report,) = tmp_path.glob("*/validation/report.json")
    report = json.loads(report.read_text())
    assert report["passed"] and report["model"]["method"] == "dca" and report["context_lengths"] == [
        2048, 4096, 8192, 16384]
