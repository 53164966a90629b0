"""A verification pass of speculative decoding attends in one launch (``cca_decode_attention_triton`` with q (B, n, H, d))
and gives each token the bits of its one-token call: same tiles, splits and order, whatever the pass's other tokens,
so that speculative decoding keeps greedy's tokens. Odd shapes: GQA ratios 1/4/5/7, both poolings, passes that cross
tile and group boundaries, pad columns inside a pass, rows at different positions."""

import pytest
import torch

from tests.support.triton_env import triton_device

INTERPRET, HAS_CUDA, DEVICE = triton_device("the decode kernels")
from cca_convert.kernels import cca_decode_triton as kern


def _state(B, H, Hkv, d, g, s, slack, positions, pooling, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    C = Hkv if pooling == "kv" else H
    slots = max(positions) // g + 40
    W = s + g - 1 + slack

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    return rnd(B, C, slots, d), rnd(B, C, slots, d), rnd(B, Hkv, W, d), rnd(B, Hkv, W, d)


CASES = [  # (B, H, Hkv, d, g, s, slack, n, positions, pooling)
    (2, 4, 1, 16, 4, 7, 8, 6, [3, 61], "kv"),
    (3, 8, 2, 32, 4, 9, 12, 9, [0, 40, 130], "kv"),
    (2, 5, 1, 16, 3, 5, 8, 7, [17, 100], "query"),
    (1, 7, 1, 16, 4, 6, 8, 5, [93], "kv"),
    (2, 2, 2, 16, 2, 3, 8, 8, [5, 70], "query"),
]
GPU_CASES = [  # Llama-3.1-8B's layout at 128K with the cache's slack; Qwen2.5-7B's heads (r = 7)
    (1, 32, 8, 128, 16, 1024, 32, 11, [131000], "kv"), (2, 32, 8, 128, 16, 1024, 32, 4, [9000, 70001], "query"),
    (2, 28, 4, 128, 16, 1024, 32, 9, [5000, 33333], "kv")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-kv{c[2]}-d{c[3]}-n{c[7]}-{c[9]}")
@pytest.mark.parametrize("with_pads", [False, True])
@torch.no_grad()
def test_a_pass_gives_each_token_its_one_token_bits(case, with_pads):
    _check_attention(case, with_pads, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@torch.no_grad()
def test_passes_on_the_gpu():
    """Tiles of several tokens (tensor-core products, bf16 and fp32) at the 8B layout, and the pass's append in bf16."""
    for case in CASES + GPU_CASES:
        for with_pads in (False, True):
            for dtype in (torch.bfloat16, torch.float32):
                _check_attention(case, with_pads, dtype)
    for case in APPEND_CASES:
        for rotated in (False, True, "eager"):
            _check_append(case, rotated, True, torch.bfloat16)


def _check_attention(case, with_pads, dtype):
    B, H, Hkv, d, g, s, slack, n, positions, pooling = case
    ck, cv, wk, wv = _state(B, H, Hkv, d, g, s, slack, positions, pooling, dtype, seed=len(positions) * 31 + n)
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(B, n, H, d, generator=gen).to(DEVICE, dtype)
    pos = torch.tensor(positions, device=DEVICE)
    real = torch.ones(B, n, dtype=torch.long)
    if with_pads:
        real[:, 1] = 0
        real[-1, n - 2:] = 0
    real = real.to(DEVICE)
    splits = None if HAS_CUDA else 3
    block = 64 if HAS_CUDA else 16
    seen = pos.clone()
    passed = kern.cca_decode_attention_triton(q, ck, cv, None, wk, wv, seen, None, d**-0.5, num_splits=splits,
                                              block_n=block, group_size=g, local_window=s,
                                              advance=real if with_pads else True)
    assert seen.tolist() == (pos + real.sum(1)).tolist()
    before = torch.cat([torch.zeros_like(real[:, :1]), real.cumsum(1)[:, :-1]], 1)  # real tokens before each
    for i in range(n):
        alone = kern.cca_decode_attention_triton(q[:, i], ck, cv, None, wk, wv, pos + before[:, i], None, d**-0.5,
                                                 num_splits=splits, block_n=block, group_size=g, local_window=s)
        assert torch.equal(passed[:, i], alone), (i, (passed[:, i] - alone).abs().max().item())
    # and the last token agrees with the twin (ring indexed by position mod W; the kernel sees the last s + g - 1)
    from cca_convert.modeling import cache_cca as cache_mod
    t = pos + before[:, -1]
    n_core = torch.div(t + 1 - s, g, rounding_mode="floor").clamp_min(0)
    lo = torch.maximum(t - (s + g - 1) + 1, n_core * g)
    ref = cache_mod.cca_decode_attention_torch(q[:, -1].float(), ck.float(), cv.float(), n_core, wk.float(), wv.float(),
                                               t, lo, d**-0.5)
    torch.testing.assert_close(passed[:, -1].float(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=0)


APPEND_CASES = [  # (B, H, Hkv, d, g, slack, n, seen, pooling)
    (2, 4, 2, 16, 4, 8, 9, [5, 22], "kv"),
    (3, 6, 2, 16, 4, 8, 7, [0, 9, 13], "query"),
    (1, 7, 1, 32, 3, 12, 11, [40], "kv"),
    (2, 2, 2, 16, 2, 8, 5, [1, 6], "query"),  # g = 2: a group's middle is its last token
]


@pytest.mark.parametrize("case", APPEND_CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-kv{c[2]}-g{c[4]}-n{c[6]}-{c[8]}")
@pytest.mark.parametrize("rotated", [False, True, "eager"], ids=["pre-rope", "post-rope", "eager-rope"])
@pytest.mark.parametrize("with_pads", [False, True])
@torch.no_grad()
def test_a_pass_appends_as_its_one_token_launches(case, rotated, with_pads):
    """The pass's append (one launch: ring writes, group-middle tables, pooling of the groups it completes, some
    with their middle inside the pass) leaves every state tensor and rotated q bit for bit as n one-token launches."""
    _check_append(case, rotated, with_pads, torch.float32)


def _check_append(case, rotated, with_pads, dtype):
    B, H, Hkv, d, g, slack, n, seen, pooling = case
    gen = torch.Generator().manual_seed(n * 7 + len(seen))
    C = Hkv if pooling == "kv" else H
    W, M, P = 5 + g - 1 + slack, slack // g + 2, max(seen) // g + 8

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    state = [rnd(B, Hkv, W, d), rnd(B, Hkv, W, d), rnd(B, Hkv, g + slack, d), rnd(B, M, d), rnd(B, M, d),
             rnd(B, C, P, d), rnd(B, C, P, d)]
    q, k, v = rnd(B, H, n, d), rnd(B, Hkv, n, d), rnd(B, Hkv, n, d)
    ang = torch.rand(B, n, d // 2, generator=gen) * 6
    cos, sin = (torch.cat((f(ang), f(ang)), -1).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    real = torch.ones(B, n, dtype=torch.long)
    if with_pads:
        real[0, 2] = 0
        real[-1, :2] = 0
    real = real.to(DEVICE)
    pos = torch.tensor(seen, device=DEVICE)
    passed = [x.clone() for x in state]
    q_pass = kern.cca_decode_append_triton(q, k, v, cos, sin, real if with_pads else None, pos.clone(), *passed, g,
                                           d**-0.5, rotated=rotated)
    before = torch.cat([torch.zeros_like(real[:, :1]), real.cumsum(1)[:, :-1]], 1)
    for i in range(n):
        q_one = kern.cca_decode_append_triton(q[:, :, i], k[:, :, i], v[:, :, i], cos[:, i], sin[:, i],
                                              real[:, i] if with_pads else None, pos + before[:, i], *state, g,
                                              d**-0.5, rotated=rotated)
        assert torch.equal(q_pass[:, i], q_one), i
    for name, a, b in zip(("win_k", "win_v", "grp_k", "mid_cos", "mid_sin", "core_k", "core_v"), passed, state):
        assert torch.equal(a, b), (name, (a - b).abs().amax(-1))


def test_a_pass_needs_the_derived_visibility():
    """Explicit ``n_core``/``win_lo`` describe one query per row: a pass (or ``advance``) with them is refused."""
    B, H, Hkv, d = 1, 4, 2, 16
    ck, cv, wk, wv = _state(B, H, Hkv, d, 4, 7, 8, [30], "kv", torch.float32, seed=0)
    q = torch.randn(B, 3, H, d, device=DEVICE)
    pos = torch.tensor([30], device=DEVICE)
    n_core = torch.tensor([5], device=DEVICE)
    with pytest.raises(ValueError, match="several tokens per row: only with the visibility derived from pos"):
        kern.cca_decode_attention_triton(q, ck, cv, n_core, wk, wv, pos, n_core * 4, d**-0.5)
    with pytest.raises(ValueError, match="advance counts the token into pos"):
        kern.cca_decode_attention_triton(q[:, 0], ck, cv, n_core, wk, wv, pos, n_core * 4, d**-0.5, advance=True)
