"""Benchmark: CCA attention (Triton) vs causal SDPA (cuDNN, flash) and the PyTorch CCA reference.

Llama-3.1-8B attention layout (32 query heads, 8 KV heads, head_dim 128), bf16, batch 1, g=16, s=1024.
  python benchmarks/attention.py --out benchmarks/results            # 4K .. 128K, both pooling modes
  python benchmarks/attention.py --lengths 4096,32768 --sweep        # tune Triton block configs first
  python benchmarks/attention.py --lengths 32768 --pooling kv --profile --passes fwd,fwd+bwd  # time per kernel
  python benchmarks/attention.py --lengths 32768,131072 --pooling kv,query --rounds 3 \
      --authors-repo ../CCA-Attention      # + the CCA authors' kernel, from a clone of their repository

Conventions
- Median of triton.testing.do_bench. "fwd" is one forward call; "fwd+bwd" is forward plus
  torch.autograd.grad w.r.t. q, k, v.
- ``cca_triton`` timings are the whole ``cca_attention_triton`` call on pre-RoPE q/k: RoPE + pooling + fused
  attention. ``cca_rotated`` is the call a model makes: q/k as its RoPE rotated them (``q_rot``/``k_rot``, the
  pooling un-rotates k itself), the same inputs as SDPA, which runs with ``enable_gqa=True`` (no repeat_kv copy) and
  ``is_causal``. In fwd+bwd, gradients are w.r.t. each method's own inputs. Where ``cca_gluon`` applies (an sm_90
  GPU, triton 3.6), ``cca_rotated`` (the default call) takes its warp-specialized kernels (the forward, dq, dk/dv);
  ``cca_rotated_tr`` is the same call with Triton kernels only (``use_gluon=False``).
- ``--rounds N`` times every method N times, alternating (method A, B, ..., A, B, ...), and reports each method's
  median round: the GPU's clock drifts over a run, and alternation spreads that drift over all methods alike.
- ``cca_authors`` (with ``--authors-repo``): the prefill path of the CCA paper's authors, imported from a clone of
  https://github.com/chenyaofo/CCA-Attention (its code is not part of this repository):
  ``codebase/core/cca_attn.py::pooling_attention_wo_cache`` with their ``cca`` pooling, i.e. RoPE, ``repeat_kv``
  copies of the KV heads, torch pooling per query head, then their Triton kernel (``cca.py``) with their block
  configs. Same pre-RoPE inputs as ``cca_triton``. Their semantics differ from CCA-SPEC.md in details (keys pooled
  after RoPE, one pooled key per query head, like our ``query`` pooling), so compare its speed, not its numbers.
  ``--check`` compares their kernel with their own dense semantics (``generate_mask`` + SDPA), output and gradients.
  Their config table knows A100 and RTX 3090 only; on any other GPU it falls back to 32 x 32 tiles, one stage.
  ``cca_authors_a100_tiles`` is the same path with the tiles their table picks on an A100 for this shape (forward
  64 x 32, 3 stages, 8 warps; backward 64 x 64, 2 stages, 4 warps), so that the comparison does not rest on a
  fallback: the faster of the two is the authors' number.
- Speed-up is against the fastest SDPA backend of the same run, same pass.
- Useful TFLOP/s counts only the score entries each method must compute: CCA n(t) core tokens plus
  the raw keys [n(t)*g, t] per query (causal attention: t+1 keys); 4*d flops per entry forward
  (QK^T and PV), 14*d forward+backward (backward = 5 matmuls: QK^T recomputed, dV, dP, dQ, dK).
- Peak memory: torch.cuda.max_memory_allocated during one call, minus what was allocated before it
  (inputs excluded).
"""

import argparse
import contextlib
import csv
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]


sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not

from cca_convert.kernels import cca_pool_triton as pool  # noqa: E402
from cca_convert.kernels import cca_reference as ref  # noqa: E402
from cca_convert.kernels import cca_triton as tri  # noqa: E402


def score_entries(L, g, s, causal_full=False):
    t = torch.arange(L, dtype=torch.float64)
    if causal_full:
        return float((t + 1).sum())
    n = torch.clamp(torch.floor((t + 1 - s) / g), min=0)
    return float((n + t - n * g + 1).sum())


def rope_tables(L, d, device, dtype, base=500000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    freqs = torch.arange(L, dtype=torch.float32, device=device)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def measure(fn, warmup, rep, foreign=False):
    """(median ms, peak extra GiB); NaN on OOM, and on any error of a ``foreign`` method (the authors' code has shape
    limits of its own: its reason is printed, and the other methods still run)."""
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
        return ms, peak
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return float("nan"), float("nan")
    except Exception as e:
        if not foreign:
            raise
        print(f"  (not timed: {type(e).__name__}: {e})", flush=True)
        return float("nan"), float("nan")


AUTHORS_MODULE = "codebase/core/cca_attn.py"


# Their get_fwd_config / get_bwd_config on capability (8, 0), causal, head_dim 128, more than 1024 queries:
# (BLOCK_M, BLOCK_N, num_stages, num_warps). Their code invites replacing these functions at runtime.
AUTHORS_A100_TILES = {"get_fwd_config": (64, 32, 3, 8), "get_bwd_config": (64, 64, 2, 4)}


@contextlib.contextmanager
def authors_tiles(name):
    """While ``cca_authors_a100_tiles`` is timed (forward and backward), the authors' kernel takes their A100 tiles."""
    if name != "cca_authors_a100_tiles":
        yield
        return
    kernel = sys.modules["codebase.core.cca"]
    saved = {fn: getattr(kernel, fn) for fn in AUTHORS_A100_TILES}
    for fn, tiles in AUTHORS_A100_TILES.items():
        setattr(kernel, fn, lambda *shape, tiles=tiles: tiles)
    try:
        yield
    finally:
        for fn, original in saved.items():
            setattr(kernel, fn, original)


def authors_call(args, q, k, v, cos, sin):
    """Their path on pre-RoPE q/k/v with (L, d) tables; their ``apply_rotary_pos_emb`` takes (B, L, d) ones."""
    return args.authors.pooling_attention_wo_cache(q, k, v, args.group_size, args.local_window, 0.0,
                                                   q.shape[1] // k.shape[1], 0, None, cos[None], sin[None])


def check_authors(args, L, q, k, v, cos, sin, do):
    """Their kernel against their own dense semantics (``generate_mask`` + fp32 SDPA) on the keys and values their
    path builds, output and gradients, with both tile sets: the timed path computes what its authors meant."""
    kernel = sys.modules["codebase.core.cca"]
    seen = []

    def spy(Q, K, V, **kw):  # the attention call of their path, inputs kept
        seen.append((Q.detach(), K.detach(), V.detach(), kw))
        return kernel.cca_attention_v2(Q, K, V, **kw)

    args.authors.cca_attention_v2 = spy
    try:
        authors_call(args, q, k, v, cos, sin)
    finally:
        args.authors.cca_attention_v2 = kernel.cca_attention_v2
    Q, K, V, kw = seen[0]
    mask = args.authors.generate_mask(L, args.group_size, K.shape[2] - L, args.local_window, device=q.device,
                                      dtype=torch.float32)
    dense_in = [x.float().requires_grad_() for x in (Q, K, V)]
    dense = F.scaled_dot_product_attention(*dense_in, attn_mask=mask)
    dense_grads = torch.autograd.grad(dense, dense_in, do.float())
    for name in ("cca_authors", "cca_authors_a100_tiles"):
        with authors_tiles(name):
            ins = [x.clone().requires_grad_() for x in (Q, K, V)]
            out = kernel.cca_attention_v2(*ins, **kw)
            grads = torch.autograd.grad(out, ins, do)
        errs = [((a.float() - b).norm() / b.norm()).item() for a, b in zip((out, *grads), (dense, *dense_grads))]
        print(f"check L={L} {name} against their dense path: rel err out {errs[0]:.2e}, dQ {errs[1]:.2e}, "
              f"dK {errs[2]:.2e}, dV {errs[3]:.2e}", flush=True)


def load_authors(repo: Path):
    """The authors' prefill path from a clone of their repository (see the module docstring)."""
    import importlib

    sys.path.insert(0, str(repo.resolve()))
    mod = importlib.import_module("codebase.core.cca_attn")
    mod.pooling_func = "cca"  # their replace_attn_forward() sets it, and patches transformers classes we do not use
    return mod


def median_and_spread(times):
    """Median of a method's rounds and their spread, (max - min) / median in percent; NaN rounds (OOM) left out."""
    ok = [t for t in times if not math.isnan(t)]
    if not ok:
        return float("nan"), float("nan")
    med = statistics.median(ok)
    return med, 100.0 * (max(ok) - min(ok)) / med


def make_methods(L, args, q, k, v, cos, sin, do):
    g, s = args.group_size, args.local_window
    q_rot, k_rot = ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)
    gluon_forward = tri.cca_gluon is not None and tri.cca_gluon.applies(q, k, v, k, v, q.shape[-1])
    methods = {}
    for pooling in args.pooling:
        methods[f"cca_triton[{pooling}]"] = (
            lambda x, y, z, p=pooling: tri.cca_attention_triton(x, y, z, cos, sin, g, s, p), (q, k, v), "cca")
        methods[f"cca_rotated[{pooling}]"] = (
            lambda x, y, z, p=pooling: tri.cca_attention_triton(None, None, z, cos, sin, g, s, p, q_rot=x, k_rot=y),
            (q_rot, k_rot, v), "cca")
        if gluon_forward:  # the default call takes the Gluon kernels here: the Triton-only call beside it
            methods[f"cca_rotated_tr[{pooling}]"] = (
                lambda x, y, z, p=pooling: tri.cca_attention_triton(None, None, z, cos, sin, g, s, p, q_rot=x,
                                                                    k_rot=y, use_gluon=False), (q_rot, k_rot, v), "cca")
        if L <= args.ref_max:
            methods[f"cca_reference[{pooling}]"] = (
                lambda x, y, z, p=pooling: ref.cca_attention_reference(x, y, z, cos, sin, g, s, p), (q, k, v), "cca")
    for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        def sdpa(x, y, z, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(x, y, z, is_causal=True, enable_gqa=True)
        methods[name] = (sdpa, (q_rot, k_rot, v), "causal")
    if args.authors is not None:
        authors = lambda x, y, z: authors_call(args, x, y, z, cos, sin)  # noqa: E731
        methods["cca_authors"] = (authors, (q, k, v), "cca")
        methods["cca_authors_a100_tiles"] = (authors, (q, k, v), "cca")
    return methods


def run_pass(fn, inputs, do, backward):
    if not backward:
        return lambda: fn(*inputs)
    leaves = [x.detach().requires_grad_() for x in inputs]
    return lambda: torch.autograd.grad(fn(*leaves), leaves, do)


def sweep(L, args, q, k, v, do, cos, sin):
    """Kernel-only timings of each candidate block config (Hopper, hd128); keeps the fastest per kernel
    (summed over pooling modes) in the module's config table for the rest of the run."""
    g, s, scale = args.group_size, args.local_window, q.shape[-1] ** -0.5
    candidates = {
        "fwd": [(64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 3)],
        "dq": [(128, 64, 8, 3), (128, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 4), (128, 64, 8, 4)],
        "dkdv_raw": [(32, 64, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (32, 128, 8, 3), (64, 128, 8, 3)],
        "dkdv_core": [(32, 64, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (32, 128, 8, 3), (64, 128, 8, 3),
                      (128, 64, 8, 3), (64, 64, 4, 4), (32, 64, 4, 4), (32, 64, 8, 3), (16, 64, 4, 3), (32, 32, 4, 3)],
    }
    candidates = {kind: configs for kind, configs in candidates.items() if kind in args.sweep_kernels}
    table = tri._CONFIGS["hopper"]
    total = {}
    for pooling in args.pooling:
        q_rot, k_rot = tri._RopeFn.apply(q, cos, sin), tri._RopeFn.apply(k, cos, sin)
        for name, fn in (("rope", lambda: (tri._RopeFn.apply(q, cos, sin), tri._RopeFn.apply(k, cos, sin))),
                         ("pool", lambda: pool.pool_forward(q_rot, k_rot, k, v, cos, sin, g, pooling, scale))):
            ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
            print(f"sweep L={L} {pooling:5s} {name} forward: {ms:8.3f} ms", flush=True)
        kc, vc = pool.pool_forward(q_rot, k_rot, k, v, cos, sin, g, pooling, scale)
        dims = tri._Dims(q_rot, k_rot, kc, g, s, scale)
        o, lse = tri._forward(q_rot, k_rot, v, kc, vc, dims)
        for kind, configs in candidates.items():
            default = table[kind][128]
            for cfg in configs:
                table[kind][128] = cfg
                if kind == "fwd":
                    fn = lambda: tri._forward(q_rot, k_rot, v, kc, vc, dims)
                else:  # the whole backward, with this kernel's config varied
                    fn = lambda: tri._backward(do, q_rot, k_rot, v, kc, vc, o, lse, dims)
                try:
                    ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
                except Exception as e:  # e.g. out of shared memory
                    ms = float("inf")
                    print(f"  {kind} {cfg}: {type(e).__name__}")
                total[kind, cfg] = total.get((kind, cfg), 0.0) + ms
                print(f"sweep L={L} {pooling:5s} {kind:4s} BM,BN,warps,stages={cfg}: {ms:8.3f} ms", flush=True)
            table[kind][128] = default
    for kind, configs in candidates.items():
        table[kind][128] = min(configs, key=lambda c: total[kind, c])
        print(f"sweep: using {kind} config {table[kind][128]}", flush=True)


def profile(L, name, fn, inputs, do, passes):
    """torch.profiler's table of the GPU kernels of ``fn`` per pass: three calls after a warm-up call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for pname in passes:
        call = run_pass(fn, inputs, do, pname == "fwd+bwd")
        call()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                call()
            torch.cuda.synchronize()
        print(f"\nprofile L={L} {pname} {name} (3 calls; times are totals over them)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="folder for attention.csv and attention.png")
    ap.add_argument("--lengths", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--pooling", default="kv,query")
    ap.add_argument("--passes", default="fwd,fwd+bwd")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--local-window", type=int, default=1024)
    ap.add_argument("--ref-max", type=int, default=8192, help="longest length the O(L^2) reference runs at")
    ap.add_argument("--warmup", type=float, default=25)
    ap.add_argument("--rep", type=float, default=100)
    ap.add_argument("--sweep", action="store_true", help="first time Triton block-config candidates, keep the best")
    ap.add_argument("--sweep-length", type=int, default=32768)
    ap.add_argument("--sweep-kernels", default=",".join(tri._CONFIGS["hopper"]),
                    help="the kernels whose configs --sweep times (default: all)")
    ap.add_argument("--check", action="store_true",
                    help="check Triton vs reference output at L <= ref-max (with --authors-repo, also their kernel "
                         "vs their dense path)")
    ap.add_argument("--profile", action="store_true", help="print the GPU kernels of each CCA Triton call, per pass")
    ap.add_argument("--rounds", type=int, default=1, help="time the methods this many times, alternating; report "
                    "each method's median round")
    ap.add_argument("--authors-repo", type=Path, default=None,
                    help="a clone of https://github.com/chenyaofo/CCA-Attention: adds the CCA authors' kernel path "
                         "as cca_authors")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    args.authors = None
    if args.authors_repo is not None:
        if not (args.authors_repo / AUTHORS_MODULE).is_file():
            ap.error(f"--authors-repo {args.authors_repo}: no {AUTHORS_MODULE} there; clone the authors' code with "
                     "`git clone https://github.com/chenyaofo/CCA-Attention` and pass that folder")
        args.authors = load_authors(args.authors_repo)
    args.pooling = args.pooling.split(",")
    args.sweep_kernels = args.sweep_kernels.split(",")
    unknown = set(args.sweep_kernels) - set(tri._CONFIGS["hopper"])
    if unknown:
        ap.error(f"--sweep-kernels: unknown kernel(s) {sorted(unknown)}; choose from {sorted(tri._CONFIGS['hopper'])}")
    lengths = [int(x) for x in args.lengths.split(",")]
    passes = args.passes.split(",")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    H, Hkv, d = args.heads, args.kv_heads, args.head_dim
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"H={H} Hkv={Hkv} d={d} g={args.group_size} s={args.local_window} bf16 batch 1", flush=True)

    def inputs(L):
        gen = torch.Generator(device=dev).manual_seed(L)
        shapes = ((1, H, L, d), (1, Hkv, L, d), (1, Hkv, L, d), (1, H, L, d))
        return (*(torch.randn(s, device=dev, dtype=dtype, generator=gen) for s in shapes), *rope_tables(L, d, dev, dtype))

    if args.sweep:  # tune once, then time every length with the chosen configs
        sweep(args.sweep_length, args, *inputs(args.sweep_length))
    rows = []
    for L in lengths:
        q, k, v, do, cos, sin = inputs(L)
        methods = make_methods(L, args, q, k, v, cos, sin, do)
        if args.check and L <= args.ref_max:
            for p in args.pooling:
                a = tri.cca_attention_triton(q, k, v, cos, sin, args.group_size, args.local_window, p).float()
                b = ref.cca_attention_reference(q, k, v, cos, sin, args.group_size, args.local_window, p).float()
                print(f"check L={L} {p}: rel err {((a - b).norm() / b.norm()).item():.2e}", flush=True)
            if args.authors is not None:
                check_authors(args, L, q, k, v, cos, sin, do)
        if args.profile:
            for name, (fn, xs, kind) in methods.items():
                if name.startswith("cca_triton"):
                    profile(L, name, fn, xs, do, passes)
        entries = {"cca": score_entries(L, args.group_size, args.local_window),
                   "causal": score_entries(L, 0, 0, causal_full=True)}
        for pname in passes:
            backward = pname == "fwd+bwd"
            flops_per_entry = (14 if backward else 4) * d
            times = {name: [] for name in methods}
            peaks = {}
            for rnd in range(args.rounds):
                for name, (fn, xs, kind) in methods.items():
                    with authors_tiles(name):
                        ms, peak = measure(run_pass(fn, xs, do, backward), args.warmup, args.rep,
                                           name.startswith("cca_authors"))
                    times[name].append(ms)
                    peaks.setdefault(name, peak)
                    print(f"  L={L:6d} {pname:7s} {name:24s} round {rnd + 1}: {ms:9.3f} ms  peak {peak:7.2f} GiB",
                          flush=True)
            res = {}
            for name, (fn, xs, kind) in methods.items():
                ms, spread = median_and_spread(times[name])
                res[name] = (ms, peaks[name], entries[kind] * H * flops_per_entry / (ms * 1e-3) / 1e12, spread)
            best_sdpa = min(res[n][0] for n in res if n.startswith("sdpa") and not math.isnan(res[n][0]))
            for name, (ms, peak, tflops, spread) in res.items():
                rows.append(dict(L=L, pass_=pname, method=name, ms=ms, speedup=best_sdpa / ms, tflops=tflops,
                                 peak_gib=peak, spread=spread))
        del q, k, v, do, methods
        torch.cuda.empty_cache()

    spread = args.rounds > 1  # the rounds' (max - min) / median, in percent
    header = (f"{'L':>7} {'pass':7} {'method':24} {'ms':>9} {'x best SDPA':>11} {'TFLOP/s':>8} {'peak GiB':>9}"
              + (f" {'spread %':>8}" if spread else ""))
    print(f"\n{args.rounds} round(s), median shown\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(f"{r['L']:>7} {r['pass_']:7} {r['method']:24} {r['ms']:9.3f} {r['speedup']:11.2f} {r['tflops']:8.1f} "
              f"{r['peak_gib']:9.2f}" + (f" {r['spread']:8.1f}" if spread else ""))

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "attention.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["L", "pass", "method", "ms", "speedup_vs_best_sdpa", "useful_tflops", "peak_gib", "rounds",
                        "spread_pct"])
            for r in rows:
                w.writerow([r["L"], r["pass_"], r["method"], f"{r['ms']:.4f}", f"{r['speedup']:.3f}",
                            f"{r['tflops']:.1f}", f"{r['peak_gib']:.3f}", args.rounds, f"{r['spread']:.1f}"])
        plot(rows, passes, args.out / "attention.png")
        print(f"wrote {args.out / 'attention.csv'} and {args.out / 'attention.png'}")


def plot(rows, passes, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(passes), figsize=(6.5 * len(passes), 4.8), squeeze=False)
    for ax, pname in zip(axes[0], passes):
        sel = [r for r in rows if r["pass_"] == pname]
        for method in dict.fromkeys(r["method"] for r in sel):
            pts = [(r["L"], r["ms"]) for r in sel if r["method"] == method and not math.isnan(r["ms"])]
            ax.plot(*zip(*pts), marker="o", label=method, linestyle="--" if "sdpa" in method else "-")
        for r in sel:
            if r["method"] == "cca_triton[kv]":
                ax.annotate(f"{r['speedup']:.1f}x", (r["L"], r["ms"]), textcoords="offset points", xytext=(0, -12),
                            ha="center", fontsize=8)
        ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="ms (median)",
               title=f"{pname}: 32q/8kv heads, d=128, bf16, g=16, s=1024")
        ax.set_xticks([r["L"] for r in sel if r["method"] == sel[0]["method"]])
        ax.set_xticklabels([f"{r['L'] // 1024}K" for r in sel if r["method"] == sel[0]["method"]])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
