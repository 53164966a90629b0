"""The PyTorch reference (kernels/cca_reference.py) against the naive per-query twin and the spec."""

import pytest
import torch
import torch.nn.functional as F

from cca_convert.kernels import cca_reference as ref
from tests.support.naive_cca import naive_cca_attention

G, S = 4, 6  # g does not divide s


def rope_tables(seq_len, head_dim, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def inputs(bsz, n_heads, n_kv, seq_len, head_dim, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, n_heads, seq_len, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(bsz, n_kv, seq_len, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(bsz, n_kv, seq_len, head_dim, generator=gen, dtype=torch.float64)
    cos, sin = rope_tables(seq_len, head_dim)
    return [t.to(dtype) for t in (q, k, v, cos, sin)]


@pytest.mark.parametrize("pooling", ["kv", "query"])
@pytest.mark.parametrize("heads", [(4, 1), (2, 2)], ids=["gqa4:1", "mha"])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("seq_len", [1, G - 1, G, S, S + 1, S + G - 1, 3 * S + 5])
def test_reference_matches_naive(seq_len, head_dim, heads, pooling):
    q, k, v, cos, sin = inputs(2, *heads, seq_len, head_dim)
    out = ref.cca_attention_reference(q, k, v, cos, sin, G, S, pooling)
    expected = naive_cca_attention(q, k, v, cos, sin, G, S, pooling)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling", ["kv", "query"])
@pytest.mark.parametrize("heads", [(4, 1), (2, 2)], ids=["gqa4:1", "mha"])
@pytest.mark.parametrize("seq_len", [G, S + G - 1, 3 * S + 5])
def test_reference_gradients_match_naive(seq_len, heads, pooling):
    q, k, v, cos, sin = inputs(2, *heads, seq_len, 80)
    grad_out = torch.randn(2, heads[0], seq_len, 80, dtype=torch.float64)

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        (fn(*leaves, cos.to(dtype), sin.to(dtype), G, S, pooling) * grad_out.to(dtype)).sum().backward()
        return [t.grad.double() for t in leaves]

    for got, expected, name in zip(grads(ref.cca_attention_reference, torch.float32),
                                   grads(naive_cca_attention, torch.float64), "qkv"):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=f"d{name}")


def full_causal(q, k, v, cos, sin):
    rep = q.shape[1] // k.shape[1]
    q, k = ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("pooling", ["kv", "query"])
@pytest.mark.parametrize("seq_len", [1, 5, 17, 32])
def test_equals_full_attention_when_window_covers_sequence(seq_len, pooling):
    q, k, v, cos, sin = inputs(2, 4, 2, seq_len, 64)
    out = ref.cca_attention_reference(q, k, v, cos, sin, group_size=4, local_window=32, pooling=pooling)
    torch.testing.assert_close(out, full_causal(q, k, v, cos, sin), atol=1e-5, rtol=0)


@pytest.mark.parametrize("local_window", [1, 3, 16])
def test_equals_full_attention_when_group_size_is_one(local_window):
    # A group of one token pools to itself (weight 1, rotated at its own position).
    q, k, v, cos, sin = inputs(2, 4, 2, 29, 64)
    out = ref.cca_attention_reference(q, k, v, cos, sin, group_size=1, local_window=local_window)
    torch.testing.assert_close(out, full_causal(q, k, v, cos, sin), atol=1e-5, rtol=0)


def test_differs_from_full_attention_past_the_window():
    q, k, v, cos, sin = inputs(1, 4, 2, 40, 64)
    out = ref.cca_attention_reference(q, k, v, cos, sin, group_size=4, local_window=8)
    full = full_causal(q, k, v, cos, sin)
    torch.testing.assert_close(out[:, :, :8], full[:, :, :8], atol=1e-5, rtol=0)
    assert (out[:, :, 12:] - full[:, :, 12:]).abs().max() > 1e-2


@pytest.mark.parametrize("pooling", ["kv", "query"])
def test_every_earlier_token_is_reachable(pooling):
    """Paper Prop. 1: d out_t / d v_tau != 0 for every tau <= t, also far past the window."""
    seq_len, g, s = 37, 4, 6
    q, k, v, cos, sin = inputs(1, 2, 1, seq_len, 64)
    v.requires_grad_()
    out = ref.cca_attention_reference(q, k, v, cos, sin, g, s, pooling)
    for t in (s + g, 20, seq_len - 1):
        (grad_v,) = torch.autograd.grad(out[0, :, t].sum(), v, retain_graph=True)
        reach = grad_v[0, 0].abs().sum(-1)
        assert (reach[: t + 1] > 0).all(), f"query {t} cannot reach {torch.nonzero(reach[: t + 1] == 0).flatten()}"
        assert (reach[t + 1 :] == 0).all(), "causality"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_close_to_fp32(dtype):
    q, k, v, cos, sin = inputs(2, 4, 2, 45, 64)
    expected = ref.cca_attention_reference(q, k, v, cos, sin, 4, 6)
    low = [t.to(dtype) for t in (q, k, v, cos, sin)]
    out = ref.cca_attention_reference(*low, 4, 6)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_rejects_bad_sizes():
    q, k, v, cos, sin = inputs(1, 2, 1, 8, 64)
    with pytest.raises(ValueError, match="group_size"):
        ref.cca_attention_reference(q, k, v, cos, sin, 0, 4)
