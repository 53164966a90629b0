"""Where one CCA decode step's GPU time goes (the exported Llama class, random bf16 weights, after a real prefill):
torch.profiler over one eager one-token step (kernels per step, GPU time by kernel), and CUDA-event time of the same
step replayed from its CUDA graph. A tool for the kernel work of issue #14, not a headline number (decode.py is).

    python benchmarks/decode_profile.py --context 32768 --layers 32
"""

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.decode import build  # noqa: E402
from cca_convert.modeling.attention_hooks import CACHE_ARG  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    build_args = argparse.Namespace(smoke=False, layers=args.layers, contexts=[args.context], new_tokens=64,
                                    group_size=16, local_window=1024, device="cuda")
    model, _ = build(build_args, torch.bfloat16)
    ids = torch.randint(3, 1000, (args.batch, args.context), device="cuda")
    with torch.no_grad():
        cache = None
        for start in range(0, args.context, 8192):
            out = model(ids[:, start:start + 8192], use_cache=True, logits_to_keep=1, **{CACHE_ARG: cache})
            cache = getattr(out, CACHE_ARG)
        tok = out.logits[:, -1:].argmax(-1)
        pos = torch.full_like(tok, args.context)

        def step(graphs):
            model.config.cca_cuda_graphs = graphs
            nonlocal pos
            logits = model(input_ids=tok, position_ids=pos, use_cache=True, **{CACHE_ARG: cache}).logits
            pos = pos + 1
            return logits

        for _ in range(3):
            step(False)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(False)
            torch.cuda.synchronize()
        per_kernel, count = defaultdict(lambda: [0, 0.0]), 0
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[e.name][0] += 1
                per_kernel[e.name][1] += e.device_time_total
                count += 1
        total = sum(v[1] for v in per_kernel.values())
        print(f"eager step, L={args.context}, batch {args.batch}, {args.layers} layers: {count} kernels, "
              f"{total / 1e3:.2f} ms of kernel time ({count / args.layers:.1f} kernels per layer)")
        for name, (n, us) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[: args.top]:
            print(f"  {us / 1e3:7.3f} ms  {n:5d}x  {name[:110]}")
        for compiled in (False, True):  # graphs of the stock code, then of its torch.compile twins
            model.config.cca_compile_decode = compiled
            cache.__dict__.pop("decode_graphs", None)  # capture anew
            for _ in range(3):
                step(True)  # eager warm-up + capture, then replays
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step(True)
                torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                step(True)
            end.record()
            torch.cuda.synchronize()
            fused = getattr(model, "_fused_modules", None)
            print(f"graph replay, compiled twins (norms, MLPs, RoPE) {'on' if compiled else 'off'}: "
                  f"{start.elapsed_time(end) / 20:.3f} ms/step, {len(kernels)} kernels "
                  f"({sum(e.device_time_total for e in kernels) / 1e3:.2f} ms) in a profiled replay "
                  f"({cache.decode_graphs.replays} replays, failure: {cache.decode_graphs.failure}, "
                  f"compile failure: {fused.failure if fused else None})")


if __name__ == "__main__":
    main()
