"""End to end against the local test Hub (no internet): a base model on the Hub -> cca-convert with validation and
--push-to-hub -> transformers loads the pushed repo with trust_remote_code in a fresh process -> same logits as the
local export. And `cca-convert push` refuses a folder whose validation failed its gates unless --force."""

import importlib.util
import json

import pytest
import torch
import yaml

from cca_convert.cli import main
from cca_convert.validate_command import load_converted_model
from tests.support.factories import char_tokenizer, sample_text, save_base
from tests.support.hub_server import FAKE_TOKEN, hub_server  # noqa: F401 (fixture)

PROBE = torch.arange(3, 103).remainder(90)[None] + 3  # 100 tokens > local_window: real CCA attention

LOAD_FROM_HUB = """
import importlib.abc, sys

class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "cca_convert" or name.startswith("cca_convert."):
            raise ImportError("the pushed repo must load without cca_convert")

sys.meta_path.insert(0, _Block())
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("user/tiny-cca", trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
with torch.no_grad():
    torch.save(model(torch.load(sys.argv[1]), use_cache=False).logits, sys.argv[2])
"""


def seed_base(hub, tmp_path):
    base = save_base(tmp_path / "base", vocab_size=128, max_position_embeddings=1024)
    char_tokenizer().save_pretrained(base)
    hub.create_repo_from_folder("user/tiny", base)
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(sample_text(1, 2000))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "cca": {"group_size": 4, "local_window": 16},
        "export": {"dtype": "float32", "max_shard_size": "60KB", "roundtrip": False},
        "validate": {"data": {"files": [str(heldout)]}, "context_lengths": [64, 128, 256], "windows": 2,
                     "passkey_trials": 0, "speed": False, "max_ppl_ratio": 2.0},
    }))
    return recipe


def test_convert_push_and_load_from_hub(tmp_path, hub_server, capsys, monkeypatch):
    recipe = seed_base(hub_server, tmp_path)
    out = tmp_path / "tiny-cca"
    monkeypatch.chdir(tmp_path)
    assert main(["user/tiny", "--recipe", str(recipe), "--output", str(out), "--push-to-hub", "user/tiny-cca"]) == 0
    printed = capsys.readouterr()
    assert "pushed" in printed.out and FAKE_TOKEN not in printed.out + printed.err
    assert not any(FAKE_TOKEN.encode() in p.read_bytes() for p in out.rglob("*") if p.is_file())

    remote = hub_server.files("user/tiny-cca")
    local = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert {k: v for k, v in remote.items() if k != ".gitattributes"} == local  # the whole folder, one commit
    assert len([p for p in local if p.endswith(".safetensors")]) >= 2
    assert json.loads(remote["validation/report.json"])["passed"] is True
    assert "validation/ppl.png" in remote and "](validation/ppl.png)" in remote["README.md"].decode()
    assert "validation passed" in hub_server.commits("user/tiny-cca")[-1].title
    card = remote["README.md"].decode()  # the card follows the repo: its snippets load the pushed id
    assert 'from_pretrained("user/tiny-cca"' in card and 'from_pretrained("tiny-cca"' not in card
    assert "\n# user/tiny-cca\n" in card and "- name: user/tiny-cca\n" in card, card[:1500]

    ids, logits = tmp_path / "ids.pt", tmp_path / "logits.pt"
    torch.save(PROBE, ids)
    (tmp_path / "empty").mkdir()
    code = LOAD_FROM_HUB.replace("sys.argv[1]", repr(str(ids))).replace("sys.argv[2]", repr(str(logits)))
    hub_server.run_python(code,
                          cwd=tmp_path / "empty", HF_MODULES_CACHE=str(tmp_path / "modules"))  # empty module cache
    assert any((tmp_path / "modules").rglob("modeling_cca_llama.py"))  # the code came from the Hub repo
    with torch.no_grad():
        expected = load_converted_model(out, "cpu")(PROBE, use_cache=False).logits
    torch.testing.assert_close(torch.load(logits), expected, rtol=0, atol=1e-5)

    # `cca-convert validate REPO`: the report goes to --output, the Hub cache is left alone
    assert main(["validate", "user/tiny-cca", "--output", str(tmp_path / "val"), "--device", "cpu"]) == 0
    report = json.loads((tmp_path / "val" / "validation" / "report.json").read_text())
    assert report["model"]["name"] == "user/tiny-cca" and report["context_lengths"] == [64, 128, 256]
    pushed = json.loads(remote["validation/report.json"])
    assert report["results"]["cca"]["perplexity"]["256"]["ppl"] == pushed["results"]["cca"]["perplexity"]["256"]["ppl"]


def test_push_refuses_a_folder_that_failed_its_gates(tmp_path, hub_server, capsys):
    recipe = seed_base(hub_server, tmp_path)
    bad = ["--set", "validate.max_ppl_ratio=0.5"]
    # during a conversion: the failed gate stops the run before export and upload
    assert main(["user/tiny", "--recipe", str(recipe), "--output", str(tmp_path / "a"), "--push-to-hub", "user/a",
                 *bad]) == 2
    assert "validation gates failed: max_ppl_ratio" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and "user/a" not in hub_server.hub.repos

    out = tmp_path / "b"
    assert main(["user/tiny", "--recipe", str(recipe), "--output", str(out), "--force", *bad]) == 0
    assert json.loads((out / "validation" / "report.json").read_text())["passed"] is False
    capsys.readouterr()
    assert main(["push", str(out), "user/b"]) == 2
    err = capsys.readouterr().err
    assert "failed its validation gates (max_ppl_ratio @ 64" in err and "--force" in err
    assert "user/b" not in hub_server.hub.repos
    assert main(["push", str(out), "user/b", "--force", "--hub-revision", "dev"]) == 0
    assert "WARNING: pushing a folder that failed" in capsys.readouterr().out
    assert "validation/report.json" in hub_server.files("user/b", "dev")
    assert "FAILED (pushed with --force)" in hub_server.commits("user/b")[-1].title


def test_push_needs_a_token(tmp_path, hub_server, monkeypatch, capsys):
    recipe = seed_base(hub_server, tmp_path)
    monkeypatch.delenv("HF_TOKEN")
    assert main(["user/tiny", "--recipe", str(recipe), "--output", str(tmp_path / "c"), "--push-to-hub", "user/c"]) == 2
    assert "needs a token with write access" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()  # refused before converting


def test_failed_upload_keeps_the_converted_folder(tmp_path, hub_server, capsys):
    recipe = seed_base(hub_server, tmp_path)
    out = tmp_path / "d"
    hub_server.fail_lfs_uploads_after(1)
    assert main(["user/tiny", "--recipe", str(recipe), "--output", str(out), "--push-to-hub", "user/d",
                 "--private"]) == 2
    err = capsys.readouterr().err
    assert "interrupted" in err and f"cca-convert push {out} user/d --private" in err
    assert (out / "validation" / "report.json").is_file()  # committed locally before the upload
    hub_server.fail_lfs_uploads_after(None)
    assert main(["push", str(out), "user/d", "--private"]) == 0
    assert hub_server.hub.repos["user/d"].private and "config.json" in hub_server.files("user/d")


def test_push_preflight_checks_the_token_and_the_namespace_before_any_work(tmp_path, hub_server, monkeypatch, capsys):
    recipe = seed_base(hub_server, tmp_path)
    cmd = ["user/tiny", "--recipe", str(recipe), "--output", str(tmp_path / "e")]
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_token_for_this_test")
    capsys.readouterr()  # seed_base's own progress output
    assert main(cmd + ["--push-to-hub", "user/e"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --push-to-hub: the Hub rejected your token (401)") and len(err.splitlines()) == 1
    assert "hf_wrong_token_for_this_test" not in err
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    assert main(cmd + ["--push-to-hub", "someone-else/e"]) == 2
    assert "cannot create or write repos under 'someone-else'" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
    assert not any("/resolve/" in r.path for r in hub_server.request_log)  # refused before downloading the base


def test_the_token_is_written_nowhere(tmp_path, hub_server, capsys, monkeypatch):
    """convert (with a finetune, TensorBoard on) + push, validate, push, a failing push and a rejected token: the token
    appears in no file under the run's folders (output, work folders, reports, card, TensorBoard events, HF_HOME
    except the client's own token store) and in nothing printed."""
    recipe = seed_base(hub_server, tmp_path)
    data = yaml.safe_load(recipe.read_text())
    (tmp_path / "train.txt").write_text(sample_text(7, 3000))
    data["finetune"] = {"enabled": True, "method": "lora", "seq_len": 64, "steps": 2, "gradient_accumulation_steps": 1,
                        "warmup_steps": 0, "checkpoint_every": 1, "tensorboard": True,
                        "data": {"files": [str(tmp_path / "train.txt")]}}
    recipe.write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "sec"
    printed = []
    assert main(["user/tiny", "--recipe", str(recipe), "--output", str(out), "--push-to-hub", "user/sec"]) == 0
    printed.append(capsys.readouterr())
    assert main(["validate", str(out), "--device", "cpu"]) == 0
    printed.append(capsys.readouterr())
    assert main(["push", str(out), "user/sec2"]) == 0
    hub_server.fail_lfs_uploads_after(0)
    assert main(["push", str(out), "user/sec3"]) == 2
    hub_server.fail_lfs_uploads_after(None)
    printed.append(capsys.readouterr())
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN + "x")  # a rejected token must not be echoed either
    assert main(["push", str(out), "user/sec4"]) == 2
    printed.append(capsys.readouterr())

    secrets = (FAKE_TOKEN.encode(), (FAKE_TOKEN + "x").encode())
    files = [p for p in tmp_path.rglob("*") if p.is_file() and "stored_tokens" not in p.name and p.name != "token"]
    assert any(p.suffix == ".safetensors" for p in files)
    if importlib.util.find_spec("tensorboard") is not None:  # TensorBoard logging is on only when it is installed
        assert any("tfevents" in p.name for p in files)
    leaked = [str(p) for p in files if any(s in p.read_bytes() for s in secrets)]
    assert leaked == []
    assert not any(s.decode() in c.out + c.err for c in printed for s in secrets)


def test_push_command_points_the_card_at_the_pushed_id(tmp_path, hub_server, capsys):
    """`cca-convert push out/m user/demo-pushed`: the card on the Hub loads user/demo-pushed, and that id loads."""
    recipe = seed_base(hub_server, tmp_path)
    out = tmp_path / "m"
    assert main([str(tmp_path / "base"), "--recipe", str(recipe), "--output", str(out)]) == 0
    local_card = (out / "README.md").read_text()
    assert 'from_pretrained("m"' in local_card and "give its path" in local_card  # a folder card says so
    assert main(["push", str(out), "user/demo-pushed"]) == 0
    card = hub_server.files("user/demo-pushed")["README.md"].decode()
    assert 'from_pretrained("user/demo-pushed"' in card and 'from_pretrained("m"' not in card
    assert "give its path" not in card
    code = LOAD_FROM_HUB.replace("user/tiny-cca", "user/demo-pushed").replace(
        "sys.argv[1]", repr(str(tmp_path / "ids.pt"))).replace("sys.argv[2]", repr(str(tmp_path / "logits.pt")))
    torch.save(PROBE, tmp_path / "ids.pt")
    (tmp_path / "empty").mkdir()
    hub_server.run_python(code, cwd=tmp_path / "empty", HF_MODULES_CACHE=str(tmp_path / "modules"))
    assert torch.load(tmp_path / "logits.pt").shape[-1] == 128


def test_push_refuses_a_folder_cca_convert_did_not_export(tmp_path, hub_server, capsys):
    """A base model's folder (here the conversion's own source) is not uploaded and its card is not rewritten."""
    seed_base(hub_server, tmp_path)
    base = tmp_path / "base"
    (base / "README.md").write_text('# my model\n\n```python\nAutoModel.from_pretrained("me/mine")\n```\n')
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    assert main(["push", str(base), "user/oops"]) == 2
    err = capsys.readouterr().err
    assert f"{base} is not a model exported by cca-convert" in err and "hf upload" in err
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before
    assert "user/oops" not in hub_server.hub.repos


def test_push_knows_each_methods_export_from_a_base(tmp_path):
    """Both methods' exports (and the first releases' model_type cca) pass; a base, a Qwen2.5-1M base with its own
    dual_chunk_attention_config, and a config that is not a JSON object are refused."""
    from cca_convert.errors import CCAError
    from cca_convert.publish import check_export

    dca = {"chunk_size": 1536, "local_size": 256, "original_max_position_embeddings": 2048}
    cases = {
        "cca": ({"model_type": "llama", "cca_group_size": 16}, True),
        "dca": ({"model_type": "llama", "dual_chunk_attention_config": dca, "dca_trained_context": 2048}, True),
        "first-release": ({"model_type": "cca", "base_model_type": "llama"}, True),
        "base": ({"model_type": "llama"}, False),
        "qwen2.5-1m-base": ({"model_type": "qwen2", "dual_chunk_attention_config": dca}, False),
        "not-an-object": ([1, 2], False),
    }
    for name, (config, exported) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        if exported:
            check_export(folder)
        else:
            with pytest.raises(CCAError, match="is not a model exported by cca-convert"):
                check_export(folder)
