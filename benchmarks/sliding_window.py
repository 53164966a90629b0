"""A sliding-window layer's attention as the exported model runs it (``cca_hf._sliding_attention``: past 4 windows, by
blocks of 2w queries over the keys each block's window reaches) against the way transformers runs it, one SDPA call
under the whole L x L window mask; forward and forward+backward, and the largest differences of the outputs and of
the gradients of q, k and v.

Why it matters: a Gemma 3's local layers (40 of Gemma-3-12B's 48) and Qwen's ``max_window_layers`` are kept as they
are by CCA, and at 32K their single masked call is most of the prefill. One layer, random inputs (a microbenchmark:
``benchmarks/recipe_cli.py`` runs the model). The default shape is one Gemma-3-12B local layer.

    python benchmarks/sliding_window.py                                  # one CUDA GPU
    python benchmarks/sliding_window.py --device cpu --lengths 48,160 --window 16 --heads 4 --kv-heads 2 --head-dim 16
"""

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from benchmarks.results_out import save_results  # noqa: E402
from cca_convert.modeling.cca_hf import _sliding_attention  # noqa: E402


def one_masked_call(module, query, key, value, scaling, window):
    """transformers' way: every query against every key, the window and causality in one L x L boolean mask."""
    q_col = torch.arange(key.shape[2] - query.shape[2], key.shape[2], device=query.device)[:, None]
    k_col = torch.arange(key.shape[2], device=query.device)[None, :]
    mask = ((k_col <= q_col) & (q_col - k_col < window))[None, None]
    return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling)[0]


def ms_per_call(fn, device: str, reps: int) -> float:
    fn()  # warm-up
    if device == "cpu":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096,16384,32768")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", type=Path, help="also write sliding_window.md / .json here")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA GPU: pass --device cpu (timings then say nothing of a GPU)")
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    lengths = [int(x) for x in args.lengths.split(",")]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    module = SimpleNamespace(num_key_value_groups=args.heads // args.kv_heads, is_causal=True, training=False)
    scaling = args.head_dim ** -0.5
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    head = (f"{where}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}, batch 1, {args.heads}/"
            f"{args.kv_heads} heads, head dim {args.head_dim}, window {args.window}; ms per call, mean of {args.reps} "
            "after one warm-up\n\n"
            "| L | one masked call fwd | by blocks fwd | ratio | one masked call fwd+bwd | by blocks fwd+bwd | ratio | "
            "max abs diff out | max abs diff dq, dk, dv |\n" + "|" + " --- |" * 9)
    print(head, flush=True)
    lines, rows = [head], []
    for L in lengths:
        torch.manual_seed(0)
        q = torch.randn(1, args.heads, L, args.head_dim, device=args.device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, args.kv_heads, L, args.head_dim, device=args.device, dtype=dtype, requires_grad=True)
                for _ in range(2))
        grad = torch.randn(1, L, args.heads, args.head_dim, device=args.device, dtype=dtype)

        def stock():
            return one_masked_call(module, q, k, v, scaling, args.window)

        def blocked():
            return _sliding_attention(module, q, k, v, None, scaling, args.window)

        with torch.no_grad():
            fwd = [ms_per_call(fn, args.device, args.reps) for fn in (stock, blocked)]
            diff = (stock().float() - blocked().float()).abs().max().item()
        bwd = [ms_per_call(lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), grad), args.device, args.reps)
               for fn in (stock, blocked)]
        grads = [torch.autograd.grad(fn(), (q, k, v), grad) for fn in (stock, blocked)]
        grad_diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(*grads))
        rows.append({"length": L, "fwd_ms": {"one_masked_call": fwd[0], "by_blocks": fwd[1]},
                     "fwd_bwd_ms": {"one_masked_call": bwd[0], "by_blocks": bwd[1]}, "max_abs_diff": diff,
                     "max_abs_grad_diff": grad_diff,
                     "by_blocks_engaged": L > 4 * args.window})
        line = (f"| {L} | {fwd[0]:.2f} | {fwd[1]:.2f} | {fwd[0] / fwd[1]:.2f}x | {bwd[0]:.2f} | {bwd[1]:.2f} | "
                f"{bwd[0] / bwd[1]:.2f}x | {diff:.2e} | {grad_diff:.2e} |")
        print(line, flush=True)
        lines.append(line)
    foot = (f"\nUp to 4 windows ({4 * args.window} tokens) both columns run the same single call; the ratio there is "
            "noise.")
    print(foot)
    if args.out:
        save_results(args.out, "sliding_window", "\n".join(lines) + "\n" + foot,
                     {"device": where, "torch": torch.__version__, "dtype": str(dtype), "window": args.window,
                      "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
