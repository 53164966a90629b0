"""CCA inside transformers' stock model classes (modeling/cca_hf.py, design C): it reproduces the project's own
CCA model, equals the stock model when the window covers the sequence, really changes attention when it does not,
decodes from its compressed cache exactly as a no-cache loop does, and trains — on tiny random checkpoints of
several families built from transformers' own configs."""

import copy
import os
import sys
import warnings

import pytest
import torch
import transformers

from cca_convert.families import FAMILIES as TABLE
from cca_convert.modeling import cca_hf as hf
from cca_convert.modeling import dca_hf
from cca_convert.modeling import decode_graph
from cca_convert.modeling.attention_hooks import CACHE_ARG
from tests.modeling.test_dca_hf import stock_and_dca
from tests.support.factories import TINY, cca_hf_model_from, cca_model_from, tiny_base_model


def cca_class(base):
    return type(f"CCA{base.__name__}", (hf.CCAModelMixin, base), {})

FAMILIES = list(TABLE)  # every supported family, from the one table


def stock_and_cca(family, g=4, s=8, seed=0):
    """A tiny random stock model of ``family`` and the same weights in its CCA class (reference backend)."""
    stock = tiny_base_model(family, seed=seed, **{"max_position_embeddings": 256, "head_dim": 16, "bos_token_id": 1,
                                                  "eos_token_id": 2, "pad_token_id": 0, **TINY.get(family, {})})
    return stock, cca_hf_model_from(stock, group_size=g, local_window=s, attn_backend="reference")


def ids(bsz=2, length=37, seed=1):
    return torch.randint(3, 96, (bsz, length), generator=torch.Generator().manual_seed(seed))


def test_reproduces_the_project_cca_model_on_llama():
    base = tiny_base_model(max_position_embeddings=256)
    legacy = cca_model_from(base, group_size=4, local_window=8, attn_backend="reference")
    config = copy.deepcopy(base.config)
    config.cca_group_size, config.cca_local_window, config.cca_attn_backend = 4, 8, "reference"
    config._attn_implementation = "cca"
    shim = cca_class(transformers.LlamaForCausalLM)(config).eval()
    shim.load_state_dict(base.state_dict())
    x = ids()
    mask = torch.ones_like(x)
    mask[1, :5] = 0  # left padding
    with torch.no_grad():
        for m in (None, mask):
            want = legacy(x, attention_mask=m, use_cache=False).logits
            got = shim(x, attention_mask=m, use_cache=False).logits
            keep = slice(None) if m is None else m.bool()
            torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_window_covering_the_sequence_equals_the_stock_model(family):
    stock, cca = stock_and_cca(family, g=4, s=64)
    x = ids(length=40)
    with torch.no_grad():
        torch.testing.assert_close(cca(x, use_cache=False).logits, stock(x, use_cache=False).logits,
                                   atol=2e-5, rtol=2e-5)
    small = stock_and_cca(family, g=4, s=8)[1]
    with torch.no_grad():
        assert (small(x, use_cache=False).logits - stock(x, use_cache=False).logits).abs().max() > 1e-3


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_cached_greedy_decode_equals_a_no_cache_loop(family):
    _, cca = stock_and_cca(family, g=4, s=8)
    prompt = ids(bsz=1, length=21)
    with torch.no_grad():
        cache = cca(prompt, use_cache=True).past_key_values
        assert isinstance(cache, hf.HFCCACache) and cache.get_seq_length() == 21  # compressed, not a full KV cache
        out = cca.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0)
        loop = prompt
        for _ in range(12):
            nxt = cca(loop, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            loop = torch.cat((loop, nxt), 1)
    assert torch.equal(out, loop)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_training_step_gives_finite_qkv_gradients(family):
    _, cca = stock_and_cca(family, g=4, s=8)
    cca.train()
    x = ids(length=30)
    loss = cca(x, labels=x, use_cache=False).loss
    loss.backward()
    names = [n for n, p in cca.named_parameters() if any(t in n for t in ("q_proj", "k_proj", "qkv_proj"))]
    assert names and all(torch.isfinite(dict(cca.named_parameters())[n].grad).all() for n in names)
    assert torch.isfinite(loss)


def test_the_pooling_undoes_every_familys_rope_and_another_rope_goes_back_through_its_own_function(monkeypatch):
    """Every supported family's RoPE is rotate_half, which the pooling undoes itself (no un-rotation pass); a RoPE that
    is not (here: one that refuses the probe's inputs) is undone by the family's own function with inverse tables,
    with the same logits and q/k/v gradients."""
    for family in FAMILIES:
        module = sys.modules[getattr(transformers, TABLE[family].causal_lm).__module__]
        assert hf.rotates_half(module.apply_rotary_pos_emb), family
    stock, cca = stock_and_cca("llama", g=4, s=8)
    x = ids(length=30)

    def logits_and_grads():
        cca.zero_grad()
        out = cca(x, use_cache=False).logits
        out.float().square().mean().backward()
        grads = [p.grad.clone() for n, p in cca.named_parameters() if any(t in n for t in ("q_proj", "k_proj", "v_proj"))]
        return [out.detach(), *grads]

    want = logits_and_grads()
    llama = transformers.models.llama.modeling_llama
    stock_rope, undone = llama.apply_rotary_pos_emb, []

    def rope(q, k, cos, sin, unsqueeze_dim=1):
        if q.dtype == torch.float64:
            raise TypeError("no float64 here")
        undone.append(q.shape[1] == 0)  # attention_hooks.unrope passes q with no heads
        return stock_rope(q, k, cos, sin, unsqueeze_dim)

    monkeypatch.setattr(llama, "apply_rotary_pos_emb", rope)
    assert not hf.rotates_half(rope)
    got = logits_and_grads()
    assert undone.count(True) == cca.config.num_hidden_layers
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter only")
def test_triton_backend_through_the_stock_classes_matches_the_reference():
    _, ref = stock_and_cca("qwen3", g=4, s=8)
    tri = copy.deepcopy(ref)
    tri.config.cca_attn_backend = "triton"
    x = ids(length=29)
    with torch.no_grad():
        torch.testing.assert_close(tri(x, use_cache=False).logits, ref(x, use_cache=False).logits, atol=1e-4, rtol=1e-4)


def test_sliding_window_layers_keep_their_own_attention():
    """A sliding-window layer is not CCA's to change: with every layer sliding (Mistral as stored; the converter
    is what replaces such a window) the shim equals the stock model, cached and not."""
    stock = tiny_base_model("mistral", max_position_embeddings=256, pad_token_id=0, eos_token_id=2, sliding_window=16)
    model = cca_hf_model_from(stock, group_size=4, local_window=8, attn_backend="reference")
    x = ids(length=40)
    with torch.no_grad():
        torch.testing.assert_close(model(x, use_cache=False).logits, stock(x, use_cache=False).logits,
                                   atol=1e-5, rtol=1e-5)
        got = model.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0)
        want = stock.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def _windowed_attention_fp64(query, key, value, pad, scaling, window):
    """Sliding-window causal attention written out (fp64): query i (column kv_len - q_len + i) sees keys j with
    j <= i's column < j + window that are not padding, and always its own key (a pad row gets no NaN)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    n_rep = query.shape[1] // key.shape[1]
    k, v = (x.double().repeat_interleave(n_rep, dim=1) for x in (key, value))
    q_col = torch.arange(kv_len - q_len, kv_len)[:, None]
    k_col = torch.arange(kv_len)[None, :]
    mask = (k_col <= q_col) & (q_col - k_col < window)
    if pad is not None:
        mask = mask[None, None] & (pad[:, None, None, -kv_len:].bool() | (k_col == q_col))
    scores = (query.double() @ k.transpose(-1, -2) * scaling).masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("q_len,kv_len,n_heads,n_kv,head_dim,window,padded", [
    (1, 16, 4, 4, 64, 16, False),       # a decode step over a full sliding cache
    (40, 40, 4, 1, 80, 16, True),       # short: one call
    (64, 64, 4, 4, 64, 16, False),      # the longest single call (4 x window)
    (65, 65, 5, 1, 64, 16, True),       # the first blocked length: blocks of 2 x window, GQA 5
    (203, 203, 7, 1, 80, 16, True),     # odd length, a partial last block, GQA 7
    (150, 165, 8, 2, 128, 16, True),    # a prefill after cached keys (chunked prefill), GQA 4
    (97, 97, 4, 4, 64, 5, False),       # a window that divides nothing
])
def test_sliding_window_attention_by_blocks_equals_the_whole_masked_attention(q_len, kv_len, n_heads, n_kv, head_dim,
                                                                           window, padded):
    """A local layer's attention goes by query blocks over the keys each window can reach: output and every gradient
    equal the window written out (fp64) over odd lengths, GQA ratios 1/4/5/7, head dims 64/80/128, batch 2 with a
    left-padded row, and keys already cached."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    q = torch.randn(2, n_heads, q_len, head_dim, requires_grad=True)
    k, v = (torch.randn(2, n_kv, kv_len, head_dim, requires_grad=True) for _ in range(2))
    pad = None
    if padded:
        pad = torch.ones(2, kv_len, dtype=torch.long)
        pad[1, :7] = 0
    module = SimpleNamespace(num_key_value_groups=n_heads // n_kv, is_causal=True, training=False)
    scaling = head_dim ** -0.5
    got = hf._sliding_attention(module, q, k, v, pad, scaling, window)
    want = _windowed_attention_fp64(q, k, v, pad, scaling, window)
    assert got.shape == (2, q_len, n_heads, head_dim)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)
    grad = torch.randn_like(want)
    got_grads = torch.autograd.grad(got, (q, k, v), grad.float())
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=2e-5)


def test_long_inputs_through_sliding_window_layers_equal_the_stock_model():
    """The blocked local attention inside the model: a left-padded batch longer than 4 windows gives the stock
    model's logits (its own masked SDPA over the whole sequence), and greedy decoding after it the stock tokens."""
    stock = tiny_base_model("mistral", max_position_embeddings=512, pad_token_id=0, eos_token_id=2, sliding_window=16)
    model = cca_hf_model_from(stock, group_size=4, local_window=8, attn_backend="reference")
    x = ids(bsz=2, length=150)
    mask = torch.ones_like(x)
    mask[1, :11] = 0
    real = mask.bool()  # (pad rows' logits are nobody's: the stock model and this one fill them differently)
    with torch.no_grad():
        torch.testing.assert_close(model(x, attention_mask=mask, use_cache=False).logits[real],
                                   stock(x, attention_mask=mask, use_cache=False).logits[real], atol=1e-5, rtol=1e-5)
        got = model.generate(x, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        want = stock.generate(x, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def test_a_decode_steps_inputs_equal_the_stock_preparation(monkeypatch):
    """The one-token step's fast preparation hands forward() exactly what transformers' own method does; every other
    call (prefill, several tokens, inputs it does not know) is the stock method's."""
    _, cca = stock_and_cca("llama")
    stock = transformers.GenerationMixin.prepare_inputs_for_generation
    cache = hf.HFCCACache(cca.config)
    x, mask = ids(bsz=2, length=9), torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    fast = [dict(next_sequence_length=1, past_key_values=cache, attention_mask=mask, use_cache=True),
            dict(next_sequence_length=1, past_key_values=cache, attention_mask=None),
            dict(next_sequence_length=1, past_key_values=cache, attention_mask=mask, position_ids=mask.cumsum(-1)),
            dict(next_sequence_length=1, past_key_values=cache, position_ids=mask[:, -1:], use_cache=True),
            # what generate() passes (it names logits_to_keep for a forward whose signature shows it)
            dict(next_sequence_length=1, past_key_values=cache, attention_mask=mask, logits_to_keep=1, use_cache=True,
                 position_ids=None)]
    slow = [dict(next_sequence_length=1, past_key_values=cache, attention_mask=mask, is_first_iteration=True),
            dict(next_sequence_length=3, past_key_values=cache, attention_mask=mask, use_cache=True),
            dict(next_sequence_length=1, past_key_values=cache, attention_mask=mask, token_type_ids=mask),
            dict(next_sequence_length=1, past_key_values=None, attention_mask=mask)]
    for n, kwargs in enumerate(fast + slow):
        want = stock(cca, x, **kwargs)
        stock_calls = []
        monkeypatch.setattr(transformers.GenerationMixin, "prepare_inputs_for_generation",
                            lambda *a, **k: stock_calls.append(1) or stock(*a, **k))
        got = cca.prepare_inputs_for_generation(x, **kwargs)
        monkeypatch.undo()
        assert len(stock_calls) == (n >= len(fast)), kwargs
        assert list(got) == list(want), kwargs
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[key], value) and got[key].stride() == value.stride(), key
            else:
                assert got[key] is value, key
    step = cca.prepare_inputs_for_generation(x, **fast[0])
    assert step["input_ids"].data_ptr() != x.data_ptr()  # a copy: generate's ids grow under it


@torch.no_grad()
def test_generate_prepares_its_one_token_steps_on_the_fast_path(monkeypatch):
    """In a real generate() (what it passes, e.g. ``logits_to_keep``), only the prefill takes the stock preparation:
    every one-token step is prepared by the CCA class itself."""
    _, cca = stock_and_cca("llama")
    stock = transformers.GenerationMixin.prepare_inputs_for_generation
    stock_calls = []
    monkeypatch.setattr(transformers.GenerationMixin, "prepare_inputs_for_generation",
                        lambda self, input_ids, **k: stock_calls.append(input_ids.shape[1]) or stock(self, input_ids, **k))
    x = ids(bsz=2, length=13)
    out = cca.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                       use_cache=True, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, hf.CCACache) and out.sequences.shape[1] == 19
    assert stock_calls == [13]


def test_generate_defers_its_stop_checks_for_a_cca_cache_on_cuda():
    """transformers' ``DeferredStopCheck.is_supported`` says yes for a CCA cache on CUDA, returned or not; everything
    else gets transformers' own answer (deferral on MPS only); the option turns it off, and a second install (a
    reload of the module) replaces its wrapper instead of stacking one more."""
    from transformers.cache_utils import DynamicCache
    from transformers.generation.utils import DeferredStopCheck

    _, cca = stock_and_cca("llama")
    cache, cuda = hf.HFCCACache(cca.config), torch.device("cuda")
    supported = DeferredStopCheck.is_supported
    assert supported(cuda, cache, False, is_assistant=False)
    assert supported(cuda, cache, True, is_assistant=False)  # handed back: it records its past (in-place crops)
    assert not supported(cuda, cache, False, is_assistant=True)
    assert not supported(torch.device("cpu"), cache, False, is_assistant=False)
    assert not supported(cuda, DynamicCache(), False, is_assistant=False)
    assert supported(torch.device("mps"), DynamicCache(), False, is_assistant=False)  # transformers' own
    cca.config.cca_defer_stop_checks = False
    assert not supported(cuda, cache, False, is_assistant=False)
    with pytest.raises(ValueError, match="cca_defer_stop_checks must be true or false"):
        hf.check_settings(transformers.LlamaConfig(cca_defer_stop_checks="no"))

    def depth(fn):
        return 0 if not hasattr(fn, "__wrapped_for_graph_decode__") else 1 + depth(fn.__wrapped__)

    before = depth(DeferredStopCheck.is_supported)
    decode_graph.install_deferred_stop_checks()
    decode_graph.install_deferred_stop_checks()
    assert depth(DeferredStopCheck.is_supported) == before >= 1
    assert DeferredStopCheck.is_supported.__wrapped_for_graph_decode__ is decode_graph.defer_stop_checks


def test_the_model_holds_no_cache_after_generate():
    """Once generate() returned and its output is dropped, nothing in the model keeps the cache (a 128K cache and its
    captured decode steps are GBs): the attention modules hold their call's tables and cache only for the call."""
    import gc
    import weakref

    _, cca = stock_and_cca("llama")
    caches = []
    cca.model.register_forward_pre_hook(lambda m, a, k: caches.append(weakref.ref(k[CACHE_ARG])),
                                        with_kwargs=True)
    out = cca.generate(ids(bsz=2, length=13), max_new_tokens=4, do_sample=False, use_cache=True,
                       return_dict_in_generate=True)
    assert isinstance(out.past_key_values, hf.CCACache) and caches[0]() is out.past_key_values
    gc.disable()  # (freed by reference counts, at once, not by a later collection)
    try:
        del out
        assert caches[0]() is None
        assert all(getattr(m, "_method_ctx", None) is None for m in cca.modules())
    finally:
        gc.enable()


@torch.no_grad()
def test_bf16_chunks_pool_bit_for_bit_what_one_pass_pools():
    """A bf16 prompt fed in group-aligned chunks pools exactly the core tokens of one pass: both pool the pre-RoPE keys
    un-rotated from the family's k_rot in fp32, never a rounded copy (which moved a 128K prompt's chunked hidden states
    off one pass's by more than full attention's rounding does, benchmarks/results/prefill-h200.md). Both keep the
    family's rotated keys in the window ring, as they attended to them (not re-rotated copies)."""
    _, cca = stock_and_cca("llama", g=4, s=8)
    cca = cca.to(torch.bfloat16)
    x = ids(bsz=2, length=64)
    one, chunked = hf.HFCCACache(cca.config), hf.HFCCACache(cca.config)
    cca.model(x, past_key_values=one, use_cache=True)
    for a, b in ((0, 24), (24, 40), (40, 64)):
        cca.model(x[:, a:b], past_key_values=chunked, use_cache=True)
    whole, parts = one.layers[0], chunked.layers[0]  # (later layers' inputs differ by the attention's rounding)
    assert torch.equal(whole.core_k[:, :, :16], parts.core_k[:, :, :16])
    assert torch.equal(whole.core_v[:, :, :16], parts.core_v[:, :, :16])
    for ring in ("win_k", "win_v", "grp_k"):
        assert torch.equal(getattr(whole, ring), getattr(parts, ring)), ring


@torch.no_grad()
def test_chunks_on_the_kernels_pool_their_own_groups_straight_from_the_chunk_as_one_pass_does(monkeypatch):
    """On the kernels, the groups that start inside a chunk are pooled by the prefill's own pooling kernel, straight
    from the chunk's q_rot/k_rot/v (no gathered copies): those core tokens equal one pass's bit for bit (bf16). A chunk
    on a group border in every row (no padding mask so far, ``cols % g == 0``) has no other groups; off the border, or
    in a padded batch, the group a row's chunk finishes is pooled in torch from the ring (close to one pass's) and the
    kernel starts each row at its next border."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1")
    from cca_convert.modeling import cache_cca as cache_mod
    monkeypatch.setattr(cache_mod.CCALayerCache, "force_triton", True)
    calls, pool = [], cache_mod.pool_forward

    def counted(*a, start=None):
        calls.append((a[0].shape[2], None if start is None else start.tolist()))
        return pool(*a, start=start)

    monkeypatch.setattr(cache_mod, "pool_forward", counted)
    stock, _ = stock_and_cca("llama", g=4, s=8)
    cca = cca_hf_model_from(stock, group_size=4, local_window=8, attn_backend="triton").to(torch.bfloat16)
    layers = cca.config.num_hidden_layers
    x = ids(bsz=2, length=64)
    one, chunked = hf.HFCCACache(cca.config), hf.HFCCACache(cca.config)
    cca.model(x, past_key_values=one, use_cache=True)
    for a, b in ((0, 24), (24, 40), (40, 47), (47, 56), (56, 64)):  # at cols 24, 40, 56: on the border; 47: off it
        cca.model(x[:, a:b], past_key_values=chunked, use_cache=True)
    assert calls == [c for c in ((16, None), (7, None), (9, [1, 1]), (8, None)) for _ in range(layers)]
    whole, parts = one.layers[0], chunked.layers[0]  # (later layers' inputs differ by the attention's rounding)
    kernel_pooled = [*range(6, 11), *range(12, 16)]  # group 11 (positions 44-47) began before the chunk at 47
    assert torch.equal(whole.core_k[:, :, kernel_pooled], parts.core_k[:, :, kernel_pooled])
    assert torch.equal(whole.core_v[:, :, kernel_pooled], parts.core_v[:, :, kernel_pooled])
    torch.testing.assert_close(whole.core_k[:, :, :16], parts.core_k[:, :, :16], atol=2e-2, rtol=0)
    torch.testing.assert_close(whole.core_v[:, :, :16], parts.core_v[:, :, :16], atol=2e-2, rtol=0)
    for ring in ("win_k", "win_v", "grp_k"):
        assert torch.equal(getattr(whole, ring), getattr(parts, ring)), ring

    # A padded batch: row 1 has 3 pads, so after 24 columns it has seen 21 tokens and its groups start at column 3.
    calls.clear()
    mask = torch.ones_like(x[:, :40])
    mask[1, :3] = 0
    one, padded = hf.HFCCACache(cca.config), hf.HFCCACache(cca.config)
    want = cca.model(x[:, :40], attention_mask=mask, past_key_values=one, use_cache=True).last_hidden_state
    got = [cca.model(x[:, a:b], attention_mask=mask[:, :b], past_key_values=padded, use_cache=True).last_hidden_state
           for a, b in ((0, 24), (24, 40))]
    assert calls == [(16, [0, 3])] * layers
    whole, parts = one.layers[0], padded.layers[0]
    for row, groups in ((0, [6, 7, 8, 9]), (1, [6, 7, 8])):  # row 1's group 5 (real tokens 20-23) began before
        for name in ("core_k", "core_v"):
            assert torch.equal(getattr(whole, name)[row, :, groups], getattr(parts, name)[row, :, groups]), (row, name)
    torch.testing.assert_close(whole.core_k[:, :, :9], parts.core_k[:, :, :9], atol=2e-2, rtol=0)
    for ring in ("win_k", "win_v", "grp_k"):
        assert torch.equal(getattr(whole, ring), getattr(parts, ring)), ring
    torch.testing.assert_close(got[1][mask[:, 24:].bool()], want[:, 24:][mask[:, 24:].bool()], atol=6e-2, rtol=0)


@torch.no_grad()
def test_a_prompt_leaves_copies_of_its_tail_not_views_of_the_whole_prompt():
    """What crop() may rebuild the rings from after a prompt is its last s + g - 1 + 256 columns: copies, so that the
    layer's whole prompt k/v (16 GiB over 32 layers at 128K) is not kept alive until the next pass."""
    _, cca = stock_and_cca("llama", g=4, s=8)
    cache = hf.HFCCACache(cca.config)
    cca.model(ids(bsz=2, length=400), past_key_values=cache, use_cache=True)
    for layer in cache.layers:
        tail = [x for x in layer._undo["tail"] if isinstance(x, torch.Tensor)]
        assert len(tail) == 5 and all(x.shape[-2] == (8 + 4 - 1) + 256 for x in tail)  # k, v, cos, sin, k_rot
        for x in tail:
            assert x.untyped_storage().nbytes() == x.numel() * x.element_size()


@torch.no_grad()
def test_the_inner_model_with_its_own_cache_gets_a_clear_error_and_with_ours_the_cached_answer():
    """``model.model`` (transformers' base model) brings a DynamicCache, which hands the attention all past keys on the
    second call: one clear error naming the fix. With an HFCCACache passed in, two calls give the one-call answer."""
    _, cca = stock_and_cca("llama")
    x = ids(bsz=2, length=30)
    first = cca.model(x[:, :20], use_cache=True)
    with pytest.raises(TypeError, match="HFCCACache"):
        cca.model(x[:, 20:], past_key_values=first.past_key_values, use_cache=True)
    cache = hf.HFCCACache(cca.config)
    parts = [cca.model(x[:, a:b], past_key_values=cache, use_cache=True).last_hidden_state for a, b in ((0, 20), (20, 30))]
    torch.testing.assert_close(torch.cat(parts, 1), cca.model(x, use_cache=False).last_hidden_state, atol=2e-4, rtol=0)


@pytest.mark.parametrize("method", ["cca", "dca"])
@torch.no_grad()
def test_the_cache_goes_in_under_either_name_and_comes_back_under_this_transformers_name(method):
    """transformers 5.24 renamed the cache argument and output field ``past_key_values`` to ``cache`` (generate()
    passes ``cache=``): a method's model takes either name on any version, hands its layers the one their version
    reads, returns this version's field, and refuses two different caches at once."""
    model = stock_and_cca("llama")[1] if method == "cca" else stock_and_dca("llama")[1]
    x = ids(bsz=2, length=30)
    want = model(x, use_cache=False).logits
    for name in ("cache", "past_key_values"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # (no deprecated name handed on to transformers)
            first = model(x[:, :20], use_cache=True)
            cache = getattr(first, CACHE_ARG)
            assert isinstance(cache, hf.HFCCACache if method == "cca" else dca_hf.DCACache)
            steps = [model(x[:, i:i + 1], use_cache=True, **{name: cache}) for i in range(20, 30)]
        assert all(getattr(step, CACHE_ARG) is cache for step in steps)
        assert cache.get_seq_length() == 30
        got = torch.cat([first.logits] + [step.logits for step in steps], 1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    other = model(x[:, :20], use_cache=True)
    with pytest.raises(ValueError, match="both cache= and past_key_values= were passed"):
        model(x[:, 20:21], use_cache=True, cache=cache, past_key_values=getattr(other, CACHE_ARG))
