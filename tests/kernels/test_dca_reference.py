"""The DCA reference twin against DCA-SPEC.md's "Must test" list (the CPU items: 1-4, 6-11 at small shapes).
Kernels, the cache class and the CLI method come later; everything they do will be compared with these functions."""

import json
import math

import pytest
import torch

from cca_convert.kernels import dca_reference as dca
from tests.support import naive_dca


def inv_freq(head_dim, rotary_dim=None, theta=10000.0):
    rot = rotary_dim or head_dim
    return 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)


def tensors(bsz=2, heads=4, kv=2, length=23, head_dim=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, heads, length, head_dim, generator=g, dtype=dtype)
    k = torch.randn(bsz, kv, length, head_dim, generator=g, dtype=dtype)
    v = torch.randn(bsz, kv, length, head_dim, generator=g, dtype=dtype)
    pos = torch.arange(length)[None].expand(bsz, -1)
    valid = torch.ones(bsz, length, dtype=torch.bool)
    return q, k, v, pos, valid


def rel_matrix(length, chunk, local):
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    pq, pk = dca.positions(i.expand(length, length), j.expand(length, length), chunk, local)
    return torch.where(j <= i, pq - pk, torch.full_like(pq, -1))


def test_paper_examples_relative_positions():
    # Fig. 2: c_p = 10, s = 6, w_p = 4 -> C = 9, w = 3
    m = rel_matrix(12, 9, 3)
    assert m[6, :7].tolist() == [6, 5, 4, 3, 2, 1, 0]
    assert m[11].tolist() == [9, 8, 7, 6, 5, 4, 5, 4, 3, 2, 1, 0]
    assert int(m.max()) == 9
    pq, pk = dca.positions(torch.arange(6, 12), torch.zeros(6, dtype=torch.long), 9, 3)
    assert pq.tolist() == [6, 7, 8, 9, 9, 9] and pk.tolist() == [0] * 6  # succ query positions of chunk 1
    # App. A.2: c_p = 8, s = 4, w_p = 3 -> C = 7, w = 3
    pq, _ = dca.positions(torch.arange(4, 8), torch.zeros(4, dtype=torch.long), 7, 3)
    assert pq.tolist() == [4, 5, 6, 7]
    pq, _ = dca.positions(torch.tensor([8, 11]), torch.tensor([0, 0]), 7, 3)
    assert pq.tolist() == [7, 7]  # inter


@pytest.mark.parametrize("chunk,local", [(9, 3), (7, 3), (5, 0), (11, 5), (16, 1)])
def test_distances_stay_in_the_trained_range(chunk, local):
    s, length = chunk - local, 5 * (chunk - local) + 3
    i = torch.arange(length)[:, None].expand(length, length)
    j = torch.arange(length)[None, :].expand(length, length)
    pq, pk = dca.positions(i, j, chunk, local)
    causal = j <= i
    d = (pq - pk)[causal]
    assert int(d.min()) >= 0 and int(d.max()) <= chunk and int(pq[causal].max()) <= chunk and int(pk.max()) <= s - 1
    intra = causal & (i // s == j // s)
    assert torch.equal((pq - pk)[intra], (i - j)[intra])  # intra distances are exact
    succ = causal & (i // s == j // s + 1)
    exact = (pq - pk) == (i - j)
    assert torch.equal(exact[succ], ((i % s) <= local)[succ])  # succ exact iff o(i) <= w
    assert bool((d == 0).sum() == length)  # D = 0 only on the diagonal


def test_config_rules_and_qwen_1m():
    qwen = json.loads('{"chunk_size": 262144, "local_size": 8192, "original_max_position_embeddings": 262144,'
                      ' "sparse_attention_enabled": true, "sparse_attention_threshold": 32768}')
    assert naive_dca.resolve_params(qwen, 262144) == (262144, 8192, 262144)  # s = 253952; sparse keys ignored
    assert naive_dca.resolve_params(None, 4096) == (3072, 512, 0)  # ChunkLlama default, temperature off
    assert naive_dca.resolve_params(None, 8192) == (6144, 1024, 0)
    for bad, match in [(dict(chunk_size=8, local_size=4), "must be < the chunk length"),
                       (dict(chunk_size=4, local_size=4), "must exceed local_size"),
                       (dict(chunk_size=9000, local_size=100), "exceeds the base model's trained context"),
                       (dict(chunk_size=8, local_size=-1), "must be >= 0"),
                       (dict(chunk_size=8.5, local_size=1), "must be an integer")]:
        with pytest.raises(ValueError, match=match):
            naive_dca.resolve_params(bad, 8192)


def test_temperature():
    assert float(dca.temperature(1000, 0)) == 1.0
    assert float(dca.temperature(262144, 262144)) == 1.0 and float(dca.temperature(1000, 262144)) == 1.0
    want = (0.1 * math.log(4.0) + 1) ** 2  # the square multiplies the logits (m applied to q and to k)
    assert float(dca.temperature(4 * 262144, 262144)) == pytest.approx(want)


@pytest.mark.parametrize("heads,kv,head_dim,rotary", [(4, 4, 16, None), (4, 1, 16, None), (5, 1, 8, None),
                                                       (7, 1, 16, 8)])
@pytest.mark.parametrize("chunk,local", [(7, 3), (5, 0), (9, 4)])
def test_reference_equals_the_naive_loop(heads, kv, head_dim, rotary, chunk, local):
    # L = 23 crosses several chunk boundaries and is not a multiple of s; batch 2 with a left-padded row
    q, k, v, pos, valid = tensors(heads=heads, kv=kv, head_dim=head_dim)
    valid = valid.clone()
    valid[1, :5] = False
    pos = (valid.long().cumsum(-1) - 1).clamp_min(0)
    freq = inv_freq(head_dim, rotary)
    args = (q, k, v, pos, pos, valid, valid, chunk, local, freq, head_dim**-0.5)
    want = naive_dca.dca_attention_naive(*args)
    torch.testing.assert_close(dca.dca_attention_reference(*args), want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(naive_dca.dca_attention_lse_merge(*args), want, atol=1e-10, rtol=1e-10)
    assert torch.isfinite(want).all() and not want[1, :, :5].any()  # pad rows: 0, finite


def test_lse_merge_equals_one_softmax_including_gradients():
    q, k, v, pos, valid = tensors(length=19)
    freq = inv_freq(16)
    grads = []
    for fn in (dca.dca_attention_reference, naive_dca.dca_attention_lse_merge):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, pos, pos, valid, valid, 7, 2, freq, 0.25)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_degenerates_to_plain_rope_attention_up_to_C_and_differs_after():
    chunk, local = 9, 3
    freq = inv_freq(16)
    q, k, v, pos, valid = tensors(length=chunk + 1)  # L <= C + 1: exactly the base model
    args = (q, k, v, pos, pos, valid, valid)
    torch.testing.assert_close(dca.dca_attention_reference(*args, chunk, local, freq, 0.25),
                               naive_dca.plain_rope_attention(*args, freq, 0.25), atol=1e-10, rtol=1e-10)
    q, k, v, pos, valid = tensors(length=30)  # longer: rows i <= C unchanged, every row i > C differs
    args = (q, k, v, pos, pos, valid, valid)
    got = dca.dca_attention_reference(*args, chunk, local, freq, 0.25)
    base = naive_dca.plain_rope_attention(*args, freq, 0.25)
    torch.testing.assert_close(got[:, :, : chunk + 1], base[:, :, : chunk + 1], atol=1e-10, rtol=1e-10)
    assert ((got[:, :, chunk + 1:] - base[:, :, chunk + 1:]).abs().amax(-1) > 1e-6).all()


def test_passes_over_a_cache_equal_one_pass():
    """Decode (one query per pass) and chunked prefill (cut inside a chunk and on a boundary) against all keys so
    far give the full pass's rows: a query's positions depend on its absolute position only."""
    chunk, local = 7, 2  # s = 5
    freq = inv_freq(16)
    q, k, v, pos, valid = tensors(length=27)
    full = dca.dca_attention_reference(q, k, v, pos, pos, valid, valid, chunk, local, freq, 0.25)
    for cuts in ([0, 3, 10, 15, 27], list(range(28))):  # mixed cut points; one token per pass
        rows = []
        for a, b in zip(cuts, cuts[1:]):
            rows.append(dca.dca_attention_reference(q[:, :, a:b], k[:, :, :b], v[:, :, :b], pos[:, a:b], pos[:, :b],
                                                    valid[:, :b], valid[:, a:b], chunk, local, freq, 0.25))
        torch.testing.assert_close(torch.cat(rows, 2), full, atol=1e-10, rtol=1e-10)


def test_left_padded_batch_equals_each_sequence_alone():
    chunk, local = 7, 2
    freq = inv_freq(16)
    q, k, v, pos, valid = tensors(bsz=2, length=26)
    valid = valid.clone()
    valid[1, :9] = False
    pos = (valid.long().cumsum(-1) - 1).clamp_min(0)
    batch = dca.dca_attention_reference(q, k, v, pos, pos, valid, valid, chunk, local, freq, 0.25)
    alone = dca.dca_attention_reference(q[1:, :, 9:], k[1:, :, 9:], v[1:, :, 9:], pos[1:, 9:], pos[1:, 9:],
                                        valid[1:, 9:], valid[1:, 9:], chunk, local, freq, 0.25)
    torch.testing.assert_close(batch[1:, :, 9:], alone, atol=1e-10, rtol=1e-10)


def test_temperature_scales_the_logits_of_the_pass():
    chunk, local = 7, 2
    freq = inv_freq(16)
    q, k, v, pos, valid = tensors(length=20)
    on = dca.dca_attention_reference(q, k, v, pos, pos, valid, valid, chunk, local, freq, 0.25, c_orig=5)
    # T = m(20)^2 with c_orig = 5 is the same as the scale multiplied by T
    t_mult = float(dca.temperature(20, 5))
    assert t_mult == pytest.approx((0.1 * math.log(4) + 1) ** 2)
    same = dca.dca_attention_reference(q, k, v, pos, pos, valid, valid, chunk, local, freq, 0.25 * t_mult)
    torch.testing.assert_close(on, same, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("heads,kv,head_dim,rotary", [(4, 4, 16, None), (4, 1, 16, None), (5, 1, 8, None),
                                                       (7, 1, 16, 8), (8, 2, 80, None)])
@pytest.mark.parametrize("chunk,local,block", [(7, 3, 4), (5, 0, 1024), (9, 4, 3)])
@pytest.mark.parametrize("c_orig", [0, 6])
def test_blocked_sdpa_path_equals_the_reference_with_gradients(heads, kv, head_dim, rotary, chunk, local, block,
                                                                c_orig):
    """The model's CPU path (wide queries through SDPA, blocks cut at every row's chunk boundaries) against the
    one-softmax reference: forward and the gradients of q, k and v, fp64, a left-padded row and a pad query inside the
    other row (so the block edges of the two rows differ), L = 23 not a multiple of s or of the block."""
    q, k, v, pos, valid = tensors(heads=heads, kv=kv, head_dim=head_dim)
    kvalid = valid.clone()
    kvalid[1, :5] = False
    pos = (kvalid.long().cumsum(-1) - 1).clamp_min(0)
    qvalid = kvalid.clone()
    qvalid[0, 11] = False  # a pad query between real ones: its output is 0, its row's neighbours are unaffected
    freq = inv_freq(head_dim, rotary)
    outs, grads = [], []
    for fn, extra in ((dca.dca_attention_reference, {}), (dca.dca_attention_blocked, {"block": block})):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, pos, pos, kvalid, qvalid, chunk, local, freq, head_dim**-0.5, c_orig, 1.1, **extra)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        outs.append(out)
        grads.append([t.grad for t in leaves])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-10, rtol=1e-10)
    assert not outs[1][0, :, 11].any() and not outs[1][1, :, :5].any() and torch.isfinite(outs[1]).all()
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_sdpa_path_over_a_cache_and_in_low_precision(dtype):
    """Passes over a rotated cache (decode steps and a chunked prefill, Lq < Lk) equal the reference's full pass in
    the inputs' precision (the products run in fp32 in both)."""
    chunk, local = 7, 2
    freq = inv_freq(16).float()
    q, k, v, pos, valid = (t.to(dtype) if t.is_floating_point() else t for t in tensors(length=27, kv=1))
    kr = dca.rotate_keys(k, pos, chunk, local, freq)
    full = dca.dca_attention_reference(q, kr, v, pos, pos, valid, valid, chunk, local, freq, 0.25, keys_rotated=True)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for cuts in ([0, 3, 10, 15, 27], [0, 25, 26, 27]):
        rows = [dca.dca_attention_blocked(q[:, :, a:b], kr[:, :, :b], v[:, :, :b], pos[:, a:b], pos[:, :b],
                                          valid[:, :b], valid[:, a:b], chunk, local, freq, 0.25, keys_rotated=True,
                                          block=4) for a, b in zip(cuts, cuts[1:])]
        got = torch.cat(rows, 2)
        assert got.dtype == dtype
        torch.testing.assert_close(got, full, **tol)
