"""CUDA-graph decoding (``modeling/decode_graph.py``): ``generate()`` replays captured one-token steps, and they give
what eager steps give: same scores, same tokens, across re-captures (the core outgrowing its reserve), left padding,
batch sizes, a second generate() and beam search (which reorders the cache every step)."""

import os
import shutil
import sys

import pytest
import torch

from cca_convert.modeling import cache_cca, decode_graph
from tests.support.factories import cca_hf_model_from, tiny_base_model


def _model(dtype, pooling="kv", family="llama", device="cuda", **overrides):
    base = tiny_base_model(family, max_position_embeddings=1024, pad_token_id=0, eos_token_id=2, **overrides)
    return cca_hf_model_from(base, group_size=4, local_window=8, pooling=pooling, attn_backend="auto").to(device, dtype)


def _prompt(bsz, length, pads=()):
    x = torch.randint(3, 96, (bsz, length), generator=torch.Generator().manual_seed(bsz * 7 + length)).cuda()
    mask = torch.ones_like(x)
    for row, n in enumerate(pads):
        mask[row, :n] = 0
        x[row, :n] = 0
    return x, mask


def _generate(model, graphs, x, mask, **kw):
    model.config.cca_cuda_graphs = graphs
    out = model.generate(x, attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True,
                         output_scores=True, return_dict_in_generate=True, **kw)
    return out, out.past_key_values


def test_cuda_graphs_option_is_checked():
    base = tiny_base_model("llama")
    with pytest.raises(ValueError, match="cca_cuda_graphs must be true or false"):
        cca_hf_model_from(base, cuda_graphs="yes")
    with pytest.raises(ValueError, match="cca_compile_decode must be true or false"):
        cca_hf_model_from(base, compile_decode=1)


@torch.no_grad()
def test_fused_twins_fall_back_to_the_stock_code_and_put_everything_back(monkeypatch):
    """The captured step's compiled twins (norms, MLPs, the modeling file's RoPE function): a twin that fails is
    redone eagerly (same output), turns every twin off, and leaving ``active()`` restores the stock code."""
    import sys

    from cca_convert.modeling import decode_graph
    model = _model(torch.float32, device="cpu")
    family = sys.modules[type(model.model.layers[0].self_attn).__module__]
    stock_rope, own = family.apply_rotary_pos_emb, object()
    model.model.norm._compiled_call_impl = own  # a user's own compile is left alone
    fused = decode_graph.FusedModules(model)
    assert len(fused.modules) == 3 * model.config.num_hidden_layers + 1 and fused.families == [family]
    calls = []

    def broken_compile(fn, **options):
        def run(*args, **kwargs):
            calls.append(fn)
            raise RuntimeError("no compiler here")
        return run

    monkeypatch.setattr(decode_graph.torch, "compile", broken_compile)
    monkeypatch.setattr(decode_graph, "_COMPILED", {})  # this process's real twins stay out of (and unharmed by) it
    x = torch.randint(3, 96, (2, 11))
    model.model.norm._compiled_call_impl = None
    expected = model(x, use_cache=False).logits
    model.model.norm._compiled_call_impl = own
    with fused.active():
        assert family.apply_rotary_pos_emb is not stock_rope
        assert model.model.norm._compiled_call_impl is own
        model.model.norm._compiled_call_impl = None  # (so that this forward can run)
        got = model(x, use_cache=False).logits
        model.model.norm._compiled_call_impl = own
    assert len(calls) == 1 and fused.failure == "RuntimeError: no compiler here"
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert family.apply_rotary_pos_emb is stock_rope and model.model.norm._compiled_call_impl is own
    assert all(m._compiled_call_impl is None for m in fused.modules if m is not model.model.norm)
    with fused.active():  # after a failure: the stock code
        assert family.apply_rotary_pos_emb is stock_rope and model.model.layers[0].mlp._compiled_call_impl is None


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton products run on a CPU only interpreted")
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "phi3"])
@torch.no_grad()
def test_skinny_linears_give_the_stock_numbers_and_put_everything_back(family, monkeypatch):
    """The captured step's Triton products (q/k/v in one launch, o, the gated MLP) on a CPU, interpreted: the logits
    of a forward of at most 16 rows are the stock model's; more rows keep cuBLAS; the output embedding (lm_head) is one
    more product; leaving ``active()`` restores the stock calls and drops what the q/k/v call kept. Qwen2 has q/k/v biases, Gemma 3 a tanh-GELU MLP, Phi-3 fused
    projections (nothing to replace: its layers stay stock)."""
    from cca_convert.modeling import decode_graph
    monkeypatch.setattr(decode_graph, "_compiled", lambda fn: fn)  # the twins: the stock functions (no compiler)
    launches = []
    for name in ("skinny_linear", "skinny_gated"):
        kernel = getattr(decode_graph, name)
        monkeypatch.setattr(decode_graph, name, lambda *a, _k=kernel, _n=name: launches.append(_n) or _k(*a))
    model = _model(torch.float32, family=family, device="cpu")
    fused = decode_graph.FusedModules(model)
    layers = model.config.num_hidden_layers
    calls, launches_per_layer = {"phi3": (1, 1)}.get(family, (4, 2))  # q, k, v, o calls; q/k/v and o launches
    assert len(fused.skinny.calls) == calls * layers + 1  # (+ lm_head)
    for rows in ((2, 1), (1, 16), (3, 7)):
        x = torch.randint(3, 96, rows, generator=torch.Generator().manual_seed(sum(rows)))
        expected = model(x, use_cache=False).logits
        launches.clear()
        with fused.active():
            got = model(x, use_cache=False).logits
        assert fused.failure is None, fused.failure
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        many = rows[0] * rows[1] > 16
        gated = 0 if family == "phi3" or many else layers
        assert launches.count("skinny_gated") == gated
        assert launches.count("skinny_linear") == (0 if many else launches_per_layer * layers + gated + 1)
        assert all(not kept for kept in fused.skinny.pending)
        assert all(m._compiled_call_impl is None for m, _ in fused.skinny.calls)
        assert all(m._compiled_call_impl is None for m in fused.modules)
    assert fused.skinny.checked == ({} if family == "phi3" else {type(model.model.layers[0].mlp): True})


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton products run on a CPU only interpreted")
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3"])
@torch.no_grad()
def test_prenorm_layers_add_their_residuals_in_other_launches(family, monkeypatch):
    """A layer whose forward is transformers' pre-norm code (Llama's and its copies) runs it with its residual adds
    fused: the first into the post-attention norm's compiled kernel, the second into the down projection's product.
    The logits are the stock model's. Other layer code (Gemma 3's four norms, Phi-3's) and a hooked layer stay stock;
    leaving ``active()`` restores every layer."""
    from cca_convert.modeling import decode_graph
    monkeypatch.setattr(decode_graph, "_compiled", lambda fn: fn)  # the twins: the stock functions (no compiler)
    residuals, sums = [], []
    kernel, add_then_norm = decode_graph.skinny_linear, decode_graph._add_then_norm
    monkeypatch.setattr(decode_graph, "skinny_linear",
                        lambda x, w, b=None, r=None: residuals.append(r is not None) or kernel(x, w, b, r))
    monkeypatch.setattr(decode_graph, "_add_then_norm", lambda *a: sums.append(a[0]) or add_then_norm(*a))
    model = _model(torch.float32, family=family, device="cpu")
    layers = list(model.model.layers)
    if family == "llama":
        layers[-1].register_forward_pre_hook(lambda *args: None)
    fused = decode_graph.FusedModules(model)
    expected_layers = {"gemma3_text": [], "phi3": [], "llama": layers[:-1]}.get(family, layers)
    assert fused.layers == expected_layers
    x = torch.randint(3, 96, (3, 1), generator=torch.Generator().manual_seed(5))
    expected = model(x, use_cache=False).logits
    for round in range(2):  # (the first call of an MLP class checks its product against the stock twin)
        residuals.clear(), sums.clear()
        with fused.active():
            got = model(x, use_cache=False).logits
        assert fused.failure is None, fused.failure
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert sums == [layer.post_attention_layernorm for layer in expected_layers]
        assert sum(residuals) == len(expected_layers) - (round == 0 and expected_layers[:1] == layers[:1])
        assert all(layer._compiled_call_impl is None for layer in layers)
    if expected_layers:  # a hook added since the layers were found: that layer runs its stock code again
        expected_layers[0].register_forward_hook(lambda *args: None)
        sums.clear()
        with fused.active():
            torch.testing.assert_close(model(x, use_cache=False).logits, expected, atol=1e-5, rtol=1e-5)
        assert sums == [layer.post_attention_layernorm for layer in expected_layers[1:]]


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")),
                    reason="Inductor on a CPU needs a C++ compiler")
@torch.no_grad()
def test_fused_twins_compile_once_per_function_and_shape_past_dynamo_recompile_limit():
    """Real Inductor twins on a CPU: Qwen3's RMSNorm forward sees three shapes per batch size (hidden, q-norm, k-norm),
    12 over four batch sizes, past Dynamo's default recompile limit (8), which would turn the twins off; they give
    the stock code's numbers, and another model reuses them."""
    from cca_convert.modeling import decode_graph
    model = _model(torch.bfloat16, family="qwen3", device="cpu")
    fused = decode_graph.FusedModules(model)
    for bsz in range(1, 5):
        x = torch.randint(3, 96, (bsz, 9), generator=torch.Generator().manual_seed(bsz))
        expected = model(x, use_cache=False).logits
        with fused.active():
            got = model(x, use_cache=False).logits
        assert fused.failure is None, fused.failure
        # bf16: a fused kernel rounds once where eager rounds per op, so logits move by up to about one bf16 ulp
        # (5.2e-3 with torch 2.11's CPU Inductor, < 2e-3 with 2.13; the GPU twin tests allow 3e-2)
        torch.testing.assert_close(got, expected, atol=1e-2, rtol=0)
    # a second model of the same shapes reuses the compiled twins: nothing is compiled again
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    other = _model(torch.bfloat16, family="qwen3", device="cpu")
    with decode_graph.FusedModules(other).active():
        other(torch.randint(3, 96, (2, 9)), use_cache=False)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.gpu
@pytest.mark.parametrize("pooling", ["kv", "query"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_gpu_graph_decode_equals_eager(dtype, pooling, monkeypatch):
    monkeypatch.setattr(cache_cca, "GRAPH_RESERVE", 24)  # re-capture every few groups
    model = _model(dtype, pooling)
    x, mask = _prompt(3, 37, pads=(0, 5, 11))
    eager, _ = _generate(model, False, x, mask, max_new_tokens=90)
    graphed, cache = _generate(model, True, x, mask, max_new_tokens=90)
    graphs = cache.decode_graphs
    assert graphs.failure is None and graphs.replays >= 60, (graphs.failure, graphs.replays)
    fused = model._fused_modules  # the steps were captured with the compiled norms, MLPs and RoPE
    layers = model.config.num_hidden_layers  # two norms and an MLP each, and the final norm
    assert fused.failure is None and len(fused.modules) == 3 * layers + 1, [type(m).__name__ for m in fused.modules]
    assert len(fused.layers) == layers  # (Llama's pre-norm layers: residual adds fused, on this Python's bytecode)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(torch.stack(graphed.scores), torch.stack(eager.scores), **tol)
    if dtype == torch.float32:
        assert torch.equal(graphed.sequences, eager.sequences)
    # decode == prefill: the replayed steps' logits are the no-cache forward's
    full = model(graphed.sequences, attention_mask=torch.cat([mask, torch.ones_like(graphed.sequences[:, 37:])], 1),
                 use_cache=False).logits[:, 36:-1].float()
    torch.testing.assert_close(torch.stack(graphed.scores, 1).float(), full, **tol)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the decode kernels on CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@torch.no_grad()
def test_twins_leave_a_decode_steps_rope_to_the_kernel(family, monkeypatch):
    """Under ``FusedModules.active()`` (a step being captured) the family's RoPE of the step's q/k is skipped and the
    decode kernel rotates them: the same logits and cache as the stock step, which rotates in transformers."""
    from cca_convert.modeling import cache_cca as cache_mod
    from cca_convert.modeling import decode_graph
    monkeypatch.setattr(cache_mod.CCALayerCache, "force_triton", True)
    calls = []
    kernel = cache_mod.cca_decode_append_triton
    monkeypatch.setattr(cache_mod, "cca_decode_append_triton",
                        lambda *a, rotated=False, **k: calls.append(rotated) or kernel(*a, rotated=rotated, **k))
    model = _model(torch.float32, family=family, device="cpu")
    x, mask = torch.randint(3, 96, (2, 13)), torch.ones(2, 14, dtype=torch.long)
    mask[1, :3] = 0
    cache, other = (model(x, attention_mask=mask[:, :13], use_cache=True).past_key_values for _ in range(2))
    step = dict(input_ids=torch.randint(3, 96, (2, 1)), attention_mask=mask, use_cache=True)
    stock = model(**step, past_key_values=cache).logits
    assert calls == [True] * model.config.num_hidden_layers  # transformers rotated, the kernel took them as they are
    calls.clear()
    with decode_graph.FusedModules(model).active():
        twins = model(**step, past_key_values=other).logits
    assert calls == ["eager"] * model.config.num_hidden_layers  # left un-rotated: the kernel rotated them
    torch.testing.assert_close(twins, stock, atol=1e-4, rtol=1e-4)
    for a, b in zip(cache.layers, other.layers):
        for name in cache_mod.CCALayerCache.TENSORS:
            torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=1e-5, rtol=1e-5)
    assert not decode_graph._UNROTATED
    # a family that hands the attention other q/k than its RoPE returned: refused at the first layer, cache untouched;
    # the capture then keeps the rotation in transformers (defer_rope off) and redoes the step
    deferring = decode_graph._deferring
    monkeypatch.setattr(decode_graph, "_deferring",
                        lambda rope, *more: lambda *a, **kw: tuple(t.clone() for t in deferring(rope)(*a, **kw)))
    third = model(x, attention_mask=mask[:, :13], use_cache=True).past_key_values
    seen = [layer.seen.clone() for layer in third.layers]
    fused = decode_graph.FusedModules(model)
    with pytest.raises(decode_graph.DeferredRopeMismatch), fused.active():
        model(**step, past_key_values=third)
    assert all(torch.equal(a, layer.seen) for a, layer in zip(seen, third.layers)) and not decode_graph._UNROTATED
    fused.defer_rope = False
    with fused.active():
        torch.testing.assert_close(model(**step, past_key_values=third).logits, stock, atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(decode_graph, "_deferring", deferring)
    # fp16 (whose rounding the kernel does not reproduce) and calls of more tokens than a verification pass stay with
    # the family's rotation
    family = sys.modules[type(model.model.layers[0].self_attn).__module__]
    rope = decode_graph._deferring(family.apply_rotary_pos_emb)
    n = decode_graph.DEFERRED_TOKENS + 1
    for q, k, cos in ((torch.randn(2, 4, 1, 16).half(), torch.randn(2, 2, 1, 16).half(), torch.rand(2, 1, 16).half()),
                      (torch.randn(2, 4, n, 16), torch.randn(2, 2, n, 16), torch.rand(2, n, 16))):
        for got, expected in zip(rope(q, k, cos, cos), family.apply_rotary_pos_emb(q, k, cos, cos)):
            assert torch.equal(got, expected)
    assert not decode_graph._UNROTATED


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@torch.no_grad()
def test_gpu_kernel_rope_rounds_as_the_familys_eager_rope(family, dtype=torch.bfloat16):
    """``rotated="eager"`` (a captured step's deferred RoPE) writes bit for bit what the kernel writes when handed
    transformers' rotated q/k in 16-bit (Triton's interpreter does not round to 16-bit as the GPU does: GPU only)."""
    from cca_convert.kernels import cca_decode_triton as kern
    model = _model(torch.float32, family=family, device="cpu")
    family = sys.modules[type(model.model.layers[0].self_attn).__module__]
    torch.manual_seed(0)
    B, H, Hkv, d, g, W = 3, 32, 8, 128, 16, 1039
    q, k, v = (torch.randn(B, n, d, dtype=dtype, device="cuda") for n in (H, Hkv, Hkv))
    ang = torch.rand(B, d // 2, device="cuda") * 100
    cos, sin = (torch.cat((f(ang), f(ang)), -1).mul(1.1).to(dtype) for f in (torch.cos, torch.sin))  # (scaled)
    q_post, k_post = family.apply_rotary_pos_emb(q[:, :, None], k[:, :, None], cos[:, None], sin[:, None])
    states = []
    for rotated, qq, kk in ((True, q_post[:, :, 0], k_post[:, :, 0]), ("eager", q, k)):
        torch.manual_seed(1)
        st = [torch.randn(B, Hkv, W, d), torch.randn(B, Hkv, W, d), torch.randn(B, Hkv, g, d), torch.randn(B, d),
              torch.randn(B, d), torch.zeros(B, Hkv, 4, d), torch.zeros(B, Hkv, 4, d)]
        st = [x.to("cuda", dtype) for x in st]
        q_rot = kern.cca_decode_append_triton(qq, kk, v, cos, sin, None, torch.tensor([7, 15, 40], device="cuda"),
                                              *st, g, d**-0.5, rotated=rotated)
        states.append([q_rot] + st)
    assert states[1][6].abs().sum() > 0  # a group completed: a core token was pooled
    for x, y in zip(*states):
        assert torch.equal(x, y)


def test_state_version_names_the_state_tensors():
    """A captured step is valid while ``state_version`` is unchanged: assigning any state tensor (or announcing a
    crop) changes it, in-place writes and counters do not, and a step replays only within the reserved core."""
    from cca_convert.modeling import cache_cca as cache_mod
    model = _model(torch.float32, device="cpu")
    x = torch.randint(3, 96, (2, 11))
    cache = model(x, use_cache=True).past_key_values
    version = cache.state_version()
    layer = cache.layers[1]
    layer.core_k.zero_()
    layer.seen.add_(0)
    layer.cols += 1
    assert cache.state_version() == version
    for name in cache_mod.CCALayerCache.TENSORS:
        layer_version = cache.state_version()
        setattr(layer, name, getattr(layer, name))  # the same object, assigned: conservatively a new state
        assert cache.state_version() != layer_version, name
    before = cache.state_version()
    layer.activate_past_recording()
    assert cache.state_version() != before
    cache.reserve(steps=2)
    g = model.config.cca_group_size
    limit = cache.replay_limit()
    assert limit == min(layer.core_k.shape[2] for layer in cache.layers) * g - 1
    assert cache.layers[0].max_seen + 2 <= limit  # reserve(steps=2) leaves room for this step and the next


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_pad_columns_while_decoding_replay_like_eager_steps():
    """A pad column in the middle of decoding (attention mask 0 in a step's last column) is a graph input read on
    the device: replayed steps with and without pads give what eager steps give, and no step runs eagerly for it."""
    model = _model(torch.float32)
    x, mask = _prompt(3, 19, pads=(0, 4))
    steps = torch.randint(3, 96, (3, 24), generator=torch.Generator().manual_seed(5)).cuda()
    step_mask = torch.ones_like(steps)
    step_mask[1, 5] = step_mask[2, 6:9] = step_mask[0, 20] = 0
    runs = []
    for graphs in (False, True):
        model.config.cca_cuda_graphs = graphs
        out = model(x, attention_mask=mask, use_cache=True)
        cache, cols, logits = out.past_key_values, mask, []
        for i in range(steps.shape[1]):
            cols = torch.cat((cols, step_mask[:, i : i + 1]), 1)
            logits.append(model(steps[:, i : i + 1], attention_mask=cols, past_key_values=cache, use_cache=True).logits)
        runs.append((torch.cat(logits, 1), cache))
    (eager, _), (graphed, cache) = runs
    assert cache.decode_graphs.replays >= steps.shape[1] - 3, cache.decode_graphs.replays  # first step + capture
    real = step_mask.bool()
    torch.testing.assert_close(graphed[real], eager[real], atol=1e-4, rtol=1e-4)
    assert torch.equal(cache.layers[0].seen, mask.sum(1) + step_mask.sum(1))


@pytest.mark.gpu
@pytest.mark.parametrize("compile_decode", [True, False], ids=["compiled", "stock"])
@torch.no_grad()
def test_gpu_graphs_follow_new_caches_batch_sizes_and_beam_search(compile_decode):
    model = _model(torch.float32)
    model.config.cca_compile_decode = compile_decode
    for bsz, length in ((1, 20), (4, 9), (1, 50)):  # a new cache (and batch size) each time: captured anew
        x, mask = _prompt(bsz, length)
        eager, _ = _generate(model, False, x, mask, max_new_tokens=30)
        graphed, cache = _generate(model, True, x, mask, max_new_tokens=30)
        assert cache.decode_graphs.replays >= 25
        assert torch.equal(graphed.sequences, eager.sequences)
    x, mask = _prompt(2, 21)
    eager, _ = _generate(model, False, x, mask, max_new_tokens=12, num_beams=3)
    graphed, cache = _generate(model, True, x, mask, max_new_tokens=12, num_beams=3)
    assert torch.equal(graphed.sequences, eager.sequences)


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_twins_survive_many_batch_sizes_of_a_q_k_norm_family():
    """Qwen3's RMSNorm forward sees three shapes per batch size (hidden, q-norm, k-norm): past Dynamo's default
    recompile limit after three batch sizes; the twins raise it and stay on."""
    model = _model(torch.float32, family="qwen3")
    for bsz in range(1, 7):
        x, mask = _prompt(bsz, 13)
        eager, _ = _generate(model, False, x, mask, max_new_tokens=12)
        graphed, cache = _generate(model, True, x, mask, max_new_tokens=12)
        assert cache.decode_graphs.replays >= 8 and cache.decode_graphs.failure is None
        assert torch.equal(graphed.sequences, eager.sequences)
    assert model._fused_modules.failure is None


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_generate_defers_its_stop_checks_with_the_same_tokens(monkeypatch):
    """On CUDA, generate() with a CCA cache it drops reads its stopping flag one step late (transformers'
    DeferredStopCheck, ``decode_graph.defer_stop_checks``) while the steps replay CUDA graphs. The tokens are those of the
    per-step sync: stopped by length, and by EOS (the step run past the stop is dropped), with left padding, with
    the cache dropped or handed back."""
    from transformers.generation import utils as generation

    checks, replays = [], []
    deferred_call, graphs = generation.DeferredStopCheck.__call__, decode_graph.DecodeGraphs
    replay = graphs.replay
    monkeypatch.setattr(generation.DeferredStopCheck, "__call__",
                        lambda self, *a: checks.append(1) or deferred_call(self, *a))
    monkeypatch.setattr(graphs, "replay", lambda self, *a: (lambda r: replays.append(r is not None) or r)(replay(self, *a)))
    model = _model(torch.float32)
    x, mask = _prompt(2, 23, pads=(0, 5))
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0, use_cache=True, max_new_tokens=30)

    def generate(defer, **more):
        model.config.cca_defer_stop_checks = defer
        checks.clear(), replays.clear()
        return model.generate(x, **kw, **more)

    plain = generate(False, eos_token_id=None)
    assert not checks and sum(replays) >= 25
    deferred = generate(True, eos_token_id=None)
    assert len(checks) >= 29 and sum(replays) >= 25
    assert torch.equal(deferred, plain)
    eos = [int(plain[0, 23 + 6]), int(plain[1, 23 + 9])]  # each row stops by its 10th new token
    synced = generate(False, eos_token_id=eos)
    deferred = generate(True, eos_token_id=eos)
    assert checks and synced.shape[1] <= 23 + 10
    assert torch.equal(deferred, synced)
    # handed back: the cache records its past from the first step on (the rings re-laid with the slack), crops the
    # step run past an EOS stop in place, and its steps still replay
    out = generate(True, eos_token_id=None, return_dict_in_generate=True)
    assert len(checks) >= 29 and sum(replays) >= 25 and torch.equal(out.sequences, plain)
    out = generate(True, eos_token_id=eos, return_dict_in_generate=True)
    assert checks and torch.equal(out.sequences, synced)
    assert out.past_key_values.get_seq_length() == synced.shape[1] - 1  # every token but the last one fed
    assert out.past_key_values.layers[0].slack and not out.past_key_values.layers[0].record_past


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_a_failed_capture_is_retried_before_decoding_turns_eager():
    """A capture that fails (here: an event queried while it runs, which invalidates it) runs its step eagerly and
    is tried again at the next step; only CAPTURE_ATTEMPTS failures with one cache turn the model's graph decoding
    off, and a host sync (data-dependent routing) at once. The tokens are those of eager decoding every time."""
    from cca_convert.modeling import decode_graph
    model = _model(torch.float32)
    x, mask = _prompt(2, 19, pads=(0, 3))
    eager, _ = _generate(model, False, x, mask, max_new_tokens=16)
    failing = [1]  # captures left to spoil

    def spoil(module, args):
        if failing[0] and torch.cuda.is_current_stream_capturing():
            failing[0] -= 1
            event = torch.cuda.Event()
            event.record()
            event.query()  # (not allowed while capturing)

    hook = model.model.layers[0].register_forward_pre_hook(spoil)
    try:
        graphed, cache = _generate(model, True, x, mask, max_new_tokens=16)
        graphs = cache.decode_graphs
        assert len(graphs.failures) == 1 and graphs.failure is None and graphs.replays >= 12, graphs.failures
        assert getattr(model, "_graph_failure", None) is None and torch.equal(graphed.sequences, eager.sequences)
        failing[0] = 100
        graphed, cache = _generate(model, True, x, mask, max_new_tokens=16)
        graphs = cache.decode_graphs
        assert len(graphs.failures) == decode_graph.CAPTURE_ATTEMPTS and graphs.replays == 0
        assert model._graph_failure == graphs.failure and torch.equal(graphed.sequences, eager.sequences)
    finally:
        hook.remove()

    def host_sync(module, args):
        if torch.cuda.is_current_stream_capturing():
            args[0].sum().item()  # (what data-dependent routing does)

    model = _model(torch.float32)
    hook = model.model.layers[0].register_forward_pre_hook(host_sync)
    try:
        graphed, cache = _generate(model, True, x, mask, max_new_tokens=16)
        graphs = cache.decode_graphs
        assert len(graphs.failures) == 1 and decode_graph.HOST_SYNC in graphs.failure and graphs.replays == 0
        assert model._graph_failure == graphs.failure and torch.equal(graphed.sequences, eager.sequences)
    finally:
        hook.remove()


def test_the_rope_dtypes_a_captured_step_defers_are_the_decode_kernels():
    """decode_graph keeps its own copy (DCA exports ship no CCA kernel): it must name the dtypes whose eager RoPE
    rounding CCA's decode kernel reproduces."""
    pytest.importorskip("triton")
    from cca_convert.kernels import cca_decode_triton
    from cca_convert.modeling import decode_graph

    assert decode_graph.EAGER_ROPE_DTYPES == cca_decode_triton.EAGER_ROPE_DTYPES


@pytest.mark.parametrize("method", ["cca", "dca"])
def test_what_generate_hands_a_decode_step_is_what_a_captured_step_takes(method):
    """A step is replayed only when every keyword generate() passes to forward is one the captured step takes: with a
    streamer and a tokenizer, as transformers serve calls generate() (a ``tokenizer`` there once kept every served CCA
    step eager). Checked on the CPU: the keywords, not the replay."""
    import copy

    from tests.modeling.test_dca_hf import stock_and_dca
    from tests.support.factories import tiny_tokenizer

    if method == "cca":
        model = _model(torch.float32, device="cpu")
    else:
        model = stock_and_dca("llama")[1]
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(set(kw)), with_kwargs=True)

    class Streamer:
        def put(self, value):
            pass

        def end(self):
            pass

    config = copy.deepcopy(model.generation_config)
    config.update(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    x = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(x, attention_mask=torch.ones_like(x), generation_config=config, streamer=Streamer(),
                       tokenizer=tiny_tokenizer(model.config.vocab_size))
    steps = seen[1:]  # after the prompt
    assert steps and all(kw - {"past_key_values", "use_cache"} <= type(model).GRAPH_INPUTS for kw in steps), steps
