"""Whole-model prefill: the exported CCA model vs stock transformers' full attention, same weights, one pass and in
chunks.

A prompt of L random tokens (batch 1) through the base model (``model.model``: the logits of every position are not
what a prefill needs), with a cache: in one pass, and in chunks of ``--chunk`` tokens through that cache (what
``generate(prefill_chunk_size=...)`` does; the CCA cache pools each chunk's completed groups and attends over its
compressed state). Models as in ``decode.py`` (Llama-3.1-8B shape, random bf16 weights shared by both): ``cca`` is the
exported class with its ``HFCCACache``, ``full`` is stock ``LlamaForCausalLM`` (SDPA) with its ``DynamicCache``.
Wall time of the whole pass (device synced), median of ``--repeats`` after one warm-up at every shape; peak memory
above the weights. ``|dh|``: mean absolute difference of each model's last hidden states, chunks against one pass
(both exact: the difference is rounding; full attention's is the yardstick for bf16's).

    python benchmarks/prefill.py --out benchmarks/results                # 32K and 128K, 32 layers
    python benchmarks/prefill.py --layers 4 --contexts 131072            # quicker, a few layers
    python benchmarks/prefill.py --smoke --device cpu                    # the code path, tiny
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.decode import build, describe  # noqa: E402
from benchmarks.results_out import save_results  # noqa: E402
from cca_convert.modeling import cca_hf  # noqa: E402
from cca_convert.modeling.attention_hooks import CACHE_ARG  # noqa: E402


def new_cache(model, backend):
    if backend == "cca":
        return cca_hf.HFCCACache(model.config)
    return None  # the stock model makes its DynamicCache


@torch.no_grad()
def prefill(model, backend, ids, chunk) -> torch.Tensor:
    """The last hidden states of a prefill of ``ids``: one pass (``chunk`` None) or chunks through one cache."""
    cache, outs = new_cache(model, backend), []
    for start in range(0, ids.shape[1], chunk or ids.shape[1]):
        out = model.model(ids[:, start : start + (chunk or ids.shape[1])], use_cache=True, **{CACHE_ARG: cache})
        cache = getattr(out, CACHE_ARG)
        outs.append(out.last_hidden_state)
    return torch.cat(outs, 1)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(model, backend, ids, chunk, repeats, device) -> dict:
    prefill(model, backend, ids[:, : min(ids.shape[1], 2 * (chunk or ids.shape[1]))], chunk)  # compile the kernels
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    times, hidden = [], None
    for _ in range(repeats):
        hidden = None  # (the last repeat's output is not part of this one's peak)
        sync(device)
        start = time.perf_counter()
        hidden = prefill(model, backend, ids, chunk)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if device.type == "cuda" else None
    return {"ms": statistics.median(times), "times_ms": [round(t, 2) for t in times], "peak_gib": peak}, hidden


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--contexts", type=ints, default=[32768, 131072])
    ap.add_argument("--chunk", type=int, default=8192, help="tokens per chunk of the chunked prefill")
    ap.add_argument("--backends", default="cca,full")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--local-window", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="a tiny model (any device): the code path, not the numbers")
    ap.add_argument("--out", type=Path, default=None, help="folder for prefill.md / prefill.json")
    args = ap.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    if not backends or set(backends) - {"cca", "full"}:
        ap.error(f"--backends takes cca and/or full, got {args.backends!r}")
    if args.chunk < 1 or args.repeats < 1 or any(c < 1 for c in args.contexts):
        ap.error("--chunk, --repeats and every context must be positive")
    args.new_tokens = 0  # (decode.build's config reads it)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    t0 = time.time()
    models = dict(zip(("cca", "full"), build(args, dtype)))
    head = (f"{describe(name, models['cca'], dtype, t0)}; {args.layers if not args.smoke else 2} layers, batch 1, "
            f"chunks of {args.chunk}, median of {args.repeats}")
    print(head, flush=True)
    rows = []
    for context in args.contexts:
        gen = torch.Generator(device="cpu").manual_seed(context)
        ids = torch.randint(3, models["cca"].config.vocab_size, (1, context), generator=gen).to(device)
        row = {"context": context, "cells": {}}
        for backend in backends:
            hidden = {}
            for mode, chunk in (("one pass", None), ("chunks", args.chunk)):
                try:
                    row["cells"][f"{backend} {mode}"], hidden[mode] = clock(models[backend], backend, ids, chunk,
                                                                            args.repeats, device)
                    cell = row["cells"][f"{backend} {mode}"]
                    print(f"  L={context} {backend} {mode}: {cell['ms']:.1f} ms"
                          + (f", peak {cell['peak_gib']:.1f} GiB" if cell["peak_gib"] is not None else ""), flush=True)
                except torch.OutOfMemoryError:
                    row["cells"][f"{backend} {mode}"] = "OOM"
                    torch.cuda.empty_cache()
            if len(hidden) == 2:
                row[f"{backend}_dh"] = (hidden["one pass"].float() - hidden["chunks"].float()).abs().mean().item()
                row[f"{backend}_h"] = hidden["one pass"].float().abs().mean().item()
            del hidden
        rows.append(row)
    text = head + "\n\n" + table(rows)
    print("\n" + text)
    if args.out:
        save_results(args.out, "prefill", text, {"device": name, "rows": rows})
    return 0


def table(rows) -> str:
    lines = ["| L | mode | cca ms | full ms | full / cca | cca peak GiB | full peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for mode in ("one pass", "chunks"):
            cca, full = r["cells"].get(f"cca {mode}"), r["cells"].get(f"full {mode}")

            def ms(c):
                return "-" if c is None else (c if isinstance(c, str) else f"{c['ms']:.1f}")

            def gib(c):
                return f"{c['peak_gib']:.1f}" if isinstance(c, dict) and c["peak_gib"] is not None else "-"

            ratio = f"{full['ms'] / cca['ms']:.2f}x" if isinstance(cca, dict) and isinstance(full, dict) else "-"
            lines.append(f"| {r['context']} | {mode} | {ms(cca)} | {ms(full)} | {ratio} | {gib(cca)} | {gib(full)} |")
    for backend in ("cca", "full"):
        dh = [f"{r['context']}: {r[backend + '_dh']:.2e} (mean |h| {r[backend + '_h']:.2e})" for r in rows
              if backend + "_dh" in r]
        if dh:
            lines.append(f"{'' if backend == 'full' else chr(10)}{backend}, chunks against one pass, mean |dh| of the "
                         f"last hidden states: {', '.join(dh)}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
