"""Where the time of one DCA decode call goes (one query over an L-key cache, Llama-3.1-8B heads): CUDA-event time of
the whole wrapper, of the kernel launch alone on prepared inputs, and torch.profiler's CPU vs CUDA totals."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cca_convert.kernels import dca_triton as tri  # noqa: E402

L = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 8, L, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device="cuda", dtype=torch.float32) / 128))
qpos = torch.tensor([[L - 1]], device="cuda")
kstart = torch.zeros(1, dtype=torch.long, device="cuda")
table = tri.rope_table(inv, 6144)


def call():
    return tri.dca_attention_triton(q, k, v, qpos, kstart, 6144, 1024, inv, 128 ** -0.5, table=table)


for _ in range(20):
    call()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(200):
    call()
cpu_side = (time.perf_counter() - t) / 200 * 1e3
torch.cuda.synchronize()
wall = (time.perf_counter() - t) / 200 * 1e3
print(f"L={L}: {wall:.3f} ms/call wall (CPU issue time {cpu_side:.3f} ms/call)")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as p:
    for _ in range(20):
        call()
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12))
print(p.key_averages().table(sort_by="cpu_time_total", row_limit=12))
