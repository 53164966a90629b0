"""Speculative decoding on the exported CCA model (issue #14): the compressed cache drops the rejected draft
tokens of a verification pass (``crop``), so ``generate(prompt_lookup_num_tokens=...)`` and
``generate(assistant_model=...)`` give exactly plain greedy output. g=4, s=8: groups complete (and are pooled)
inside verification passes, and the prompt is longer than the window."""

import pytest
import torch

from tests.factories import cca_hf_model_from, tiny_base_model

G, S = 4, 8


def _models(device="cpu"):
    base = tiny_base_model("llama", **{"max_position_embeddings": 512, "pad_token_id": 0, "eos_token_id": 2})
    backend = "triton" if device == "cuda" else "reference"
    model = cca_hf_model_from(base, group_size=G, local_window=S, attn_backend=backend)
    return base.to(device), model.to(device)


def _prompt(bsz=1, seed=4):
    unit = torch.randint(3, 96, (bsz, 9), generator=torch.Generator().manual_seed(seed))
    return torch.cat([unit, unit[:, :5], unit, unit[:, 2:]], 1)  # repeats: prompt lookup finds drafts


@torch.no_grad()
def test_prompt_lookup_equals_greedy():
    _, model = _models()
    prompt = _prompt()
    kw = dict(max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True)
    greedy = model.generate(prompt, **kw)
    lookup = model.generate(prompt, prompt_lookup_num_tokens=5, **kw)
    assert torch.equal(lookup, greedy)


@torch.no_grad()
@pytest.mark.parametrize("assistant", ["same weights", "other weights"])
def test_assisted_generation_equals_greedy(assistant):
    base, model = _models()
    draft = base if assistant == "same weights" else tiny_base_model("llama", seed=3, **{
        "max_position_embeddings": 512, "pad_token_id": 0, "eos_token_id": 2})
    prompt = _prompt(seed=7)
    kw = dict(max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True)
    greedy = model.generate(prompt, **kw)
    assisted = model.generate(prompt, assistant_model=draft, **kw)
    assert torch.equal(assisted, greedy)


@torch.no_grad()
def test_crop_restores_the_exact_state():
    """Prefill, a 7-token pass, crop 5 of them, then decode: logits equal a run that never saw the 5."""
    _, model = _models()
    ids = _prompt()
    out = model(ids[:, :20], use_cache=True)
    cache = out.past_key_values
    model(ids[:, 20:27], past_key_values=cache)
    cache.crop(-5)  # transformers >= 5.18 convention; older versions pass the length to keep (22)
    assert cache.get_seq_length() == 22
    got = [model(ids[:, i:i + 1], past_key_values=cache).logits for i in range(22, 30)]
    ref_cache = model(ids[:, :22], use_cache=True).past_key_values
    want = [model(ids[:, i:i + 1], past_key_values=ref_cache).logits for i in range(22, 30)]
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), atol=1e-5, rtol=1e-5)
    cache2 = model(ids[:, :20], use_cache=True).past_key_values
    cache2.crop(17)  # after a prefill: its tail is kept, so it can be dropped too (positive = length to keep)
    torch.testing.assert_close(model(ids[:, 17:18], past_key_values=cache2).logits,
                               model(ids[:, :18], use_cache=False).logits[:, -1:], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_crop_past_the_last_pass_is_refused_with_the_reason():
    _, model = _models()
    cache = model(_prompt()[:, :20], use_cache=True).past_key_values
    model(_prompt()[:, 20:21], past_key_values=cache)
    with pytest.raises(RuntimeError, match="can drop only columns of its last forward pass"):
        cache.crop(-1)


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_speculative_decoding_equals_greedy_with_the_triton_kernels():
    """On CUDA the prefill and one-token steps run the Triton kernels (which write the cache in place): prompt
    lookup and an assistant model still give exactly greedy output."""
    base, model = _models("cuda")
    prompt = _prompt(bsz=1, seed=7).cuda()
    kw = dict(max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True)
    greedy = model.generate(prompt, **kw)
    assert torch.equal(model.generate(prompt, prompt_lookup_num_tokens=5, **kw), greedy)
    assert torch.equal(model.generate(prompt, assistant_model=base, **kw), greedy)
