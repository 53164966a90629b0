"""`cca-convert` end to end on tiny random checkpoints: exported repo, clean-process loading, errors."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from cca_convert import methods, published
from cca_convert.cli import main
from tests.support.child_env import checkout_env
from tests.support.factories import LLAMA3_ROPE, save_base

REPO = Path(__file__).resolve().parents[1]


def write_recipe(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def base(tmp_path):
    return save_base(tmp_path / "tiny-llama", rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)


@pytest.fixture
def recipe(tmp_path):
    return write_recipe(tmp_path / "r.yaml", """\
        cca: {group_size: 4, local_window: 16, pooling: kv}
        export: {dtype: float32, max_shard_size: 40KB, roundtrip_tokens: 50}
        finetune: {enabled: false}   # stages with their own tests
        validate: {enabled: false}
        """)


def convert(base, recipe, out, *extra):
    return main([str(base), "--recipe", str(recipe), "--output", str(out), *extra])


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_export_is_a_complete_repo(base, recipe, tmp_path):
    assert convert(base, recipe, tmp_path / "out") == 0
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {"AutoModelForCausalLM": "modeling_cca_llama.CCALlamaForCausalLM"}
    assert config["model_type"] == "llama" and config["architectures"] == ["CCALlamaForCausalLM"]
    assert (config["cca_group_size"], config["cca_local_window"], config["cca_pooling"]) == (4, 16, "kv")
    assert config["rope_parameters"]["rope_type"] == "llama3"
    assert not (out / "modeling_cca.py").exists() and not (out / "configuration_cca.py").exists()
    for name in ("modeling_cca_llama.py", "cca_hf.py", "attention_hooks.py", "attention_cca.py", "cache_cca.py",
                 "cca_reference.py",
                 "cca_triton.py",
                 "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "cca_recipe.yaml", "README.md", "model.safetensors.index.json"):
        assert (out / name).is_file(), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embeddings, as in the base
    assert yaml.safe_load((out / "cca_recipe.yaml").read_text())["cca"]["group_size"] == 4
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert {"cca", "custom_code"} <= set(front["tags"])
    assert front["library_name"] == "transformers" and front["pipeline_tag"] == "text-generation"
    assert "| group size `g` | 4 |" in card
    assert leftovers(tmp_path) == []


LOADER = textwrap.dedent("""
    import importlib.abc, sys, torch
    folder, out, overrides, blocked = sys.argv[1], sys.argv[2], eval(sys.argv[3]), sys.argv[4].split(",")
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in blocked:
                raise ImportError(f"No module named {name!r}")
    sys.meta_path.insert(0, Block())
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **overrides).eval()
    ids = torch.arange(60).remainder(96)[None]
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
        generated = model.generate(ids[:, :20], max_new_tokens=30, do_sample=False)
        torch.save({"logits": logits, "g": model.config.cca_group_size, "s": model.config.cca_local_window,
                    "module": type(model).__module__, "generated": generated}, out)
""")


def load_in_clean_process(folder: Path, tmp_path: Path, blocked=("cca_convert",), **overrides) -> dict:
    out = tmp_path / f"logits-{len(list(tmp_path.iterdir()))}.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    subprocess.run([sys.executable, "-c", LOADER, str(folder), str(out), repr(overrides), ",".join(blocked)],
                   check=True, cwd=tmp_path, env=env, capture_output=True)
    return torch.load(out)


def test_exported_folder_loads_without_cca_convert_and_honours_overrides(base, recipe, tmp_path):
    out = tmp_path / "out"
    assert convert(base, recipe, out) == 0
    from cca_convert.families import FAMILIES

    ids = torch.arange(60).remainder(96)[None]

    def in_process(**overrides):
        model = published.family_class(FAMILIES["llama"], methods.get("cca")).from_pretrained(out, **overrides).eval()
        with torch.no_grad():
            return model(ids, use_cache=False).logits

    default = load_in_clean_process(out, tmp_path)
    assert default["module"].startswith("transformers_modules.")
    torch.testing.assert_close(default["logits"], in_process(), atol=1e-5, rtol=0)

    overridden = load_in_clean_process(out, tmp_path, cca_group_size=8, cca_local_window=24)
    assert (overridden["g"], overridden["s"]) == (8, 24)
    torch.testing.assert_close(overridden["logits"], in_process(cca_group_size=8, cca_local_window=24), atol=1e-5,
                               rtol=0)
    # Up to the window the override changes nothing; after it, core tokens differ.
    torch.testing.assert_close(overridden["logits"][:, :16], default["logits"][:, :16], atol=1e-5, rtol=0)
    assert (overridden["logits"][:, 30:] - default["logits"][:, 30:]).abs().max() > 1e-4


def test_exported_folder_needs_no_triton(base, recipe, tmp_path):
    """triton is optional for users: without it the model loads, runs and generates on the reference."""
    out = tmp_path / "out"
    assert convert(base, recipe, out) == 0
    with_triton = load_in_clean_process(out, tmp_path)
    without = load_in_clean_process(out, tmp_path, blocked=("cca_convert", "triton"))
    torch.testing.assert_close(without["logits"], with_triton["logits"], atol=1e-5, rtol=0)
    assert without["generated"].shape == (1, 50)
    assert torch.equal(without["generated"], with_triton["generated"])


def test_qwen2_with_bias_converts_and_round_trips(tmp_path, recipe):
    base = save_base(tmp_path / "tiny-qwen2", family="qwen2")
    assert convert(base, recipe, tmp_path / "out") == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["CCAQwen2ForCausalLM"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None  # Qwen2's own q/k/v bias, none on o_proj


def test_set_overrides_recipe_keys(base, recipe, tmp_path):
    assert convert(base, recipe, tmp_path / "out", "--set", "cca.group_size=8", "--set", "cca.pooling=query") == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["cca_group_size"], config["cca_pooling"]) == (8, "query")


def test_overwrite_replaces_and_failures_leave_nothing(base, recipe, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    assert convert(base, recipe, out) == 0
    before = sorted(p.name for p in out.iterdir())

    from cca_convert import pipeline
    from cca_convert.errors import CCAError

    def broken(*args, **kwargs):
        raise CCAError("round trip: simulated mismatch")

    monkeypatch.setattr(pipeline.roundtrip, "roundtrip_check", broken)
    assert convert(base, recipe, out, "--overwrite", "--set", "cca.group_size=8") == 2
    assert "simulated mismatch" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before  # the old export is untouched
    assert json.loads((out / "config.json").read_text())["cca_group_size"] == 4
    assert leftovers(tmp_path) == []

    monkeypatch.undo()
    assert convert(base, recipe, out, "--overwrite", "--set", "cca.group_size=8") == 0
    assert json.loads((out / "config.json").read_text())["cca_group_size"] == 8


BAD_RECIPES = {
    "malformed-yaml": ("cca:\n  group_size: [4\n", "malformed YAML"),
    "unknown-key": ("cca:\n  group_size: 4\n  gruop_size: 4\n", "r.yaml:3: cca.gruop_size: unknown key"),
    "group-size-zero": ("cca:\n  group_size: 0\n", "r.yaml:2: cca.group_size"),
    "wrong-type": ("cca:\n  local_window: lots\n", "cca.local_window"),
    "passkey-depth": ("validate:\n  passkey_depths: [0.5, 1.5]\n", "r.yaml:2: validate.passkey_depths: passkey depths "
                                                                   "must be between 0 and 1"),
}


@pytest.mark.parametrize("case", BAD_RECIPES)
def test_bad_recipe_is_one_clear_error_and_writes_nothing(case, base, tmp_path, capsys):
    text, expected = BAD_RECIPES[case]
    recipe = write_recipe(tmp_path / "r.yaml", text)
    assert convert(base, recipe, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and expected in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_unsupported_architecture_lists_supported(tmp_path, recipe, capsys):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    assert convert(folder, recipe, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert "unsupported architecture model_type='gpt2'" in err and "llama" in err and "qwen2" in err
    assert not (tmp_path / "out").exists()


def test_existing_output_is_refused(base, recipe, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert convert(base, recipe, out) == 2
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_missing_source_folder(tmp_path, recipe, capsys):
    assert convert(tmp_path / "nope" / "model", recipe, tmp_path / "out") == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert not (tmp_path / "out").exists()


def test_cli_without_source_exits_non_zero():
    proc = subprocess.run([sys.executable, "-m", "cca_convert.cli"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: the following arguments are required: SOURCE (see `cca-convert --help`)"
    ]


def test_nan_base_is_refused_at_load_naming_the_tensor(base, recipe, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    shard = next(base.glob("*.safetensors"))
    tensors = load_file(shard)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][3, 5] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    assert convert(base, recipe, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading progress bar
    assert err.startswith("error: ") and name in err and "non-finite" in err
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_leftovers_of_killed_runs_are_removed_and_live_ones_kept(base, recipe, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # a PID that has exited
    stale = [tmp_path / f".out.partial-{dead_pid}", tmp_path / f".out.old-{dead_pid}"]
    live = tmp_path / f".out.partial-{os.getppid()}"  # a running process: another run's work in progress
    for folder in (*stale, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
    assert convert(base, recipe, tmp_path / "out") == 0
    assert not any(p.exists() for p in stale) and live.is_dir()


def test_model_card_snippets_run_as_written_without_prompting(base, recipe, tmp_path):
    """Every Python snippet of the card, run as a user pastes it (stdin open, offline): no custom-code prompt,
    no warning about the model type, no error."""
    import re

    out = tmp_path / "out"
    assert convert(base, recipe, out) == 0
    card = (out / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", card, re.S)
    assert blocks
    code = "\n".join(blocks).replace(f'"{out.name}"', repr(str(out)))
    code = re.sub(r"^# (AutoModelForCausalLM\.from_pretrained)", r"\1", code, flags=re.M)  # the commented variant too
    code += "\nprint('ran', type(tokenizer).__name__, type(model).__name__)\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code], stdin=subprocess.PIPE, capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ran " in proc.stdout and "CCALlamaForCausalLM" in proc.stdout
    assert "Do you wish to run the custom code" not in proc.stdout + proc.stderr
    assert "You are using a model of type" not in proc.stderr
    assert "transformers>=5.17" in card and "triton" in card


@pytest.mark.skipif(torch.cuda.is_available(), reason="the run would be on the GPU")
def test_triton_backend_without_a_gpu_is_one_clear_error(base, recipe, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert convert(base, recipe, tmp_path / "out", "--set", "cca.attn_backend=triton") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: cca.attn_backend=triton needs a CUDA GPU")
    assert not (tmp_path / "out").exists()


def test_sigterm_is_a_clean_interrupt(base, tmp_path):
    """SIGTERM mid-run: one message, exit 130, no staging folder or lock left, nothing at the output."""
    import signal
    import time

    recipe = write_recipe(tmp_path / "slow.yaml", """\
        cca: {group_size: 4, local_window: 16}
        export: {dtype: float32, roundtrip: true, roundtrip_tokens: 50}
        finetune: {enabled: false}
        validate: {enabled: false}
        """)
    out = tmp_path / "out"
    env = checkout_env(PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "cca_convert.cli", str(base), "--recipe", str(recipe),
                             "--output", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:  # wait until the staging folder exists (the round trip runs a few seconds)
        if "roundtrip" in line:
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-1000:]
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == [
        "error: interrupted; nothing was written to the output folder (an interrupted finetune resumes with --resume)"]
    assert "Traceback" not in err
    assert not out.exists() and leftovers(tmp_path) == [] and not (tmp_path / ".out.lock").exists()


@pytest.mark.parametrize("override,message", [
    ({"cca_attn_backend": "Full"}, r"cca_attn_backend must be one of \('auto', 'triton', 'reference', 'full'\), got 'Full'"),
    ({"cca_group_size": 2.5}, r"cca_group_size must be an integer >= 1, got 2.5"),
    ({"cca_group_size": 0}, r"cca_group_size must be an integer >= 1, got 0"),
    ({"cca_local_window": -1}, r"cca_local_window must be an integer >= 1, got -1"),
    ({"cca_pooling": "mean"}, r"cca_pooling must be one of \('kv', 'query'\), got 'mean'"),
    ({"group_size": 8}, r"CCA settings are named cca_<name>, e.g. from_pretrained\(..., cca_group_size=...\)"),
])
def test_bad_load_time_overrides_fail_at_load(base, recipe, tmp_path, override, message):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    assert convert(base, recipe, out) == 0
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, **override)
    ok = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, cca_group_size=8, cca_attn_backend="full")
    assert (ok.config.cca_group_size, ok.config.cca_attn_backend) == (8, "full")
