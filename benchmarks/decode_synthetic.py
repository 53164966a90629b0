"""SECONDARY (synthetic caches, the first releases' model class): decode latency and memory, CCA compressed cache vs
full attention (SDPA + DynamicCache, backend ``full``). What users run is ``benchmarks/decode.py`` (real prefill, then
``generate()`` on the exported class); this one isolates the per-step work at a given cache size.

Llama-3.1-8B-shaped model (32 layers, hidden 4096, 32 q / 8 kv heads, hd 128, MLP 14336, vocab 128256),
random weights, bf16, one GPU. Contexts 8K/32K/128K.

Cache state: NOT prefilled. Both caches are constructed directly with random tensors of the shapes a
prefill of ``L`` tokens leaves (full: K/V of L positions per layer in a DynamicCache; CCA: L/g core
tokens, an s+g-1 slot ring, the g-slot pre-RoPE ring, counts = L), so every decode step does exactly the
memory traffic and work of a step at context L. (Prefill correctness is covered by tests/modeling/test_cache_cca.py.)

Per-token latency = mean over timed steps of one ``forward`` of one new token (CUDA events), after warm-up.
``attn layer``: one CCAAttention module (projections included) with its layer's cache.
``max batch @128K``: largest batch of a tried ladder whose cache fill + one decode step runs without OOM.

    python benchmarks/decode_synthetic.py --out benchmarks/results/decode-h200
"""

import argparse
import csv
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cca_convert.modeling import cache_cca as cache_mod  # noqa: E402
from cca_convert.modeling.attention_hooks import CACHE_ARG  # noqa: E402
from tests.legacy import configuration_cca as cc  # noqa: E402  (the first releases' class, kept as a test reference)
from tests.legacy import modeling_cca as mc  # noqa: E402

BF16 = torch.bfloat16
DEV = "cuda"


def make_config(backend, layers, g, s, pooling):
    llama = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=140000,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    return cc.CCAConfig(**llama.to_dict(), group_size=g, local_window=s, pooling=pooling, attn_backend=backend)


def fill_full(cfg, bsz, ctx, layers):
    cache = transformers.DynamicCache(config=cfg)
    for i in range(layers):
        k = torch.randn(bsz, cfg.num_key_value_heads, ctx, cfg.head_dim, device=DEV, dtype=BF16)
        cache.update(k, torch.randn_like(k), i)
        del k
    return cache


def fill_cca(cfg, bsz, ctx, layers):
    cache = cache_mod.CCACache(cfg)
    g, s, d, n_kv = cfg.group_size, cfg.local_window, cfg.head_dim, cfg.num_key_value_heads
    core_heads = cfg.num_attention_heads if cfg.pooling == "query" else n_kv
    for layer in cache.layers[:layers]:
        layer.core_k = torch.randn(bsz, core_heads, ctx // g, d, device=DEV, dtype=BF16)
        layer.core_v = torch.randn_like(layer.core_k)
        layer.win_k = torch.randn(bsz, n_kv, s + g - 1, d, device=DEV, dtype=BF16)
        layer.win_v = torch.randn_like(layer.win_k)
        layer.grp_k = torch.randn(bsz, n_kv, g, d, device=DEV, dtype=BF16)
        layer.mid_cos = torch.ones(bsz, d, device=DEV, dtype=BF16)
        layer.mid_sin = torch.zeros(bsz, d, device=DEV, dtype=BF16)
        layer.seen = torch.full((bsz,), ctx, device=DEV, dtype=torch.long)
        layer.cols = layer.max_seen = ctx
    return cache


def timed(step, warmup, iters):
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        step(warmup + i)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def use_backend(model, backend):
    """``full``: SDPA as PyTorch dispatches it (cuDNN attention on H100/H200 with torch 2.11, which plans a new
    cuDNN graph whenever the key length changes, i.e. every decoding step); ``full-nocudnn``: same, cuDNN SDPA off."""
    model.config.attn_backend = "full" if backend.startswith("full") else backend
    torch.backends.cuda.enable_cudnn_sdp(backend != "full-nocudnn")


def bench_model(model, backend, bsz, ctx, layers, warmup, iters):
    use_backend(model, backend)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    full = backend.startswith("full")
    cache = (fill_full if full else fill_cca)(model.config, bsz, ctx, layers)
    cache_gib = (sum(layer.keys.numel() * 2 * 2 for layer in cache.layers) if full else cache.nbytes()) / 2**30
    ids = torch.randint(0, model.config.vocab_size, (bsz, 1), device=DEV)

    def step(i):
        pos = torch.full((bsz, 1), ctx + i, device=DEV)
        model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1, **{CACHE_ARG: cache})

    with torch.no_grad():
        ms = timed(step, warmup, iters)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del cache
    return ms, peak, cache_gib


def bench_layer(model, backend, bsz, ctx, warmup, iters):
    use_backend(model, backend)
    attn = model.model.layers[0].self_attn
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cache = (fill_full if backend.startswith("full") else fill_cca)(model.config, bsz, ctx, 1)
    hidden = torch.randn(bsz, 1, model.config.hidden_size, device=DEV, dtype=BF16)

    def step(i):
        pos = torch.full((bsz, 1), ctx + i, device=DEV)
        attn(hidden, model.model.rotary_emb(hidden, pos), None, cache)

    with torch.no_grad():
        ms = timed(step, warmup, iters)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del cache
    return ms, peak


def profile_steps(model, ctx, bsz):
    for backend in ("full", "full-nocudnn", "auto"):
        use_backend(model, backend)
        attn = model.model.layers[0].self_attn
        cache = (fill_full if backend.startswith("full") else fill_cca)(model.config, bsz, ctx, 1)
        hidden = torch.randn(bsz, 1, model.config.hidden_size, device=DEV, dtype=BF16)
        with torch.no_grad():
            for i in range(5):
                attn(hidden, model.model.rotary_emb(hidden, torch.full((bsz, 1), ctx + i, device=DEV)), None, cache)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
                for i in range(5, 10):
                    attn(hidden, model.model.rotary_emb(hidden, torch.full((bsz, 1), ctx + i, device=DEV)), None, cache)
                torch.cuda.synchronize()
        print(f"--- {backend} ctx={ctx} batch={bsz} (5 steps)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=40))
        del cache
        torch.cuda.empty_cache()


def max_batch(model, backend, ctx, ladder, layers):
    best = 0
    for bsz in ladder:
        try:
            ms, peak, _ = bench_model(model, backend, bsz, ctx, layers, warmup=1, iters=1)
            best = bsz
            print(f"  max-batch probe {backend:4s} ctx={ctx} batch={bsz}: ok ({ms:.1f} ms/token, peak {peak:.1f} GiB)", flush=True)
        except torch.OutOfMemoryError:
            print(f"  max-batch probe {backend:4s} ctx={ctx} batch={bsz}: OOM", flush=True)
            torch.cuda.empty_cache()
            break
    torch.cuda.empty_cache()
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/decode")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--local-window", type=int, default=1024)
    ap.add_argument("--pooling", default="kv")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--full-ladder", default="4,6,7,8,16")
    ap.add_argument("--cca-ladder", default="16,32,64,96,128")
    ap.add_argument("--profile", action="store_true", help="torch.profiler of one attention-layer step per backend")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    t0 = time.time()
    cfg = make_config("auto", args.layers, args.group_size, args.local_window, args.pooling)
    torch.set_default_dtype(BF16)
    with torch.device(DEV):
        model = mc.CCAForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, built in {time.time() - t0:.0f}s; "
          f"g={cfg.group_size} s={cfg.local_window} pooling={cfg.pooling}; {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)

    if args.profile:
        profile_steps(model, int(args.contexts.split(",")[-1]), int(args.batches.split(",")[0]))
        return

    rows = []
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    for ctx in contexts:
        for bsz in batches:
            res = {}
            try:
                for backend in ("full", "full-nocudnn", "auto"):
                    lay_ms, lay_peak = bench_layer(model, backend, bsz, ctx, args.warmup, 3 * args.iters)
                    ms, peak, cache_gib = bench_model(model, backend, bsz, ctx, args.layers, args.warmup, args.iters)
                    res[backend] = (lay_ms, lay_peak, ms, peak, cache_gib)
            except Exception:  # keep the rest of the table
                traceback.print_exc()
                torch.cuda.empty_cache()
                continue
            f, n, c = res["full"], res["full-nocudnn"], res["auto"]
            row = dict(
                context=ctx, batch=bsz,
                layer_full_ms=f[0], layer_full_nocudnn_ms=n[0], layer_cca_ms=c[0],
                layer_speedup=f[0] / c[0], layer_speedup_nocudnn=n[0] / c[0],
                model_full_ms=f[2], model_full_nocudnn_ms=n[2], model_cca_ms=c[2],
                model_speedup=f[2] / c[2], model_speedup_nocudnn=n[2] / c[2],
                cache_full_gib=f[4], cache_cca_gib=c[4], peak_full_gib=max(f[3], n[3]), peak_cca_gib=c[3],
            )
            rows.append(row)
            print("  " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    ctx_max = max(contexts)
    mb_full = max_batch(model, "full-nocudnn", ctx_max, [int(x) for x in args.full_ladder.split(",")], args.layers)
    mb_cca = max_batch(model, "auto", ctx_max, [int(x) for x in args.cca_ladder.split(",")], args.layers)

    header = (f"{'context':>7} {'B':>2} | {'layer full/noCuDNN/CCA (ms)':>28} {'x':>13} | "
              f"{'model full/noCuDNN/CCA (ms)':>27} {'x':>11} | {'cache full/CCA GiB':>18} | {'peak full/CCA GiB':>17}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['context']:>7} {r['batch']:>2} | {r['layer_full_ms']:>8.3f} {r['layer_full_nocudnn_ms']:>8.3f} {r['layer_cca_ms']:>8.3f}   "
            f"{r['layer_speedup']:>5.1f}x/{r['layer_speedup_nocudnn']:>5.1f}x | "
            f"{r['model_full_ms']:>8.2f} {r['model_full_nocudnn_ms']:>8.2f} {r['model_cca_ms']:>7.2f}   "
            f"{r['model_speedup']:>4.1f}x/{r['model_speedup_nocudnn']:>4.1f}x | "
            f"{r['cache_full_gib']:>8.2f} {r['cache_cca_gib']:>8.2f} | {r['peak_full_gib']:>8.1f} {r['peak_cca_gib']:>7.1f}"
        )
    lines.append(f"largest batch that fits at context {ctx_max} (ladders full {args.full_ladder}, CCA {args.cca_ladder}): "
                 f"full {mb_full}, CCA {mb_cca}")
    table = "\n".join(lines)
    print("\n" + table)
    with open(os.path.join(args.out, "decode.csv"), "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(args.out, "decode_max_batch.csv"), "w", newline="") as fh:
        fh.write(f"context,backend,max_batch,ladder\n{ctx_max},full,{mb_full},{args.full_ladder.replace(',', ' ')}\n"
                 f"{ctx_max},cca,{mb_cca},{args.cca_ladder.replace(',', ' ')}\n")
    with open(os.path.join(args.out, "decode_table.txt"), "w") as fh:
        fh.write(table + "\n")
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
