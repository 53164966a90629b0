"""Decode in real ``generate()``: the exported CCA model vs stock transformers' full attention, same weights.

What users run: a prompt of L random tokens per row, a real prefill, then ``model.generate()`` with its defaults.
The time of each generated token is read inside that one ``generate()`` call (a logits processor stamps every step;
generate waits for the device once per step, so the stamps keep its period: ``benchmarks/step_clock.py``), and
ms/token is the median step after the first few (which include kernel compilation and, for the compiled baseline,
CUDA-graph capture). ``--sync-steps``: the clock syncs the device at every stamp, as the results before 2026-11-24
did; that adds generate's post-forward host work (sampling, stopping checks) to every step.

Models (Llama-3.1-8B shape, random bf16 weights shared by all rows; ``--smoke``: a tiny one that runs on a CPU):
- ``cca``: the exported class (stock ``LlamaForCausalLM`` + ``CCAModelMixin``, the CLI's defaults g=16, s=1024,
  pooling kv, attn_backend auto) with its own ``CCACache``; on CUDA its one-token steps replay CUDA graphs (the
  default, ``decode_graph.py``) and generate() reads its stopping flag one step late (``decode_graph.defer_stop_checks``).
- ``cca-eager``: the same with ``cca_cuda_graphs=False``: every step launched from Python.
- ``dca``: the DCA export's class (``DCAModelMixin``) on the same weights, with the sizes the CLI gives
  Llama-3.1-8B (c = 131072: C = 98304, w = 16384, temperature off), its ``DCACache``; on CUDA its one-token steps
  replay CUDA graphs (the same mechanism as CCA's). DCA keeps every key: its floor is the full-attention one.
- ``dca-eager``: the same with ``dca_cuda_graphs=False``.
- ``full``: stock ``LlamaForCausalLM``, SDPA, ``DynamicCache``: what ``generate()`` does by default.
- ``full-static``: the same with ``cache_implementation="static"``; on CUDA, transformers then compiles the decode
  step (torch.compile "reduce-overhead": CUDA graphs). Its SDPA gets a mask (the static cache's empty slots), so
  transformers repeats each KV head for its query heads first (``use_gqa_in_sdpa``): a copy of the cache per layer
  and step (1.46 ms of a step at 8K x 1 on an H200). The best full attention this model class offers: #54's fair
  baseline.
- ``full-kernels``: full attention given this package's engineering: the DCA export's class with one chunk holding
  every position (chunk_size = the model's context, local_size 0: every key at its true distance, which is plain
  causal attention) on the same weights, so its decode kernel, one-launch cache writes, few-row products and CUDA-graph
  steps. A ratio to it measures the method, not the software around it.
- ``floor``: the bytes one decode step must read (every weight but the input embedding, plus the cache at context L)
  over the GPU's memory bandwidth (its datasheet's); "% floor" = floor / measured. The "read floor" is the same bytes
  over the bandwidth this GPU reaches in a plain read of 4 GiB (``benchmarks/read_floor.py``, measured at the start
  of the run): what a step would take if it did nothing but read them.

Long prompts are prefilled in chunks (transformers' ``prefill_chunk_size``) for every row, so that batch x context
fits in activation memory: ``--prefill-chunk`` tokens per row, fewer for large batches so that one chunk holds at
most ``--prefill-tokens`` (batch 64: 1024 per row). A cell that runs out of memory prints OOM. The prefill time
(start of generate() to its first token) follows one short generate() per CCA backend that compiled its kernels: a
process's first prompt pays that compilation once, seconds on a fresh machine.

    python benchmarks/decode.py --out benchmarks/results/decode-h200                      # 8K/32K/128K x 1/16/64
    python benchmarks/decode.py --contexts 131072 --batches 64 --backends cca             # one expensive cell
    python benchmarks/decode.py --out D --resume                                          # continue a stopped run
    python benchmarks/decode.py --smoke --device cpu                                      # the code path, tiny
    python benchmarks/decode.py --contexts 131072 --batches 64,256 --backends cca --prefill-rows 1   # shortcut

The first releases' synthetic-cache measurement (caches filled with random tensors, no prefill, one forward per
step) is ``benchmarks/decode_synthetic.py``: a secondary table that isolates the per-step work.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.read_floor import read_bandwidth  # noqa: E402
from benchmarks.results_out import save_results  # noqa: E402
from benchmarks.step_clock import timed_generate  # noqa: E402
from cca_convert import methods, published  # noqa: E402
from cca_convert.families import FAMILIES  # noqa: E402
from cca_convert.kernels.dca_params import default_sizes  # noqa: E402
from cca_convert.modeling import cache_cca as cache_module  # noqa: E402
from cca_convert.modeling.attention_hooks import CACHE_ARG  # noqa: E402

BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # bytes/s, by a substring of the device name
BACKENDS = ("cca", "cca-eager", "dca", "dca-eager", "full", "full-static", "full-kernels")
DCA_TRAINED_CONTEXT = 131072  # Llama-3.1-8B's c: the DCA sizes the CLI derives from it


def configs(args):
    if args.smoke:
        shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    else:
        shape = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    config = transformers.LlamaConfig(**shape, max_position_embeddings=max(args.contexts) + args.new_tokens + 64,
                                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=None, pad_token_id=0)
    config.cca_group_size, config.cca_local_window = args.group_size, args.local_window
    config.cca_pooling, config.cca_attn_backend = "kv", "auto"
    return config


def dca_config(args, whole: bool = False):
    """The DCA export's config: the CLI's sizes for Llama-3.1-8B, or (``whole``) one chunk holding every position."""
    config = configs(args)
    if whole:
        c = chunk = config.max_position_embeddings
        local = 0
    else:
        c = 256 if args.smoke else DCA_TRAINED_CONTEXT
        chunk, local = default_sizes(c)
    config.dual_chunk_attention_config = {"chunk_size": chunk, "local_size": local,
                                          "original_max_position_embeddings": 0}
    config.dca_trained_context = c
    return config


def build(args, dtype):
    """The CCA export's class and stock LlamaForCausalLM, sharing one set of random weights."""
    config = configs(args)
    cls = published.family_class(FAMILIES["llama"], methods.get("cca"))
    torch.set_default_dtype(dtype)
    try:
        with torch.device(args.device):
            torch.manual_seed(0)
            cca = cls(config).eval()
        with torch.device("meta"):
            full = transformers.LlamaForCausalLM(configs(args)).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    full.config._attn_implementation = "sdpa"
    full.load_state_dict(cca.state_dict(), assign=True)  # the same tensors, not a copy
    full.model.rotary_emb = cca.model.rotary_emb  # its inv_freq is a non-persistent buffer
    full.generation_config = transformers.GenerationConfig(pad_token_id=0)
    cca.generation_config = transformers.GenerationConfig(pad_token_id=0)
    return cca, full


def build_dca(args, cca, whole: bool = False):
    """The DCA export's class on ``cca``'s weights (the same tensors); ``whole``: the full-kernels model."""
    with torch.device("meta"):
        dca = published.family_class(FAMILIES["llama"], methods.get("dca"))(dca_config(args, whole)).eval()
    dca.load_state_dict(cca.state_dict(), assign=True)
    dca.model.rotary_emb = cca.model.rotary_emb
    for module in dca.modules():  # (its attention modules hold the rotary module they read)
        if hasattr(module, "_dca_rotary"):
            object.__setattr__(module, "_dca_rotary", cca.model.rotary_emb)
    dca.generation_config = transformers.GenerationConfig(pad_token_id=0)
    return dca


def model_for(backend, cca, dca, full, whole=None):
    """The model a backend runs, its CUDA-graph switch set."""
    if backend == "full-kernels":
        whole.config.dca_cuda_graphs = True
        return whole
    for method, model in (("cca", cca), ("dca", dca)):
        if backend.startswith(method):
            setattr(model.config, f"{method}_cuda_graphs", backend == method)
            return model
    return full


def describe(name, model, dtype, t0) -> str:
    """The run's first line: device, versions, model size and CCA settings (the script adds its own)."""
    return (f"{name}, torch {torch.__version__}, transformers {transformers.__version__}; "
            f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters ({dtype}), "
            f"g={model.config.cca_group_size} s={model.config.cca_local_window}; built in {time.time() - t0:.0f}s")


def cache_size(model, backend, context, batch) -> int:
    """Bytes of a backend's cache at ``context``: CCA's compressed one, or every key and value (DCA, full)."""
    cfg = model.config
    cache_cca, cache_full = cache_module.cache_bytes(
        context, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
        cfg.cca_group_size, cfg.cca_local_window, cfg.cca_pooling, model.dtype.itemsize, batch)
    return cache_cca if backend.startswith("cca") else cache_full


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def floor_ms(model, backend, context, batch, bandwidth) -> float:
    embedding = model.get_input_embeddings().weight
    weights = weight_bytes(model) - embedding.numel() * embedding.element_size()  # a step reads one row of it
    return (weights + cache_size(model, backend, context, batch)) / bandwidth * 1e3


def no_room(model, backend, context, batch, memory) -> str | None:
    """Why a cell cannot run in ``memory`` bytes: the weights and the cache at ``context`` alone exceed them (a
    prefill would run for minutes before running out of memory); None where they fit."""
    need = weight_bytes(model) + cache_size(model, backend, context, batch)
    if memory is not None and need > memory:
        return f"no room ({need / 2**30:.0f} GiB > {memory / 2**30:.0f})"
    return None


def prefill_chunk(args, batch: int) -> int:
    """Tokens per row in one prefill chunk: ``--prefill-chunk``, fewer where ``batch`` rows would pass
    ``--prefill-tokens`` (generate()'s chunk activations grow with batch x chunk)."""
    return min(args.prefill_chunk, max(1, args.prefill_tokens // batch))


def warm_up(model, backend, args):
    """One generate() whose prompt is two of batch 1's chunks (where the contexts reach that far), so that the cells'
    prefill times do not count the one-time Triton compilation of CCA's prefill and chunk kernels. (Triton compiles a
    kernel again for integer arguments of another divisibility by 16, e.g. a core capacity: a cell may still pay one.)"""
    chunk = prefill_chunk(args, 1)
    ids = torch.randint(3, model.config.vocab_size, (1, min(2 * chunk, max(args.contexts))), device=args.device)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                       prefill_chunk_size=chunk)


def run_cell(model, backend, context, batch, args) -> dict:
    device = torch.device(args.device)
    gen = torch.Generator(device="cpu").manual_seed(context + batch)
    ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=gen).to(device)
    kwargs = {"prefill_chunk_size": prefill_chunk(args, batch)}
    if backend == "full-static":
        kwargs["cache_implementation"] = "static"
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    repeats = batch // args.prefill_rows if args.prefill_rows and batch > args.prefill_rows else 1
    if repeats > 1:  # the shortcut: a real prefill of the first rows, their cache rows repeated to the batch
        with torch.no_grad():
            out = model.generate(ids[: args.prefill_rows], attention_mask=torch.ones_like(ids[: args.prefill_rows]),
                                 max_new_tokens=1, do_sample=False, return_dict_in_generate=True, **kwargs)
        kwargs[CACHE_ARG] = getattr(out, CACHE_ARG)
        del kwargs["prefill_chunk_size"]  # (transformers <= 5.17's chunked prefill would feed the cached prompt again)
        kwargs[CACHE_ARG].batch_repeat_interleave(repeats)
        ids = out.sequences.repeat_interleave(repeats, 0)  # the prompt (cached) and its first token (the next step)
        del out
    cell = timed_generate(model, ids, args.new_tokens, args.skip, args.sync_steps, **kwargs)
    cell["prefilled_rows"] = batch // repeats
    cell["tokens_per_s"] = batch / cell["ms_per_token"] * 1e3
    cell["prefill_chunk"] = prefill_chunk(args, batch)
    cell["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return cell


def release(model):
    """Free what a cell leaves on the device before the next one: transformers' compiled step for a static cache
    (the memory pool of its CUDA graphs keeps the cache it captured: 16 GiB at 8K x 16) and the allocator's cache."""
    if hasattr(model, "_compiled_call"):
        del model._compiled_call
        torch._dynamo.reset()  # (this also drops the CUDA-graph trees' pools)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def table(rows, bandwidth_name, read_name=None) -> str:
    lines = [f"| L | batch | {' | '.join(f'{b} ms/token' for b in BACKENDS)} | CCA floor ms (% floor) | "
             f"full floor ms (full-static % floor) | CCA vs full-static | CCA vs full | CCA-eager vs full | "
             f"CCA tokens/s | full floor ms (DCA % floor) | DCA vs full-static | CCA vs full-kernels | "
             f"DCA vs full-kernels | full read floor ms (DCA % of it) |",
             "|" + " --- |" * (len(BACKENDS) + 13)]
    for r in rows:
        cells = r["cells"]

        def ms(b):
            c = cells.get(b)
            return "-" if c is None else (c if isinstance(c, str) else f"{c['ms_per_token']:.2f}")

        def ratio(b, ours="cca"):
            a, c = cells.get(ours), cells.get(b)
            if isinstance(a, dict) and isinstance(c, dict):
                return f"{c['ms_per_token'] / a['ms_per_token']:.2f}x"
            return "-"

        def pct(b, floor):
            c = cells.get(b)
            return f"{floor:.2f} ({100 * floor / c['ms_per_token']:.0f}%)" if isinstance(c, dict) else f"{floor:.2f}"

        cca = cells.get("cca")
        read = pct("dca", r["floor_read_ms"]) if r.get("floor_read_ms") else "-"
        dca = (f"{pct('dca', r['floor_full_ms'])} | {ratio('full-static', 'dca')} | {ratio('full-kernels')} | "
               f"{ratio('full-kernels', 'dca')} | {read}")
        shortcut = next((c["prefilled_rows"] for c in cells.values() if isinstance(c, dict)
                         and c.get("prefilled_rows", r["batch"]) < r["batch"]), None)
        batch = f"{r['batch']} ({shortcut} prefilled, repeated)" if shortcut else r["batch"]
        lines.append(f"| {r['context']} | {batch} | {' | '.join(ms(b) for b in BACKENDS)} | "
                     f"{pct('cca', r['floor_cca_ms'])} | {pct('full-static', r['floor_full_ms'])} | "
                     f"{ratio('full-static')} | {ratio('full')} | {ratio('full', 'cca-eager')} | "
                     f"{cca['tokens_per_s']:.0f} | {dca} |" if isinstance(cca, dict) else
                     f"| {r['context']} | {batch} | {' | '.join(ms(b) for b in BACKENDS)} | "
                     f"{r['floor_cca_ms']:.2f} | {r['floor_full_ms']:.2f} | - | - | {ratio('full', 'cca-eager')} | - | "
                     f"{dca} |")
    lines.append(f"\nfloor: bytes read per step / {bandwidth_name} (DCA keeps every key: the full floor)"
                 + (f"; read floor: the same bytes / {read_name}, this GPU's plain read of 4 GiB" if read_name else "")
                 + "; ratios > 1x: the method is faster")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--contexts", type=ints, default=[8192, 32768, 131072])
    ap.add_argument("--batches", type=ints, default=[1, 16, 64])
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--skip", type=int, default=4, help="first steps left out of the median (compile, capture)")
    ap.add_argument("--prefill-chunk", type=int, default=8192, help="prefill tokens per row and chunk")
    ap.add_argument("--prefill-tokens", type=int, default=65536, help="most tokens (rows x chunk) in one chunk")
    ap.add_argument("--prefill-rows", type=int, default=0,
                    help="a shortcut for batches whose real prefill takes too long (128K x 64: ~11 min): prefill "
                         "this many rows, repeat their cache rows to the batch (the decode steps read what a real "
                         "prefill leaves; the table marks such rows)")
    ap.add_argument("--sync-steps", action="store_true",
                    help="the step clock syncs the device every step (the clock of results before 2026-11-24)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--local-window", type=int, default=1024)
    ap.add_argument("--bandwidth", type=float, default=None, help="bytes/s (default: by device name)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--memory-gib", type=float, default=None,
                    help="device memory a cell's weights and cache must fit in, else it is marked 'no room' without "
                         "running (default: the CUDA device's total memory)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model (any device): the code path, not the numbers")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for decode.md / decode.json, written again after every cell (a run stopped by a time "
                         "limit keeps what it measured)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run whose decode.json is in --out: its measured cells are kept, the others "
                         "(and those that ran out of memory) run (same settings and GPU required; the table says how "
                         "many processes measured it)")
    args = ap.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        ap.error(f"unknown backend(s) {unknown}; choose from {BACKENDS}")
    if args.prefill_rows:
        if "full-static" in backends:
            ap.error("--prefill-rows hands generate() a filled cache; full-static builds its own: leave it out")
        uneven = [b for b in args.batches if b > args.prefill_rows and b % args.prefill_rows]
        if args.prefill_rows < 0 or uneven:
            ap.error(f"--prefill-rows must be positive and divide every larger batch (not {uneven})")
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth = args.bandwidth or next((bw for key, bw in BANDWIDTH.items() if key in name), None)
    if bandwidth is None:
        if not args.smoke:
            ap.error(f"no memory bandwidth known for {name!r}: pass --bandwidth BYTES_PER_S")
        bandwidth = 1e11  # a smoke run's floor is not a claim
    read_bw = read_bandwidth(device) if device.type == "cuda" and not args.smoke else None
    read_name = f"{read_bw / 1e12:.2f} TB/s" if read_bw else None
    if read_bw:
        print(f"plain read of 4 GiB: {read_name} ({read_bw / bandwidth:.0%} of the floor's {bandwidth / 1e12:.2f} "
              "TB/s)", flush=True)
    kept, processes = {}, 0
    if args.resume:
        kept, processes = resumed(ap, args, name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.time()
    cca, full = build(args, dtype)
    dca = build_dca(args, cca) if any(b.startswith("dca") for b in backends) else None
    whole = build_dca(args, cca, whole=True) if "full-kernels" in backends else None
    # the table's rows: the resumed run's (all of them, measured or not here) and this run's grid, in order
    grid = {(c, n): {"context": c, "batch": n, "cells": {}} for c in args.contexts for n in args.batches}
    by_key = {**{k: {**r, "cells": dict(r["cells"])} for k, r in kept.items()},
              **{k: r for k, r in grid.items() if k not in kept}}
    rows = [by_key[k] for k in sorted(by_key)]
    for r in rows:
        r.update(floor_cca_ms=floor_ms(cca, "cca", r["context"], r["batch"], bandwidth),
                 floor_full_ms=floor_ms(cca, "full", r["context"], r["batch"], bandwidth),
                 floor_read_ms=floor_ms(cca, "full", r["context"], r["batch"], read_bw) if read_bw else None)
    todo = [(k, b) for k in grid for b in backends if by_key[k]["cells"].get(b, "OOM") == "OOM"]  # OOM: try again
    for k, b in todo:
        by_key[k]["cells"].pop(b, None)
    processes += 1 if todo else 0
    head = (f"{describe(name, cca, dtype, t0)}; {args.new_tokens} new tokens, prefill chunks of {args.prefill_chunk} "
            f"tokens per row, at most {args.prefill_tokens} per chunk; "
            f"step clock {'synced every step' if args.sync_steps else 'unsynced'}"
            + (f"; cells measured by {processes} processes (--resume), each on a {name}" if processes > 1 else ""))
    print(head, flush=True)
    cells = sum(len(r["cells"]) for r in rows) + len(todo)
    for backend in dict.fromkeys(b for _, b in todo):
        if backend.startswith(("cca", "dca")) or backend == "full-kernels":
            warm_up(model_for(backend, cca, dca, full, whole), backend, args)

    def save(complete: bool):
        if not args.out:
            return
        done = sum(len(r["cells"]) for r in rows)
        text = head + "\n\n" + table(rows, f"{bandwidth / 1e12:.2f} TB/s", read_name)
        if not complete:
            text += f"\n\n(partial: {done} of {cells} cells so far)"
        save_results(args.out, "decode", text, {"device": name, "rows": rows, "settings": settings(args, name),
                                                "processes": processes, "complete": complete,
                                                "read_bandwidth": read_bw})

    memory = (args.memory_gib * 2**30 if args.memory_gib is not None else
              torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None)
    for (context, batch), backend in todo:
        row = by_key[(context, batch)]
        model = model_for(backend, cca, dca, full, whole)
        why = no_room(model, backend, context, batch, memory)
        if why:
            row["cells"][backend] = why
            print(f"  L={context} batch={batch} {backend}: {why}", flush=True)
            save(complete=False)
            continue
        try:
            row["cells"][backend] = run_cell(model, backend, context, batch, args)
            cell = row["cells"][backend]
            print(f"  L={context} batch={batch} {backend}: {cell['ms_per_token']:.2f} ms/token "
                  f"(prefill {cell['prefill_s']:.1f}s in chunks of {prefill_chunk(args, batch)}"
                  + (f", {cell['graph_replays']} steps replayed from its CUDA graphs" if model is not full else
                     ", transformers' own steps")
                  + (f", peak {cell['peak_gib']:.1f} GiB" if cell["peak_gib"] else "")
                  + (f", {cell['prefilled_rows']} rows prefilled" if cell["prefilled_rows"] < batch else "")
                  + ")", flush=True)
        except torch.OutOfMemoryError:
            row["cells"][backend] = "OOM"
            print(f"  L={context} batch={batch} {backend}: OOM", flush=True)
        release(model)
        save(complete=False)
    if kept:
        print(f"  kept from the run resumed: {sum(c != 'OOM' for r in kept.values() for c in r['cells'].values())} "
              "cells", flush=True)
    print("\n" + head + "\n\n" + table(rows, f"{bandwidth / 1e12:.2f} TB/s", read_name))
    save(complete=True)
    return 0


SETTINGS = ("new_tokens", "skip", "prefill_chunk", "prefill_tokens", "prefill_rows", "sync_steps", "layers",
            "group_size", "local_window", "smoke")


def settings(args, device_name: str) -> dict:
    """What a cell's numbers depend on besides its context, batch and backend."""
    return {"device": device_name, **{k: getattr(args, k) for k in SETTINGS}}


def resumed(ap, args, device_name: str):
    """The rows of the run in ``--out`` to keep, keyed by (context, batch), and the count of processes that measured
    them; a clear error where there is nothing to resume or it was measured otherwise."""
    path = args.out / "decode.json" if args.out else None
    if path is None or not path.is_file():
        ap.error(f"--resume continues the run whose decode.json is in --out; found none ({path})")
    try:
        earlier = json.loads(path.read_text())
        mine, theirs = settings(args, device_name), earlier["settings"]
        rows = {(r["context"], r["batch"]): r for r in earlier["rows"]}
    except (ValueError, KeyError, TypeError) as exc:
        ap.error(f"--resume: {path} is not a decode.json this script wrote with --out ({exc!r})")
    differ = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
    if differ:
        ap.error(f"--resume: {path} was measured with other settings (theirs, now): {differ}; rerun with those, "
                 "or write to a new --out")
    return rows, earlier.get("processes", 1)


if __name__ == "__main__":
    raise SystemExit(main())
