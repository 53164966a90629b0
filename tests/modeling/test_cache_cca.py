"""Compressed CCA cache and decoding: prefill + decode == one full forward (CCA-SPEC.md, "Decoding with a cache")."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

from cca_convert import published
from cca_convert.modeling import cache_cca as cache_mod
from tests.legacy import configuration_cca as cc
from tests.legacy import modeling_cca as mc

ATOL = 2e-4
VOCAB = 101


def make_model(pooling="kv", g=4, s=6, heads=4, kv_heads=2, layers=2, seed=0, hidden=32, **extra):
    torch.manual_seed(seed)
    llama = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    cfg = cc.CCAConfig(**llama.to_dict(), group_size=g, local_window=s, pooling=pooling, **extra)
    return mc.CCAForCausalLM(cfg).float().eval()


def cached_logits(model, ids, chunks, mask=None):
    """Feed ``ids`` in chunks of the given sizes through one cache; returns the concatenated logits."""
    out, cache, i, logits = None, None, 0, []
    for c in chunks:
        kw = {} if mask is None else {"attention_mask": mask[:, : i + c]}
        out = model(ids[:, i : i + c], past_key_values=cache, use_cache=True, **kw)
        cache, i = out.past_key_values, i + c
        logits.append(out.logits)
    assert i == ids.shape[1]
    assert isinstance(cache, cache_mod.CCACache)
    return torch.cat(logits, 1), cache


CONFIGS = [  # (pooling, g, s, heads, kv_heads)
    ("kv", 4, 6, 4, 2),  # GQA, g does not divide s
    ("query", 4, 6, 4, 2),
    ("kv", 3, 8, 4, 4),  # MHA
    ("query", 5, 3, 4, 1),  # g > s, MQA
    ("kv", 1, 2, 4, 2),  # every token its own group
]


@pytest.mark.parametrize("pooling,g,s,heads,kv_heads", CONFIGS)
@torch.no_grad()
def test_prefill_then_decode_matches_full_forward(pooling, g, s, heads, kv_heads):
    model = make_model(pooling, g, s, heads, kv_heads)
    ids = torch.randint(3, VOCAB, (2, 37))
    full = model(ids, use_cache=False).logits
    prompt = 11  # crosses s; decoding crosses many group boundaries
    dec, cache = cached_logits(model, ids, [prompt] + [1] * (37 - prompt))
    torch.testing.assert_close(dec, full, atol=ATOL, rtol=0)
    assert cache.get_seq_length() == 37
    layer = cache.layers[0]
    assert layer.seen.tolist() == [37, 37]
    assert layer.win_k.shape[2] == s + g - 1  # raw keys: never more than s+g-1 slots


@pytest.mark.parametrize("record_past", [False, True])
@pytest.mark.parametrize("kernels", [False, True])
@torch.no_grad()
def test_decode_after_a_prompt_longer_than_the_kept_tail(kernels, record_past, monkeypatch):
    """A prefill keeps only its last ``window + ROLLBACK`` columns to rebuild the rings from (``crop``): the rings
    must still hold each position at slot ``position % size`` however that tail is offset (a 300-token prompt: the
    tail starts at column 35, resp. 3 with the speculative slack, not a multiple of the ring sizes), with and without
    the slack, on the PyTorch path and the decode kernels (TRITON_INTERPRET=1), a left-padded row included."""
    if kernels:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the decode kernels on CPU need TRITON_INTERPRET=1")
        monkeypatch.setattr(cache_mod.CCALayerCache, "force_triton", True)
    model = make_model("kv", 4, 6, 4, 2, layers=1, attn_backend="auto" if kernels else "reference")
    ids = torch.randint(3, VOCAB, (2, 306))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    out = model(ids[:, :300], attention_mask=mask[:, :300], use_cache=True,
                **({} if not record_past else {"past_key_values": _recording(model)}))
    cache, logits = out.past_key_values, []
    assert cache.layers[0].slack == (cache_mod.SPECULATIVE_SLACK if record_past else 0)
    for i in range(300, 306):
        logits.append(model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], past_key_values=cache).logits)
    logits = torch.cat(logits, 1)
    torch.testing.assert_close(logits[:1], model(ids[:1], use_cache=False).logits[:, 300:], atol=ATOL, rtol=0)
    real = model(ids[1:, 5:], use_cache=False).logits[:, 295:]
    torch.testing.assert_close(logits[1:], real, atol=ATOL, rtol=0)


def use_kernels(kernels, monkeypatch):
    """``kernels``: the cache runs the Triton kernels (decode steps and chunks) on CPU tensors (TRITON_INTERPRET=1)."""
    if kernels:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1")
        monkeypatch.setattr(cache_mod.CCALayerCache, "force_triton", True)
    return {"hidden": 64} if kernels else {}  # head dim 16: the decode kernels' smallest


KERNELS = pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])


@pytest.mark.parametrize("record_past", [False, True])
@KERNELS
@torch.no_grad()
def test_chunks_after_a_prompt_longer_than_the_kept_tail(record_past, kernels, monkeypatch):
    """Chunked prefill (attention over core tokens ++ ring ++ chunk) after a first chunk longer than the tail a
    prefill keeps: the rings it reads are the positions they should hold."""
    model = make_model("kv", 4, 6, 4, 2, layers=1, **use_kernels(kernels, monkeypatch))
    ids = torch.randint(3, VOCAB, (2, 330))
    kw = {"past_key_values": _recording(model)} if record_past else {}
    out = model(ids[:, :300], use_cache=True, **kw)
    cache, logits = out.past_key_values, [out.logits]
    for i, j in ((300, 307), (307, 308), (308, 330)):
        logits.append(model(ids[:, i:j], past_key_values=cache).logits)
    torch.testing.assert_close(torch.cat(logits, 1), model(ids, use_cache=False).logits, atol=ATOL, rtol=0)


def _recording(model):
    cache = cache_mod.CCACache(model.config)
    cache.activate_past_recording()
    return cache


@pytest.mark.parametrize("pooling,g,s,heads,kv_heads", CONFIGS[:4])
@KERNELS
@torch.no_grad()
def test_chunked_prefill_matches_full_forward(pooling, g, s, heads, kv_heads, kernels, monkeypatch):
    model = make_model(pooling, g, s, heads, kv_heads, **use_kernels(kernels, monkeypatch))
    ids = torch.randint(3, VOCAB, (2, 45))
    full = model(ids, use_cache=False).logits
    chunked, _ = cached_logits(model, ids, [5, 7, 3, 11, 1, 2, 9, 1, 6])
    torch.testing.assert_close(chunked, full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("pooling", ["kv", "query"])
@KERNELS
@torch.no_grad()
def test_left_padded_batch_matches_single_sequences(pooling, kernels, monkeypatch):
    model = make_model(pooling, 4, 6, 4, 2, **use_kernels(kernels, monkeypatch))
    lengths, total = [30, 17, 9], 30
    ids = torch.randint(3, VOCAB, (3, total))
    mask = torch.zeros(3, total, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, total - n :] = 1
    ids = ids.masked_fill(mask == 0, 0)
    # prompt of 13 columns (one row is all padding then), a chunk of 5, then token by token
    for chunks in ([13] + [1] * 17, [6, 7, 5] + [1] * 12):
        logits, cache = cached_logits(model, ids, chunks, mask)
        assert cache.layers[1].seen.tolist() == lengths
        for b, n in enumerate(lengths):
            single = model(ids[b : b + 1, total - n :], use_cache=False).logits[0]
            torch.testing.assert_close(logits[b, total - n :], single, atol=ATOL, rtol=0)


@torch.no_grad()
def test_generate_greedy_with_cache_equals_without_cache():
    model = make_model("kv", 4, 6, 4, 2)
    ids = torch.randint(3, VOCAB, (3, 14))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :9] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=25, do_sample=False, pad_token_id=0, eos_token_id=None)
    with_cache = model.generate(ids, use_cache=True, **kw)
    without = model.generate(ids, use_cache=False, **kw)
    assert torch.equal(with_cache, without)
    chunked = model.generate(ids, use_cache=True, prefill_chunk_size=4, **kw)
    assert torch.equal(chunked, without)


@torch.no_grad()
def test_generate_sampling_runs():
    model = make_model("query", 4, 6, 4, 2)
    ids = torch.randint(3, VOCAB, (2, 10))
    torch.manual_seed(1234)
    a = model.generate(ids, do_sample=True, top_k=20, max_new_tokens=20, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(1234)
    b = model.generate(ids, do_sample=True, top_k=20, max_new_tokens=20, pad_token_id=0, eos_token_id=None)
    assert a.shape == (2, 30) and torch.equal(a, b)


@torch.no_grad()
def test_group_size_override_at_load_uses_new_g(tmp_path):
    model = make_model("kv", 4, 6, 4, 2)
    model.save_pretrained(tmp_path)
    loaded = mc.CCAForCausalLM.from_pretrained(tmp_path, group_size=3, local_window=5).float().eval()
    assert (loaded.config.group_size, loaded.config.local_window) == (3, 5)
    ids = torch.randint(3, VOCAB, (1, 30))
    full = loaded(ids, use_cache=False).logits
    dec, cache = cached_logits(loaded, ids, [8] + [1] * 22)
    torch.testing.assert_close(dec, full, atol=ATOL, rtol=0)
    assert cache.layers[0].core_k.shape[2] >= 30 // 3 and cache.layers[0].win_k.shape[2] == 5 + 3 - 1
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(loaded.generate(ids, **kw), loaded.generate(ids, use_cache=False, **kw))


@torch.no_grad()
def test_full_backend_keeps_dynamic_cache():
    model = make_model("kv", 4, 6, 4, 2, attn_backend="full")
    ids = torch.randint(3, VOCAB, (2, 12))
    out = model(ids, use_cache=True)
    assert isinstance(out.past_key_values, transformers.DynamicCache)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))


def test_decode_torch_twin_matches_reference_one_query():
    """The decode function on a hand-built state equals the reference attention's last row."""
    from cca_convert.kernels import cca_reference as ref
    torch.manual_seed(0)
    g, s, L, H, Hkv, d = 4, 7, 29, 6, 2, 8
    for pooling in ("kv", "query"):
        q, k, v = torch.randn(2, H, L, d), torch.randn(2, Hkv, L, d), torch.randn(2, Hkv, L, d)
        cfg = transformers.LlamaConfig(hidden_size=H * d, num_attention_heads=H, head_dim=d, max_position_embeddings=64)
        cos, sin = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)(q, torch.arange(L)[None])
        expect = ref.cca_attention_reference(q, k, v, cos[0], sin[0], g, s, pooling)[:, :, -1]
        q_rot, k_rot = ref.apply_rope(q, cos[0], sin[0]), ref.apply_rope(k, cos[0], sin[0])
        ck, cv = ref.pool_core_tokens(q_rot, k_rot, k, v, cos[0], sin[0], g, pooling)
        W = s + g - 1
        t = torch.full((2,), L - 1)
        slots = (torch.arange(L - W, L)) % W
        wk, wv = torch.zeros(2, Hkv, W, d), torch.zeros(2, Hkv, W, d)
        wk[:, :, slots], wv[:, :, slots] = k_rot[:, :, L - W :], v[:, :, L - W :]
        n = ref.visible_core_count(t, g, s)
        got = cache_mod.cca_decode_attention_torch(q_rot[:, :, -1], ck, cv, n, wk, wv, t, n * g, d**-0.5)
        torch.testing.assert_close(got, expect, atol=1e-5, rtol=0)


def test_cache_size_llama31_8b_128k():
    """Bytes at 128K context for the Llama-3.1-8B layout: analytic, and measured by filling one layer."""
    layout = dict(num_layers=32, n_heads=32, n_kv=8, head_dim=128, group_size=16, local_window=1024, dtype_bytes=2)
    L = 128 * 1024
    res = {}
    for pooling in ("kv", "query"):
        cca, full = cache_mod.cache_bytes(L, pooling=pooling, **layout)
        res[pooling] = cca / full
        print(f"128K Llama-3.1-8B bf16 g=16 s=1024 pooling={pooling}: CCA {cca / 2**30:.3f} GiB, "
              f"full DynamicCache {full / 2**30:.3f} GiB, ratio {100 * cca / full:.2f}%")
    assert res["kv"] <= 0.08
    assert 0.24 < res["query"] < 0.28

    # Measured: fill one layer with the same head layout at a smaller scale (g=16, s=64, 2048 tokens),
    # compare with the analytic formula scaled the same way.
    g, s, L_small, d = 16, 64, 2048, 16
    for pooling in ("kv", "query"):
        cfg = cc.CCAConfig(num_hidden_layers=1, hidden_size=32 * d, num_attention_heads=32, num_key_value_heads=8,
                           group_size=g, local_window=s, pooling=pooling)
        cache = cache_mod.CCACache(cfg)
        q = torch.randn(1, 32, L_small, d, dtype=torch.bfloat16)
        k, v = torch.randn(1, 8, L_small, d, dtype=torch.bfloat16), torch.randn(1, 8, L_small, d, dtype=torch.bfloat16)
        pos = torch.arange(L_small, dtype=torch.float32)
        freq = pos[:, None] * (10000 ** (-torch.arange(0, d, 2) / d))[None]
        emb = torch.cat((freq, freq), -1)
        with torch.no_grad():
            cache.cca_attention(0, q, k, v, emb.cos().bfloat16(), emb.sin().bfloat16(), None, d**-0.5)
        measured = cache.layers[0].nbytes()
        analytic, full = cache_mod.cache_bytes(L_small, 1, 32, 8, d, g, s, pooling, 2)
        print(f"measured one layer ({L_small} tokens, g={g}, s={s}, hd={d}, pooling={pooling}): {measured} B, "
              f"analytic {analytic} B, full {full} B ({100 * measured / full:.2f}%)")
        assert measured == analytic


_INTERPRET_SCRIPT = textwrap.dedent(
    """
    import torch
    from cca_convert import published
    from cca_convert.modeling import cache_cca as cache_mod
    from cca_convert.kernels import cca_decode_triton as kern
    torch.manual_seed(0)
    for (B, H, Hkv, d, P, W, pooling) in [(2, 4, 2, 16, 37, 11, "kv"), (3, 6, 2, 16, 20, 9, "query"), (1, 2, 2, 32, 0, 5, "kv")]:
        C = Hkv if pooling == "kv" else H
        q = torch.randn(B, H, d)
        ck, cv = torch.randn(B, C, P, d), torch.randn(B, C, P, d)
        wk, wv = torch.randn(B, Hkv, W, d), torch.randn(B, Hkv, W, d)
        pos = torch.randint(0, 60, (B,))
        n_core = torch.randint(0, P + 1, (B,))
        lo = (pos - torch.randint(0, W, (B,))).clamp_min(0)
        a = cache_mod.cca_decode_attention_torch(q, ck, cv, n_core, wk, wv, pos, lo, d**-0.5)
        b = kern.cca_decode_attention_triton(q, ck, cv, n_core, wk, wv, pos, lo, d**-0.5, num_splits=3, block_n=8)
        err = (a - b).abs().max().item()
        assert err < 1e-4, (B, H, Hkv, P, W, pooling, err)
    # visibility derived in the kernel from the position (what the cache passes) == given explicitly
    g, s = 4, 7
    for pooling in ("kv", "query"):
        B, H, Hkv, d, P, W = 3, 4, 2, 16, 30, s + g - 1
        C = Hkv if pooling == "kv" else H
        q, ck, cv = torch.randn(B, H, d), torch.randn(B, C, P, d), torch.randn(B, C, P, d)
        wk, wv = torch.randn(B, Hkv, W, d), torch.randn(B, Hkv, W, d)
        pos = torch.tensor([0, 5, 99])
        n_core = torch.div(pos + 1 - s, g, rounding_mode="floor").clamp_min(0)
        a = cache_mod.cca_decode_attention_torch(q, ck, cv, n_core, wk, wv, pos, n_core * g, d**-0.5)
        b = kern.cca_decode_attention_triton(q, ck, cv, None, wk, wv, pos, None, d**-0.5, num_splits=2, block_n=8,
                                            group_size=g, local_window=s)
        assert (a - b).abs().max().item() < 1e-4, pooling
        # advance: the kernels count the token into pos after every read of it
        strided = torch.tensor([[1, 0], [0, 0], [1, 1]])[:, 0]
        for splits, real in ((3, strided), (1, None), (2, torch.tensor([0, 1, 1]).bool())):
            moved = pos.clone()
            b = kern.cca_decode_attention_triton(q, ck, cv, None, wk, wv, moved, None, d**-0.5, num_splits=splits,
                                                block_n=8, group_size=g, local_window=s,
                                                advance=True if real is None else real)
            assert (a - b).abs().max().item() < 1e-4, (pooling, splits)
            assert moved.tolist() == (pos + (1 if real is None else real.long())).tolist(), (moved, real)

    # post-RoPE q/k (rotated=True, YaRN-like attention scaling in the tables) == pre-RoPE q/k: same cache, same q
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    for pooling, real in (("kv", None), ("query", torch.tensor([True, False, True]))):
        B, H, Hkv, d, g, W = 3, 4, 2, 16, 4, 9
        C = Hkv if pooling == "kv" else H
        q, k, v = torch.randn(B, H, 1, d), torch.randn(B, Hkv, 1, d), torch.randn(B, Hkv, 1, d)
        ang = torch.rand(B, 1, d // 2) * 6
        cos, sin = (torch.cat((f(ang), f(ang)), -1) * 1.3 for f in (torch.cos, torch.sin))
        q_post, k_post = apply_rotary_pos_emb(q, k, cos, sin)
        seen = torch.tensor([7, 11, 3])  # groups 1 and 2 complete at 7 and 11: pooled
        states = []
        for rotated in (False, True):
            torch.manual_seed(1)
            st = [torch.randn(B, Hkv, W, d), torch.randn(B, Hkv, W, d), torch.randn(B, Hkv, g, d), torch.randn(B, d),
                  torch.randn(B, d), torch.zeros(B, C, 4, d), torch.zeros(B, C, 4, d)]
            qq, kk = (q_post, k_post) if rotated else (q, k)
            q_rot = kern.cca_decode_append_triton(qq[:, :, 0], kk[:, :, 0], v[:, :, 0], cos[:, 0], sin[:, 0], real,
                                                  seen.clone(), *st, g, d**-0.5, rotated=rotated)
            states.append([q_rot] + st)
        for x, y in zip(*states):
            assert (x - y).abs().max().item() < 1e-4, (pooling, (x - y).abs().max().item())
        assert states[0][6].abs().sum() > 0  # a core token was pooled

    # The whole decode step (RoPE, ring writes, pooling kernel, attention kernel) inside a model,
    # with a left-padded row, against unpadded full forwards.
    import transformers
    from tests.legacy import modeling_cca as mc
    from tests.legacy import configuration_cca as cc
    cache_mod.CCALayerCache.force_triton = True
    for pooling, g, s, H, Hkv in [("kv", 2, 3, 4, 2), ("query", 3, 4, 4, 2)]:
        torch.manual_seed(0)
        llama = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=H, num_key_value_heads=Hkv, max_position_embeddings=64)
        m = mc.CCAForCausalLM(cc.CCAConfig(**llama.to_dict(), group_size=g, local_window=s, pooling=pooling)).eval()
        ids = torch.randint(3, 101, (2, 14))
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        mask[1, 10] = 0  # a pad column while decoding (the kernels read the mask's int64 column as it is)
        with torch.no_grad():
            out = m(ids[:, :8], attention_mask=mask[:, :8])
            cache, logits = out.past_key_values, [out.logits]
            for i in range(8, 14):
                out = m(ids[:, i : i + 1], past_key_values=cache, attention_mask=mask[:, : i + 1])
                logits.append(out.logits)
            logits = torch.cat(logits, 1)
            err0 = (logits[:1] - m(ids[:1], use_cache=False).logits).abs().max().item()
            real = mask[1].bool()
            err1 = (logits[1, real] - m(ids[1:, real], use_cache=False).logits[0]).abs().max().item()
        assert max(err0, err1) < 2e-4, (pooling, g, s, err0, err1)
        assert cache.layers[0].core_k.shape[2] > 0

    # the exported class (stock attention modules hand over post-RoPE q/k: the rotated decode path)
    from tests.support.factories import cca_hf_model_from, tiny_base_model
    base = tiny_base_model("llama", max_position_embeddings=128, pad_token_id=0)
    for pooling in ("kv", "query"):
        m = cca_hf_model_from(base, group_size=3, local_window=4, pooling=pooling, attn_backend="auto")
        ids = torch.randint(3, 96, (2, 20))
        mask = torch.ones_like(ids)
        mask[1, :4] = 0
        with torch.no_grad():
            out = m(ids[:, :9], attention_mask=mask[:, :9], use_cache=True)
            cache, logits = out.past_key_values, [out.logits]
            for i in range(9, 20):
                assert cache.decodes_rotated(0, torch.zeros(2, 4, 1, 16))
                out = m(ids[:, i : i + 1], past_key_values=cache, attention_mask=mask[:, : i + 1], use_cache=True)
                logits.append(out.logits)
            full = m(ids, attention_mask=mask, use_cache=False).logits
        err = max((torch.cat(logits, 1)[0] - full[0]).abs().max().item(),
                  (torch.cat(logits, 1)[1, 4:] - full[1, 4:]).abs().max().item())
        assert err < 2e-4, (pooling, err)
    print("interpret ok")
    """
)


def test_decode_triton_kernel_interpreted():
    triton = pytest.importorskip("triton")
    import numpy

    old_triton = tuple(int(x) for x in triton.__version__.split(".")[:2]) <= (3, 6)
    if old_triton and tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 3):
        # triton 3.6's interpreter turns loaded scalars into 1-element arrays, which NumPy >= 2.3 refuses
        # (seen on the GPU image: triton 3.6 + NumPy 2.5). `make test-oldest` pins NumPy < 2.3 for this.
        pytest.skip("triton <= 3.6's CPU interpreter needs NumPy < 2.3")
    if not (published.KERNELS_DIR / "cca_decode_triton.py").exists():
        pytest.skip("decode kernel not built yet")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", _INTERPRET_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "interpret ok" in res.stdout, res.stdout + res.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pooling", ["kv", "query"])
def test_decode_triton_kernel_gpu_large(pooling):
    from cca_convert.kernels import cca_decode_triton as kern
    torch.manual_seed(0)
    B, H, Hkv, d, P, W = 4, 32, 8, 128, 8192, 1039
    C = Hkv if pooling == "kv" else H
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, H, d, device=dev, dtype=dt)
    ck, cv = torch.randn(B, C, P + 64, d, device=dev, dtype=dt), torch.randn(B, C, P + 64, d, device=dev, dtype=dt)
    wk, wv = torch.randn(B, Hkv, W, d, device=dev, dtype=dt), torch.randn(B, Hkv, W, d, device=dev, dtype=dt)
    pos = torch.tensor([131071, 131000, 5000, 100], device=dev)
    n_core = torch.div(pos + 1 - 1024, 16, rounding_mode="floor").clamp_min(0)
    lo = n_core * 16
    a = cache_mod.cca_decode_attention_torch(q, ck, cv, n_core, wk, wv, pos, lo, d**-0.5)
    b = kern.cca_decode_attention_triton(q, ck, cv, n_core, wk, wv, pos, lo, d**-0.5)
    torch.testing.assert_close(b.float(), a.float(), atol=2e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
@pytest.mark.parametrize("pooling", ["kv", "query"])
def test_decode_parity_on_gpu(pooling):
    model = make_model(pooling, 16, 64, 8, 2, layers=2, hidden=256).cuda()  # head_dim 32: the Triton decode path
    ids = torch.randint(3, VOCAB, (2, 300), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    full0 = model(ids[:1], use_cache=False).logits
    full1 = model(ids[1:, 7:], use_cache=False).logits
    dec, _ = cached_logits(model, ids, [150, 37] + [1] * 113, mask)
    torch.testing.assert_close(dec[:1], full0, atol=5e-3, rtol=0)
    torch.testing.assert_close(dec[1:, 7:], full1, atol=5e-3, rtol=0)
