"""`cca-convert serve`: transformers' OpenAI-compatible server on an exported CCA and DCA model, asked over plain
HTTP on localhost; the answer is what the model's own greedy generate() gives."""

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from cca_convert.cli import main
from tests.support.child_env import checkout_env
from tests.support.factories import save_base

REPO = Path(__file__).resolve().parents[1]
def _server_importable() -> bool:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
        from transformers.cli.transformers import app  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _server_importable(), reason="needs transformers' server (pip install "
                                                                  "\"cca-convert[serve]\")")

RECIPES = {
    "cca": {"cca": {"group_size": 4, "local_window": 16}},
    "dca": {"method": "dca", "dca": {"chunk_size": 48, "local_size": 8, "temperature": False}},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:  # the server's reason, not only its status
        raise AssertionError(f"{exc.code} from {url}: {exc.read().decode(errors='replace')}") from None


@pytest.mark.parametrize("method", ["cca", "dca"])
def test_served_export_answers_over_http_as_its_generate_does(method, tmp_path):
    # the prompt and answer fit the export's context, which transformers >= 5.25's server enforces (400 otherwise)
    base = save_base(tmp_path / "base", max_position_embeddings=128)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPES[method], "export": {"dtype": "float32", "roundtrip": False},
                                      "finetune": {"enabled": False}, "validate": {"enabled": False}}))
    out = tmp_path / "out"
    assert main([str(base), "--recipe", str(recipe), "--output", str(out)]) == 0
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "cca_convert.cli", "serve", str(out), "--device", "cpu",
                               "--port", str(port)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=checkout_env())
    try:
        for _ in range(240):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert server.poll() is None, server.stdout.read()[-3000:]
                time.sleep(0.5)
        prompt = "the lord spake unto moses, saying, speak unto the children of israel"  # > C + 1 tokens (DCA)
        answer = post(f"http://127.0.0.1:{port}/v1/completions",
                      {"model": str(out), "prompt": prompt, "max_tokens": 6, "temperature": 0})
    finally:
        server.terminate()
        server.wait(timeout=60)
    text = answer["choices"][0]["text"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(model).__name__ == f"{method.upper()}LlamaForCausalLM"
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
    assert text == tok.decode(want, skip_special_tokens=True), (text, tok.decode(want))
    assert answer["usage"]["completion_tokens"] >= 1


def test_continuous_batching_is_refused_with_the_reason(tmp_path, capsys):
    assert main(["serve", str(tmp_path), "--continuous-batching"]) == 2
    assert "paged KV cache" in capsys.readouterr().err


@pytest.mark.parametrize("user_value", [None, "YES"])
def test_hub_kernels_stay_off_unless_the_user_turns_them_on(user_value, tmp_path, monkeypatch):
    """transformers >= 5.25 would swap Hub-downloaded kernels into the served model on a GPU (and fail offline):
    the server gets USE_HUB_KERNELS=NO, unless the user set the variable."""
    import transformers.cli.transformers as cli

    base = save_base(tmp_path / "base", max_position_embeddings=128)
    out = tmp_path / "out"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPES["cca"], "export": {"dtype": "float32", "roundtrip": False},
                                      "finetune": {"enabled": False}, "validate": {"enabled": False}}))
    assert main([str(base), "--recipe", str(recipe), "--output", str(out)]) == 0
    monkeypatch.setenv("USE_HUB_KERNELS", user_value or "")  # recorded, so the test leaves the variable as it was
    if user_value is None:
        monkeypatch.delenv("USE_HUB_KERNELS")
    seen = {}

    def app(args, prog_name):  # transformers' server, not started: what it would be started with
        seen["args"], seen["env"] = args, __import__("os").environ.get("USE_HUB_KERNELS")

    monkeypatch.setattr(cli, "app", app)
    assert main(["serve", str(out), "--port", "0"]) == 0
    assert seen == {"args": ["serve", str(out), "--trust-remote-code", "--port", "0"], "env": user_value or "NO"}
