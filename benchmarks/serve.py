"""Served over HTTP: the CCA and DCA exports behind ``cca-convert serve`` against the stock model behind
``transformers serve``, the same server (transformers' OpenAI-compatible one) on the same random weights.

What a client of the endpoint sees. Each server answers one short warm-up request (kernel compilation, CUDA-graph
capture), then, per context L, ``--requests`` streamed ``/v1/completions`` requests whose prompt is exactly L tokens
and which ask for ``--new-tokens`` greedy tokens. Per request: the time to the first streamed token (the prefill as
the client waits for it), the decode rate after it (tokens/s between the first and the last streamed token) and the
whole request's latency; the table prints the medians and each row's ratio to the stock server.

Rows:
- ``full``: ``transformers serve BASE`` with its defaults (SDPA, a DynamicCache, every step launched from Python).
- ``full-compile``: ``transformers serve BASE --compile`` (static cache + torch.compile: CUDA graphs), the fairest
  full attention the server offers.
- ``cca`` / ``dca``: ``cca-convert serve EXPORT`` on the exports the CLI makes of that base with its defaults (no
  finetune: the weights are the base's).

The base is Llama-3.1-8B's shape (``--smoke``: a tiny one for the CPU) with random bf16 weights and a word-level
tokenizer built here over the model's 128,256 ids: one token per word, so a prompt of L words is L tokens. Random
weights give speed, not quality (the fidelity benchmarks measure quality). Requests are served one at a time, as
the server does without continuous batching (docs/SERVING.md).

    python benchmarks/serve.py --out benchmarks/results            # 32K prompts, 4 rows, one GPU
    python benchmarks/serve.py --smoke --device cpu --contexts 48  # the code path, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
import transformers
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.results_out import save_results  # noqa: E402

ROWS = ("full", "cca", "dca", "full-compile")  # the compiled row last: its compilation takes longest
STOCK_SERVE = "from transformers.cli.transformers import main; main()"


def base_config(args) -> transformers.LlamaConfig:
    if args.smoke:
        shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    else:  # Llama-3.1-8B
        shape = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072)
    return transformers.LlamaConfig(**shape, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)


def word_tokenizer(vocab_size: int, context: int):
    """One token per whitespace-separated word ``w<id>``: prompts of exact lengths, any id decodable."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # model_input_names as Llama's tokenizer: no token_type_ids, which generate() would hand to every forward
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<pad>", model_max_length=context,
                                                model_input_names=["input_ids", "attention_mask"])


def write_base(folder: Path, args) -> None:
    config = base_config(args)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(args.device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    # no end-of-text id: every request generates exactly --new-tokens (random weights would stop anywhere)
    model.generation_config = transformers.GenerationConfig(bos_token_id=1, pad_token_id=0, eos_token_id=None)
    model.save_pretrained(folder)
    word_tokenizer(config.vocab_size, config.max_position_embeddings).save_pretrained(folder)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def export(base: Path, method: str, out: Path, work: Path) -> None:
    """The CLI's export of ``base`` with ``method``'s defaults (no finetune, no validation)."""
    recipe = work / f"{method}.yaml"
    recipe.write_text(yaml.safe_dump({"method": method, "finetune": {"enabled": False},
                                      "validate": {"enabled": False},
                                      "export": {"dtype": "bfloat16", "roundtrip": False}}))
    subprocess.run([sys.executable, "-m", "cca_convert.cli", str(base), "--recipe", str(recipe), "--output",
                    str(out)], cwd=ROOT, check=True, env=env())


def env() -> dict:
    # Hub kernels off for every server, as `cca-convert serve` has them (transformers >= 5.25 with `kernels` would
    # download norm/RoPE/activation kernels into the stock server's model on a GPU): one code base on both sides
    return {"USE_HUB_KERNELS": "NO", **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(row: str, folder: Path, port: int, device: str) -> list[str]:
    options = ["--port", str(port), "--device", device]
    if row.startswith("full"):
        return [sys.executable, "-c", STOCK_SERVE, "serve", str(folder), *options,
                *(["--compile"] if row == "full-compile" else [])]
    return [sys.executable, "-m", "cca_convert.cli", "serve", str(folder), *options]


def wait_healthy(server: subprocess.Popen, port: int, log: Path, timeout: float = 900) -> None:
    start = time.time()
    while time.time() - start < timeout:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health in {timeout:.0f}s:\n{log.read_text()[-3000:]}")


def prompt(length: int, vocab_size: int, seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    return " ".join(f"w{i}" for i in torch.randint(3, vocab_size, (length,), generator=gen).tolist())


def streamed_request(port: int, model: str, text: str, new_tokens: int) -> dict:
    """One streamed completion: seconds to the first token, to the last one, and the server's token counts."""
    # OpenAI's streams carry usage only when asked (transformers >= 5.25 follows that; older servers always sent it)
    body = {"model": model, "prompt": text, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    start = time.perf_counter()
    first = last = None
    usage = None
    with urllib.request.urlopen(req, timeout=1800) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"the server answered an error: {chunk['error']}")
            if any(c.get("text") for c in chunk.get("choices", [])):
                now = time.perf_counter()
                first = first or now
                last = now
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    if first is None or usage is None:
        raise RuntimeError("the stream had no text or no usage")
    tokens = usage["completion_tokens"]
    return {"ttft_s": first - start, "decode_tok_s": (tokens - 1) / (last - first) if last > first else None,
            "latency_s": end - start, "prompt_tokens": usage["prompt_tokens"], "completion_tokens": tokens}


def gpu_memory_mib(pid: int) -> float | None:
    """The memory the server process holds on the GPU (nvidia-smi), or None off CUDA."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    held = [float(m) for p, m in (line.split(",") for line in out.strip().splitlines() if "," in line)
            if int(p) == pid]
    return sum(held) if held else None


def serve_row(row: str, folder: Path, args, vocab_size: int, work: Path) -> list[dict]:
    port = free_port()
    log = work / f"server-{row}.log"
    with log.open("w") as sink:
        server = subprocess.Popen(server_command(row, folder, port, args.device), cwd=work, stdout=sink,
                                  stderr=subprocess.STDOUT, env=env())
    results = []
    try:
        wait_healthy(server, port, log)
        for context in args.contexts:
            # one untimed request of each shape: Triton compiles per shape, and --compile per static-cache size
            started = time.perf_counter()
            streamed_request(port, str(folder), prompt(context, vocab_size, 0), args.new_tokens)
            print(f"{row}: warm-up request ({context} tokens) {time.perf_counter() - started:.1f}s", flush=True)
            for i in range(args.requests):
                r = streamed_request(port, str(folder), prompt(context, vocab_size, 1 + i), args.new_tokens)
                if r["prompt_tokens"] != context:
                    raise RuntimeError(f"{row}: the prompt became {r['prompt_tokens']} tokens, not {context}")
                results.append({"row": row, "context": context, **r})
                rate = f"{r['decode_tok_s']:.1f} tok/s" if r["decode_tok_s"] else "n/a"
                print(f"{row} @ {context}: first token {r['ttft_s']:.3f}s, decode {rate}, latency "
                      f"{r['latency_s']:.2f}s ({r['completion_tokens']} tokens)", flush=True)
        memory = gpu_memory_mib(server.pid)
        for r in results:
            r["server_gpu_mib"] = memory
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    return results


def table(results: list[dict], args) -> str:
    def median(row, context, key):
        values = [r[key] for r in results if r["row"] == row and r["context"] == context and r[key] is not None]
        return statistics.median(values) if values else None

    lines = ["| L | server | first token (s) | decode tok/s | latency (s) | GPU memory held (MiB) | first token, "
             "full / this | decode, this / full | decode, this / full-compile |", "|---" * 9 + "|"]
    for context in args.contexts:
        for row in args.rows:
            if not any(r["row"] == row and r["context"] == context for r in results):
                lines.append(f"| {context} | {row} | failed | | | | | | |")
                continue
            ttft, rate, lat = (median(row, context, k) for k in ("ttft_s", "decode_tok_s", "latency_s"))
            mem = median(row, context, "server_gpu_mib")
            base_ttft, base_rate = median("full", context, "ttft_s"), median("full", context, "decode_tok_s")
            fair_rate = median("full-compile", context, "decode_tok_s")

            def ratio(a, b, invert=False):
                return f"{(b / a if invert else a / b):.2f}x" if a and b else "-"

            # No decode rate when the text came in one streamed chunk (a streamer holds text back until it can cut it)
            lines.append(f"| {context} | {row} | {ttft:.3f} | {f'{rate:.1f}' if rate else 'n/a'} | {lat:.2f} | "
                         f"{f'{mem:,.0f}' if mem else '-'} | {ratio(ttft, base_ttft, invert=True)} | "
                         f"{ratio(rate, base_rate)} | {ratio(rate, fair_rate)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="32768", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=3, help="timed requests per context and server")
    p.add_argument("--rows", default=",".join(ROWS), help=f"servers to run, of {','.join(ROWS)}")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--smoke", action="store_true", help="a tiny model (the code path on a CPU)")
    p.add_argument("--work", type=Path, help="where the base and exports are written (default: a temporary folder)")
    p.add_argument("--out", type=Path, help="write serve.md / serve.json here")
    args = p.parse_args(argv)
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        p.error(f"unknown rows {unknown}: choose from {','.join(ROWS)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="cca-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    base = work / "base"
    write_base(base, args)
    folders = {"full": base, "full-compile": base}
    for method in ("cca", "dca"):
        if method in args.rows:
            folders[method] = work / method
            export(base, method, folders[method], work)
    config = base_config(args)
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device
    head = (f"{device}, torch {torch.__version__}, transformers {transformers.__version__}; Llama "
            f"{'(smoke shape)' if args.smoke else '3.1-8B shape'}, random bf16 weights; {args.new_tokens} new "
            f"tokens per request, median of {args.requests}; USE_HUB_KERNELS={env()['USE_HUB_KERNELS']}; base and "
            f"exports written in {time.time() - t0:.0f}s")
    print(head, flush=True)
    results = []
    for row in args.rows:
        try:
            results += serve_row(row, folders[row], args, config.vocab_size, work)
        except Exception as error:  # a row that fails is printed as failed; the others still run
            print(f"{row}: FAILED: {error}", flush=True)
        if args.out:  # after every row: a run stopped by a time limit keeps the rows it finished
            save_results(args.out, "serve", f"{head}\n\n{table(results, args)}", {"head": head, "results": results})
    print(f"{head}\n\n{table(results, args)}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if len({r["row"] for r in results}) == len(args.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
