"""The finetune's loss without whole-sequence logits equals transformers' own loss, and so do every gradient."""

import pytest
import torch

from cca_convert.finetune.chunked_loss import ChunkedLoss, chunked_cross_entropy
from tests.support.factories import cca_hf_model_from, family_and_overrides, tiny_base_model


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batch(vocab, batch=2, length=37, pad=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    labels = ids.clone()
    mask = torch.ones_like(ids)
    if pad:
        labels[0, -pad:] = -100
        mask[0, -pad:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gemma3_text", "phi3", "llama-tied-llama3"])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_loss_and_gradients_equal_the_models_own(family, chunk):
    fam, overrides = family_and_overrides(family)
    base = tiny_base_model(fam, **overrides).float()
    model = cca_hf_model_from(base, group_size=4, local_window=8, attn_backend="reference").train()
    batch = _batch(model.config.vocab_size, pad=5)
    want_loss, want = _loss_and_grads(model, batch)
    with ChunkedLoss(model, chunk=chunk):
        got_loss, got = _loss_and_grads(model, batch)
        assert model(**batch).logits.shape[-1] == model.config.hidden_size  # engaged: no vocabulary-wide logits
    assert set(got) == set(want)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    after_loss, _ = _loss_and_grads(model, batch)  # removed: the model's own forward again (logits, not hidden)
    assert model(**batch).logits.shape[-1] == model.config.vocab_size
    torch.testing.assert_close(after_loss, want_loss)


def test_softcapped_logits_are_capped_per_chunk():
    base = tiny_base_model("gemma3_text", **family_and_overrides("gemma3_text")[1]).float()
    base.config.final_logit_softcapping = 3.0
    batch = _batch(base.config.vocab_size)
    want_loss, want = _loss_and_grads(base.train(), batch)
    with ChunkedLoss(base, chunk=5):
        got_loss, got = _loss_and_grads(base, batch)
    assert base.config.final_logit_softcapping == 3.0
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_lora_wrapped_model_trains_the_same():
    from peft import LoraConfig, get_peft_model

    base = tiny_base_model("llama").float()
    model = cca_hf_model_from(base, group_size=4, local_window=8, attn_backend="reference")
    chunked = ChunkedLoss(model, chunk=9).install()
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    batch = _batch(model.config.vocab_size, length=29)
    got_loss, got = _loss_and_grads(peft_model.train(), batch)
    chunked.remove()
    want_loss, want = _loss_and_grads(peft_model, batch)
    assert got and set(got) == set(want)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_chunk_never_holds_more_than_its_logits():
    """Peak extra memory is one chunk's logits, not the sequence's: measured with a saved-tensor hook counting
    what autograd keeps for the backward pass."""
    vocab, dim, length = 5000, 16, 4096
    head = torch.nn.Linear(dim, vocab, bias=False)
    hidden = torch.randn(1, length, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (1, length))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_cross_entropy(hidden, head, labels, chunk=256)
    assert max(saved) < 4 * 256 * vocab  # never a (4096, 5000) logits tensor
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.functional.cross_entropy(head(hidden[0, :-1]).float(), labels[0, 1:])
    assert max(saved) >= 4 * (length - 1) * vocab  # the unchunked path does keep them (the test can fail)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_chunked_loss_on_the_gpu_under_bf16_autocast_with_the_triton_kernels(family):
    """The trainer's setting: fp32 master weights, bf16 autocast, the Triton CCA kernels; chunks of an odd size."""
    fam, overrides = family_and_overrides(family)
    base = tiny_base_model(fam, **overrides).float()
    model = cca_hf_model_from(base, group_size=4, local_window=16, attn_backend="triton").cuda().train()
    batch = {k: v.cuda() for k, v in _batch(model.config.vocab_size, length=301, pad=7).items()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want_loss, want = _loss_and_grads(model, batch)
        with ChunkedLoss(model, chunk=37):
            got_loss, got = _loss_and_grads(model, batch)
    torch.testing.assert_close(got_loss, want_loss, rtol=2e-3, atol=2e-3)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=2e-2, atol=2e-3, msg=name)
