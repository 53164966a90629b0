"""The benchmark scripts run (on a tiny model, CPU): they are what the results tables come from."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def test_decode_benchmark_times_generate_for_every_backend(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "decode.py"), "--smoke", "--device", "cpu", "--contexts", "70",
           "--batches", "1,2", "--new-tokens", "6", "--skip", "1", "--prefill-chunk", "48", "--prefill-tokens", "64",
           "--group-size", "4", "--local-window", "16", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
    assert [(r["context"], r["batch"]) for r in rows] == [(70, 1), (70, 2)]
    for row in rows:
        assert set(row["cells"]) == {"cca", "cca-eager", "dca", "dca-eager", "full", "full-static", "full-kernels"}
        for cell in row["cells"].values():
            assert cell["ms_per_token"] > 0 and len(cell["steps_ms"]) == 5  # one stamp per new token
            assert cell["prefill_chunk"] == {1: 48, 2: 32}[row["batch"]]  # at most 64 tokens (rows x chunk)
    assert "| 70 | 2 |" in (tmp_path / "decode.md").read_text()


def test_decode_table_puts_dca_beside_the_measured_read_floor():
    """decode.py's last column is DCA's share of the read floor (the step's bytes at the GPU's measured read
    speed), and its footer names that speed; runs without a measured read (CPU) print "-" and no such footer."""
    spec = importlib.util.spec_from_file_location("decode_bench", REPO / "benchmarks" / "decode.py")
    decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(decode)
    row = {"context": 8192, "batch": 1, "floor_cca_ms": 3.17, "floor_full_ms": 3.35, "floor_read_ms": 3.66,
           "cells": {"dca": {"ms_per_token": 5.05}}}
    text = decode.table([row], "4.80 TB/s", "4.39 TB/s")
    line = next(x for x in text.splitlines() if x.startswith("| 8192 |"))
    header = text.splitlines()[0]
    assert line.count("|") == header.count("|")
    assert line.rstrip(" |").endswith("3.66 (72%)") and "3.35 (66%)" in line
    assert "read floor: the same bytes / 4.39 TB/s" in text
    text = decode.table([{**row, "floor_read_ms": None}], "4.80 TB/s")
    assert next(x for x in text.splitlines() if x.startswith("| 8192 |")).rstrip(" |").endswith("-")
    assert "read floor" not in text.split("\n\n")[-1]


@torch.no_grad()
def test_decode_benchmarks_full_kernels_row_is_full_attention():
    """The full-kernels row runs the DCA class with one chunk holding every position: stock full attention's logits
    at every position up to the model's context."""
    spec = importlib.util.spec_from_file_location("decode_bench", REPO / "benchmarks" / "decode.py")
    decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(decode)
    args = SimpleNamespace(smoke=True, layers=2, contexts=[300], new_tokens=6, group_size=4, local_window=8,
                           device="cpu")
    cca, full = decode.build(args, torch.float32)
    whole = decode.build_dca(args, cca, whole=True)
    x = torch.randint(3, 500, (2, whole.config.max_position_embeddings), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(whole(x).logits, full(x).logits, atol=1e-5, rtol=1e-5)
    dca = decode.build_dca(args, cca)  # the CLI's sizes (c = 256 in a smoke run): chunked past C = 192
    assert not torch.allclose(dca(x).logits[:, -1], full(x).logits[:, -1], atol=1e-3)


@pytest.mark.parametrize("backend", ["cca", "dca", "full-kernels", "full-static"])
def test_generate_profile_runs_each_decode_row(backend):
    """benchmarks/generate_profile.py profiles any row of decode.py (its docstring's smoke command, per backend)."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "generate_profile.py"), "--smoke", "--device", "cpu",
           "--context", "64", "--backend", backend, "--skip", "1", "--steps", "2", "--top", "5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"{backend}, context 64, batch 1, cpu") and "| kernel |" in proc.stdout


def test_decode_benchmark_saves_every_cell_and_resumes(tmp_path, monkeypatch):
    """A run stopped by a time limit keeps the cells it measured (decode.json is written after each), and ``--resume``
    measures only the rest, keeping the earlier rows outside its own grid; other settings are refused."""
    base = [sys.executable, str(REPO / "benchmarks" / "decode.py"), "--smoke", "--device", "cpu", "--new-tokens", "4",
            "--skip", "1", "--group-size", "4", "--local-window", "8", "--out", str(tmp_path)]
    spec = importlib.util.spec_from_file_location("decode_bench", REPO / "benchmarks" / "decode.py")
    decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(decode)
    real, calls = decode.run_cell, []

    def stopped_at_the_third(*args):  # the time limit: the process dies during its third cell
        calls.append(args[1])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(decode, "run_cell", stopped_at_the_third)
    monkeypatch.setattr(sys, "argv", base[1:] + ["--contexts", "40", "--batches", "1", "--backends", "cca,full,dca"])
    with pytest.raises(KeyboardInterrupt):
        decode.main()
    saved = json.loads((tmp_path / "decode.json").read_text())
    assert not saved["complete"] and saved["processes"] == 1
    assert sorted(saved["rows"][0]["cells"]) == ["cca", "full"]
    assert "(partial: 2 of 3 cells so far)" in (tmp_path / "decode.md").read_text()
    measured = saved["rows"][0]["cells"]["cca"]["steps_ms"]
    again = subprocess.run(base + ["--contexts", "40,48", "--batches", "1", "--backends", "cca,dca", "--resume"],
                           capture_output=True, text=True, cwd=REPO, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "L=40 batch=1 cca" not in again.stdout and "L=40 batch=1 dca:" in again.stdout
    saved = json.loads((tmp_path / "decode.json").read_text())
    assert saved["complete"] and saved["processes"] == 2
    assert [(r["context"], sorted(r["cells"])) for r in saved["rows"]] == [(40, ["cca", "dca", "full"]),
                                                                           (48, ["cca", "dca"])]
    assert saved["rows"][0]["cells"]["cca"]["steps_ms"] == measured  # kept, not measured again
    assert "measured by 2 processes" in (tmp_path / "decode.md").read_text()
    saved["rows"][1]["cells"]["dca"] = "OOM"  # a cell that ran out of memory (e.g. beside another's leftovers)
    (tmp_path / "decode.json").write_text(json.dumps(saved))
    retried = subprocess.run(base + ["--contexts", "48", "--batches", "1", "--backends", "cca,dca", "--resume"],
                             capture_output=True, text=True, cwd=REPO, timeout=600)
    assert retried.returncode == 0 and "L=48 batch=1 dca:" in retried.stdout and "cca:" not in retried.stdout
    assert isinstance(json.loads((tmp_path / "decode.json").read_text())["rows"][1]["cells"]["dca"], dict)
    other = subprocess.run(base + ["--contexts", "40", "--batches", "1", "--backends", "cca", "--resume",
                                   "--new-tokens", "5"], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert other.returncode == 2 and "other settings" in other.stderr and "new_tokens" in other.stderr
    nothing = subprocess.run(base[:-1] + [str(tmp_path / "none"), "--resume"], capture_output=True, text=True,
                             cwd=REPO, timeout=600)
    assert nothing.returncode == 2 and "found none" in nothing.stderr


def test_decode_benchmark_marks_cells_whose_cache_cannot_fit(tmp_path):
    """A cell whose weights and cache exceed the device memory is marked without a prefill that would run for
    minutes before running out of memory; the cells that fit run."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "decode.py"), "--smoke", "--device", "cpu", "--new-tokens", "3",
           "--skip", "1", "--group-size", "4", "--local-window", "8", "--contexts", "40,200000", "--batches", "1",
           "--backends", "dca,full", "--memory-gib", "0.05", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    small, large = json.loads((tmp_path / "decode.json").read_text())["rows"]
    assert all(isinstance(c, dict) for c in small["cells"].values())
    assert all(c.startswith("no room (") for c in large["cells"].values())  # 0.1 GiB of keys and values
    assert "no room (" in (tmp_path / "decode.md").read_text()


def test_decode_benchmark_prefill_rows_shortcut_is_labelled(tmp_path):
    """``--prefill-rows``: the first rows prefilled for real, their cache rows repeated to the batch; the table says so,
    and full-static (which builds its own cache) is refused."""
    base = [sys.executable, str(REPO / "benchmarks" / "decode.py"), "--smoke", "--device", "cpu", "--contexts", "40",
            "--batches", "1,4", "--new-tokens", "4", "--skip", "1", "--group-size", "4", "--local-window", "8",
            "--prefill-rows", "2"]
    proc = subprocess.run(base + ["--backends", "cca,full", "--out", str(tmp_path)], capture_output=True, text=True,
                          cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
    assert [r["cells"]["cca"]["prefilled_rows"] for r in rows] == [1, 2]
    assert all(len(r["cells"]["full"]["steps_ms"]) == 3 for r in rows)
    assert "| 40 | 4 (2 prefilled, repeated) |" in (tmp_path / "decode.md").read_text()
    refused = subprocess.run(base + ["--backends", "cca,full-static"], capture_output=True, text=True, cwd=REPO,
                             timeout=600)
    assert refused.returncode == 2 and "full-static builds its own" in refused.stderr


def test_attention_benchmark_refuses_an_unknown_sweep_kernel():
    """``--sweep-kernels`` names kernels of the config table; a typo fails before anything runs (no GPU needed)."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "attention.py"), "--sweep", "--sweep-kernels", "dkdv_core,dkvd"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 2
    assert "unknown kernel(s) ['dkvd']" in proc.stderr and "dkdv_raw" in proc.stderr


def test_attention_benchmark_refuses_a_folder_without_the_authors_code_and_zero_rounds(tmp_path):
    """``--authors-repo`` must hold the authors' ``codebase/core/cca_attn.py`` and ``--rounds`` be >= 1: both fail
    before anything runs, naming the fix (no GPU needed)."""
    script = str(REPO / "benchmarks" / "attention.py")
    proc = subprocess.run([sys.executable, script, "--authors-repo", str(tmp_path)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 2
    assert "no codebase/core/cca_attn.py there" in proc.stderr
    assert "git clone https://github.com/chenyaofo/CCA-Attention" in proc.stderr
    proc = subprocess.run([sys.executable, script, "--rounds", "0"], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 2 and "--rounds must be at least 1, got 0" in proc.stderr


def test_attention_benchmark_calls_the_authors_path_as_their_attention_layer_does(tmp_path, monkeypatch):
    """``cca_authors`` calls ``pooling_attention_wo_cache`` of the clone it is given with pre-RoPE q/k/v, the recipe's
    g and s, no dropout, the GQA ratio, no cache and (1, L, d) tables, after selecting their ``cca`` pooling."""
    core = tmp_path / "codebase" / "core"
    core.mkdir(parents=True)
    (core / "cca_attn.py").write_text(
        "calls = []\n"
        "def pooling_attention_wo_cache(*args):\n"
        "    calls.append((pooling_func, args))\n"
        "    return args[0]\n")
    attention = _attention_benchmark()
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m == "codebase" or m.startswith("codebase.")]:
        monkeypatch.delitem(sys.modules, name)
    mod = attention.load_authors(tmp_path)
    args = SimpleNamespace(group_size=4, local_window=8, pooling=["kv"], ref_max=0, authors=mod)
    L, d = 12, 16
    q, k, v = torch.randn(1, 6, L, d), torch.randn(1, 2, L, d), torch.randn(1, 2, L, d)
    cos, sin = attention.rope_tables(L, d, "cpu", torch.float32)
    methods = attention.make_methods(L, args, q, k, v, cos, sin, None)
    for name in ("cca_authors", "cca_authors_a100_tiles"):
        fn, inputs, kind = methods[name]
        assert fn(*inputs) is q and kind == "cca"
    assert len(mod.calls) == 2
    pooling_func, call = mod.calls[0]
    assert pooling_func == "cca"
    assert call[0] is q and call[1] is k and call[2] is v and call[3:9] == (4, 8, 0.0, 3, 0, None)
    assert torch.equal(call[9], cos[None]) and torch.equal(call[10], sin[None])
    for name in [m for m in sys.modules if m == "codebase" or m.startswith("codebase.")]:
        del sys.modules[name]


def _attention_benchmark():
    spec = importlib.util.spec_from_file_location("attention_benchmark", REPO / "benchmarks" / "attention.py")
    attention = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(attention)
    return attention


def test_attention_benchmark_median_and_spread_leave_out_failed_rounds():
    attention = _attention_benchmark()
    assert attention.median_and_spread([2.0, float("nan"), 4.0, 3.0]) == (3.0, 100.0 * 2.0 / 3.0)
    ms, spread = attention.median_and_spread([float("nan")])
    assert math.isnan(ms) and math.isnan(spread)


def test_speculative_benchmark_compares_drafts_with_greedy(tmp_path):
    """``benchmarks/speculative.py``: greedy, prompt lookup and the oracle's drafts run in generate(); every row's
    tokens must equal greedy's (exit 1 otherwise), a pass of all-right drafts adds every draft and the bonus token."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "speculative.py"), "--smoke", "--device", "cpu", "--contexts",
           "70", "--new-tokens", "25", "--unit", "16", "--lookup-tokens", "5", "--oracle-right", "5,2", "--skip", "1",
           "--group-size", "4", "--local-window", "16", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "speculative.json").read_text())["rows"]
    assert [r["drafts"] for r in rows] == ["prompt lookup", "oracle, 5 of 5 right", "oracle, 2 of 5 right"]
    assert all(r["greedy"]["tokens_per_pass"] == 1 for r in rows)
    assert all(r["equal"] for r in rows)
    assert rows[1]["spec"]["tokens_per_pass"] == 6 and rows[2]["spec"]["tokens_per_pass"] == 3
    assert "| 70 | oracle, 2 of 5 right |" in (tmp_path / "speculative.md").read_text()


def test_speculative_benchmark_on_an_export_and_a_text(tmp_path):
    """``--model`` / ``--text``: a CCA export loaded as users load it, prompted with a text file and a quote of its
    start; prompt lookup and the oracle's drafts give the greedy tokens. Bad pairings of the options exit with 2."""
    from cca_convert.cli import main
    from tests.support.factories import save_base

    base = save_base(tmp_path / "base")
    (tmp_path / "recipe.yaml").write_text("cca: {group_size: 4, local_window: 8}\n"
                                          "export: {dtype: float32, roundtrip_tokens: 40}\nvalidate: {enabled: false}\n")
    assert main([str(base), "--recipe", str(tmp_path / "recipe.yaml"), "--output", str(tmp_path / "out")]) == 0
    text = tmp_path / "text.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 4)
    cmd = [sys.executable, str(REPO / "benchmarks" / "speculative.py"), "--device", "cpu", "--model",
           str(tmp_path / "out"), "--text", str(text), "--contexts", "60,90", "--quote", "20", "--new-tokens", "12",
           "--lookup-tokens", "4", "--oracle-right", "4", "--skip", "1", "--out", str(tmp_path / "res")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "res" / "speculative.json").read_text())["rows"]
    assert [(r["context"], r["drafts"]) for r in rows] == [(60, "prompt lookup"), (60, "oracle, 4 of 4 right"),
                                                          (90, "prompt lookup"), (90, "oracle, 4 of 4 right")]
    assert all(r["equal"] for r in rows)
    assert "text.txt's first L - 20 tokens, then its first 20 again" in (tmp_path / "res" / "speculative.md").read_text()
    for bad, why in ((["--model", str(tmp_path / "out")], "--model and --text go together"),
                     (["--model", str(tmp_path / "out"), "--text", str(text), "--quote", "60"], "--quote must be"),
                     (["--model", str(tmp_path / "out"), "--text", str(tmp_path / "none.txt"), "--quote", "20"],
                      "none.txt: no such file")):
        proc = subprocess.run(cmd[:2] + ["--device", "cpu", "--contexts", "60", *bad], capture_output=True, text=True,
                              cwd=REPO, timeout=600)
        assert proc.returncode != 0 and why in proc.stderr, proc.stderr[-2000:]


def test_prefill_benchmark_times_one_pass_and_chunks_for_both_backends(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "prefill.py"), "--smoke", "--device", "cpu", "--contexts", "40,53",
           "--chunk", "16", "--group-size", "4", "--local-window", "8", "--repeats", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "prefill.json").read_text())["rows"]
    assert [r["context"] for r in rows] == [40, 53]
    for row in rows:
        assert set(row["cells"]) == {"cca one pass", "cca chunks", "full one pass", "full chunks"}
        assert all(c["ms"] > 0 and len(c["times_ms"]) == 2 for c in row["cells"].values())
        assert row["cca_dh"] < 1e-4 and row["full_dh"] < 1e-4  # fp32: chunks give one pass's hidden states
    assert "| 53 | chunks |" in (tmp_path / "prefill.md").read_text()
    bad = subprocess.run(cmd[:2] + ["--backends", "cca,flash"], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert bad.returncode == 2 and "--backends takes cca and/or full" in bad.stderr


def test_dca_defaults_sweep_measures_every_setting_and_names_the_chosen_one(tmp_path):
    """The sweep's code path on a tiny random base (c = 64): the base row, eight settings (four (C, w) x temperature)
    measured with the validator's functions, a merge of --json files and the chosen row."""
    from tests.support.factories import save_base

    base = save_base(tmp_path / "base", max_position_embeddings=64)
    raw = tmp_path / "kjv.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "dca_defaults.py"), "--bases", "kjv", "--base", str(base),
           "--device", "cpu", "--windows", "2", "--trials", "1", "--json", str(raw)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(raw.read_text())["rows"]
    assert [r["setting"] and r["setting"]["name"] for r in rows] == [None] + [
        f"{size} temperature {t}" for size in ("C=3c/4 w=c/8", "C=3c/4 w=c/16", "C=c-1 w=c/8", "C=c-1 w=c/32")
        for t in ("off", "on")]
    assert rows[5]["setting"]["chunk_size"] == 63 and rows[8]["setting"]["local_size"] == 2  # C = c - 1, w = c/32
    assert all(set(r["ppl"]) == {"64", "128", "256", "512"} and all(math.isfinite(v) for v in r["ppl"].values())
               for r in rows)
    merged = subprocess.run([sys.executable, str(REPO / "benchmarks" / "dca_defaults.py"), "--merge", str(raw),
                             "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert merged.returncode == 0, merged.stderr[-3000:]
    chosen = json.loads((tmp_path / "dca_defaults.json").read_text())["chosen"]
    assert f"| {chosen} **(chosen)** |" in merged.stdout and "| base (plain RoPE) |" in merged.stdout


def test_serve_benchmark_streams_from_each_server(tmp_path):
    """The serving benchmark's path on a tiny model: the CLI's CCA export and the stock base served, streamed
    completions of exactly L prompt tokens, the table with ratios to the stock server."""
    pytest.importorskip("fastapi")
    cmd = [sys.executable, str(REPO / "benchmarks" / "serve.py"), "--smoke", "--device", "cpu", "--contexts", "40",
           "--new-tokens", "4", "--requests", "1", "--rows", "full,cca", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = json.loads((tmp_path / "serve.json").read_text())["results"]
    assert [(r["row"], r["prompt_tokens"], r["completion_tokens"]) for r in results] == [("full", 40, 4), ("cca", 40, 4)]
    assert all(r["ttft_s"] > 0 and r["latency_s"] >= r["ttft_s"] for r in results)
    assert "| 40 | cca |" in (tmp_path / "serve.md").read_text()


def test_serve_table_says_n_a_where_a_stream_gave_no_decode_rate():
    """A stream whose text came in one chunk has no decode rate (CI once saw it on the CPU, and the table crashed on
    the None): that cell and the ratios over it read n/a and -, the other rows keep their numbers."""
    spec = importlib.util.spec_from_file_location("serve_bench", REPO / "benchmarks" / "serve.py")
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    results = [{"row": "full", "context": 40, "ttft_s": 0.01, "decode_tok_s": None, "latency_s": 0.02,
                "server_gpu_mib": None},
               {"row": "cca", "context": 40, "ttft_s": 0.02, "decode_tok_s": 50.0, "latency_s": 0.1,
                "server_gpu_mib": None}]
    text = serve.table(results, SimpleNamespace(contexts=[40], rows=["full", "cca"]))
    full, cca = (next(x for x in text.splitlines() if x.startswith(f"| 40 | {r} |")) for r in ("full", "cca"))
    assert [c.strip() for c in full.split("|")[1:-1]] == ["40", "full", "0.010", "n/a", "0.02", "-", "1.00x", "-", "-"]
    assert [c.strip() for c in cca.split("|")[1:-1]][3:] == ["50.0", "0.10", "-", "0.50x", "-", "-"]


def test_recipes_at_scale_runs_every_shipped_recipe_row_on_tiny_shapes(tmp_path):
    """The at-scale benchmark's code path (converter config, preflight estimate, finetune stage per backend, the
    validation's scoring pass) on tiny shapes of each recipe's family; the GPU run uses the released shapes."""
    out = tmp_path / "scale.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "recipes_at_scale.py"), "--tiny", "--device", "cpu", "--steps",
           "2", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900,
                          env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["row"] for r in results] == ["llama-3.1-8b", "qwen3-8b", "qwen3-30b-a3b", "gemma3-12b", "qwen2.5-7b",
                                           "mistral-7b", "olmo2-7b", "llama-2-7b-32k", "phi-4"]  # every 7-30B recipe
    for r in results:
        assert {x["backend"] for x in r["runs"]} == {"reference", "full"}
        assert all(math.isfinite(x["losses"][-1]) and x["tokens_per_s"] > 0 for x in r["runs"])
        assert {v["backend"] for v in r["validate"]} == {"full", "cca"}
        assert r["estimate_gib"]["finetune"] > 0 and r["estimate_gib"]["validate"] > 0
    assert "| phi-4 |" in proc.stdout


def test_recipes_at_scale_estimates_the_released_shapes_without_a_gpu():
    cmd = [sys.executable, str(REPO / "benchmarks" / "recipes_at_scale.py"), "--estimate-only", "--rows",
           "llama-3.1-8b", "qwen3-30b-a3b"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "llama-3.1-8b: 8.03B params; estimates finetune 34.5 GiB" in proc.stdout
    assert "qwen3-30b-a3b: 30.53B params" in proc.stdout


@pytest.mark.slow
def test_recipe_cli_runs_the_family_dca_recipe_through_every_stage_on_a_tiny_shape(tmp_path):
    """The real-shape CLI benchmark's code path: a random checkpoint of Llama-3.1-8B's family at a tiny shape
    (trained context 64), `cca-convert --set method=dca` with its defaults, every stage to the round trip."""
    out = tmp_path / "cli.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "recipe_cli.py"), "--tiny", "--row", "llama-3.1-8b", "--method",
           "dca", "--workdir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["exit_code"] == 0 and result["report"]["context_lengths"] == [64, 128, 256, 512]
    assert result["report"]["model"]["method"] == "dca" and "CCA" not in result["stdout"]
    assert "[6/6] roundtrip" in result["stdout"] and "validated lengths [64, 128, 256, 512]" in proc.stdout


def test_recipe_cli_writes_a_multimodal_release_as_the_hub_holds_it_and_converts_its_language_model(tmp_path):
    """``--multimodal``: the row's release as google/gemma-3-12b-pt ships it (language model + vision tower +
    projector under the Hub's tensor names, lm_head tied away), at a tiny shape; the CLI converts its language model
    through every stage and the export holds none of the vision tensors."""
    from safetensors import safe_open

    out = tmp_path / "cli.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "recipe_cli.py"), "--tiny", "--row", "gemma3-12b", "--multimodal",
           "--method", "cca", "--workdir", str(tmp_path), "--keep", "--data", "examples/data/heldout.txt",
           "--json", str(out), "--", "--set", "validate.context_lengths=[64]", "--set", "cca.group_size=4",
           "--set", "cca.local_window=16", "--set", "finetune.seq_len=64", "--set", "finetune.steps=1",
           "--set", "finetune.gradient_accumulation_steps=1", "--set", "finetune.data={files: [examples/data/train.txt]}",
           "--set", "export.dtype=float32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["exit_code"] == 0 and result["multimodal"] and "[8/8] roundtrip" in result["stdout"]
    assert "multimodal checkpoint's language model (gemma3_text) is converted" in result["stdout"]

    def names(folder):
        found = set()
        for shard in folder.glob("*.safetensors"):
            with safe_open(str(shard), "pt") as f:
                found |= set(f.keys())
        return found

    work = next(tmp_path.glob("cca-recipe-cli-*"))
    base, export = names(work / "base"), names(work / "out")
    assert json.loads((work / "base" / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert {n.split(".")[0] for n in base} == {"language_model", "vision_tower", "multi_modal_projector"}
    assert "language_model.model.embed_tokens.weight" in base and not any("lm_head" in n for n in base)
    assert export and all(n.startswith("model.") or n == "lm_head.weight" for n in export)
    assert not any("vision" in n or "projector" in n for n in export)


def test_every_benchmark_is_registered_and_the_results_index_is_current():
    """Benchmarks are a product: each script has a registry row (what it measures, its command, how it is verified),
    every script the README names is registered, and the generated results index matches the tree."""
    import re

    from benchmarks.registry import BENCHMARKS, HELPERS
    from benchmarks.run import index_text

    scripts = {p.name for p in (REPO / "benchmarks").glob("*.py")}
    registered = {b.script for b in BENCHMARKS.values()}
    assert scripts - HELPERS == registered, "register every benchmark in benchmarks/registry.py"
    assert set(re.findall(r"benchmarks/(\w+\.py)", (REPO / "README.md").read_text())) <= registered | HELPERS
    assert (REPO / "benchmarks/results/INDEX.md").read_text() == index_text(), "run: python benchmarks/run.py --index"
    assert not list((REPO / "benchmarks/results").rglob("test-*.txt")), "pytest logs go to docs/test-runs/"
    for bench in BENCHMARKS.values():  # "how it is verified" names tests and scripts that exist
        for path in re.findall(r"(?:tests|benchmarks)/[\w/]+\.py", bench.verify):
            assert (REPO / path).is_file(), f"{bench.name}: {path}"


def test_the_runner_keeps_a_record_of_a_benchmark_run(tmp_path, monkeypatch):
    """``benchmarks/run.py NAME``: the script runs as registered and its record names the command, the commit, the
    versions and the GPU, with the printed output."""
    import json

    from benchmarks import registry, run

    monkeypatch.setattr(run, "RECORDS", tmp_path / "records")
    monkeypatch.setattr(run, "write_index", lambda: None)
    bench = registry.Benchmark("toy", "registry.py", "nothing", "", "this test", gpu=False)
    monkeypatch.setitem(registry.BENCHMARKS, "toy", bench)
    monkeypatch.setattr(run, "BENCHMARKS", registry.BENCHMARKS)
    assert run.run("toy", []) == 0
    record = json.loads(next((tmp_path / "records").glob("toy-*.json")).read_text())
    assert record["command"] == "python benchmarks/registry.py" and record["exit_code"] == 0
    assert record["versions"]["torch"] and record["gpu"] and record["date"] and "commit" in record


def test_the_runner_forwards_script_arguments_and_keeps_a_completed_record(tmp_path, monkeypatch):
    """Arguments after the name go to the script, the first ``--`` wherever it stands (a later one is the script's:
    ``recipe_cli -- --row r -- --set k`` hands ``--set k`` to cca-convert); a failed run (here: an argument the
    script refuses) is recorded beside the completed run's record, which stays."""
    from benchmarks import registry, run

    monkeypatch.setattr(run, "RECORDS", tmp_path / "records")
    monkeypatch.setattr(run, "write_index", lambda: None)
    bench = registry.Benchmark("toy", "run.py", "nothing", "--list", "this test", gpu=False)
    monkeypatch.setitem(registry.BENCHMARKS, "toy", bench)
    monkeypatch.setattr(run, "BENCHMARKS", registry.BENCHMARKS)
    assert run.main(["toy", "--list", "--"]) == 0  # run.py's own --list, forwarded: it lists and exits 0
    good = next((tmp_path / "records").glob("toy-*.json"))
    assert json.loads(good.read_text())["command"] == "python benchmarks/run.py --list"
    assert run.main(["toy", "--", "--list", "--"]) == 0  # a second `--` is the script's own: it goes through
    assert json.loads(good.read_text())["command"] == "python benchmarks/run.py --list --"
    assert run.main(["toy", "--", "--no-such-option"]) != 0
    assert json.loads(good.read_text())["exit_code"] == 0, "a failed run replaced the completed record"
    failed = json.loads(good.with_name(good.stem + "-failed.json").read_text())
    assert failed["exit_code"] != 0 and failed["command"].endswith("--no-such-option")


def test_dca_decode_rows_read_their_caches_from_hbm_as_a_model_step_does():
    """benchmarks/dca.py's decode rows cycle through enough layers' caches to hold 4x the L2 (an H200's 60 MB): one
    cache that fits the L2, replayed alone, would time the L2 (8K x 1 is 34 MB)."""
    spec = importlib.util.spec_from_file_location("dca_bench", REPO / "benchmarks" / "dca.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    l2 = 60 * 2**20
    per_layer = lambda L, batch: 2 * batch * bench.HKV * (L + 1024) * bench.D * 2  # noqa: E731
    for L, batch in ((8192, 1), (32768, 1), (8192, 16), (131072, 1), (131072, 64)):
        n = bench.cache_layers(L, batch, l2_bytes=l2)
        assert n * per_layer(L, batch) >= 4 * l2 and (n == 1 or (n - 1) * per_layer(L, batch) < 4 * l2)
    assert bench.cache_layers(8192, 1, l2_bytes=l2) == 7
    assert bench.cache_layers(131072, 64, l2_bytes=l2) == 1
    assert bench.cache_layers(64, 1, l2_bytes=l2) == 32  # at most a Llama-3.1-8B's layers
    assert bench.cache_layers(8192, 1, requested=1, l2_bytes=l2) == 1


def test_read_floor_reads_every_key_and_value_once():
    """The "K/V read" column of benchmarks/dca.py (and decode.py's measured read) is a floor only if its kernel reads
    exactly the first L columns of keys and values (strided views with spare room past L, L not a multiple of a
    tile, batch > 1), every config of the sweep."""
    from benchmarks import read_floor
    from tests.support.triton_env import triton_device

    device = triton_device("the read-floor kernel")[2]
    gen = torch.Generator().manual_seed(0)
    shapes = ((2, 3, 333, 40), (1, 2, 128, 0), (3, 1, 1000, 24))
    for (B, Hkv, L, spare), cfg in zip(shapes * 2, read_floor.READ_CONFIGS):
        kbuf = torch.randn(B, Hkv, L + spare, 16, generator=gen).to(device)
        vbuf = torch.randn(B, Hkv, L + spare, 16, generator=gen).to(device)
        kbuf[:, :, L:] = 1e6  # the room past L must not be read into the sum
        vbuf[:, :, L:] = 1e6
        k, v = kbuf[:, :, :L], vbuf[:, :, :L]
        want = k.double().sum() + v.double().sum()
        got = read_floor.read_kv(k, v, *cfg, sms=5).double().sum()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-2), (B, Hkv, L, cfg, got.item(), want.item())


def test_fidelity_dca_row_reads_the_dca_run_report(tmp_path):
    """``fidelity.py --dca`` summarises a real DCA run's report: its results and speed lie under "dca" (the method's
    name), the base's under "base"; the row's table holds the report's numbers at every length."""
    from cca_convert.cli import main
    from tests.support.factories import TINY, save_base

    spec = importlib.util.spec_from_file_location("fidelity_bench", REPO / "benchmarks" / "fidelity.py")
    fidelity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fidelity)
    base = save_base(tmp_path / "base", **{**TINY.get("llama", {}), "max_position_embeddings": 128})
    text = tmp_path / "heldout.txt"
    text.write_text("".join(chr(97 + (i * 7) % 26) for i in range(3000)))
    out = tmp_path / "out"
    assert main([str(base), "--output", str(out), "--set", "method=dca", "--set", "validate.data.dataset=null",
                 "--set", f"validate.data.files=[{text}]", "--set", "validate.context_lengths=[c,2c]",
                 "--set", "validate.windows=1", "--set", "validate.passkey_trials=1", "--set", "validate.speed=true",
                 "--set", "validate.max_ppl_ratio=null", "--force"]) == 0
    report = json.loads((out / "validation" / "report.json").read_text())
    table, ok, data = fidelity.dca_summary(report, passkey=True)
    for n in (128, 256):
        ppl = report["results"]["dca"]["perplexity"][str(n)]["ppl"]
        assert f"| {n} | {report['results']['base']['perplexity'][str(n)]['ppl']:.3f} | {ppl:.3f} |" in table
        assert data["ppl"]["dca"][n] == ppl and "trials" in data["passkey"]["dca"][n]
    assert "passkey bar" in table and f"DCA {report['speed']['256']['dca']['latency_s'] * 1e3:.1f} ms" in table
    assert ok is False  # a random base meets neither bar (its ppl does not grow 3x past c)


def test_sliding_window_benchmark_compares_the_blocked_layer_with_one_masked_call(tmp_path):
    """benchmarks/sliding_window.py (the A/B its record cites) runs on CPU; past 4 windows the blocked attention it times
    gives the single masked call's outputs and gradients."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "sliding_window.py"), "--device", "cpu", "--lengths", "48,160",
           "--window", "16", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--reps", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "sliding_window.json").read_text())["rows"]
    assert [(r["length"], r["by_blocks_engaged"]) for r in rows] == [(48, False), (160, True)]
    for row in rows:
        assert row["max_abs_diff"] < 1e-5 and row["max_abs_grad_diff"] < 1e-5
        assert all(t > 0 for t in (*row["fwd_ms"].values(), *row["fwd_bwd_ms"].values()))
    assert "| 160 |" in (tmp_path / "sliding_window.md").read_text()
