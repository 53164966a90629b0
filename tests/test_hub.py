"""cca_convert.hub against the local test Hub (tests/support/hub_server.py): downloads, pushes, errors."""

import shutil

import pytest
import torch

from cca_convert.errors import CCAError
from cca_convert.hub import push_folder, resolve_source
from tests.support.hub_server import FAKE_TOKEN, closed_port_url, configure_hf_client, hub_server  # noqa: F401 (fixture)

INPUT_IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 127, 2, 3, 4]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT_IDS).logits


class TinyLlama:
    """A tiny random LlamaForCausalLM saved as one safetensors file and as several shards."""

    def __init__(self, root):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
        model = LlamaForCausalLM(config).eval()
        self.logits = _logits(model)
        self.single, self.sharded = root / "single", root / "sharded"
        model.save_pretrained(self.single)
        model.save_pretrained(self.sharded, max_shard_size="150KB")
        self.shards = sorted(p.name for p in self.sharded.glob("*.safetensors"))
        assert len(self.shards) >= 3 and (self.sharded / "model.safetensors.index.json").is_file()
        assert [p.name for p in self.single.glob("*.safetensors")] == ["model.safetensors"]

    @staticmethod
    def files(folder) -> dict[str, bytes]:
        return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return TinyLlama(tmp_path_factory.mktemp("tiny"))


def _load_logits(folder) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    return _logits(LlamaForCausalLM.from_pretrained(folder).eval())


# ----------------------------------------------------------------------------------------------------------------------
# resolve_source
# ----------------------------------------------------------------------------------------------------------------------
def test_resolve_source_downloads_only_needed_files(hub_server, tiny):
    wanted = tiny.files(tiny.sharded) | {"tokenizer.json": b"{\"version\": \"1.0\"}", "tokenizer_config.json": b"{}",
                                         "chat_template.jinja": b"{{ messages }}"}
    unwanted = {"pytorch_model.bin": b"\0bin", "original/consolidated.00.pth": b"\0pth",
                "original/model.safetensors": b"\0st", "onnx/model.onnx": b"\0onnx", "model-q4.gguf": b"\0gguf",
                "README.md": b"# tiny", "notes/extra.json": b"{}"}
    hub_server.create_repo_with_files("user/tiny", wanted | unwanted)

    folder = resolve_source("user/tiny")

    assert sorted(TinyLlama.files(folder)) == sorted(wanted)
    assert sorted(hub_server.downloads("user/tiny")) == sorted(wanted)  # nothing else was fetched
    assert torch.equal(_load_logits(folder), tiny.logits)
    api_calls = [r for r in hub_server.request_log if r.path.startswith("/api/")]
    assert api_calls and all(r.auth == "valid" for r in api_calls)  # the token was sent
    assert FAKE_TOKEN not in repr(hub_server.request_log)


def test_resolve_source_revision_and_local_paths(hub_server, tiny, tmp_path, monkeypatch):
    first = hub_server.create_repo_with_files("user/tiny", tiny.files(tiny.single))
    hub_server.create_repo_with_files("user/tiny", {"config.json": b"{}"})  # main moves on
    assert torch.equal(_load_logits(resolve_source("user/tiny", revision=first)), tiny.logits)

    assert resolve_source(str(tiny.single)) == tiny.single
    monkeypatch.chdir(tmp_path)
    for source in ["./missing", "/no/such/dir", "a/b/c", "missing/"]:
        with pytest.raises(CCAError, match="no such folder"):
            resolve_source(source)
    assert not [r for r in hub_server.request_log if "missing" in r.path or "/no/" in r.path]
    with pytest.raises(CCAError, match="valid Hub model id"):
        resolve_source("bad id!")


@pytest.mark.parametrize("gate_metadata", [False, True], ids=["files-gated", "all-gated"])
def test_resolve_source_gated(hub_server, gate_metadata):
    hub_server.hub.gate_metadata = gate_metadata
    hub_server.create_repo_with_files("meta/gated", {"config.json": b"{}", "model.safetensors": b"\0w"}, gated=True)
    with pytest.raises(CCAError, match=r"accept the license at .*/meta/gated and log in with `hf auth login` or set HF_TOKEN"):
        resolve_source("meta/gated")


def test_resolve_source_missing_repo_and_revision(hub_server, monkeypatch):
    hub_server.create_repo_with_files("user/tiny", {"config.json": b"{}", "model.safetensors": b"\0w"})
    with pytest.raises(CCAError, match="'user/tinny' not found .*typo.*if it is private, check that your token"):
        resolve_source("user/tinny")
    with pytest.raises(CCAError, match="revision 'v9' not found in user/tiny"):
        resolve_source("user/tiny", revision="v9")
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(CCAError, match="not found .*hf auth login"):
        resolve_source("user/tinny")
    hub_server.create_repo_with_files("user/bin-only", {"config.json": b"{}", "pytorch_model.bin": b"\0w"})
    with pytest.raises(CCAError, match="no \\*.safetensors weights"):
        resolve_source("user/bin-only")


def test_resolve_source_unreachable_or_offline(hub_server, monkeypatch, tmp_path):
    from huggingface_hub import constants

    configure_hf_client(monkeypatch, closed_port_url(), tmp_path / "hf")
    with pytest.raises(CCAError, match="could not reach the Hub at http://127.0.0.1:.*pass a local model folder"):
        resolve_source("user/tiny")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CCAError, match="HF_HUB_OFFLINE is set .*pass a local model folder"):
        resolve_source("user/tiny")


# ----------------------------------------------------------------------------------------------------------------------
# push_folder
# ----------------------------------------------------------------------------------------------------------------------
def test_push_then_load_from_hub(hub_server, tiny, tmp_path):
    url = push_folder(tiny.single, "user/pushed")

    assert url.startswith(f"{hub_server.url}/user/pushed/commit/")
    remote = hub_server.files("user/pushed")
    assert {k: v for k, v in remote.items() if k != ".gitattributes"} == tiny.files(tiny.single)
    writes = [r for r in hub_server.request_log if r.method == "POST"]
    assert writes and all(r.auth == "valid" for r in writes)
    assert FAKE_TOKEN not in repr(hub_server.request_log)

    out = tmp_path / "logits.pt"
    hub_server.run_python(f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained("user/pushed").eval()
        with torch.no_grad():
            torch.save(model(torch.tensor({INPUT_IDS.tolist()})).logits, {str(out)!r})
    """)
    assert torch.equal(torch.load(out), tiny.logits)


def test_push_needs_valid_token(hub_server, tiny, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(CCAError, match="hf auth login"):
        push_folder(tiny.single, "user/pushed")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_token")
    with pytest.raises(CCAError, match="rejected your token .*hf auth login"):
        push_folder(tiny.single, "user/pushed")
    assert "user/pushed" not in hub_server.hub.repos
    assert "hf_wrong_token" not in repr(hub_server.request_log)


def test_interrupted_upload_resumes_without_resending(hub_server, tiny):
    hub_server.fail_lfs_uploads_after(1)
    with pytest.raises(CCAError, match="interrupted.*run the same command again"):
        push_folder(tiny.sharded, "user/resume")
    finished = hub_server.lfs_uploads()
    assert len(finished) == 1
    assert set(hub_server.files("user/resume")) == {".gitattributes"}  # nothing committed

    hub_server.fail_lfs_uploads_after(None)
    hub_server.clear_log()
    push_folder(tiny.sharded, "user/resume")

    resent = hub_server.lfs_uploads()
    assert not set(resent) & set(finished)  # the finished shard was not sent again
    assert len(resent) == len(tiny.shards) - 1
    remote = hub_server.files("user/resume")
    assert {k: v for k, v in remote.items() if k != ".gitattributes"} == tiny.files(tiny.sharded)


def test_repush_with_fewer_shards_leaves_no_stale_shard(hub_server, tiny):
    push_folder(tiny.sharded, "user/shrink")
    assert {p for p in hub_server.files("user/shrink") if p.endswith(".safetensors")} == set(tiny.shards)

    push_folder(tiny.single, "user/shrink")

    remote = hub_server.files("user/shrink")
    assert {p for p in remote if "safetensors" in p} == {"model.safetensors"}
    assert torch.equal(_load_logits("user/shrink"), tiny.logits)  # transformers, in-process, through the fixture


def test_push_to_branch_and_pull_request(hub_server, tiny, tmp_path):
    main_url = push_folder(tiny.single, "user/br")
    commits = len(hub_server.commits("user/br"))
    assert push_folder(tiny.single, "user/br") == main_url  # unchanged: no new commit
    assert len(hub_server.commits("user/br")) == commits

    branch_url = push_folder(tiny.sharded, "user/br", revision="cca-v2", commit_message="sharded")
    assert "/user/br/commit/" in branch_url
    assert hub_server.refs("user/br")["cca-v2"] == branch_url.rsplit("/", 1)[1]
    assert set(tiny.shards) <= set(hub_server.files("user/br", "cca-v2"))
    assert "model.safetensors" not in hub_server.files("user/br", "cca-v2")
    assert hub_server.files("user/br")["model.safetensors"] == (tiny.single / "model.safetensors").read_bytes()
    assert push_folder(tiny.sharded, "user/br", revision="cca-v2") == branch_url  # existing branch is fine

    changed = tmp_path / "changed"
    shutil.copytree(tiny.single, changed)
    (changed / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny CCA\n")
    pr_url = push_folder(changed, "user/br", create_pr=True)
    assert pr_url == f"{hub_server.url}/user/br/discussions/1"
    assert "README.md" in hub_server.files("user/br", "refs/pr/1")
    assert "README.md" not in hub_server.files("user/br")
    with pytest.raises(CCAError, match="pull request is always opened against main"):
        push_folder(changed, "user/br", create_pr=True, revision="cca-v2")


def test_push_private_repo(hub_server, tiny, monkeypatch):
    push_folder(tiny.single, "user/secret", private=True)
    assert hub_server.hub.repos["user/secret"].private
    push_folder(tiny.single, "user/public")
    assert not hub_server.hub.repos["user/public"].private
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(CCAError, match="'user/secret' not found .*if it is private, log in with `hf auth login`"):
        resolve_source("user/secret")
