"""DCA inside transformers' stock classes (modeling/dca_hf.py) at model level, on tiny random checkpoints: it is the
base model while L <= C + 1, differs after, decodes from its cache exactly like full passes (across chunk
boundaries, left padding), a padded batch equals each sequence alone, and prompt-lookup (speculative) decoding gives
the greedy output through the cache's crop. On a GPU (``-m gpu``) the model with the Triton kernel equals the model
with the PyTorch twin (prefill, cached decode, chunked prefill, left padding; fp32 and bf16)."""

import copy

import pytest
import torch
import transformers

from cca_convert.families import FAMILIES
from cca_convert.modeling import dca_hf as hf
from tests.support.factories import TINY, tiny_base_model

CHUNK, LOCAL = 24, 8  # s = 16: chunk boundaries at 16, 32, 48 ...


def stock_and_dca(family, **dca):
    stock = tiny_base_model(family, **{"max_position_embeddings": 512, "pad_token_id": 0, "eos_token_id": 2,
                                       **TINY.get(family, {})})
    config = copy.deepcopy(stock.config)
    config.dual_chunk_attention_config = {"chunk_size": CHUNK, "local_size": LOCAL, **dca}
    config._attn_implementation = "dca"
    base = getattr(transformers, FAMILIES[family].causal_lm)
    model = type(f"DCA{base.__name__}", (hf.DCAModelMixin, base), {})(config).eval()
    model.load_state_dict(stock.state_dict())
    return stock, model


def ids(bsz=2, length=40, seed=1):
    return torch.randint(3, 96, (bsz, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_base_model_up_to_C_and_different_after(family):
    stock, model = stock_and_dca(family)
    with torch.no_grad():
        x = ids(length=CHUNK + 1)
        torch.testing.assert_close(model(x, use_cache=False).logits, stock(x, use_cache=False).logits,
                                   atol=1e-5, rtol=1e-5)
        x = ids(length=60)
        got, want = model(x, use_cache=False).logits, stock(x, use_cache=False).logits
    torch.testing.assert_close(got[:, : CHUNK + 1], want[:, : CHUNK + 1], atol=1e-5, rtol=1e-5)
    assert ((got[:, CHUNK + 1:] - want[:, CHUNK + 1:]).abs().amax(-1) > 1e-4).all()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cached_decode_and_chunked_prefill_equal_full_passes(family):
    _, model = stock_and_dca(family)
    x = ids(length=70)
    mask = torch.ones_like(x)
    mask[1, :9] = 0  # left padding
    with torch.no_grad():
        want = model(x, attention_mask=mask, use_cache=False).logits
        cache = model(x[:, :21], attention_mask=mask[:, :21], use_cache=True).past_key_values
        assert isinstance(cache, hf.DCACache)
        parts = [model(x[:, 21:33], attention_mask=mask[:, :33], past_key_values=cache, use_cache=True).logits]
        for i in range(33, 70):  # one token per pass across the boundaries at 48 and 64 (row 0) ...
            parts.append(model(x[:, i:i + 1], attention_mask=mask[:, :i + 1], past_key_values=cache,
                               use_cache=True).logits)
    torch.testing.assert_close(torch.cat(parts, 1), want[:, 21:], atol=1e-4, rtol=1e-4)


def test_left_padded_batch_equals_each_sequence_alone():
    _, model = stock_and_dca("llama")
    x = ids(length=58)
    mask = torch.ones_like(x)
    mask[1, :11] = 0
    with torch.no_grad():
        batch = model(x, attention_mask=mask, use_cache=False).logits
        alone = model(x[1:, 11:], use_cache=False).logits
    torch.testing.assert_close(batch[1:, 11:], alone, atol=1e-4, rtol=1e-4)


def test_prompt_lookup_decoding_equals_greedy_through_crop():
    _, model = stock_and_dca("llama")
    prompt = torch.cat([ids(bsz=1, length=20, seed=4)] * 3, 1)  # repeats: the lookup finds drafts
    with torch.no_grad():
        greedy = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None,
                                use_cache=True)
        lookup = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None,
                                prompt_lookup_num_tokens=4, use_cache=True)
    assert torch.equal(lookup, greedy)


@torch.no_grad()
def test_the_model_holds_no_cache_after_a_forward():
    """The attention modules hold their call's tables and cache only for the call: dropping the output frees the
    cache at once."""
    import gc
    import weakref

    _, dca = stock_and_dca("llama")
    gc.disable()
    try:
        out = dca(ids(), use_cache=True)
        cache = weakref.ref(out.past_key_values)
        del out
        assert cache() is None
        assert all(getattr(m, "_method_ctx", None) is None for m in dca.modules())
    finally:
        gc.enable()


def test_attention_weights_are_refused_not_returned_as_none():
    _, model = stock_and_dca("llama")
    with pytest.raises(ValueError, match="output_attentions=True: DCA.*attn_implementation='eager'"):
        model(ids(), output_attentions=True)


def test_bad_settings_fail_when_the_model_is_built():
    with pytest.raises(ValueError, match="must be < the chunk length"):
        stock_and_dca("llama", chunk_size=16, local_size=8)


def test_bad_backend_and_unprefixed_options_fail_when_the_model_is_built():
    with pytest.raises(ValueError, match="dca_attn_backend must be one of"):
        _, model = stock_and_dca("llama")
        config = copy.deepcopy(model.config)
        config.dca_attn_backend = "Triton"
        type(model)(config)


def kernel_vs_reference(family, dtype, c_orig, device, steps=30, new_tokens=40):
    """The whole model: Triton kernel vs the PyTorch twin, prefill (with left padding) and then cached decode and a
    chunked-prefill pass across chunk boundaries (C = 24, s = 16; 150 tokens cross 9 boundaries). Without the
    temperature the cached passes also equal the full pass. (With it they cannot, past one layer: a token's deeper
    keys/values depend on the T of the pass that computed them, as in vLLM.)"""
    _, model = stock_and_dca(family, original_max_position_embeddings=c_orig)
    model = model.to(device, dtype)
    end = 120 + steps
    x = ids(length=end).to(device)
    mask = torch.ones_like(x)
    mask[1, :13] = 0
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    runs = {}
    for backend in ("triton", "reference"):
        model.config.dca_attn_backend = backend
        with torch.no_grad():
            full = model(x, attention_mask=mask, use_cache=False).logits.float()
            cache = model(x[:, :100], attention_mask=mask[:, :100], use_cache=True).past_key_values
            out = [model(x[:, 100:120], attention_mask=mask[:, :120], past_key_values=cache).logits]
            for i in range(120, end):
                out.append(model(x[:, i:i + 1], attention_mask=mask[:, :i + 1], past_key_values=cache).logits)
        runs[backend] = (full, torch.cat(out, 1).float())
    torch.testing.assert_close(runs["triton"][0], runs["reference"][0], **tol)
    torch.testing.assert_close(runs["triton"][1], runs["reference"][1], **tol)
    if dtype == torch.float32 and not c_orig:
        torch.testing.assert_close(runs["triton"][1], runs["triton"][0][:, 100:], **tol)
    model.config.dca_attn_backend = "auto"
    with torch.no_grad():
        greedy = model.generate(x[:, :40], attention_mask=mask[:, :40], max_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=0, eos_token_id=None)
        model.config.dca_attn_backend = "reference"
        twin = model.generate(x[:, :40], attention_mask=mask[:, :40], max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
    if dtype == torch.float32:
        assert torch.equal(greedy, twin)
    return model


@pytest.mark.parametrize("c_orig", [0, 64], ids=["no-temperature", "temperature"])
@pytest.mark.slow
def test_kernel_equals_reference_at_model_level_interpreted(c_orig, monkeypatch):
    """The model's kernel path (the Triton attention, the key rotation fused with the cache writes, the split merge,
    the per-pass shared state) run on CPU tensors by Triton's interpreter: what CI can check of what a GPU runs."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 to run the Triton kernels on the CPU")
    from cca_convert.modeling import dca_hf as shim
    monkeypatch.setattr(shim, "KERNEL_ON_CPU", True)
    calls = {"attention": 0, "keys": 0}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(shim, "dca_attention_triton", spy("attention", shim.dca_attention_triton))
    monkeypatch.setattr(shim, "rotate_keys_triton", spy("keys", shim.rotate_keys_triton))
    monkeypatch.setattr(shim, "append_rotated_triton", spy("keys", shim.append_rotated_triton))
    model = kernel_vs_reference("llama", torch.float32, c_orig, "cpu", steps=6, new_tokens=8)
    layers = model.config.num_hidden_layers
    assert calls["attention"] >= 10 * layers and calls["keys"] == calls["attention"], calls


@pytest.mark.gpu
@pytest.mark.parametrize("c_orig", [0, 64], ids=["no-temperature", "temperature"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_gpu_kernel_equals_reference_at_model_level(family, dtype, c_orig):
    kernel_vs_reference(family, dtype, c_orig, "cuda")


@torch.no_grad()
def test_cache_counts_written_columns_on_the_device_and_crops_them():
    """What a CUDA-graph step relies on, on the CPU: each pass writes at the device-side column counter, the buffers
    keep spare room (their replacement bumps the version a captured step is checked against), a crop moves the
    counter back and stops the dropped columns counting as real tokens, and the host counters round-trip."""
    _, model = stock_and_dca("llama")
    x = ids(bsz=2, length=30)
    mask = torch.ones_like(x)
    mask[1, :5] = 0
    cache = model(x, attention_mask=mask, use_cache=True).past_key_values
    layer = cache.layers[0]
    assert int(cache.columns) == layer.length == 30 and layer.buffers[0].shape[2] == 30 + hf.SPARE_COLUMNS
    assert layer.buffers[3].sum(1).tolist() == [30, 25]
    version = cache.state_version()
    for i in range(3):
        cache = model(ids(bsz=2, length=1, seed=i), attention_mask=torch.ones(2, 31 + i, dtype=torch.long),
                      past_key_values=cache).past_key_values
    assert int(cache.columns) == 33 and cache.state_version() == version  # appended in place
    counters = cache.host_counters()
    cache.advance(2)
    assert cache.get_seq_length() == 35
    cache.set_host_counters(counters)
    cache.crop(-2)
    assert int(cache.columns) == cache.get_seq_length() == 31
    assert layer.buffers[3].sum(1).tolist() == [31, 26]
    assert cache.replay_limit() == 30 + hf.SPARE_COLUMNS - 1
    cache.reserve(2000)
    assert cache.state_version() != version and cache.replay_limit() >= 31 + 2000 - 1


def test_cuda_graphs_option_is_checked():
    _, model = stock_and_dca("llama")
    config = copy.deepcopy(model.config)
    config.dca_cuda_graphs = "yes"
    with pytest.raises(ValueError, match="dca_cuda_graphs must be true or false"):
        type(model)(config)


@pytest.mark.gpu
@pytest.mark.parametrize("c_orig", [0, 64], ids=["no-temperature", "temperature"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@torch.no_grad()
def test_gpu_graph_decode_equals_eager(family, dtype, c_orig, monkeypatch):
    """generate() with CUDA-graph steps (the default; ``dca_cuda_graphs=False``: eager) gives eager's scores (bf16:
    bit for bit; fp32: within 1e-5) and tokens on a left-padded batch, across chunk boundaries and buffer growths
    (each a new capture), with most steps replayed; without the temperature its steps' logits are the no-cache
    forward's."""
    monkeypatch.setattr(hf, "SPARE_COLUMNS", 16)  # the buffers grow every few steps: re-captures
    _, model = stock_and_dca(family, original_max_position_embeddings=c_orig)
    model = model.to("cuda", dtype)
    x = ids(length=60).cuda()
    mask = torch.ones_like(x)
    mask[1, :7] = 0
    runs = {}
    for graphs in (False, True):
        model.config.dca_cuda_graphs = graphs
        # a cache of the caller's: not sized by generate(), so its buffers grow (SPARE_COLUMNS) while it decodes
        out = model.generate(x, attention_mask=mask, max_new_tokens=90, do_sample=False, pad_token_id=0, use_cache=True,
                             eos_token_id=None, return_dict_in_generate=True, output_scores=True,
                             past_key_values=hf.DCACache(model.config))
        runs[graphs] = (out, out.past_key_values.__dict__.get("decode_graphs"))
    (eager, none), (graphed, record) = runs[False], runs[True]
    assert none is None and record.failure is None and record.replays >= 60, (record.failures, record.replays)
    if dtype == torch.bfloat16:  # eager's operations with eager's roundings (fused RoPE round trip included)
        assert torch.equal(torch.stack(graphed.scores), torch.stack(eager.scores))
    else:  # (fp32: fused kernels may contract to FMAs; 1.8e-7 to 3.0e-7 measured on an H200)
        torch.testing.assert_close(torch.stack(graphed.scores), torch.stack(eager.scores), atol=1e-5, rtol=1e-5)
    assert torch.equal(graphed.sequences, eager.sequences)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    if not c_orig:  # decode == prefill
        full_mask = torch.cat([mask, torch.ones_like(graphed.sequences[:, 60:])], 1)
        full = model(graphed.sequences, attention_mask=full_mask, use_cache=False).logits[:, 59:-1].float()
        torch.testing.assert_close(torch.stack(graphed.scores, 1).float(), full, **tol)


def test_generate_defers_its_stop_checks_for_a_dca_cache_on_cuda():
    """transformers' ``DeferredStopCheck.is_supported`` says yes for a DCA cache on CUDA (its crop is done in place),
    as for CCA's (``decode_graph.defer_stop_checks``); not elsewhere, not for an assistant, not with the option off."""
    from transformers.generation.utils import DeferredStopCheck

    _, model = stock_and_dca("llama")
    cache, cuda = hf.DCACache(model.config), torch.device("cuda")
    supported = DeferredStopCheck.is_supported
    assert supported(cuda, cache, False, is_assistant=False) and supported(cuda, cache, True, is_assistant=False)
    assert not supported(cuda, cache, False, is_assistant=True)
    assert not supported(torch.device("cpu"), cache, False, is_assistant=False)
    model.config.dca_defer_stop_checks = False
    assert not supported(cuda, cache, False, is_assistant=False)
    config = copy.deepcopy(model.config)
    config.dca_defer_stop_checks = "no"
    with pytest.raises(ValueError, match="dca_defer_stop_checks must be true or false"):
        type(model)(config)


@torch.no_grad()
def test_a_generate_step_may_replay_without_reading_its_mask_column(monkeypatch):
    """A step's new mask column must be real for a DCA step to replay. When generate() made the mask (its last one
    extended by ones: the one-token path of ``prepare_inputs_for_generation`` marks it) the cache knows without a
    device read; any other mask is read, and a pad column keeps the step eager."""
    _, model = stock_and_dca("llama")
    x = ids(bsz=2, length=20)
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    cache = model(x, attention_mask=mask, use_cache=True).past_key_values
    assert cache.leading_pads_only is True
    step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    inputs = model.prepare_inputs_for_generation(torch.cat([x, x[:, :1]], 1), next_sequence_length=1,
                                                 past_key_values=cache, attention_mask=step_mask, use_cache=True)
    assert inputs["attention_mask"] is step_mask and vars(cache)["extended_mask"] is step_mask
    pad_column = torch.cat([mask, torch.zeros_like(mask[:, :1])], 1)
    assert cache.graph_step_allowed(step_mask[:, -1:], extended=True)
    assert cache.graph_step_allowed(step_mask[:, -1:]) and not cache.graph_step_allowed(pad_column[:, -1:])
    model(inputs["input_ids"], attention_mask=step_mask, past_key_values=cache)  # (CPU: eager; the mark is taken)
    assert "extended_mask" not in vars(cache)
    # in generate(), each step's mask reaches the replay check as the object prepare_inputs_for_generation marked
    marked, replayed = [], type(model)._replayed_decode

    def spy(self, cache, kwargs):
        marked.append(vars(cache).get("extended_mask") is kwargs.get("attention_mask") is not None)
        return replayed(self, cache, kwargs)

    monkeypatch.setattr(type(model), "_replayed_decode", spy)
    model.generate(x, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, use_cache=True,
                   eos_token_id=None)
    assert marked == [True] * 4, marked


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_generate_defers_its_stop_checks_with_the_same_tokens(monkeypatch):
    """On CUDA, generate() with a DCA cache reads its stopping flag one step late while its steps replay CUDA graphs
    without reading their mask columns; the tokens are those of the per-step sync, stopped by length and by EOS,
    with the cache dropped or handed back (the step run past the stop cropped in place)."""
    from transformers.generation import utils as generation

    checks, extended = [], []
    deferred_call, allowed = generation.DeferredStopCheck.__call__, hf.DCACache.graph_step_allowed
    monkeypatch.setattr(generation.DeferredStopCheck, "__call__",
                        lambda self, *a: checks.append(1) or deferred_call(self, *a))
    monkeypatch.setattr(hf.DCACache, "graph_step_allowed",
                        lambda self, real, ext=False: extended.append(ext) or allowed(self, real, ext))
    _, model = stock_and_dca("llama")
    model = model.to("cuda")
    x = ids(length=40).cuda()
    mask = torch.ones_like(x)
    mask[1, :5] = 0
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0, use_cache=True, max_new_tokens=30)

    def generate(defer, **more):
        model.config.dca_defer_stop_checks = defer
        checks.clear(), extended.clear()
        return model.generate(x, **kw, **more)

    plain = generate(False, eos_token_id=None, return_dict_in_generate=True)
    assert not checks and plain.past_key_values.decode_graphs.replays >= 25 and all(extended[1:])
    plain = plain.sequences
    out = generate(True, eos_token_id=None, return_dict_in_generate=True)
    assert len(checks) >= 29 and out.past_key_values.decode_graphs.replays >= 25
    assert torch.equal(out.sequences, plain)
    eos = [int(plain[0, 40 + 6]), int(plain[1, 40 + 9])]  # each row stops by its 10th new token
    synced = generate(False, eos_token_id=eos)
    assert torch.equal(generate(True, eos_token_id=eos), synced)
    out = generate(True, eos_token_id=eos, return_dict_in_generate=True)
    assert checks and torch.equal(out.sequences, synced)
    assert out.past_key_values.get_seq_length() == synced.shape[1] - 1  # every token but the last one fed


@torch.no_grad()
def test_generate_sizes_the_cache_once(monkeypatch):
    """generate() knows how long the sequence gets: the DCA cache it creates allocates every layer's buffers once at
    that length plus a captured step's room (no doubling, no copy, no second buffer during a chunked prefill);
    past the plan the buffers grow as for any other cache, and so they do from the start when the planned buffers
    would not fit in the device's free memory (a large max_length, a short output)."""
    _, model = stock_and_dca("llama")
    x = ids(bsz=2, length=30)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False, pad_token_id=0,
                         use_cache=True, eos_token_id=None, return_dict_in_generate=True, prefill_chunk_size=8)
    cache = out.past_key_values
    assert isinstance(cache, hf.DCACache) and cache.get_seq_length() == 30 + 12 - 1
    assert all(layer.buffers[0].shape[2] == 30 + 12 - 1 + hf.STEP_ROOM for layer in cache.layers)
    assert all(layer.version == 1 for layer in cache.layers)  # one allocation per layer
    assert torch.equal(out.sequences, model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12,
                                                     do_sample=False, pad_token_id=0, use_cache=True,
                                                     eos_token_id=None, past_key_values=hf.DCACache(model.config)))
    layer = cache.layers[0]
    layer.reserve(layer.planned + 1)
    assert layer.buffers[0].shape[2] == layer.planned + 1 + hf.SPARE_COLUMNS and layer.version == 2
    per_layer = sum(x.numel() * x.element_size() for x in cache.layers[1].buffers)  # at 30 + 11 + STEP_ROOM columns
    for free, planned in ((per_layer * model.config.num_hidden_layers, True), (per_layer, False)):
        monkeypatch.setattr(hf, "free_bytes", lambda device, free=free: free)
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                             pad_token_id=0, use_cache=True, eos_token_id=None, return_dict_in_generate=True)
        capacity = out.past_key_values.layers[0].buffers[0].shape[2]
        assert capacity == (30 + 11 + hf.STEP_ROOM if planned else 30 + hf.SPARE_COLUMNS), (free, capacity)


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_cache_plan_is_checked_against_the_devices_free_memory():
    """On a real device (``torch.cuda.mem_get_info``, no stand-in): a plan whose buffers fit is allocated at once; one
    larger than the free memory is dropped at the first pass, which allocates what it writes plus the spare room
    instead of running out of memory."""
    config = stock_and_dca("llama")[1].config
    device, bsz, n = torch.device("cuda"), 2, 3
    free = hf.free_bytes(device)
    assert free is not None and free > 0
    k = torch.randn(bsz, config.num_key_value_heads, n, config.head_dim, device=device, dtype=torch.bfloat16)
    pos = torch.arange(n, device=device).expand(bsz, n).contiguous()
    valid = torch.ones(bsz, n, dtype=torch.bool, device=device)
    columns = torch.arange(n, device=device)
    layers = config.num_hidden_layers
    # every column takes at least a byte per layer: free // layers + 1 columns of every layer exceed the free memory
    for planned, fits in ((64, True), (free // layers + 1, False)):
        cache = hf.DCACache(config, max_cache_length=planned)
        layer = cache.layers[0]
        layer.append(k, k.clone(), pos, valid, columns)
        want = planned + hf.STEP_ROOM if fits else n + hf.SPARE_COLUMNS
        assert layer.buffers[0].shape[2] == want and layer.planned == (want if fits else 0), (planned, fits)
        assert all(other.planned == layer.planned for other in cache.layers)  # the plan is the cache's, checked once
        torch.testing.assert_close(layer.buffers[1][:, :, :n], k, rtol=0, atol=0)
        del cache, layer
        torch.cuda.empty_cache()


@torch.no_grad()
def test_a_step_being_captured_takes_the_familys_rope_back_as_eager_computes_it(monkeypatch):
    """Under ``FusedModules.active()`` (a step being captured) the family's RoPE leaves a DCA step's q/k un-rotated
    and the attention runs the RoPE and its inverse as one twin (``rope_round_trip``): the stock step's logits and
    cache, on a left-padded batch."""
    from cca_convert.modeling import decode_graph

    if not decode_graph.EAGER_ROPE_DTYPES:
        pytest.skip("without triton nothing is captured, so no RoPE is deferred")
    calls = []
    round_trip = hf.rope_round_trip
    monkeypatch.setattr(hf, "rope_round_trip", lambda *a: calls.append(1) or round_trip(*a))
    _, model = stock_and_dca("llama")
    cache, other, step, stock = _left_padded_caches_and_step(model)
    assert not calls
    fused = decode_graph.FusedModules(model)
    with fused.active():
        twins = model(**step, past_key_values=other).logits
    assert fused.failure is None and len(calls) == model.config.num_hidden_layers and not decode_graph._UNROTATED
    torch.testing.assert_close(twins, stock, atol=1e-5, rtol=1e-5)
    for a, b in zip(cache.layers, other.layers):
        for x, y in zip(a.tensors(), b.tensors()):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


def _left_padded_caches_and_step(model):
    """Two equal caches of a left-padded batch's prefill, the next step's inputs, and that step's eager logits
    (computed on the first cache)."""
    x = ids(bsz=2, length=20)
    mask = torch.ones(2, 21, dtype=torch.long)
    mask[1, :4] = 0
    cache, other = (model(x, attention_mask=mask[:, :20], use_cache=True).past_key_values for _ in range(2))
    step = dict(input_ids=ids(bsz=2, length=1, seed=5), attention_mask=mask, use_cache=True)
    return cache, other, step, model(**step, past_key_values=cache).logits


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_captured_steps_cache_write_takes_the_familys_rope_back_interpreted(family, monkeypatch):
    """On the kernel path the cache write's launch takes a captured step's RoPE back (``append_rotated_triton``'s
    ``deferred``) instead of ``rope_round_trip``: the eager kernel step's logits and cache, on a left-padded batch
    (Triton's interpreter on CPU tensors, fp32; to 1e-6, as the values, which no RoPE touches: the step's compiled
    norms round otherwise. The launch alone is bit for bit: ``test_dca_triton``)."""
    import os

    from cca_convert.modeling import decode_graph

    if os.environ.get("TRITON_INTERPRET") != "1" or not decode_graph.EAGER_ROPE_DTYPES:
        pytest.skip("needs triton and TRITON_INTERPRET=1 to run the Triton kernels on the CPU")
    monkeypatch.setattr(hf, "KERNEL_ON_CPU", True)
    calls = {"round_trip": 0, "deferred": 0}
    round_trip, append = hf.rope_round_trip, hf.append_rotated_triton
    monkeypatch.setattr(hf, "rope_round_trip", lambda *a: calls.__setitem__("round_trip", 1) or round_trip(*a))

    def spy(*args):
        calls["deferred"] += args[-1] is not None
        return append(*args)

    monkeypatch.setattr(hf, "append_rotated_triton", spy)
    _, model = stock_and_dca(family)
    cache, other, step, stock = _left_padded_caches_and_step(model)
    assert calls == {"round_trip": 0, "deferred": 0}
    fused = decode_graph.FusedModules(model)
    with fused.active():
        twins = model(**step, past_key_values=other).logits
    assert fused.failure is None and not decode_graph._UNROTATED
    assert calls == {"round_trip": 0, "deferred": model.config.num_hidden_layers}, calls
    torch.testing.assert_close(twins, stock, atol=1e-5, rtol=1e-5)
    for a, b in zip(cache.layers, other.layers):
        for x, y in zip(a.tensors(), b.tensors()):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
