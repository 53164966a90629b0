"""The published modeling file against the base transformers models it replaces."""

import pytest
import torch

from tests.support.factories import LLAMA3_ROPE, cca_model_from, tiny_base_model

CASES = {
    "llama-gqa": dict(family="llama"),
    "llama3.1-rope-tied": dict(family="llama", rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
    "llama-mha-bias": dict(family="llama", num_key_value_heads=4, attention_bias=True),
    "qwen2-bias": dict(family="qwen2", num_attention_heads=8, num_key_value_heads=2, head_dim=8),
}


def ids(seq_len, bsz=2, vocab=96, seed=0):
    return torch.randint(0, vocab, (bsz, seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("pooling", ["kv", "query"])
def test_window_covering_sequence_gives_base_logits(case, pooling):
    base = tiny_base_model(**CASES[case])
    model = cca_model_from(base, group_size=4, local_window=64, pooling=pooling)
    x = ids(50)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, base(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_small_window_changes_logits_after_it(case):
    base = tiny_base_model(**CASES[case])
    model = cca_model_from(base, group_size=4, local_window=6)
    x = ids(50)
    with torch.no_grad():
        got, expected = model(x).logits, base(x).logits
    torch.testing.assert_close(got[:, :6], expected[:, :6], atol=1e-5, rtol=0)
    assert (got[:, 12:] - expected[:, 12:]).abs().max() > 1e-3


def test_full_backend_is_plain_attention():
    base = tiny_base_model()
    model = cca_model_from(base, group_size=4, local_window=6, attn_backend="full")
    x = ids(40)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, base(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn_backend", ["reference", "full"])
def test_left_padding_equals_unpadded(attn_backend):
    base = tiny_base_model()
    model = cca_model_from(base, group_size=4, local_window=6, attn_backend=attn_backend)
    x = ids(30)
    mask = torch.ones_like(x)
    mask[1, :7] = 0
    with torch.no_grad():
        padded = model(x, attention_mask=mask).logits
        alone = model(x[1:, 7:]).logits
        first = model(x[:1]).logits
    torch.testing.assert_close(padded[1, 7:], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(padded[0], first[0], atol=1e-5, rtol=0)


def test_inner_padding_is_refused():
    model = cca_model_from(tiny_base_model(), group_size=4, local_window=6)
    x = ids(12)
    mask = torch.ones_like(x)
    mask[0, 5] = 0
    with pytest.raises(ValueError, match="left or right padding"):
        model(x, attention_mask=mask)


def test_loss_and_gradients_flow():
    model = cca_model_from(tiny_base_model(), group_size=4, local_window=6).train()
    x = ids(33)
    out = model(x, labels=x)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0  # through pooling weights too


def test_gradient_checkpointing_matches():
    model = cca_model_from(tiny_base_model(), group_size=4, local_window=6).train()
    x = ids(33)
    model(x, labels=x).loss.backward()
    plain = model.model.layers[0].self_attn.k_proj.weight.grad.clone()
    model.zero_grad()
    model.gradient_checkpointing_enable()
    model(x, labels=x).loss.backward()
    torch.testing.assert_close(model.model.layers[0].self_attn.k_proj.weight.grad, plain, atol=1e-6, rtol=1e-5)
