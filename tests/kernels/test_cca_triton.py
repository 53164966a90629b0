"""Triton CCA attention vs the PyTorch reference: forward and gradients through RoPE and pooling.

CPU: runs only under ``TRITON_INTERPRET=1`` (set before triton is imported, as CI does), on small
shapes. GPU: the same checks at long lengths, every head dim and bf16 (``-m gpu``).
bf16 tolerance, FlashAttention style: max|tri - ref_fp32| <= 2 * max|ref_bf16 - ref_fp32| + atol,
where ref_bf16 is the reference run on the same inputs cast to bf16.
"""

import functools

import pytest
import torch

from tests.support.triton_env import triton_device

INTERPRET, HAS_CUDA, DEVICE = triton_device("Triton kernels")

from cca_convert.kernels import cca_reference as ref
from cca_convert.kernels import cca_triton as tri


def rope_tables(L, d, batch=None, device=DEVICE):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    if batch is None:
        pos = torch.arange(L, dtype=torch.float32)
    else:  # per-sequence positions (e.g. left padding shifts them)
        pos = torch.arange(L, dtype=torch.float32)[None] + torch.arange(batch, dtype=torch.float32)[:, None] * 3
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def make_inputs(B, H, Hkv, L, d, seed, per_seq_rope=False, transposed=False, batch1_rope=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, d, generator=gen)
    k = torch.randn(B, Hkv, L, d, generator=gen)
    v = torch.randn(B, Hkv, L, d, generator=gen)
    do = torch.randn(B, H, L, d, generator=gen)
    if transposed:  # (B, L, heads, d) storage viewed as (B, heads, L, d), as models produce it
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    cos, sin = rope_tables(L, d, B if per_seq_rope else None, device="cpu")
    if batch1_rope:  # (1, L, d): what transformers' rotary embedding returns for one row of position ids
        cos, sin = cos[None], sin[None]
    return [x.to(DEVICE) for x in (q, k, v, do, cos, sin)]


def run(fn, q, k, v, do, cos, sin, g, s, pooling, dtype):
    leaves = [x.to(dtype).detach().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, cos.to(dtype), sin.to(dtype), g, s, pooling)
    grads = torch.autograd.grad(out, leaves, do.to(dtype)) if out.numel() else [torch.zeros_like(x) for x in leaves]
    return [out.float(), *(x.float() for x in grads)]


def _prerotated(fn):
    """``fn`` called the way a model calls it: q and k rotated by the model's own RoPE (``q_rot``/``k_rot``), the
    pre-RoPE k beside them (it is pooled), no pre-RoPE q."""
    def call(q, k, v, cos, sin, *args):
        return fn(None, k, v, cos, sin, *args, q_rot=ref.apply_rope(q, cos, sin), k_rot=ref.apply_rope(k, cos, sin))
    return call


def _rotated_only(fn):
    """``fn`` handed only what a model's RoPE gives: q_rot and k_rot, no pre-RoPE q or k (the pooling un-rotates
    k_rot)."""
    def call(q, k, v, cos, sin, *args):
        return fn(None, None, v, cos, sin, *args, q_rot=ref.apply_rope(q, cos, sin), k_rot=ref.apply_rope(k, cos, sin))
    return call


def check(B, H, Hkv, L, d, g, s, pooling, dtype, seed=0, use_tma=None, prerotated=False, use_gluon=None, **kw):
    """``prerotated``: True, q/k rotated with the pre-RoPE k beside them; "only", no pre-RoPE k (``_rotated_only``)."""
    q, k, v, do, cos, sin = make_inputs(B, H, Hkv, L, d, seed, **kw)
    kernel = functools.partial(tri.cca_attention_triton, use_tma=use_tma, use_gluon=use_gluon)
    kernel = {True: _prerotated, "only": _rotated_only}[prerotated](kernel) if prerotated else kernel
    got = run(kernel, q, k, v, do, cos, sin, g, s, pooling, dtype)
    want = run(ref.cca_attention_reference, q, k, v, do, cos, sin, g, s, pooling, torch.float32)
    names = ("out", "dq", "dk", "dv")
    if dtype == torch.float32:
        for name, a, b in zip(names, got, want):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m, n=name: f"{n}: {m}")
        return
    low = run(ref.cca_attention_reference, q, k, v, do, cos, sin, g, s, pooling, dtype)
    for name, a, b, c in zip(names, got, want, low):
        assert torch.isfinite(a).all(), name
        err, ref_err = (a - b).abs().max().item(), (c - b).abs().max().item()
        assert err <= 2 * ref_err + 2e-3, f"{name}: triton err {err:.3e} vs reference-in-{dtype} err {ref_err:.3e}"


def seq_lengths(g, s, extra=()):
    return sorted({1, g - 1, g, s, s + 1, s + g - 1, 3 * s + 5, *extra} - {0})


HEADS = [pytest.param(4, 1, id="gqa4"), pytest.param(2, 2, id="mha")]
POOLING = ["kv", "query"]


# ---------------------------------------------------------------- small shapes (CPU interpreter and GPU)
@pytest.mark.parametrize("pooling", POOLING)
@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("L", seq_lengths(4, 6))
def test_small_lengths(L, H, Hkv, pooling):
    """g=4 does not divide s=6; every length around a group / window boundary."""
    check(2, H, Hkv, L, 64 if L % 2 else 80, 4, 6, pooling, torch.float32, seed=L)


@pytest.mark.parametrize(
    "B,H,Hkv,L,d,g,s,pooling",
    [
        pytest.param(1, 4, 1, 70, 64, 2, 5, "kv", id="many-core-tokens"),  # mask-free core tiles
        pytest.param(1, 4, 2, 70, 80, 3, 37, "query", id="long-window"),  # mask-free raw tiles
        pytest.param(2, 6, 2, 45, 64, 3, 7, "kv", id="r3-kv"),  # head stack not a power of two
        pytest.param(1, 6, 2, 45, 64, 3, 7, "query", id="r3-query"),
        pytest.param(1, 2, 1, 20, 64, 1, 1, "kv", id="g1-s1"),
        pytest.param(2, 4, 2, 33, 64, 5, 3, "kv", id="g-gt-s"),
        pytest.param(1, 4, 1, 17, 64, 8, 20, "kv", id="L-lt-s"),  # CCA == causal attention here
    ],
)
@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
def test_small_configs(B, H, Hkv, L, d, g, s, pooling, use_tma):
    """Both ways of fetching the forward's key/value tiles: address arithmetic, and TMA descriptors (zeros past the
    rows and the head dim; what a Hopper GPU uses)."""
    check(B, H, Hkv, L, d, g, s, pooling, torch.float32, seed=L + g, use_tma=use_tma)


from cca_convert.kernels import cca_pool_triton as pool


@pytest.mark.parametrize("pooling", POOLING)
@pytest.mark.parametrize(
    "B,H,Hkv,L,d,g",
    [
        pytest.param(2, 4, 1, 23, 80, 5, id="g5-hd80"),  # half head dim 40 padded to 64; L % g != 0
        pytest.param(1, 6, 2, 70, 64, 33, id="g33-r3"),  # group padded to 64 rows, r not a power of two
        pytest.param(1, 2, 2, 9, 64, 1, id="g1"),
    ],
)
def test_pooling_kernels_match_reference(B, H, Hkv, L, d, g, pooling):
    """The pooling kernels alone vs ``pool_core_tokens``: core tokens, and the gradients the backward
    adds into dq_rot / dk_rot / dv plus the one it returns for the pre-RoPE k."""
    q, k, v, _, cos, sin = make_inputs(B, H, Hkv, L, d, seed=g, per_seq_rope=True)
    q_rot, k_rot = ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)
    scale = 0.3
    leaves = [x.detach().clone().requires_grad_() for x in (q_rot, k_rot, k, v)]
    want_kc, want_vc = ref.pool_core_tokens(*leaves, cos, sin, g, pooling, scale)
    dkc, dvc = torch.randn_like(want_kc), torch.randn_like(want_vc)
    want_grads = torch.autograd.grad((want_kc * dkc).sum() + (want_vc * dvc).sum(), leaves)

    kc, vc = pool.pool_forward(q_rot, k_rot, k, v, cos, sin, g, pooling, scale)
    torch.testing.assert_close(kc, want_kc, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vc, want_vc, atol=1e-5, rtol=1e-5)
    base = [torch.randn_like(x) for x in (q_rot, k_rot, v)]  # the attention's share, which must be kept
    dq, dk_rot, dv = (x.clone() for x in base)
    dk = pool.pool_backward(dkc, dvc, q_rot, k_rot, k, v, cos, sin, dq, dk_rot, dv, g, pooling, scale)
    got = (dq - base[0], dk_rot - base[1], dk, dv - base[2])
    for name, a, b in zip(("dq_rot", "dk_rot", "dk", "dv"), got, (want_grads[0], want_grads[1], want_grads[2], want_grads[3])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")

    # The core-token gradients as the attention kernels' (n_split, ...) partial sums: the backward adds them up.
    parts_k, parts_v = torch.randn((3, *dkc.shape)), torch.randn((3, *dvc.shape))
    parts_k[2], parts_v[2] = dkc - parts_k[0] - parts_k[1], dvc - parts_v[0] - parts_v[1]
    dq, dk_rot, dv = (x.clone() for x in base)
    dk = pool.pool_backward(parts_k, parts_v, q_rot, k_rot, k, v, cos, sin, dq, dk_rot, dv, g, pooling, scale)
    for name, a, b in zip(("dq_rot", "dk_rot", "dk", "dv"), (dq - base[0], dk_rot - base[1], dk, dv - base[2]), got):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"partial sums {n}: {m}")
    with pytest.raises(ValueError, match="n_split"):
        pool.pool_backward(parts_k, dvc, q_rot, k_rot, k, v, cos, sin, dq, dk_rot, dv, g, pooling, scale)

    # No pre-RoPE k: un-rotated from k_rot; its gradient share goes back through the un-rotation into dk_rot.
    kc, vc = pool.pool_forward(q_rot, k_rot, None, v, cos, sin, g, pooling, scale)
    torch.testing.assert_close(kc, want_kc, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vc, want_vc, atol=1e-5, rtol=1e-5)
    dq, dk_rot, dv = (x.clone() for x in base)
    assert pool.pool_backward(dkc, dvc, q_rot, k_rot, None, v, cos, sin, dq, dk_rot, dv, g, pooling, scale) is None
    leaves = [x.detach().clone().requires_grad_() for x in (q_rot, k_rot, v)]
    kc, vc = ref.pool_core_tokens(leaves[0], leaves[1], None, leaves[2], cos, sin, g, pooling, scale)
    want_grads = torch.autograd.grad((kc * dkc).sum() + (vc * dvc).sum(), leaves)
    for name, a, b in zip(("dq_rot", "dk_rot", "dv"), (dq - base[0], dk_rot - base[1], dv - base[2]), want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"from k_rot {n}: {m}")


@pytest.mark.parametrize("pooling", POOLING)
@pytest.mark.parametrize("from_rot", [False, True], ids=["k", "from-k_rot"])
def test_pooling_from_a_start_column_per_row_pools_each_rows_own_groups(pooling, from_rot):
    """``start``: row b's groups begin at its column start_b (a chunk whose rows sit at different offsets in a group).
    Each row's complete groups equal ``pool_core_tokens`` of that row from start_b; a last group that runs past the
    end is finite (its slot is never read)."""
    B, H, Hkv, L, d, g = 3, 4, 2, 23, 80, 5
    q, k, v, _, cos, sin = make_inputs(B, H, Hkv, L, d, seed=7, per_seq_rope=True)
    q_rot, k_rot = ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)
    start = torch.tensor([0, 3, 4], dtype=torch.int32, device=q.device)
    kc, vc = pool.pool_forward(q_rot, k_rot, None if from_rot else k, v, cos, sin, g, pooling, 0.3, start=start)
    assert kc.shape[2] == L // g and torch.isfinite(kc).all() and torch.isfinite(vc).all()
    for b, a in enumerate(start.tolist()):
        row = (x[b : b + 1, ..., a:, :] for x in (q_rot, k_rot, k, v))
        want_kc, want_vc = ref.pool_core_tokens(*row, cos[b : b + 1, a:], sin[b : b + 1, a:], g, pooling, 0.3)
        n = want_kc.shape[2]  # (L - a) // g complete groups
        torch.testing.assert_close(kc[b : b + 1, :, :n], want_kc, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vc[b : b + 1, :, :n], want_vc, atol=1e-5, rtol=1e-5)
    # all-zero starts are the plain pooling, bit for bit
    zero = pool.pool_forward(q_rot, k_rot, k, v, cos, sin, g, pooling, 0.3, start=torch.zeros(B, dtype=torch.int32, device=q.device))
    for a, b in zip(zero, pool.pool_forward(q_rot, k_rot, k, v, cos, sin, g, pooling, 0.3)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pooling", POOLING)
def test_return_core_gives_the_pooled_tokens(pooling):
    """What a KV cache keeps after prefill: the same core tokens as the reference, with the same output."""
    q, k, v, _, cos, sin = make_inputs(2, 4, 2, 27, 64, seed=5)
    out, kc, vc = tri.cca_attention_triton(q, k, v, cos, sin, 4, 6, pooling, return_core=True)
    want_out, want_kc, want_vc = ref.cca_attention_reference(q, k, v, cos, sin, 4, 6, pooling, return_core=True)
    for got, want in ((out, want_out), (kc, want_kc), (vc, want_vc)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert kc.shape == (2, 4 if pooling == "query" else 2, 27 // 4, 64)


def test_per_sequence_rope_and_strided_inputs():
    check(2, 4, 2, 30, 64, 3, 5, "kv", torch.float32, seed=1, per_seq_rope=True, transposed=True)


@pytest.mark.parametrize("pooling", ["kv", "query"])
def test_batch_broadcast_rope_table(pooling):
    # (1, L, d) tables at batch 3: the batch dim broadcasts (the model's training path passes exactly this).
    check(3, 4, 2, 30, 32, 4, 5, pooling, torch.float32, seed=2, batch1_rope=True, transposed=True)


@pytest.mark.parametrize("pooling", POOLING)
def test_fp16(pooling):
    check(2, 4, 1, 40, 64, 3, 5, pooling, torch.float16, seed=2)


def test_causal_when_window_covers_everything():
    q, k, v, _, cos, sin = make_inputs(1, 4, 2, 24, 64, seed=3)
    out = tri.cca_attention_triton(q, k, v, cos, sin, 4, 24)
    q_rot, k_rot = ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)
    full = torch.nn.functional.scaled_dot_product_attention(
        q_rot, k_rot.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
    )
    torch.testing.assert_close(out, full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("pooling", POOLING)
@pytest.mark.parametrize("B,H,Hkv,L,d,g,s", [pytest.param(2, 4, 1, 23, 80, 4, 6, id="gqa4-hd80"),
                                             pytest.param(1, 5, 1, 41, 64, 3, 7, id="gqa5"),
                                             pytest.param(2, 7, 7, 30, 64, 5, 4, id="mha7-g-gt-s")])
def test_prerotated_q_and_k_give_what_the_kernels_own_rope_gives(B, H, Hkv, L, d, g, s, pooling):
    """Handed q_rot/k_rot (the model's rotation) instead of rotating q and k itself, each backend gives the same
    output and, back through that rotation and the pooled pre-RoPE k, the same q/k/v gradients."""
    q, k, v, do, cos, sin = make_inputs(B, H, Hkv, L, d, seed=L, per_seq_rope=True)
    want = run(ref.cca_attention_reference, q, k, v, do, cos, sin, g, s, pooling, torch.float32)
    for fn in (ref.cca_attention_reference, tri.cca_attention_triton):
        got = run(_prerotated(fn), q, k, v, do, cos, sin, g, s, pooling, torch.float32)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m, n=name: f"{fn.__name__} {n}: {m}")


@pytest.mark.parametrize("pooling", POOLING)
@pytest.mark.parametrize("B,H,Hkv,L,d,g,s,scaled", [pytest.param(2, 4, 1, 23, 80, 4, 6, 1.0, id="gqa4-hd80"),
                                                    pytest.param(1, 5, 1, 41, 64, 3, 7, 1.3, id="gqa5-scaled"),
                                                    pytest.param(2, 7, 7, 30, 64, 5, 4, 0.7, id="mha7-scaled")])
def test_rotated_q_and_k_alone_give_what_the_pre_rope_k_gives(B, H, Hkv, L, d, g, s, scaled, pooling):
    """Given only q_rot/k_rot, the pooled pre-RoPE keys are un-rotated from k_rot (tables scaled as YaRN's attention
    factor does included): same output, and the same q/k/v gradients back through the model's rotation."""
    q, k, v, do, cos, sin = make_inputs(B, H, Hkv, L, d, seed=L, per_seq_rope=True)
    cos, sin = cos * scaled, sin * scaled
    want = run(ref.cca_attention_reference, q, k, v, do, cos, sin, g, s, pooling, torch.float32)
    for fn in (ref.cca_attention_reference, tri.cca_attention_triton):
        got = run(_rotated_only(fn), q, k, v, do, cos, sin, g, s, pooling, torch.float32)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m, n=name: f"{fn.__name__} {n}: {m}")


def test_unapply_rope_inverts_scaled_tables():
    x = torch.randn(2, 3, 11, 80, dtype=torch.float64)
    cos, sin = (t.double() * 1.7 for t in rope_tables(11, 80, batch=2, device="cpu"))
    torch.testing.assert_close(ref.unapply_rope(ref.apply_rope(x, cos, sin), cos, sin).double(), x, atol=1e-6, rtol=0)
    cos, sin = (t.double() for t in rope_tables(11, 80, device="cpu"))
    torch.testing.assert_close(ref.unapply_rope(ref.apply_rope(x, cos, sin), cos, sin).double(), x, atol=1e-6, rtol=0)


@pytest.mark.skipif(HAS_CUDA, reason="CPU tensors; the GPU side is test_gpu_use_gluon_runs_the_gluon_forward")
def test_gluon_forward_asked_for_where_it_cannot_run_is_an_error():
    q, k, v, do, cos, sin = make_inputs(1, 4, 1, 40, 32, 0)
    with pytest.raises(ValueError, match="use_gluon=True needs .*Hopper"):
        tri.cca_attention_triton(q, k, v, cos, sin, 4, 6, use_gluon=True)
    out = tri.cca_attention_triton(q, k, v, cos, sin, 4, 6, use_gluon=False)
    torch.testing.assert_close(out, tri.cca_attention_triton(q, k, v, cos, sin, 4, 6), atol=0, rtol=0)


def test_no_grad_and_bad_args():
    q, k, v, _, cos, sin = make_inputs(1, 2, 1, 9, 64, seed=4)
    with torch.no_grad():
        out = tri.cca_attention_triton(q, k, v, cos, sin, 2, 3)
    torch.testing.assert_close(out, ref.cca_attention_reference(q, k, v, cos, sin, 2, 3), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError):
        tri.cca_attention_triton(q, k, v, cos, sin, 2, 3, pooling="mean")
    with pytest.raises(ValueError, match="head_dim"):
        tri.cca_attention_triton(q[..., :63], k[..., :63], v[..., :63], cos[:, :63], sin[:, :63], 2, 3)
    with pytest.raises(ValueError):
        tri.cca_attention_triton(q, k, v, cos, sin, 0, 3)
    for fn in (tri.cca_attention_triton, ref.cca_attention_reference):
        with pytest.raises(ValueError, match="k_rot"):
            fn(q, None, v, cos, sin, 2, 3)


# ---------------------------------------------------------------- a chunk after a prefill (the cache's entry)
JUNK = 100.0  # scale of the values in columns and core slots the chunk entry must not read: a read shows


def chunk_case(starts, n, H, Hkv, d, g, s, pooling, seed, lead_extra=0, spare_slots=3):
    """Row b's chunk of ``n`` queries at positions ``starts[b] ..``, cut from a whole random sequence: the chunk
    entry's inputs (junk where a key column or core slot must not be read) and what the whole-sequence reference gives
    for those queries (fp32, on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    B, L, lead = len(starts), max(starts) + n, s + g - 1 + lead_extra
    q, k, v = (torch.randn(B, h, L, d, generator=gen) for h in (H, Hkv, Hkv))
    cos, sin = rope_tables(L, d, device="cpu")
    q_rot, k_rot = ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)
    core_heads = H if pooling == "query" else Hkv
    n_slots = L // g + spare_slots
    core_k, core_v = (JUNK * torch.randn(B, core_heads, n_slots, d, generator=gen) for _ in range(2))
    k_raw, v_raw = (JUNK * torch.randn(B, Hkv, lead + n, d, generator=gen) for _ in range(2))
    q_chunk, want = torch.empty(B, H, n, d), torch.empty(B, H, n, d)
    for b, t in enumerate(starts):
        end = t + n
        args = (k[b:b + 1, :, :end], v[b:b + 1, :, :end], cos[:end], sin[:end], g, s, pooling)
        out, kc, vc = ref.cca_attention_reference(q[b:b + 1, :, :end], *args, return_core=True)
        want[b], q_chunk[b] = out[0, :, t:], q_rot[b, :, t:end]
        core_k[b, :, : kc.shape[2]], core_v[b, :, : vc.shape[2]] = kc[0], vc[0]
        first = max(0, t - lead)  # columns of negative positions keep their junk
        k_raw[b, :, first - (t - lead):], v_raw[b, :, first - (t - lead):] = k_rot[b, :, first:end], v[b, :, first:end]
    inputs = [x.to(DEVICE) for x in (q_chunk, k_raw, v_raw, core_k, core_v)]
    return inputs, torch.tensor(starts, device=DEVICE), lead, want.to(DEVICE)


CHUNK_BACKENDS = [pytest.param(ref.cca_chunk_attention_reference, id="reference"),
                  pytest.param(tri.cca_chunk_attention_triton, id="triton")]


@pytest.mark.parametrize("fn", CHUNK_BACKENDS)
@pytest.mark.parametrize(
    "starts,n,H,Hkv,d,g,s,pooling,lead_extra",
    [
        pytest.param([0, 9, 30], 13, 4, 1, 64, 4, 6, "kv", 0, id="gqa4-from-0"),  # a row with no prompt (all pads)
        pytest.param([41, 5], 23, 5, 1, 80, 3, 7, "query", 0, id="gqa5-hd80"),
        pytest.param([17, 50], 11, 7, 7, 64, 5, 3, "kv", 2, id="mha7-g-gt-s-wider-lead"),
        pytest.param([70, 66, 3], 9, 4, 1, 64, 2, 5, "kv", 0, id="many-core-tokens"),
        pytest.param([64], 40, 8, 2, 64, 4, 37, "query", 0, id="long-window"),
    ],
)
def test_chunk_after_a_prefill_is_the_whole_sequence_attention(fn, starts, n, H, Hkv, d, g, s, pooling, lead_extra):
    """The cache's entry (queries starting at a per-row position, raw keys from the ring and the chunk, core tokens
    from the cache) gives, for those queries, what the whole-sequence reference gives: both backends, rows starting at
    different positions (0 included), GQA 1/4/5/7, g > s, core slots and key columns it must not read full of junk."""
    (q, k_raw, v_raw, core_k, core_v), starts, lead, want = chunk_case(starts, n, H, Hkv, d, g, s, pooling, seed=n,
                                                                        lead_extra=lead_extra)
    got = fn(q, k_raw, v_raw, core_k, core_v, starts, lead, g, s, d**-0.5)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("fn", CHUNK_BACKENDS)
def test_chunk_entry_refuses_keys_that_do_not_cover_the_window(fn):
    """Raw keys that start fewer than s + g - 1 positions before the chunk would silently miss keys its first queries
    see; raw keys of another length than lead + chunk are misread. Both: one clear error."""
    (q, k_raw, v_raw, core_k, core_v), starts, lead, _ = chunk_case([9, 30], 5, 4, 1, 64, 4, 6, "kv", seed=1)
    with pytest.raises(ValueError, match="key_lead must cover"):
        fn(q, k_raw[:, :, 1:], v_raw[:, :, 1:], core_k, core_v, starts, lead - 1, 4, 6, 0.125)
    with pytest.raises(ValueError, match="k_raw must hold"):
        fn(q, k_raw[:, :, :-1], v_raw[:, :, :-1], core_k, core_v, starts, lead, 4, 6, 0.125)
    with pytest.raises(ValueError, match="group_size"):
        fn(q, k_raw, v_raw, core_k, core_v, starts, lead, 0, 6, 0.125)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pooling", POOLING)
@pytest.mark.parametrize("H,Hkv,d", [pytest.param(32, 8, 128, id="llama-gqa4"), pytest.param(14, 2, 80, id="r7-hd80")])
def test_gpu_chunk_after_a_prefill(pooling, H, Hkv, d):
    """bf16 at a few thousand positions, rows at different offsets, FlashAttention-style tolerance (both backends in
    bf16 against the fp32 answer)."""
    inputs, starts, lead, want = chunk_case([3001, 1500], 2049, H, Hkv, d, 16, 100, pooling, seed=d)
    bf16 = [x.bfloat16() for x in inputs]
    got = tri.cca_chunk_attention_triton(*bf16, starts, lead, 16, 100, d**-0.5).float()
    low = ref.cca_chunk_attention_reference(*bf16, starts, lead, 16, 100, d**-0.5).float()
    assert torch.isfinite(got).all()
    err, ref_err = (got - want).abs().max().item(), (low - want).abs().max().item()
    assert err <= 2 * ref_err + 2e-3, f"triton err {err:.3e} vs reference-in-bf16 err {ref_err:.3e}"


# ---------------------------------------------------------------- GPU: long sequences, all head dims, bf16
@pytest.mark.parametrize("pooling", POOLING)
@pytest.mark.parametrize("H,Hkv", [pytest.param(8, 2, id="gqa4"), pytest.param(4, 4, id="mha")])
@pytest.mark.parametrize("L", seq_lengths(16, 100, extra=(1000, 4097)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_lengths(dtype, L, H, Hkv, pooling):
    check(2, H, Hkv, L, 128, 16, 100, pooling, dtype, seed=L)


@pytest.mark.parametrize("pooling", POOLING)
@pytest.mark.parametrize(
    "dtype,d",
    [(torch.bfloat16, 64), (torch.bfloat16, 80), (torch.bfloat16, 96), (torch.float16, 128), (torch.float32, 80),
     (torch.bfloat16, 256)],
    ids=["bf16-64", "bf16-80", "bf16-96", "fp16-128", "fp32-80", "bf16-256"],
)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_head_dims(dtype, d, pooling):
    check(2, 8, 2, 1000, d, 16, 100, pooling, dtype, seed=d)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pooling", POOLING)
@pytest.mark.parametrize("given", [pytest.param(True, id="with-k"), pytest.param("only", id="rotated-only")])
def test_gpu_prerotated_q_and_k(given, pooling):
    """The model's call (q and k rotated by its own RoPE; with the pre-RoPE k, or the pooling un-rotating k_rot) at a
    long length in bf16: GQA 4 with head dim 128, GQA 7 with head dim 80."""
    check(2, 8, 2, 4097, 128, 16, 100, pooling, torch.bfloat16, seed=9, prerotated=given)
    check(1, 14, 2, 3001, 80, 16, 500, pooling, torch.bfloat16, seed=10, prerotated=given)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_qwen_like_heads():
    """r = 7 (Qwen2.5-7B: 28 query heads, 4 KV heads), s not a multiple of g."""
    check(1, 14, 2, 3000, 128, 16, 500, "kv", torch.bfloat16, seed=7)
    check(1, 14, 2, 3000, 128, 16, 500, "query", torch.bfloat16, seed=8)


GLUON_ONLY = "the Gluon kernels serve sm_90 GPUs with triton 3.6 (gluon_parts.VERIFIED_TRITON)"


def gluon_serves_this_gpu():
    return tri.cca_gluon is not None and HAS_CUDA and tri.cca_gluon.hopper_ok(torch.empty(1, device="cuda",
                                                                                          dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_use_gluon_runs_the_gluon_forward():
    """On an sm_90 GPU with the verified triton, the default call and ``use_gluon=True`` run the Gluon forward (not a
    silent fallback from a failed import), close to the Triton forward's output; elsewhere asking for it is a clear
    error."""
    q = torch.randn(1, 8, 300, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, 2, 300, 128, device="cuda", dtype=torch.bfloat16)
    cos, sin = (x.to(torch.bfloat16) for x in rope_tables(300, 128))
    if not gluon_serves_this_gpu():
        with pytest.raises(ValueError, match="use_gluon=True needs"):
            tri.cca_attention_triton(q, k, v, cos, sin, 16, 100, use_gluon=True)
        pytest.skip(GLUON_ONLY)
    calls = []
    real = tri.cca_gluon.forward
    try:
        tri.cca_gluon.forward = lambda *a: calls.append(1) or real(*a)
        gluon_fwd = tri.cca_attention_triton(q, k, v, cos, sin, 16, 100, use_gluon=True)
        default = tri.cca_attention_triton(q, k, v, cos, sin, 16, 100)
        triton_fwd = tri.cca_attention_triton(q, k, v, cos, sin, 16, 100, use_gluon=False)
        # the Gluon softmax scales the raw scores' row max, which takes a positive scale: others run the Triton forward
        negative = tri.cca_attention_triton(q, k, v, cos, sin, 16, 100, scale=-0.05)
        negative_triton = tri.cca_attention_triton(q, k, v, cos, sin, 16, 100, scale=-0.05, use_gluon=False)
    finally:
        tri.cca_gluon.forward = real
    assert calls == [1, 1]
    assert torch.equal(default, gluon_fwd)
    torch.testing.assert_close(gluon_fwd, triton_fwd, atol=2e-2, rtol=0)
    assert torch.equal(negative, negative_triton)
    with pytest.raises(ValueError, match="a positive scale"):
        tri.cca_attention_triton(q, k, v, cos, sin, 16, 100, scale=-0.05, use_gluon=True)
    with pytest.raises(ValueError, match="not with use_tma=False"):
        tri.cca_attention_triton(q, k, v, cos, sin, 16, 100, use_gluon=True, use_tma=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pooling", POOLING)
@pytest.mark.parametrize(
    "B,H,Hkv,L,d,g,s,dtype,kw",
    [pytest.param(2, 8, 2, 4097, 128, 16, 100, torch.bfloat16, {}, id="gqa4-hd128-b2"),
     pytest.param(1, 10, 2, 3001, 64, 16, 500, torch.bfloat16, {}, id="gqa5-hd64"),
     pytest.param(1, 14, 2, 2000, 80, 16, 300, torch.bfloat16, {"transposed": True}, id="gqa7-hd80-strided"),
     pytest.param(2, 4, 4, 1000, 128, 16, 100, torch.float16, {"per_seq_rope": True}, id="mha-fp16"),
     pytest.param(1, 4, 1, 37, 128, 4, 6, torch.bfloat16, {}, id="short-g4"),
     # one stack of heads (pooling kv): a program's two work items are neighbouring blocks of different lengths
     pytest.param(1, 4, 1, 3001, 128, 16, 200, torch.bfloat16, {}, id="one-stack-gqa4"),
     pytest.param(1, 8, 2, 1, 128, 16, 100, torch.bfloat16, {}, id="one-token")],
)
def test_gpu_gluon_forward(B, H, Hkv, L, d, g, s, dtype, kw, pooling):
    """The warp-specialized forward (and the Triton backward on its logsumexp) against the reference: GQA 1/4/5/7,
    head dims 64/80/128, lengths off every tile and group size, batch 2, strided inputs, fp16."""
    if not gluon_serves_this_gpu():
        pytest.skip(GLUON_ONLY)
    check(B, H, Hkv, L, d, g, s, pooling, dtype, seed=L + d, use_gluon=True, **kw)
    check(B, H, Hkv, L, d, g, s, pooling, dtype, seed=L + d, use_gluon=True, prerotated="only", **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pooling", POOLING)
@pytest.mark.parametrize(
    "B,H,Hkv,L,d,g,s,dtype,kw",
    [pytest.param(2, 8, 2, 4097, 128, 16, 100, torch.bfloat16, {}, id="gqa4-hd128-b2"),
     # a stack of 4 heads reaches into the next KV group
     pytest.param(1, 10, 2, 3001, 128, 16, 500, torch.bfloat16, {}, id="gqa5"),
     pytest.param(1, 14, 2, 2000, 80, 16, 300, torch.bfloat16, {"transposed": True}, id="gqa7-hd80-strided"),
     pytest.param(1, 8, 2, 37, 128, 4, 6, torch.bfloat16, {}, id="shorter-than-a-tile"),
     pytest.param(1, 16, 4, 1000, 64, 8, 64, torch.bfloat16, {}, id="gqa4-hd64"),
     pytest.param(2, 8, 4, 1500, 128, 16, 200, torch.float16, {}, id="gqa2-fp16"),
     pytest.param(2, 4, 4, 300, 128, 16, 100, torch.bfloat16, {}, id="mha")],
)
@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "two-streams"])
def test_gpu_gluon_backward_gives_the_triton_kernels_numbers(B, H, Hkv, L, d, g, s, dtype, kw, pooling, one_launch,
                                                             monkeypatch):
    """The default call on an sm_90 GPU takes the Gluon forward, the Gluon dq kernel, and its dk/dv kernels wherever
    query heads are stacked (GQA). The backward kernels visit the same rows in the same order as the Triton kernels, so
    from the same forward (padded head dim 128) every gradient is bit-identical, and close to it otherwise: head dim
    64 (the Triton dk/dv kernels take 32-row tiles), and the gradients where the core tokens' pass is Gluon's (pooling
    kv: it sums its rows in bands, top down); bf16 and fp16. Pooling kv takes both dk/dv passes in one launch where
    the raw keys' programs are few (forced here either way)."""
    if not gluon_serves_this_gpu():
        pytest.skip(GLUON_ONLY)
    monkeypatch.setattr(tri, "_ONE_LAUNCH_WAVES", 10**9 if one_launch else 0)
    q, k, v, do, cos, sin = make_inputs(B, H, Hkv, L, d, seed=L + H, **kw)
    q, k, v, do = (x.to(dtype) for x in (q, k, v, do))
    calls = []
    real, real_dq, real_fwd, real_forward = tri.cca_gluon.dkdv, tri.cca_gluon.dq, tri.cca_gluon.forward, tri._forward
    real_one = tri.cca_gluon.dkdv_one_launch
    try:
        tri.cca_gluon.dkdv = lambda *a, **k_: calls.append(k_["raw"]) or real(*a, **k_)
        tri.cca_gluon.dkdv_one_launch = lambda *a, **k_: calls.append("one") or real_one(*a, **k_)
        tri.cca_gluon.dq = lambda *a: calls.append("dq") or real_dq(*a)
        tri.cca_gluon.forward = lambda *a: calls.append("fwd") or real_fwd(*a)
        gluon = run(functools.partial(tri.cca_attention_triton, use_gluon=None), q, k, v, do, cos, sin, g, s, pooling,
                    dtype)
        gluon_calls, calls[:] = list(calls), []
        # the Triton backward from the same (Gluon) forward: what the Gluon backward must reproduce
        tri._forward = lambda *a, **k_: real_forward(*a, **{**k_, "use_gluon": True})
        triton_bwd = run(functools.partial(tri.cca_attention_triton, use_gluon=False), q, k, v, do, cos, sin, g, s,
                         pooling, dtype)
        tri._forward = real_forward
        assert calls == ["fwd"]
        calls.clear()
        run(functools.partial(tri.cca_attention_triton, use_gluon=False), q, k, v, do, cos, sin, g, s, pooling, dtype)
        run(functools.partial(tri.cca_attention_triton, use_tma=False), q, k, v, do, cos, sin, g, s, pooling, dtype)
    finally:
        tri.cca_gluon.dkdv, tri.cca_gluon.dq, tri.cca_gluon.forward = real, real_dq, real_fwd
        tri.cca_gluon.dkdv_one_launch = real_one
        tri._forward = real_forward
    assert calls == []  # neither with use_gluon=False nor with use_tma=False
    stacked = Hkv < H  # the raw keys' kernel stacks the r query heads of a KV head
    core_stacked = stacked and pooling == "kv" and L >= g
    if core_stacked and one_launch:
        assert gluon_calls == ["fwd", "dq", "one"]
    else:  # core pass first, on the side stream
        assert gluon_calls == ["fwd", "dq"] + [False] * core_stacked + [True] * stacked
    for name, a, b in zip(("out", "dq", "dk", "dv"), gluon, triton_bwd):
        # pooling kv: the core tokens' gradients reach dk, dv, and dq through the pooling's scores
        if d > 64 and not (core_stacked and name != "out"):
            assert torch.equal(a, b), f"{name}: max |diff| {(a - b).abs().max().item():.3e}"
        else:
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.skipif(tri.cca_gluon is None, reason="triton without Gluon")
def test_gluon_one_launch_refuses_query_pooling():
    """Both dk/dv passes share one launch only when the core heads are the KV heads (pooling kv); with pooling query
    (one core head per query head) the call says so before it touches a GPU."""
    q = torch.zeros(1, 8, 64, 64)
    k = torch.zeros(1, 2, 64, 64)
    kc = torch.zeros(1, 8, 4, 64)  # pooling query: C = H
    dims = tri._Dims(q, k, kc, 16, 16, 0.125)
    lse = torch.zeros(1, 8, 64)
    with pytest.raises(ValueError, match="needs pooling kv"):
        tri.cca_gluon.dkdv_one_launch(q, k, k, kc, kc, q, lse, lse, dims, 4, 16, 1, n_split=1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "B,H,Hkv,L,d,g,s",
    [pytest.param(2, 8, 2, 4097, 128, 16, 100, id="gqa4-hd128-b2"),
     pytest.param(1, 10, 2, 3001, 128, 16, 500, id="gqa5"),
     pytest.param(1, 14, 2, 2000, 80, 16, 300, id="gqa7-hd80"),
     pytest.param(2, 8, 2, 4099, 128, 7, 300, id="g7-b2"),
     pytest.param(1, 8, 2, 37, 128, 4, 6, id="shorter-than-a-tile")],
)
@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "two-streams"])
def test_gpu_gluon_backward_kernels_before_the_pooling(B, H, Hkv, L, d, g, s, one_launch, monkeypatch):
    """What the end-to-end test above cannot see with pooling kv: before the pooling backward mixes them, dq and the
    raw keys' dk/dv of the Gluon backward are bit-identical to the Triton kernels', and the core tokens' fp32 sums
    (Gluon: bands; one launch with the raw keys' pass, or beside it on a side stream) differ from theirs only by the
    order of the additions."""
    if not gluon_serves_this_gpu():
        pytest.skip(GLUON_ONLY)
    monkeypatch.setattr(tri, "_ONE_LAUNCH_WAVES", 10**9 if one_launch else 0)
    q, k, v, do, cos, sin = (x.to(torch.bfloat16) for x in make_inputs(B, H, Hkv, L, d, seed=L + H))
    scale = d**-0.5
    kc, vc = tri.pool_forward(q, k, k, v, cos, sin, g, "kv", scale)
    dims = tri._Dims(q, k, kc, g, s, scale)
    o, lse = tri._forward(q, k, v, kc, vc, dims, use_gluon=True)
    gluon = tri._backward(do, q, k, v, kc, vc, o, lse, dims, use_gluon=None)
    triton_ = tri._backward(do, q, k, v, kc, vc, o, lse, dims, use_gluon=False)
    for name, a, b in zip(("dq", "dk", "dv"), gluon, triton_):
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max().item():.3e}"
    for name, a, b in zip(("dk_core", "dv_core"), gluon[3:], triton_[3:]):
        a, b = a.sum(0), b.sum(0)  # per-split partial sums: the splits differ, their total must not
        err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        assert torch.isfinite(a).all() and err < 1e-3, f"{name}: max |diff| / max |ref| = {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pooling", POOLING)
def test_gpu_gluon_chunk_on_a_128_border_gives_one_pass_numbers(pooling):
    """On an sm_90 GPU the chunk entry runs the Gluon forward with its rows offset. A chunk that starts on a multiple
    of 128 positions walks the tiles one pass walks, so it gives one pass's output bit for bit: what makes a chunked
    prefill equal to one pass (``benchmarks/prefill.py``'s |dh|)."""
    if not gluon_serves_this_gpu():
        pytest.skip(GLUON_ONLY)
    B, H, Hkv, L, d, g, s, start = 2, 8, 2, 1500, 128, 16, 100, 768
    q, k, v, _, cos, sin = (x.to(torch.bfloat16) for x in make_inputs(B, H, Hkv, L, d, seed=5))
    q_rot, k_rot = ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)
    whole, kc, vc = tri.cca_attention_triton(None, None, v, cos, sin, g, s, pooling, return_core=True, q_rot=q_rot,
                                             k_rot=k_rot)
    lead = s + g - 1 + 9  # raw keys from 9 columns before the first one the chunk's queries see
    pos = torch.full((B,), start, dtype=torch.int32, device=q.device)
    calls = []
    real = tri.cca_gluon.forward
    try:
        tri.cca_gluon.forward = lambda *a: calls.append(a[-2] is not None) or real(*a)
        got = tri.cca_chunk_attention_triton(q_rot[:, :, start:], k_rot[:, :, start - lead:], v[:, :, start - lead:],
                                             kc, vc, pos, lead, g, s, d**-0.5)
    finally:
        tri.cca_gluon.forward = real
    assert calls == [True]  # the Gluon forward, with rows offset
    assert torch.equal(got, whole[:, :, start:]), f"max |diff| {(got - whole[:, :, start:]).abs().max().item():.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pooling", POOLING)
def test_gpu_pointer_path(pooling):
    """The forward's tile fetch on a pre-Hopper GPU (or unaligned rows): pointer loads, same numbers."""
    check(2, 8, 2, 4097, 128, 16, 100, pooling, torch.bfloat16, seed=3, use_tma=False)
    check(2, 8, 2, 1000, 80, 16, 100, pooling, torch.bfloat16, seed=4, use_tma=False, transposed=True)
