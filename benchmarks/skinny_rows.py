"""The Triton few-row products (``kernels/skinny_triton.py``) against cuBLAS, 1-16 rows, Llama-3.1-8B's shapes.

What the captured decode step runs per layer (q/k/v in one launch, o, gate+up+activation in one launch, down), each
timed per layer call inside a CUDA graph over 32 layers' distinct weights (so that no weight is read from L2), as in
a replayed step. cuBLAS: ``F.linear`` per weight, the activation and product eager. A microbenchmark (random weights,
no model): ``benchmarks/decode.py`` measures what users run.

    python benchmarks/skinny_rows.py                   # one CUDA GPU
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not

from cca_convert.kernels.skinny_triton import skinny_gated, skinny_linear  # noqa: E402


def per_call_us(fn, calls: int, replays: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays / calls * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    layers, dev, dt = args.layers, "cuda", torch.bfloat16

    def weights(n, k):
        return [torch.randn(n, k, device=dev, dtype=dt) * 0.01 for _ in range(layers)]

    wq, wk, wv, wg, wu, wd = weights(4096, 4096), weights(1024, 4096), weights(1024, 4096), weights(14336, 4096), \
        weights(14336, 4096), weights(4096, 14336)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, us per layer call ({layers} layers' "
          f"weights, inside a CUDA graph)\n")
    print("| rows | q/k/v cuBLAS | q/k/v Triton | o cuBLAS | o Triton | gate+up+SiLU cuBLAS | gate+up+SiLU Triton | "
          "down cuBLAS | down Triton |\n" + "|" + " --- |" * 9)
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, 4096, device=dev, dtype=dt)
        h = torch.randn(rows, 14336, device=dev, dtype=dt)
        pairs = [
            (lambda: [F.linear(x, w[i]) for i in range(layers) for w in (wq, wk, wv)],
             lambda: [skinny_linear(x, [wq[i], wk[i], wv[i]]) for i in range(layers)]),
            (lambda: [F.linear(x, wq[i]) for i in range(layers)],
             lambda: [skinny_linear(x, [wq[i]]) for i in range(layers)]),
            (lambda: [F.silu(F.linear(x, wg[i])) * F.linear(x, wu[i]) for i in range(layers)],
             lambda: [skinny_gated(x, wg[i], wu[i], "silu") for i in range(layers)]),
            (lambda: [F.linear(h, wd[i]) for i in range(layers)],
             lambda: [skinny_linear(h, [wd[i]]) for i in range(layers)]),
        ]
        cells = [f"{per_call_us(fn, layers):.1f}" for pair in pairs for fn in pair]
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
