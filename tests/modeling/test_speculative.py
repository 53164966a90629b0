"""Speculative decoding on the exported CCA model (issue #14): the compressed cache drops the rejected draft
tokens of a verification pass (``crop``), so ``generate(prompt_lookup_num_tokens=...)`` and
``generate(assistant_model=...)`` give exactly plain greedy output. g=4, s=8: groups complete (and are pooled)
inside verification passes, and the prompt is longer than the window."""

import functools
import os

import pytest
import torch

from cca_convert.modeling import cache_cca
from tests.support.factories import cca_hf_model_from, tiny_base_model

G, S = 4, 8


def _models(device="cpu", backend=None):
    base = tiny_base_model("llama", **{"max_position_embeddings": 512, "pad_token_id": 0, "eos_token_id": 2})
    backend = backend or ("triton" if device == "cuda" else "reference")
    model = cca_hf_model_from(base, group_size=G, local_window=S, attn_backend=backend)
    return base.to(device), model.to(device)


def _prompt(bsz=1, seed=4):
    unit = torch.randint(3, 96, (bsz, 9), generator=torch.Generator().manual_seed(seed))
    return torch.cat([unit, unit[:, :5], unit, unit[:, 2:]], 1)  # repeats: prompt lookup finds drafts


def _on_kernels(kernels, monkeypatch):
    """The decode kernels on CPU tensors (Triton's interpreter) where ``kernels``, else the PyTorch decode path."""
    if kernels:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the decode kernels on CPU need TRITON_INTERPRET=1")
        monkeypatch.setattr(cache_cca.CCALayerCache, "force_triton", True)


def _padded(seed, units):
    """Two rows of ``units`` repeated prompts, the second left-padded by 3 columns: ids and mask."""
    ids = torch.cat([_prompt(bsz=2, seed=seed)] * units, 1)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def _steps(model, ids, mask, cache, start, stop):
    """The logits of one-token steps over columns ``start .. stop - 1``."""
    return torch.cat([model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], past_key_values=cache).logits
                      for i in range(start, stop)], 1)


def _no_copies(*args, **kwargs):
    raise AssertionError("a pass within the slack saved its state for crop()")


@torch.no_grad()
@pytest.mark.parametrize("kernels", [False, True])
def test_prompt_lookup_equals_greedy(kernels, monkeypatch):
    """Verification passes within the speculative slack are cropped in place: no per-pass copies of the state."""
    _on_kernels(kernels, monkeypatch)
    _, model = _models(backend="auto" if kernels else "reference")
    prompt = _prompt()
    kw = dict(max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True)
    greedy = model.generate(prompt, **kw)
    from cca_convert.modeling import cache_cca as cache_mod
    monkeypatch.setattr(cache_mod.CCALayerCache, "_state", _no_copies)
    lookup = model.generate(prompt, prompt_lookup_num_tokens=5, return_dict_in_generate=True, **kw)
    assert torch.equal(lookup.sequences, greedy)
    assert lookup.past_key_values.layers[0].slack == cache_mod.SPECULATIVE_SLACK


@torch.no_grad()
def test_the_first_pass_prefills_the_prompt_as_greedy_does(monkeypatch):
    """Prompt lookup's first call holds the prompt and its first drafts; it runs as greedy decoding runs the same
    tokens: the prompt's prefill (greedy's shapes, so greedy's roundings of the prompt's keys and values), then the
    drafts as a verification pass. Its logits are those of the one call, its cache that of the prompt's prefill."""
    _, model = _models()
    prompt = _prompt()
    calls = []
    forward = type(model).__mro__[1].forward  # the stock forward under CCAModelMixin's

    @functools.wraps(forward)  # (generate() reads the signature: it passes logits_to_keep to a forward that shows it)
    def counted(self, *args, **kwargs):
        calls.append((kwargs["input_ids"].shape[1], kwargs.get("logits_to_keep")))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model).__mro__[1], "forward", counted)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True)
    lookup = model.generate(prompt, prompt_lookup_num_tokens=5, **kw)
    n = prompt.shape[1]
    assert calls[:3] == [(n + 5, 6), (n, 1), (5, 5)]  # generate()'s call, then the prompt alone and its 5 drafts
    monkeypatch.undo()
    assert torch.equal(lookup, model.generate(prompt, **kw))

    from cca_convert.modeling import cca_hf
    ids = torch.cat([prompt, prompt[:, :4]], 1)
    one = cca_hf.HFCCACache(model.config)
    one.activate_past_recording()
    logits = model(ids, past_key_values=one, use_cache=True, logits_to_keep=5).logits
    assert logits.shape[1] == 5
    full = model(ids, use_cache=False).logits[:, -5:]
    torch.testing.assert_close(logits, full, atol=1e-5, rtol=1e-5)
    one.crop(-4)
    alone = cca_hf.HFCCACache(model.config)
    alone.activate_past_recording()
    model(prompt, past_key_values=alone, use_cache=True, logits_to_keep=1)
    for a, b in zip(one.layers, alone.layers):
        assert torch.equal(a.seen, b.seen) and a.cols == b.cols
        slots = torch.arange(prompt.shape[1]) % a.win_k.shape[2]  # (the cropped drafts' slots are stale, unread)
        for name in ("win_k", "win_v"):
            assert torch.equal(getattr(a, name)[:, :, slots], getattr(b, name)[:, :, slots]), name
        n_core = prompt.shape[1] // G
        for name in ("core_k", "core_v"):
            assert torch.equal(getattr(a, name)[:, :, :n_core], getattr(b, name)[:, :, :n_core]), name


@torch.no_grad()
@pytest.mark.slow
@pytest.mark.parametrize("kernels", [False, True])
def test_recorded_crop_is_done_in_place(kernels, monkeypatch):
    """After ``activate_past_recording`` (generate() calls it for speculative decoding, before the prefill) the rings
    keep SPECULATIVE_SLACK more positions. A pass within it runs token by token on the decode kernels (where they run)
    and gives the no-cache forward's logits; a crop counts the dropped columns out of ``seen`` in place (no state
    tensor replaced: captured steps stay valid), pads among them included; the next steps then give what a run that
    never saw them gives. Beyond the slack the last pass is undone as without it."""
    _on_kernels(kernels, monkeypatch)
    from cca_convert.modeling import cache_cca as cache_mod
    from cca_convert.modeling import cca_hf
    _, model = _models(backend="auto" if kernels else "reference")
    slack = cache_mod.SPECULATIVE_SLACK
    ids, mask = _padded(seed=3, units=2)  # (2, 60)

    def recorded(n):
        cache = cca_hf.HFCCACache(model.config)
        cache.activate_past_recording()
        model(ids[:, :n], attention_mask=mask[:, :n], past_key_values=cache)
        return cache

    steps = functools.partial(_steps, model, ids, mask)
    cache = recorded(20)
    layer = cache.layers[0]
    assert layer.slack == slack and layer.win_k.shape[2] == S + G - 1 + slack and layer.grp_k.shape[2] == G + slack
    hole = mask[:, :27].clone()
    hole[1, 24] = 0  # a pad column inside the pass, cropped away
    passed = model(ids[:, 20:27], attention_mask=hole, past_key_values=cache).logits
    full = model(ids[:1, :27], use_cache=False).logits  # (row 0: no pads)
    torch.testing.assert_close(passed[:1], full[:, 20:27], atol=1e-4, rtol=1e-4)
    version, seen, bound = cache.state_version(), layer.seen.clone(), layer.max_seen
    cache.crop(-5)
    assert cache.state_version() == version and cache.get_seq_length() == 22
    assert layer.seen.tolist() == [seen[0] - 5, seen[1] - 4]  # row 1: one of the dropped columns was a pad
    assert layer.max_seen == bound - 4  # (the bound on every row's count drops by the fewest dropped)
    torch.testing.assert_close(steps(cache, 22, 30), steps(recorded(22), 22, 30), atol=1e-5, rtol=1e-5)
    # the prefill's own columns, and several passes at once (both within the slack)
    cache = recorded(30)
    model(ids[:, 30:33], attention_mask=mask[:, :33], past_key_values=cache)
    steps(cache, 33, 35)
    cache.crop(-9)  # 2 steps, the 3-token pass and 4 prefill columns
    torch.testing.assert_close(steps(cache, 26, 34), steps(recorded(26), 26, 34), atol=1e-5, rtol=1e-5)
    # a pass longer than the slack: undone as without it (restore + re-run)
    cache = recorded(20)
    model(ids[:, 20:20 + slack + 2], attention_mask=mask[:, :20 + slack + 2], past_key_values=cache)
    cache.crop(-3)
    n = 20 + slack - 1
    torch.testing.assert_close(steps(cache, n, n + 3), steps(recorded(n), n, n + 3), atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.slow
@pytest.mark.parametrize("kernels", [False, True])
def test_the_slack_changes_no_rounding(kernels, monkeypatch):
    """A cache recording its past from the start (assisted decoding: rings with the speculative slack) gives the
    logits of one that does not, bit for bit: a chunked prefill (chunks past the slack attend over the ring's
    visible positions in position order) and decode steps, on the PyTorch path and on the decode kernels."""
    _on_kernels(kernels, monkeypatch)
    from cca_convert.modeling import cache_cca as cache_mod
    from cca_convert.modeling import cca_hf
    _, model = _models(backend="auto" if kernels else "reference")
    slack = cache_mod.SPECULATIVE_SLACK
    ids, mask = _padded(seed=6, units=4)  # (2, 120)
    cuts = (0, 20, 20 + slack + 3, 20 + 2 * slack + 7)  # a prefill, then two chunks longer than the slack
    runs = []
    for record in (False, True):
        cache = cca_hf.HFCCACache(model.config)
        if record:
            cache.activate_past_recording()
        logits = [model(ids[:, a:b], attention_mask=mask[:, :b], past_key_values=cache).logits
                  for a, b in zip(cuts, cuts[1:])]
        logits.append(_steps(model, ids, mask, cache, cuts[-1], cuts[-1] + 12))
        assert cache.layers[0].slack == (slack if record else 0)
        runs.append(torch.cat(logits, 1))
    real = mask[:, : cuts[-1] + 12].bool()
    assert torch.equal(runs[0][real], runs[1][real])


@torch.no_grad()
@pytest.mark.slow
@pytest.mark.parametrize("kernels", [False, True])
def test_recording_announced_after_the_prefill_relays_the_rings(kernels, monkeypatch):
    """generate()'s deferred stopping check calls ``activate_past_recording`` after the prefill, then crops once with
    no copies. A filled layer then re-lays its rings with the slack. Its steps give the numbers of the layer that
    never did (bit for bit on the decode kernels), with pads and the group middles the old rings held. Crops of the
    later steps are done in place, after which the steps give what a run that never saw the dropped columns gives."""
    _on_kernels(kernels, monkeypatch)
    from cca_convert.modeling import cache_cca as cache_mod
    from cca_convert.modeling import cca_hf
    _, model = _models(backend="auto" if kernels else "reference")
    slack = cache_mod.SPECULATIVE_SLACK
    ids, mask = _padded(seed=5, units=2)  # (2, 60)
    mask[0, 30] = 0  # a pad column among the steps
    steps = functools.partial(_steps, model, ids, mask)

    def prefilled(n, steps_before=0):
        cache = cca_hf.HFCCACache(model.config)
        model(ids[:, :n], attention_mask=mask[:, :n], past_key_values=cache)
        if steps_before:
            steps(cache, n, n + steps_before)
        return cache

    for n, before in ((21, 0), (18, 5)):  # the current group's middle already seen, or not yet (g=4: at 2 mod 4)
        plain, relaid = prefilled(n, before), prefilled(n, before)
        relaid.activate_past_recording()
        layer = relaid.layers[0]
        assert layer.record_past and layer.slack == slack
        assert layer.win_k.shape[2] == S + G - 1 + slack and layer.grp_k.shape[2] == G + slack
        assert layer.mid_cos.shape[1] == slack // G + 2
        start = n + before
        want = steps(plain, start, start + 20)
        with monkeypatch.context() as patch:
            patch.setattr(cache_mod.CCALayerCache, "_state", _no_copies)
            got = steps(relaid, start, start + 20)
            version = relaid.state_version()
            relaid.crop(-6)
        real = mask[:, start:start + 20].bool()  # (a pad column's logits are no token's)
        if kernels:
            assert torch.equal(got[real], want[real])
        else:
            torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
        assert relaid.state_version() == version and relaid.get_seq_length() == start + 14
        real = mask[:, start + 14:start + 24].bool()
        torch.testing.assert_close(steps(relaid, start + 14, start + 24)[real],
                                   steps(prefilled(n, before + 14), start + 14, start + 24)[real], atol=1e-5, rtol=1e-5)


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
    # a crop that keeps one column of the pass: that column is re-run alone (its q came rotated only, as a chunk's)
    cache1 = model(ids[:, :20], use_cache=True).past_key_values
    model(ids[:, 20:27], past_key_values=cache1)
    cache1.crop(-6)
    torch.testing.assert_close(model(ids[:, 21:22], past_key_values=cache1).logits,
                               model(ids[:, :22], use_cache=False).logits[:, -1:], atol=1e-5, rtol=1e-5)
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
    lookup = model.generate(prompt, prompt_lookup_num_tokens=5, return_dict_in_generate=True, **kw)
    assert torch.equal(lookup.sequences, greedy)
    graphs = lookup.past_key_values.decode_graphs  # verification passes were captured and replayed
    assert graphs.failure is None and graphs.replays > 0 and any(n > 1 for _, n in graphs.captured)
    assert torch.equal(model.generate(prompt, assistant_model=base, **kw), greedy)


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_verification_passes_give_the_one_token_steps_logits_bit_for_bit():
    """bf16, CUDA graphs: a captured verification pass of n tokens (replayed after in-place crops) gives bit for bit the
    logits of the n captured one-token steps it stands for, from the same cache state: every product of the step
    (Triton few-row products, lm_head included) rounds each row alike whatever the rows, so speculative decoding picks
    the greedy tokens even at near ties. A 300-token prompt: the prefill's kept tail is offset in the rings."""
    from cca_convert.modeling import cca_hf
    base = tiny_base_model("llama", max_position_embeddings=512, pad_token_id=0, eos_token_id=2)
    model = cca_hf_model_from(base, group_size=G, local_window=S, attn_backend="triton").to("cuda", torch.bfloat16)
    ids = torch.randint(3, 96, (1, 311), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)

    def recorded():
        cache = cca_hf.HFCCACache(model.config)
        cache.activate_past_recording()
        model(ids[:, :300], attention_mask=mask[:, :300], past_key_values=cache, use_cache=True)
        return cache

    steps, passes = recorded(), recorded()
    for _ in range(3):  # capture, then replays after in-place crops
        one = torch.cat([model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], past_key_values=steps,
                               use_cache=True).logits for i in range(300, 311)], 1)
        steps.crop(-11)
        many = model(ids[:, 300:311], attention_mask=mask, past_key_values=passes, use_cache=True).logits
        passes.crop(-11)
        assert torch.equal(one, many)
    assert steps.decode_graphs.replays >= 22 and passes.decode_graphs.replays >= 2
    assert steps.state_version() == steps.decode_graphs.captured[(1, 1)].version  # the crops replaced nothing
    # generate(): plain greedy (no slack in the rings) and prompt lookup (slack) split the decode kernel's work alike
    kw = dict(max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True)
    prompt = torch.cat([ids[:, :150]] * 2, 1)
    assert torch.equal(model.generate(prompt, prompt_lookup_num_tokens=10, **kw), model.generate(prompt, **kw))
