"""The DCA Triton kernel vs its PyTorch twin (DCA-SPEC.md "Must test" 5, 7, 8, 9 at kernel level).

CPU: only under ``TRITON_INTERPRET=1`` at small shapes; GPU (``-m gpu``): long shapes, bf16, Qwen-1M's GQA.
The kernel takes keys rotated once at ``j % s`` (the cache layout) and the number of leading pad columns per sequence.
bf16 tolerance, FlashAttention style: max|tri - ref_fp32| <= 2 * max|ref_bf16 - ref_fp32| + atol.
"""

import pytest
import torch

from tests.support.triton_env import triton_device

INTERPRET, HAS_CUDA, DEVICE = triton_device("Triton kernels")

from cca_convert.kernels import dca_reference as ref
from cca_convert.kernels import dca_triton as tri
from tests.support import naive_dca


def case(B, H, Hkv, L, d, C, w, pads=None, lq=None, c_orig=0, rotary=None, seed=0, dtype=torch.float32, splits=None,
         af=1.0, use_tma=None, use_gluon=None):
    """Kernel vs reference over the last ``lq`` queries of left-padded sequences of tensor length ``L``."""
    gen = torch.Generator().manual_seed(seed)
    lq = lq or L
    q, k, v = (torch.randn(B, n, x, d, generator=gen).to(DEVICE) for n, x in ((H, lq), (Hkv, L), (Hkv, L)))
    rot = rotary or d
    inv_freq = (1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))).to(DEVICE)
    kstart = torch.tensor(pads or [0] * B, device=DEVICE)
    kpos = torch.arange(L, device=DEVICE)[None] - kstart[:, None]
    kvalid, kpos = kpos >= 0, kpos.clamp_min(0)
    qpos, qvalid = kpos[:, L - lq:], kvalid[:, L - lq:]
    scale = d ** -0.5
    expect = ref.dca_attention_reference(q, k, v, qpos, kpos, kvalid, qvalid, C, w, inv_freq, scale, c_orig, af)
    kr = ref.rotate_keys(k.to(dtype), kpos, C, w, inv_freq, af)
    temp = ref.temperature_per_sequence(kstart, L, c_orig) if c_orig else None  # None: the kernel's T = 1 path
    got = tri.dca_attention_triton(q.to(dtype), kr, v.to(dtype), torch.where(qvalid, qpos, -1), kstart, C, w,
                                   inv_freq, scale, temp, af, splits=splits, use_tma=use_tma,
                                   use_gluon=use_gluon).float()
    real = qvalid[:, None, :, None].expand_as(expect)
    err = (got - expect)[real].abs().max().item()
    assert torch.isfinite(got).all(), "pad rows must be finite"
    assert (got[~real] == 0).all(), "pad rows are defined as 0"
    if dtype == torch.float32:
        assert err < 2e-5, err
    else:
        rounded = ref.dca_attention_reference(*(x.to(dtype).float() for x in (q, k, v)), qpos, kpos, kvalid,
                                              qvalid, C, w, inv_freq, scale, c_orig, af)
        bound = 2 * (rounded.to(dtype).float() - expect)[real].abs().max().item() + 1e-2
        assert err <= bound, (err, bound)


# (B, H, Hkv, L, d, C, w): lengths not multiples of s or of the tiles, 1 / 2 / >= 5 chunk boundaries crossed,
# w = 0 and w = s - 1, s not a multiple of the tiles, GQA r = 1, 4, 5, 7, head dims 64 / 80 / 128
SHAPES = [
    (1, 4, 4, 23, 64, 15, 3),  # one boundary (s = 12)
    (1, 4, 1, 37, 64, 13, 4),  # r = 4, boundaries at 9, 18, 27, 36
    (2, 5, 1, 45, 80, 7, 0),  # w = 0, r = 5, d = 80, >= 5 boundaries
    (1, 7, 1, 50, 128, 11, 5),  # w = s - 1, r = 7, d = 128
    (2, 8, 2, 70, 64, 32, 8),  # s = 24 (tiles of 16 straddle every boundary)
    (1, 2, 2, 9, 64, 9, 1),  # L <= C + 1: the plain causal attention
]


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}kv{}L{}d{}C{}w{}".format(*s))
def test_prefill_matches_reference(shape, use_tma):
    """Both ways of fetching key/value tiles: address arithmetic, and TMA descriptors (zeros past the sequence and
    past the head dim; what a Hopper GPU uses)."""
    case(*shape, use_tma=use_tma)


@pytest.mark.parametrize("pads", [[0, 11], [6, 0, 29]])
def test_left_padded_batch(pads):
    case(len(pads), 4, 2, 41, 64, 10, 2, pads=pads, c_orig=12)  # temperature on, per sequence


@pytest.mark.parametrize("lq,splits", [(1, 1), (1, 3), (1, 7), (5, 1), (5, 4), (12, 2)])
def test_cached_passes(lq, splits):
    """Decode (lq=1) and chunked prefill (lq>1) over a cache, with the key columns split over several programs
    (flash-decoding) whose partial results merge by their log-sum-exps."""
    case(2, 7, 1, 60, 64, 11, 3, pads=[0, 9], lq=lq, splits=splits, c_orig=20)


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_decode_over_a_buffer_with_spare_room_equals_exact_keys(splits):
    """A decode step reading a cache's whole buffer (what a CUDA-graph step does: spare columns past the sequence hold
    garbage) gives the numbers of the exact-length keys: the key ranges end at each row's query, and the flash-decoding
    splits share the columns the rows attend to (found on the device), not the buffer's."""
    gen = torch.Generator().manual_seed(3)
    B, H, Hkv, L, d, C, w, room = 2, 8, 2, 53, 64, 11, 3, 40
    q = torch.randn(B, H, 1, d, generator=gen).to(DEVICE)
    k, v = (torch.randn(B, Hkv, L + room, d, generator=gen).to(DEVICE) for _ in range(2))
    inv_freq = (1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))).to(DEVICE)
    kstart = torch.tensor([0, 9], device=DEVICE)
    qpos = (L - 1 - kstart)[:, None]
    args = (qpos, kstart, C, w, inv_freq, d ** -0.5)
    exact = tri.dca_attention_triton(q, k[:, :, :L], v[:, :, :L], *args, splits=splits, split_by_span=True)
    whole = tri.dca_attention_triton(q, k, v, *args, splits=splits, split_by_span=True)
    assert torch.equal(whole, exact)
    static = tri.dca_attention_triton(q, k[:, :, :L], v[:, :, :L], *args, splits=splits)
    torch.testing.assert_close(exact, static, atol=2e-6, rtol=2e-6)  # (the merge may sum an empty split more)


@pytest.mark.parametrize("lq,splits", [(1, 3), (5, 4)])
def test_cached_passes_with_tma(lq, splits):
    case(2, 7, 1, 60, 80, 11, 3, pads=[0, 9], lq=lq, splits=splits, c_orig=20, use_tma=True)


def test_tma_refuses_unaligned_rows():
    """A forced ``use_tma`` on rows the copy engine cannot fetch (here: 4 bytes past an aligned address) is one clear
    error; the default then takes the pointer path."""
    k = torch.randn(1, 1, 9, 65, device=DEVICE)[..., 1:]  # rows start 4 bytes into the buffer: not 16-byte aligned
    q, v = torch.randn(1, 1, 9, 64, device=DEVICE), torch.randn(1, 1, 9, 64, device=DEVICE)
    pos, kstart = torch.arange(9, device=DEVICE)[None], torch.zeros(1, dtype=torch.long, device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32, device=DEVICE) / 64))
    with pytest.raises(ValueError, match="16-byte aligned"):
        tri.dca_attention_triton(q, k, v, pos, kstart, 8, 2, inv_freq, 0.125, use_tma=True)
    out = tri.dca_attention_triton(q, k, v, pos, kstart, 8, 2, inv_freq, 0.125)
    assert torch.equal(out, tri.dca_attention_triton(q, k.contiguous(), v, pos, kstart, 8, 2, inv_freq, 0.125,
                                                     use_tma=False))


def test_partial_rotary():
    case(1, 4, 2, 30, 64, 10, 2, rotary=32)


def test_partial_rotary_attention_factor_temperature_and_splits():
    """The prologue's rotation: only the first ``rotary`` channels turn (times the attention factor, as YaRN's
    and LongRoPE's RoPE scale them); the rest pass through, all scaled by T; decode splits merged."""
    case(2, 6, 2, 47, 80, 13, 3, pads=[5, 0], rotary=48, af=1.3, c_orig=9, lq=3, splits=3)


@pytest.mark.parametrize("d,rotary,pads", [(64, None, [0]), (80, 48, [0, 7]), (128, 64, [3])])
def test_rotate_keys_matches_twin(d, rotary, pads):
    """The cache's key rotation kernel (positions j % s, pads at any position, partial rotary, a factor) == twin."""
    gen = torch.Generator().manual_seed(d)
    B, L = len(pads), 41
    k = torch.randn(B, 3, L, d, generator=gen).to(DEVICE)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, rotary or d, 2, dtype=torch.float32) / (rotary or d)))).to(DEVICE)
    kpos = torch.arange(L, device=DEVICE)[None] - torch.tensor(pads, device=DEVICE)[:, None]  # pads: negative
    want = ref.rotate_keys(k, kpos, 13, 4, inv_freq, 1.2)
    got = tri.rotate_keys_triton(k, kpos, 13, 4, tri.rope_table(inv_freq, 13, 1.2))
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert tri.rotate_keys_triton(k, kpos, 13, 4, tri.rope_table(inv_freq, 13, 1.2), torch.bfloat16).dtype == \
        torch.bfloat16


def test_rope_table_is_the_twins_rotation():
    """The kernel's table rows are the twin's cos/sin (rope_at) at positions 0..C."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    table = tri.rope_table(inv_freq, 11, 1.25)
    x = torch.randn(12, 16)
    half = x[:, 8:], x[:, :8]
    cos, sin = table[:, :8].repeat(1, 2), table[:, 8:].repeat(1, 2)
    want = ref.rope_at(x, torch.arange(12), inv_freq, 1.25)
    assert torch.equal(x * cos + torch.cat([-half[0], half[1]], -1) * sin, want)


def test_reference_matches_naive_with_rotated_keys():
    """The cache path of the reference (keys rotated once, passed in) equals the spec's literal loop."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 19, 16, generator=gen), torch.randn(1, 2, 19, 16, generator=gen), torch.randn(
        1, 2, 19, 16, generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    pos, valid = torch.arange(19)[None], torch.ones(1, 19, dtype=torch.bool)
    naive = naive_dca.dca_attention_naive(q, k, v, pos, pos, valid, valid, 7, 2, inv_freq, 0.25)
    kr = ref.rotate_keys(k, pos, 7, 2, inv_freq)
    got = ref.dca_attention_reference(q, kr, v, pos, pos, valid, valid, 7, 2, inv_freq, 0.25, keys_rotated=True)
    assert (got - naive).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [
    (1, 28, 4, 3001, 128, 1024, 128),  # Qwen2.5-7B-1M's heads (r = 7), 3+ chunks, L odd
    (1, 32, 8, 4500, 128, 768, 96),  # Llama-3.1-8B heads, >= 5 boundaries
    (2, 8, 8, 2000, 64, 300, 0),  # r = 1, w = 0
    (1, 20, 4, 1500, 80, 500, 40),  # r = 5, d = 80
], ids=lambda s: "B{}H{}kv{}L{}d{}C{}w{}".format(*s) if isinstance(s, tuple) else None)
def test_gpu_long(shape, dtype):
    case(*shape, dtype=dtype)


def gluon_serves_this_gpu():
    return tri.dca_gluon is not None and HAS_CUDA and tri.dca_gluon.hopper_ok(torch.empty(1, device="cuda",
                                                                                        dtype=torch.bfloat16))


GLUON_ONLY = "the Gluon prefill serves sm_90 GPUs with triton 3.6 (gluon_parts.VERIFIED_TRITON)"


@pytest.mark.gpu
@pytest.mark.skipif(not gluon_serves_this_gpu(), reason=GLUON_ONLY)
@pytest.mark.parametrize("shape,kw", [
    ((1, 28, 4, 3001, 128, 1024, 128), {}),  # r = 7, L odd, s = 896 (tiles straddle the boundaries)
    ((2, 32, 8, 2500, 128, 768, 96), {"pads": [0, 317]}),  # r = 4, batch 2, left padding: two items of pad rows only
    ((2, 16, 16, 2000, 64, 300, 0), {}),  # r = 1, w = 0, d = 64
    ((2, 20, 4, 1500, 64, 100, 20), {}),  # r = 5, s = 80 < a tile: a warpgroup's rows span two chunks or more
    ((3, 32, 8, 3000, 128, 1024, 100), {"pads": [5, 0, 999], "lq": 1300, "c_orig": 512}),  # a pass after a prefill,
    # rows not a multiple of the items, the temperature per sequence
    ((2, 32, 8, 700, 128, 300, 44), {"af": 1.3, "dtype": torch.float16}),  # attention factor, fp16
], ids=["r7", "pads", "r1-d64-w0", "s80", "chunk-temp", "fp16-af"])
def test_gpu_gluon_prefill(shape, kw):
    """The Hopper kernel (``dca_gluon``) against the fp32 twin, as the Triton kernel is held. Every shape has enough
    query rows for one split (the Gluon kernel does not split keys; fewer rows go to the Triton kernel's splits)."""
    case(*shape, **{"dtype": torch.bfloat16, **kw}, use_gluon=True)


@pytest.mark.gpu
@pytest.mark.skipif(not gluon_serves_this_gpu(), reason=GLUON_ONLY)
def test_gpu_gluon_serves_prefill_by_default(monkeypatch):
    """A default call runs the Gluon kernel for a bf16 prefill with rows enough for one split, and this file's kernel
    for what it does not serve (decode, few rows, head dim 80, partial rotary, use_tma=False); use_gluon=True there is
    a clear error."""
    calls = []
    real = tri.dca_gluon.forward
    monkeypatch.setattr(tri.dca_gluon, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    case(2, 32, 8, 600, 128, 256, 32, dtype=torch.bfloat16)
    assert len(calls) == 1
    case(2, 32, 8, 600, 128, 256, 32, dtype=torch.bfloat16, lq=1)
    case(1, 8, 2, 600, 128, 256, 32, dtype=torch.bfloat16)  # 40 row tiles: the Triton kernel's splits fill the GPU
    case(2, 32, 8, 600, 80, 256, 32, dtype=torch.bfloat16)
    case(2, 32, 8, 600, 128, 256, 32, dtype=torch.bfloat16, rotary=64)
    case(2, 32, 8, 600, 128, 256, 32, dtype=torch.bfloat16, use_tma=False)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="use_gluon=True needs"):
        case(2, 32, 8, 600, 80, 256, 32, dtype=torch.bfloat16, use_gluon=True)


@pytest.mark.gpu
def test_gpu_triton_prefill_where_gluon_would_serve():
    """This file's kernel (TMA tiles) on the shapes the Gluon kernel takes by default: both stay held to the twin."""
    case(1, 32, 8, 4500, 128, 768, 96, dtype=torch.bfloat16, use_gluon=False)
    case(2, 32, 8, 2500, 128, 768, 96, pads=[0, 317], dtype=torch.bfloat16, use_gluon=False)


@pytest.mark.gpu
def test_gpu_pointer_path():
    """The tile fetch a pre-Hopper GPU (or unaligned rows) gets: prefill, and decode over a long cache in splits."""
    case(1, 32, 8, 4500, 128, 768, 96, dtype=torch.bfloat16, use_tma=False)
    case(2, 28, 4, 20000, 128, 4096, 512, pads=[0, 1234], lq=1, c_orig=8192, dtype=torch.bfloat16, use_tma=False)


@pytest.mark.gpu
@pytest.mark.parametrize("lq", [1, 7, 64])
def test_gpu_decode_over_long_cache(lq):
    case(2, 28, 4, 20000, 128, 4096, 512, pads=[0, 1234], lq=lq, c_orig=8192, dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("B,L,splits", [(8, 50000, None), (40, 9000, None), (3, 30000, 2)])
def test_gpu_decode_wide_tiles(B, L, splits):
    """Decode splits of >= _WIDE_SPLIT columns run the wide tile config (128-key tiles): batch 8 over 50K keys
    (5 splits), batch 40 over 9K (one split: the batch fills the GPU), and forced splits; left padding."""
    pads = [(977 * i) % 3000 for i in range(B)]
    case(B, 32, 8, L, 128, 6144, 1024, pads=pads, lq=1, c_orig=8192, dtype=torch.bfloat16, splits=splits)


@pytest.mark.parametrize("d,pads,n", [(64, [0], 1), (80, [0, 7], 5), (128, [3, 0], 23)])
def test_append_rotated_matches_rotate_then_index_copy(d, pads, n):
    """The cache's one-launch append (keys rotated at ``pos % s`` written at device-side columns with the values,
    positions and validity) == the key rotation kernel then four ``index_copy_``, bit for bit (the twin's rotation:
    within a bf16 rounding); other columns untouched."""
    gen = torch.Generator().manual_seed(d + n)
    B, cap, start = len(pads), 64, 11
    k = torch.randn(B, 3, n, d, generator=gen).to(DEVICE)
    v = torch.randn(B, 3, n, d, generator=gen).to(DEVICE, torch.bfloat16)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))).to(DEVICE)
    pos = (torch.arange(n, device=DEVICE)[None] + start - torch.tensor(pads, device=DEVICE)[:, None])
    valid = pos >= 0
    pos = pos.clamp_min(0)
    columns = torch.arange(start, start + n, device=DEVICE)
    buffers = [torch.randn(B, 3, cap, d, generator=gen).to(DEVICE, torch.bfloat16),
               torch.randn(B, 3, cap, d, generator=gen).to(DEVICE, torch.bfloat16),
               torch.randint(0, 9, (B, cap), generator=gen).to(DEVICE), torch.zeros(B, cap, dtype=torch.bool,
                                                                                   device=DEVICE)]
    want = [x.clone() for x in buffers]
    table = tri.rope_table(inv_freq, 13, 1.2)
    new = (tri.rotate_keys_triton(k, pos, 13, 4, table, torch.bfloat16), v, pos, valid)
    for buf, x, dim in zip(want, new, (2, 2, 1, 1)):
        buf.index_copy_(dim, columns, x)
    tri.append_rotated_triton(k, v, pos, valid, columns, 13, 4, table, buffers)
    for got, expect in zip(buffers, want):
        assert torch.equal(got, expect)
    twin = ref.rotate_keys(k, pos, 13, 4, inv_freq, 1.2)
    torch.testing.assert_close(buffers[0][:, :, start:start + n].float(), twin, atol=1e-5, rtol=8e-3)
    with pytest.raises(ValueError, match="do not match the cache"):
        tri.append_rotated_triton(k, v.float(), pos, valid, columns, 13, 4, tri.rope_table(inv_freq, 13, 1.2), buffers)


def _deferred_rope_case(dtype, rep, n, device):
    """A captured step's pass: q/k before the family's RoPE (Llama's), its (B, n, d) tables in q's dtype, and what the
    eager step computes: transformers' RoPE, then ``attention_hooks.unrope`` (fp32), then the cache write."""
    from cca_convert.modeling.attention_hooks import inverse_rope
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(rep + n)
    B, Hkv, d, cap, start = 2, 2, 64, 40, 7
    q = torch.randn(B, Hkv * rep, n, d, generator=gen).to(device, dtype)
    k = torch.randn(B, Hkv, n, d, generator=gen).to(device, dtype)
    v = torch.randn(B, Hkv, n, d, generator=gen).to(device, dtype)
    ang = (torch.arange(start, start + n)[None, :, None] + torch.tensor([0, 5])[:, None, None]) * \
        torch.logspace(0, -3, d // 2)
    cos, sin = (torch.cat([f(ang), f(ang)], -1).mul(1.1).to(device, dtype) for f in (torch.cos, torch.sin))
    inv_freq = (1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))).to(device)
    pos = torch.arange(start, start + n, device=device)[None].expand(B, n) - torch.tensor([0, 5], device=device)[:, None]
    valid = torch.ones(B, n, dtype=torch.bool, device=device)
    columns = torch.arange(start, start + n, device=device)
    table = tri.rope_table(inv_freq, 13, 1.2)
    buffers = lambda: [torch.zeros(B, Hkv, cap, d, device=device, dtype=dtype),  # noqa: E731
                       torch.zeros(B, Hkv, cap, d, device=device, dtype=dtype),
                       torch.zeros(B, cap, dtype=torch.long, device=device),
                       torch.zeros(B, cap, dtype=torch.bool, device=device)]
    inverse = inverse_rope(cos, sin)
    q_post, k_post = apply_rotary_pos_emb(q, k, cos, sin)
    q_eager, k_eager = apply_rotary_pos_emb(q_post.float(), k_post.float(), *inverse)  # (attention_hooks.unrope)
    eager = buffers()
    tri.append_rotated_triton(k_eager, v, pos, valid, columns, 13, 4, table, eager)
    fused = buffers()
    q_fused = tri.append_rotated_triton(k, v, pos, valid, columns, 13, 4, table, fused, (q, cos, sin, *inverse))
    return q_eager.to(dtype), eager, q_fused, fused


@pytest.mark.parametrize("rep,n", [(1, 1), (4, 1), (5, 3), (7, 33)])
def test_append_takes_a_deferred_rope_back_as_the_eager_step_computes_it(rep, n):
    """``deferred``: the family's RoPE and its inverse, in the cache write's launch, give the eager step's queries and
    cache bit for bit (fp32 here: the interpreter rounds 16-bit otherwise than a GPU; bf16 on the GPU below)."""
    q_eager, eager, q_fused, fused = _deferred_rope_case(torch.float32, rep, n, DEVICE)
    assert torch.equal(q_fused, q_eager)
    for got, want in zip(fused, eager):
        assert torch.equal(got, want)
    assert eager[0].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rep,n", [(4, 1), (7, 33)])
def test_gpu_append_takes_a_deferred_rope_back_as_the_eager_step_computes_it(dtype, rep, n):
    q_eager, eager, q_fused, fused = _deferred_rope_case(dtype, rep, n, "cuda")
    assert torch.equal(q_fused, q_eager)
    for got, want in zip(fused, eager):
        assert torch.equal(got, want)
