"""What client code does with an exported repo (a Llama and a Qwen3 export, loaded as users load them): pipelines,
generate variants, model outputs, training utilities, peft, save/reload, compile, device_map. Each convention is
either honoured exactly like the stock model or refused with an error naming the way out — never silently wrong."""

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from cca_convert.cli import main
from tests.support.factories import save_base

RECIPE = """
cca: {group_size: 4, local_window: 8}
export: {dtype: float32, roundtrip_tokens: 40}
validate: {enabled: false}
"""


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def export(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"client-{request.param}")
    base = save_base(root / "base", family=request.param)
    (root / "recipe.yaml").write_text(RECIPE)
    assert main([str(base), "--recipe", str(root / "recipe.yaml"), "--output", str(root / "out")]) == 0
    return base, root / "out"


def load(out, **kw):
    return AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, **kw).eval()


def ids(bsz=2, length=30, seed=0):
    return torch.randint(3, 96, (bsz, length), generator=torch.Generator().manual_seed(seed))


def test_pipeline_text_generation(export):
    _, out = export
    pipe = transformers.pipeline("text-generation", model=str(out), trust_remote_code=True, device="cpu")
    text = pipe("the quick brown fox", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text.startswith("the quick brown fox") and len(text) > len("the quick brown fox")
    assert type(pipe.model).__name__.startswith("CCA")


def test_tokenizer_loads_without_remote_code(export):
    _, out = export
    assert AutoTokenizer.from_pretrained(out)("abc").input_ids  # no trust_remote_code prompt: stock model_type


def test_generate_greedy_sampling_beam(export):
    _, out = export
    model, x = load(out), ids()
    greedy = model.generate(x, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert greedy.shape == (2, 40) and torch.equal(greedy, model.generate(x, max_new_tokens=10, do_sample=False,
                                                                           pad_token_id=0))
    torch.manual_seed(0)
    sampled = model.generate(x, max_new_tokens=10, do_sample=True, top_k=20, temperature=0.8, pad_token_id=0)
    assert sampled.shape == (2, 40)
    beams = model.generate(x, max_new_tokens=10, num_beams=3, do_sample=False, pad_token_id=0, early_stopping=True)
    assert beams.shape[0] == 2 and torch.equal(beams[:, :30], x)
    # beam search over the compressed cache == beam search recomputing everything (no cache)
    no_cache = model.generate(x, max_new_tokens=10, num_beams=3, do_sample=False, pad_token_id=0, use_cache=False,
                              early_stopping=True)
    assert torch.equal(beams, no_cache)


def test_outputs_hidden_states_return_dict_labels_embeds_logits_to_keep(export):
    _, out = export
    model, x = load(out), ids()
    with torch.no_grad():
        res = model(x, output_hidden_states=True, use_cache=False)
        assert len(res.hidden_states) == model.config.num_hidden_layers + 1
        assert all(h.shape == (2, 30, model.config.hidden_size) for h in res.hidden_states)
        tup = model(x, return_dict=False, use_cache=False)
        assert isinstance(tup, tuple) and torch.equal(tup[0], res.logits)
        loss = model(x, labels=x, use_cache=False).loss
        ref = torch.nn.functional.cross_entropy(res.logits[:, :-1].reshape(-1, res.logits.shape[-1]), x[:, 1:].reshape(-1))
        torch.testing.assert_close(loss, ref)
        emb = model(inputs_embeds=model.get_input_embeddings()(x), use_cache=False).logits
        torch.testing.assert_close(emb, res.logits)
        last = model(x, logits_to_keep=1, use_cache=False).logits
        torch.testing.assert_close(last[:, 0], res.logits[:, -1])


def test_refusals_name_the_way_out(export):
    _, out = export
    model, x = load(out), ids()
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        model(x, output_attentions=True)
    mask4d = torch.ones(2, 1, 30, 30, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="2-D padding mask"):
        model(x, attention_mask=mask4d, use_cache=False)


def test_eager_and_sdpa_run_the_base_attention(export):
    base, out = export
    x = ids()
    stock = AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        want = stock(x, use_cache=False).logits
        for impl in ("sdpa", "eager"):
            model = load(out, attn_implementation=impl)
            assert model.config._attn_implementation == impl
            torch.testing.assert_close(model(x, use_cache=False).logits, want, atol=1e-5, rtol=1e-5)
            attn = model(x, output_attentions=True, use_cache=False).attentions if impl == "eager" else None
            assert impl == "sdpa" or len(attn) == model.config.num_hidden_layers


def test_gradient_checkpointing_matches_and_peft_lora_trains(export):
    _, out = export
    x = ids()
    grads = []
    for ckpt in (False, True):
        model = load(out).train()
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(x, labels=x).loss.backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)

    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(load(out), LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"]))
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        loss = lora(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_save_pretrained_round_trip_and_overrides(export, tmp_path):
    _, out = export
    model, x = load(out, cca_local_window=16), ids()
    model.save_pretrained(tmp_path / "again")
    again = load(tmp_path / "again")
    assert again.config.cca_local_window == 16 and type(again).__name__ == type(model).__name__
    with torch.no_grad():
        torch.testing.assert_close(again(x, use_cache=False).logits, model(x, use_cache=False).logits)


def test_torch_compile_and_device_map(export):
    _, out = export
    model, x = load(out, device_map="auto"), ids()
    with torch.no_grad():
        want = model(x, use_cache=False).logits
        compiled = torch.compile(model, backend="eager")  # traces the forward (no C compiler needed in CI)
        torch.testing.assert_close(compiled(x, use_cache=False).logits, want)
