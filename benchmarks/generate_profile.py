"""Where a decode step's GPU time goes, inside a real ``generate()`` (issue #14's "find where").

The model and prompt are benchmarks/decode.py's (Llama-3.1-8B shape, random bf16 weights, a real chunked prefill).
A logits processor starts ``torch.profiler`` after step ``--skip`` (compilation and CUDA-graph capture are done by
then) and stops it ``--steps`` steps later, so only steady-state steps are recorded: the replayed graph's kernels and
generate's own work between them. Printed: per step, the wall time, the GPU's busy time, and the kernels grouped by
name (time per step, launches per step, share of the busy time).

    python benchmarks/generate_profile.py --context 32768 --backend cca
    python benchmarks/generate_profile.py --context 32768 --backend full-static
    python benchmarks/generate_profile.py --context 32768 --backend dca            # or full-kernels: decode.py's rows
    python benchmarks/generate_profile.py --smoke --device cpu --context 64     # the code path, tiny

benchmarks/decode_profile.py profiles one step outside generate (eager, then replayed with and without the compiled
twins).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import functools
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.decode import BACKENDS, build, build_dca, floor_ms, model_for, prefill_chunk  # noqa: E402


class ProfileWindow(LogitsProcessor):
    """Profiles generate steps ``skip`` .. ``skip + steps`` (called once per step, after the step's forward), then
    times the next ``steps`` steps without the profiler: their wall time, and the host time spent in the model's
    ``prepare_inputs_for_generation``, ``forward`` and ``_update_model_kwargs_for_generation`` (``HostTimer``)."""

    def __init__(self, skip: int, steps: int, timers: list[HostTimer]):
        self.skip, self.steps, self.calls, self.stamps, self.timers = skip, steps, 0, [], timers
        self.python = cProfile.Profile()  # a third window: the host's Python functions
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA])

    @staticmethod
    def sync(scores):
        if scores.is_cuda:
            torch.cuda.synchronize(scores.device)

    def __call__(self, input_ids, scores):
        if self.calls == self.skip:
            self.sync(scores)
            self.profiler.start()
            self.stamps.append(time.perf_counter())
        elif self.calls == self.skip + self.steps:
            self.sync(scores)
            self.stamps.append(time.perf_counter())
            self.profiler.stop()
            self.stamps.append(time.perf_counter())
            for timer in self.timers:
                timer.on = True
        elif self.calls == self.skip + 2 * self.steps:
            self.sync(scores)
            self.stamps.append(time.perf_counter())
            for timer in self.timers:
                timer.on = False
            self.python.enable()
        elif self.calls == self.skip + 3 * self.steps:
            self.python.disable()
        self.calls += 1
        return scores


class HostTimer:
    """Host seconds inside one method of ``owner`` (an instance, or a class such as ``torch.cuda.CUDAGraph``),
    wrapped in place, while ``on``."""

    def __init__(self, owner, name: str):
        self.name, self.samples, self.on = name, [], False
        inner = getattr(owner, name)

        @functools.wraps(inner)  # generate reads the signatures to validate its kwargs
        def timed(*args, **kwargs):
            if not self.on:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.samples.append(time.perf_counter() - start)

        setattr(owner, name, timed)

    def summary(self, steps: int) -> str:
        if not self.samples:
            return f"{self.name} never ran"
        return (f"{self.name} {sum(self.samples) / steps * 1e6:.0f} us/step ({len(self.samples)} calls, median "
                f"{statistics.median(self.samples) * 1e6:.0f} us)")


def kernel_table(profiler, steps: int, top: int, cuda: bool) -> tuple[str, float]:
    """Kernels grouped by name; on a CPU (--smoke) the aten ops instead, nested ones counted twice."""
    by_name, busy = defaultdict(lambda: [0.0, 0]), 0.0
    for event in profiler.events():
        if cuda and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and not event.name.startswith("aten::"):
            continue
        us = event.device_time if cuda else event.cpu_time
        by_name[event.name][0] += us
        by_name[event.name][1] += 1
        busy += us
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    lines = ["| kernel | us / step | launches / step | share |", "| --- | --- | --- | --- |"]
    for name, (us, n) in rows[:top]:
        lines.append(f"| `{name[:90]}` | {us / steps:.1f} | {n / steps:.1f} | {100 * us / busy:.1f}% |")
    rest, busy = sum(v[0] for _, v in rows[top:]), max(busy, 1e-9)
    lines.append(f"| (the other {max(0, len(rows) - top)} kernels) | {rest / steps:.1f} | - | {100 * rest / busy:.1f}% |")
    return "\n".join(lines), busy / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--backend", choices=BACKENDS, default="cca", help="a row of benchmarks/decode.py")
    ap.add_argument("--skip", type=int, default=6)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--local-window", type=int, default=1024)
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--prefill-tokens", type=int, default=65536)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="a tiny model (any device): the code path, not the numbers")
    args = ap.parse_args()
    args.contexts, args.new_tokens = [args.context], args.skip + 3 * args.steps + 2

    cca, full = build(args, torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32)
    dca = build_dca(args, cca) if args.backend.startswith("dca") else None
    whole = build_dca(args, cca, whole=True) if args.backend == "full-kernels" else None
    model = model_for(args.backend, cca, dca, full, whole)  # (its CUDA-graph switch set as decode.py sets it)
    kwargs = {"prefill_chunk_size": prefill_chunk(args, args.batch)}
    if args.backend == "full-static":
        kwargs["cache_implementation"] = "static"
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.context), device=args.device)
    timers = [HostTimer(model, name) for name in ("prepare_inputs_for_generation", "forward",
                                                 "_update_model_kwargs_for_generation")]
    if hasattr(model, "_replayed_decode"):
        timers.append(HostTimer(model, "_replayed_decode"))
    if ids.is_cuda:
        timers.append(HostTimer(torch.cuda.CUDAGraph, "replay"))
    window = ProfileWindow(args.skip, args.steps, timers)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                       min_new_tokens=args.new_tokens, do_sample=False,
                       logits_processor=LogitsProcessorList([window]), **kwargs)
    wall_ms = (window.stamps[1] - window.stamps[0]) / args.steps * 1e3
    real_ms = (window.stamps[3] - window.stamps[2]) / args.steps * 1e3
    host = "; ".join(t.summary(args.steps) for t in timers)
    text, busy_us = kernel_table(window.profiler, args.steps, args.top, ids.is_cuda)
    floor = floor_ms(model, args.backend, args.context, args.batch, 4.8e12)
    name = torch.cuda.get_device_name(args.device) if ids.is_cuda else "cpu"
    print(f"{args.backend}, context {args.context}, batch {args.batch}, {name}, torch "
          f"{torch.__version__}: {args.steps} profiled steps; wall {wall_ms:.2f} ms/step (profiler on), GPU busy "
          f"{busy_us / 1e3:.2f} ms/step, floor at 4.8 TB/s {floor:.2f} ms\nthe next {args.steps} steps, profiler off: "
          f"wall {real_ms:.2f} ms/step (GPU idle ~{real_ms - busy_us / 1e3:.2f} ms/step); host time per step in "
          f"{host}\n\n{text}")
    stats = pstats.Stats(window.python).stats  # {(file, line, function): (calls, ncalls, tottime, cumtime, ...)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:args.top]
    lines = ["| function | own us / step | with callees us / step | calls / step |", "| --- | --- | --- | --- |"]
    for (file, line, func), (_, calls, own, total, _) in rows:
        where = f"{Path(file).name}:{line}" if line else "built-in"
        lines.append(f"| `{func[:60]}` ({where}) | {own / args.steps * 1e6:.0f} | {total / args.steps * 1e6:.0f} | "
                     f"{calls / args.steps:.1f} |")
    print(f"\nthe {args.steps} steps after, under cProfile (its own cost inflates every call):\n\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
