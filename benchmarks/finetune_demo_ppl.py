#!/usr/bin/env python3
"""Held-out perplexity of the demo models: base (full attention), converted CCA, finetuned CCA.

Token-weighted NLL over non-overlapping 1024-token windows of ``examples/data/heldout.txt`` (books as
``<s> text </s>``, concatenated; the first token of each window is not scored), the same protocol as
``examples/train_tiny_llama.py --eval-only``.

    cca-convert examples/tiny-llama --recipe recipes/tiny-demo.yaml --output out/tiny-cca --overwrite
    python benchmarks/finetune_demo_ppl.py examples/tiny-llama out/tiny-cca
"""

import argparse
import math
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def heldout_ids(tokenizer, path: Path) -> torch.Tensor:
    books = [b.strip("\n") + "\n" for b in path.read_text(encoding="utf-8").split("\n\n\n") if b.strip()]
    ids = []
    for book in books:
        ids.append(tokenizer.bos_token_id)
        ids.extend(tokenizer(book, add_special_tokens=False, verbose=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, window: int, max_windows: int | None) -> tuple[float, int]:
    model.eval()
    nll, count = 0.0, 0
    for i, start in enumerate(range(0, len(ids), window)):
        if max_windows is not None and i >= max_windows:
            break
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            continue
        logits = model(input_ids=chunk[None]).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count), count


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="model folders (CCA ones are loaded with trust_remote_code)")
    p.add_argument("--heldout", type=Path, default=Path("examples/data/heldout.txt"))
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--max-windows", type=int, help="score only the first N windows (quicker)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.models[0])
    ids = heldout_ids(tokenizer, args.heldout)
    for folder in args.models:
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
        ppl, n = perplexity(model, ids, args.window, args.max_windows)
        print(f"{folder}: held-out ppl {ppl:.3f} over {n} tokens ({time.perf_counter() - t0:.0f}s)", flush=True)
        if getattr(model.config, "model_type", "") == "cca":  # the same weights with full attention, for reference
            model.config.attn_backend = "full"
            ppl_full, _ = perplexity(model, ids, args.window, args.max_windows)
            print(f"{folder} (attn_backend=full): held-out ppl {ppl_full:.3f}", flush=True)


if __name__ == "__main__":
    main()
