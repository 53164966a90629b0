"""Benchmark: DCA attention (the fused kernel: Triton, or Gluon for prefill on Hopper) vs causal SDPA and a
ChunkLlama-style three-call merge.

Llama-3.1-8B attention layout (32 query heads, 8 KV heads, head_dim 128), bf16, batch 1. DCA sizes: ChunkLlama's
default for an 8K-trained Llama 3 (c = 8192: chunk_size C = 6144, local_size w = 1024, chunk length s = 5120).
  python benchmarks/dca.py --out benchmarks/results                  # prefill 32K/128K, decode 32K/128K
  python benchmarks/dca.py --model --model-lengths 32768,131072      # + whole-model generate() decode
  python benchmarks/dca.py --decode-sweep --decode-lengths 8192,32768,131072 --decode-batches 1,16   # decode tiles

Conventions
- Median of triton.testing.do_bench, one forward call. DCA has the same FLOPs as causal attention (every query sees
  every earlier key); useful TFLOP/s = L(L+1)/2 entries x 4d x heads / time for every method.
- "DCA" = what the model runs per layer: rotate the pass's keys once at j % s (a small Triton kernel), then the
  fused kernel, which rotates the queries itself; both read the model's cos/sin table of positions 0..C.
  "DCA kernel" = the fused kernel alone on keys already rotated (a cache's). On a Hopper GPU with triton 3.6 both
  run the Gluon kernel (``dca_gluon``) by default; "DCA kernel (Triton)" is the Triton kernel it replaces there.
- SDPA (cuDNN, flash) runs on already-rotated q/k (RoPE not timed), ``enable_gqa=True`` (no repeat_kv copy),
  ``is_causal`` (prefill) or one query over the whole cache (decode). The ratio is against the faster of the two.
- "3-call merge" = ChunkLlama / vLLM's formulation in PyTorch: per chunk one causal flash call (intra) and two
  non-causal ones (succ, inter) through ``aten._scaled_dot_product_flash_attention`` (which returns the LSE), on
  repeat_kv'd keys as ChunkLlama does, then an fp32 LSE merge; its query/key rotations are timed too.
- Decode (attention only), per layer (x32 for a model), timed inside CUDA graphs on every side (as a captured decode
  step runs; ``do_bench_cudagraph``): one new query per row at position L-1 against a cache of L keys. "DCA step" is
  what a captured DCA step runs (the new key rotated and written into the cache, the kernel over the cache's whole
  buffers, the split merge); SDPA has no cache write and no RoPE. Each timed call runs every side over several
  layers' caches, one after another (enough to hold 4x the L2, ``--decode-layers``), and the time is divided by
  their number: as in a model step, each layer's keys come from HBM. A cache replayed alone stays in the L2 when it
  fits (8K x 1) and times the L2; the records before 2026-12-01 were taken that way. "K/V read" is the floor under
  every side: a plain read of the same keys and values (``benchmarks/read_floor.py``),
  and the last two columns each kernel's share of that read speed.
- ``--model``: Llama-3.1-8B-shaped model with random bf16 weights (32 layers), a real prefill then ``generate()``:
  ms/token = the median step time inside that one generate() call (``benchmarks/step_clock.py``), DCA model vs the
  same weights with transformers' SDPA attention (both with their dynamic caches; no static cache or CUDA graph
  on either side).
"""

import argparse
import functools
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.read_floor import fastest_read  # noqa: E402
from benchmarks.results_out import save_results  # noqa: E402
from benchmarks.step_clock import timed_generate  # noqa: E402
from cca_convert import methods, published  # noqa: E402
from cca_convert.kernels import dca_reference as ref  # noqa: E402
from cca_convert.kernels import dca_triton as tri  # noqa: E402

H, HKV, D = 32, 8, 128
CHUNK, LOCAL = 6144, 1024


def measure(fn, warmup=5, rep=30):
    try:
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return float("nan")


def inputs(L, lq=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lq = lq or L
    q = torch.randn(1, H, lq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, HKV, L, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, HKV, L, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v


@functools.lru_cache(maxsize=None)
def inv_freq():
    return 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))


def dca_call(q, k, v, L, lq):
    """(what a layer runs: rotate the pass's new keys once + the kernel over the cache; the kernel alone)."""
    qpos = torch.arange(L - lq, L, device="cuda")[None]
    kpos = torch.arange(L, device="cuda")[None]
    kstart = torch.zeros(1, dtype=torch.long, device="cuda")
    scale = D ** -0.5
    kr = ref.rotate_keys(k, kpos, CHUNK, LOCAL, inv_freq()).to(k.dtype)
    table = tri.rope_table(inv_freq(), CHUNK)  # the model computes it once, not per layer

    def full():
        new = tri.rotate_keys_triton(k[:, :, L - lq:], qpos, CHUNK, LOCAL, table)
        keys = new if lq == L else kr  # decode: the cache already holds the older keys rotated
        return tri.dca_attention_triton(q, keys, v, qpos, kstart, CHUNK, LOCAL, inv_freq(), scale, table=table)

    def kernel_only(use_gluon=None):
        return tri.dca_attention_triton(q, kr, v, qpos, kstart, CHUNK, LOCAL, inv_freq(), scale, table=table,
                                        use_gluon=use_gluon)

    return full, kernel_only


def three_call_merge(q, k, v, L):
    """ChunkLlama / vLLM's DCA prefill: 3 flash calls per chunk (1 for chunk 0, 2 for chunk 1) + an fp32 LSE merge."""
    s = CHUNK - LOCAL
    scale = D ** -0.5
    pos = torch.arange(L, device="cuda")[None]
    o = pos % s

    def run():
        rot = lambda x, p: ref.rope_at(x, p[:, None].expand(-1, x.shape[1], -1), inv_freq()).to(x.dtype)  # noqa: E731
        kk = rot(k, o).repeat_interleave(H // HKV, 1)
        vv = v.repeat_interleave(H // HKV, 1)
        q_intra, q_succ = rot(q, o), rot(q, torch.clamp(o + s, max=CHUNK))
        q_inter = rot(q, torch.full_like(o, min(2 * s - 1, CHUNK)))
        out = torch.empty_like(q)
        for n in range(math.ceil(L / s)):
            a, b = n * s, min((n + 1) * s, L)
            parts = [torch.ops.aten._scaled_dot_product_flash_attention(
                q_intra[:, :, a:b], kk[:, :, a:b], vv[:, :, a:b], 0.0, True, False, scale=scale)]
            if n >= 1:
                parts.append(torch.ops.aten._scaled_dot_product_flash_attention(
                    q_succ[:, :, a:b], kk[:, :, a - s:a], vv[:, :, a - s:a], 0.0, False, False, scale=scale))
            if n >= 2:
                parts.append(torch.ops.aten._scaled_dot_product_flash_attention(
                    q_inter[:, :, a:b], kk[:, :, :a - s], vv[:, :, :a - s], 0.0, False, False, scale=scale))
            lse = torch.stack([p[1] for p in parts])  # (parts, B, H, rows) fp32
            w = torch.softmax(lse, 0)
            out[:, :, a:b] = sum(wi[..., None] * p[0].float() for wi, p in zip(w, parts)).to(q.dtype)
        return out

    return run


def sdpa_calls(q, kv, causal):
    """SDPA by backend over each (keys, values) of ``kv`` (layers' caches) one after another, as one call."""
    out = {}
    for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel(backend):
                for k, v in kv:
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            return o
        out[name] = call
    return out


def check_agreement(L=20000):
    """The three implementations compute the same DCA (bf16): max |difference| vs the fp32 PyTorch twin."""
    q, k, v = inputs(L)
    kpos = torch.arange(L, device="cuda")[None]
    valid = torch.ones(1, L, dtype=torch.bool, device="cuda")
    last = slice(L - 256, L)  # the twin materialises scores: check the last 256 queries (all three parts)
    want = ref.dca_attention_blocked(q[:, :, last].float(), k.float(), v.float(), kpos[:, last], kpos, valid,
                                     valid[:, last], CHUNK, LOCAL, inv_freq(), D ** -0.5)
    full, kernel = dca_call(q, k, v, L, L)
    got = {"DCA kernel": full()[:, :, last].float(), "DCA kernel (Triton)": kernel(use_gluon=False)[:, :, last].float(),
           "3-call merge": three_call_merge(q, k, v, L)()[:, :, last].float()}
    return {name: float((x - want).abs().max()) for name, x in got.items()}


SWEEP = [(128, 64, 8, 3, 64), (128, 64, 8, 3, 128), (128, 128, 8, 3, 128), (64, 64, 4, 3, 64), (128, 64, 4, 3, 64),
         (128, 32, 4, 4, 128), (64, 128, 4, 3, 64), (128, 64, 8, 4, 128)]


def sweep(L=32768):
    """Time the Triton kernel's prefill tile configs (BLOCK_M, BLOCK_N, warps, stages, rows per head); keep the
    fastest (the Gluon kernel, where it serves, has its own)."""
    q, k, v = inputs(L)
    _, gluon_or_triton = dca_call(q, k, v, L, L)
    kernel = functools.partial(gluon_or_triton, use_gluon=False)
    best = None
    for cfg in SWEEP:
        tri._CONFIGS["prefill"], tri._MIN_ROWS_PER_HEAD = cfg[:4], cfg[4]
        try:
            ms = measure(kernel)
        except Exception as exc:  # e.g. out of shared memory
            print(f"  {cfg}: {type(exc).__name__}", flush=True)
            continue
        print(f"  {cfg}: {ms:.2f} ms", flush=True)
        if best is None or ms < best[0]:
            best = (ms, cfg)
    tri._CONFIGS["prefill"], tri._MIN_ROWS_PER_HEAD = best[1][:4], best[1][4]
    print(f"fastest at L={L}: {best[1]} ({best[0]:.2f} ms)", flush=True)
    return best[1]


def prefill_rows(lengths):
    rows = []
    for L in lengths:
        q, k, v = inputs(L)
        full, kernel = dca_call(q, k, v, L, L)
        kr = ref.rotate_keys(k, torch.arange(L, device="cuda")[None], CHUNK, LOCAL, inv_freq()).to(k.dtype)
        qr = q  # SDPA's speed does not depend on which rotation its inputs carry (RoPE not timed)
        times = {"DCA": measure(full), "DCA kernel": measure(kernel)}
        if tri.dca_gluon is not None and tri.dca_gluon.applies(q, kr, v, D // 2, 1):  # the kernel it replaces, beside
            times["DCA kernel (Triton)"] = measure(lambda: kernel(use_gluon=False))
        times.update({f"SDPA {n}": measure(fn) for n, fn in sdpa_calls(qr, [(kr, v)], True).items()})
        times["3-call merge"] = measure(three_call_merge(q, k, v, L), warmup=2, rep=10)
        flops = L * (L + 1) / 2 * 4 * D * H
        rows.append({"L": L, "ms": times, "tflops": {n: flops / t / 1e9 for n, t in times.items()}})
        del q, k, v, kr, qr
        torch.cuda.empty_cache()
    return rows


def measure_graph(fn, rep=100):
    """Median ms of ``fn`` replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``): the device time of a
    decode step's launches without the host's, as a captured decode step runs them."""
    try:
        fn()  # compile outside the capture
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return float("nan")


def cache_layers(L, batch, spare=1024, requested=0, l2_bytes=None):
    """How many layers' caches a decode measurement cycles through: ``requested``, or (0) enough that together they
    hold at least 4x the GPU's L2 (at most 32, a Llama-3.1-8B's layers). A model step reads each layer's cache once,
    after the other layers' weights and caches have gone through the L2, so its keys come from HBM; one cache replayed
    alone stays in the L2 when it fits (8K x 1: 34 MB of a 60 MB L2) and times the L2, not a model's step."""
    if requested:
        return requested
    per_layer = 2 * batch * HKV * (L + spare) * D * 2  # keys and values, bf16
    if l2_bytes is None:
        l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(32, math.ceil(4 * l2_bytes / per_layer)))


def decode_calls(L, batch, spare=1024, layers=1):
    """One decode step's attention, batch ``batch`` at position L-1 of an L-token cache, over ``layers`` layers'
    caches one after another (each call times them all; the callers divide by ``layers``):
    - "DCA step": what a captured DCA decode step runs per layer: the new key rotated and written into the cache's
      buffers with its value, position and validity (one launch), then the kernel over the whole buffers (``spare``
      columns of room past L), each row's keys ending at its query (``split_by_span``), and the split merge;
    - "DCA kernel": the kernel alone on an L-column cache (splits of the L columns), and the merge;
    - "SDPA cuDNN" / "SDPA flash": one query over L rotated keys (no cache write, no RoPE)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    shape = (batch, HKV, L + spare, D)
    posbuf = torch.arange(L + spare, device="cuda").expand(batch, -1).contiguous()
    validbuf = (posbuf < L).contiguous()
    caches = []
    for _ in range(layers):
        kbuf = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        vbuf = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        kbuf[:, :, L:] = 0
        vbuf[:, :, L:] = 0
        caches.append((kbuf, vbuf, [kbuf, vbuf, posbuf, validbuf], vbuf[:, :, L - 1:L].clone()))
    q = torch.randn(batch, H, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_new = torch.randn(batch, HKV, 1, D, device="cuda", dtype=torch.float32, generator=gen)
    qpos = torch.full((batch, 1), L - 1, device="cuda")
    qpos32, valid = qpos.to(torch.int32), torch.ones(batch, 1, dtype=torch.bool, device="cuda")
    columns = torch.tensor([L - 1], device="cuda")
    kstart = torch.zeros(batch, dtype=torch.int32, device="cuda")
    table = tri.rope_table(inv_freq(), CHUNK)
    scale = D ** -0.5

    def step():
        for kbuf, vbuf, buffers, v_new in caches:
            tri.append_rotated_triton(k_new, v_new, qpos, valid, columns, CHUNK, LOCAL, table, buffers)
            out = tri.dca_attention_triton(q, kbuf, vbuf, qpos32, kstart, CHUNK, LOCAL, inv_freq(), scale,
                                           table=table, split_by_span=True)
        return out

    views = [(kbuf[:, :, :L], vbuf[:, :, :L]) for kbuf, vbuf, _, _ in caches]

    def kernel():
        for k, v in views:
            out = tri.dca_attention_triton(q, k, v, qpos32, kstart, CHUNK, LOCAL, inv_freq(), scale, table=table)
        return out

    calls = {"DCA step": step, "DCA kernel": kernel}
    calls.update({f"SDPA {n}": fn for n, fn in sdpa_calls(q, views, False).items()})
    return calls, views


def decode_rows(lengths, batches=(1,), layers=0):
    rows = []
    for L in lengths:
        for batch in batches:
            n = cache_layers(L, batch, requested=layers)
            calls, views = decode_calls(L, batch, layers=n)
            ms = {name: measure_graph(fn) / n for name, fn in calls.items()}
            ms["K/V read"] = fastest_read(views, measure_graph) / n
            rows.append({"L": L, "batch": batch, "layers": n, "ms": ms})
            print(f"  decode L={L} batch={batch} ({n} layers' caches): "
                  + ", ".join(f"{name} {t * 1e3:.1f} us" for name, t in rows[-1]["ms"].items()), flush=True)
            del calls
            torch.cuda.empty_cache()
    return rows


DECODE_SWEEP = [(16, 64, 4, 3), (16, 128, 4, 2), (16, 128, 4, 3), (16, 64, 4, 4), (16, 64, 2, 3), (16, 128, 8, 2),
                (16, 256, 8, 2), (16, 64, 4, 5), (16, 64, 8, 4), (16, 32, 4, 6)]
# (programs per SM, columns per split): one wave of programs, fewer and longer splits, up to eight waves
DECODE_SPLITS = [(1, 512), (2, 512), (3, 512), (4, 512), (8, 256)]


def decode_sweep(lengths, batches, layers=0):
    """Time the decode tile configs (BLOCK_M, BLOCK_N, warps, stages) x split policies (programs per SM, columns
    per split) as a captured step runs them ("DCA step", per layer over ``cache_layers`` caches); print each cell's
    fastest; restore the defaults."""
    default = (tri._CONFIGS["decode"], tri._DECODE_WAVES, tri._SPLIT_COLUMNS)
    results = []
    for L in lengths:
        for batch in batches:
            n = cache_layers(L, batch, requested=layers)
            calls, _ = decode_calls(L, batch, layers=n)
            sdpa = min(measure_graph(calls["SDPA cuDNN"]), measure_graph(calls["SDPA flash"])) / n
            cell = []
            for cfg in DECODE_SWEEP:
                for waves, cols in DECODE_SPLITS:
                    tri._CONFIGS["decode"], tri._DECODE_WAVES, tri._SPLIT_COLUMNS = cfg, waves, cols
                    try:
                        ms = measure_graph(calls["DCA step"]) / n
                    except Exception as exc:  # e.g. out of shared memory
                        print(f"  {cfg} waves {waves} cols {cols}: {type(exc).__name__}", flush=True)
                        continue
                    cell.append((ms, cfg, waves, cols))
            tri._CONFIGS["decode"], tri._DECODE_WAVES, tri._SPLIT_COLUMNS = default
            cell.sort(key=lambda x: x[0])
            here = next(c for c in cell if (c[1], c[2], c[3]) == default)
            print(f"L={L} batch={batch} ({n} layers' caches): SDPA {sdpa * 1e3:.1f} us; default {here[0] * 1e3:.1f}; fastest "
                  + "; ".join(f"{c[1]} x{c[2]}/{c[3]} {c[0] * 1e3:.1f}" for c in cell[:3]), flush=True)
            results.append({"L": L, "batch": batch, "layers": n, "sdpa_ms": sdpa, "cells": cell})
            del calls
            torch.cuda.empty_cache()
    return results


def model_rows(lengths, new_tokens):
    import transformers

    from cca_convert.families import FAMILIES

    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=H,
        num_key_value_heads=HKV, max_position_embeddings=8 * 8192, rope_theta=500000.0, tie_word_embeddings=False,
        dtype="bfloat16")
    config.dual_chunk_attention_config = {"chunk_size": CHUNK, "local_size": LOCAL,
                                          "original_max_position_embeddings": 0}
    cls = published.family_class(FAMILIES["llama"], methods.get("dca"))
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = cls(config).eval()
    torch.set_default_dtype(torch.float32)
    rows = []
    for L in lengths:
        ids = torch.randint(0, 128000, (1, L), device="cuda")
        row = {"L": L}
        for name, impl in (("DCA", "dca"), ("base (SDPA)", "sdpa")):
            model.config._attn_implementation = impl

            timed_generate(model, ids[:, :1024], 4)  # warm-up: compiles the kernels
            row[name] = timed_generate(model, ids, new_tokens)
            print(f"  L={L} {name}: prefill {row[name]['prefill_s']:.1f}s, {row[name]['ms_per_token']:.1f} ms/token",
                  flush=True)
            torch.cuda.empty_cache()
        rows.append(row)
    model.config._attn_implementation = "dca"
    return rows


def table(prefill, decode, model, agreement) -> str:
    out = []
    if prefill:
        names = list(prefill[0]["ms"])
        out.append("Prefill forward (batch 1, 32/8 heads, d 128, bf16), ms (useful TFLOP/s):\n")
        out.append("| L | " + " | ".join(names) + " | DCA / best SDPA | DCA / 3-call |")
        out.append("|" + " --- |" * (len(names) + 3))
        for r in prefill:
            best = min(r["ms"]["SDPA cuDNN"], r["ms"]["SDPA flash"])
            cells = [f"{r['ms'][n]:.2f} ({r['tflops'][n]:.0f})" for n in names]
            out.append(f"| {r['L']} | " + " | ".join(cells) + f" | {best / r['ms']['DCA']:.2f}x speed | "
                       f"{r['ms']['3-call merge'] / r['ms']['DCA']:.2f}x faster |")
    if decode:
        names = list(decode[0]["ms"])
        out.append("\nDecode attention per layer, one query per row over an L-key cache, timed inside CUDA graphs "
                   "over several layers' caches, so that keys come from HBM as in a model step (us; x32 for a "
                   "32-layer model):\n")
        out.append("| L | batch | layers' caches | " + " | ".join(names)
                   + " | DCA step / best SDPA | DCA kernel / best SDPA | K/V read / DCA kernel | K/V read / best SDPA |")
        out.append("|" + " --- |" * (len(names) + 7))
        for r in decode:
            best = min(r["ms"]["SDPA cuDNN"], r["ms"]["SDPA flash"])
            read = r["ms"]["K/V read"]
            out.append(f"| {r['L']} | {r['batch']} | {r['layers']} | "
                       + " | ".join(f"{r['ms'][n] * 1e3:.1f}" for n in names)
                       + f" | {best / r['ms']['DCA step']:.2f}x speed | {best / r['ms']['DCA kernel']:.2f}x speed"
                       + f" | {read / r['ms']['DCA kernel']:.0%} | {read / best:.0%} |")
    if model:
        out.append("\nWhole model (Llama-3.1-8B shape, random bf16 weights), real prefill then generate():\n")
        out.append("| L | DCA prefill s | DCA ms/token | base prefill s | base ms/token |")
        out.append("| --- | --- | --- | --- | --- |")
        for r in model:
            d, b = r["DCA"], r["base (SDPA)"]
            out.append(f"| {r['L']} | {d['prefill_s']:.2f} | {d['ms_per_token']:.1f} | {b['prefill_s']:.2f} | "
                       f"{b['ms_per_token']:.1f} |")
    if agreement:
        out.append("\nAgreement with the fp32 PyTorch twin (last 256 queries of L=20000, bf16 inputs): "
                   + ", ".join(f"{k} max|diff| {v:.2e}" for k, v in agreement.items()))
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--decode-lengths", default="32768,131072")
    ap.add_argument("--decode-batches", default="1")
    ap.add_argument("--decode-sweep", action="store_true",
                    help="only time the decode tile configs and split policies at --decode-lengths x --decode-batches")
    ap.add_argument("--decode-layers", type=int, default=0,
                    help="layers' caches a decode measurement cycles through (0: enough for 4x the L2; 1: one "
                         "cache replayed alone, which stays in the L2 when it fits)")
    ap.add_argument("--model", action="store_true", help="also time whole-model generate() (random 8B weights)")
    ap.add_argument("--model-lengths", default="32768")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None, help="folder for dca.md / dca.json")
    ap.add_argument("--sweep", action="store_true", help="first pick the fastest prefill tile config at 32K")
    args = ap.parse_args()
    if args.decode_layers < 0:
        ap.error(f"--decode-layers must be >= 0 (0: enough caches for 4x the L2), got {args.decode_layers}")
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    dev = torch.cuda.get_device_name()
    print(f"{dev}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    if args.decode_sweep:
        decode_sweep(ints(args.decode_lengths), ints(args.decode_batches), args.decode_layers)
        return
    chosen = sweep() if args.sweep else None
    agreement = check_agreement()
    prefill = prefill_rows(ints(args.lengths))
    decode = decode_rows(ints(args.decode_lengths), ints(args.decode_batches), args.decode_layers)
    model = model_rows(ints(args.model_lengths), args.new_tokens) if args.model else []
    cfg = chosen or (*tri._CONFIGS["prefill"], tri._MIN_ROWS_PER_HEAD)
    text = (f"{dev}, torch {torch.__version__}, triton {triton.__version__}; C={CHUNK}, w={LOCAL}; Triton prefill "
            f"tiles (BLOCK_M, BLOCK_N, warps, stages, rows/head) {cfg}\n\n") + table(
        prefill, decode, model, agreement)
    print(text)
    if args.out:
        save_results(args.out, "dca", text, {"device": dev, "prefill": prefill, "decode": decode, "model": model,
                                             "agreement": agreement})


if __name__ == "__main__":
    main()
