"""Model-level training parity: the whole CCA model's loss and the gradients of every trainable parameter,
``attn_backend="triton"`` (what ``auto`` picks on CUDA) vs ``"reference"``, driven as the finetune drives it:
``model.train()``, batches > 1, labels, optional padding mask, autocast, gradient checkpointing, LoRA.

A kernel test proves the kernel; this proves the model that calls it. The kernel tests passed while the
model fed the kernels rotary tables shaped (1, L, d) at batch > 1 and trained on garbage: only a test at
this level catches that kind of fault.

CPU: the Triton kernels under ``TRITON_INTERPRET=1`` at tiny shapes. GPU (``-m gpu``): the combinations of
the finetune (micro-batch 1/2/8, pure bf16, fp32 weights under bf16 autocast, fp16, GQA ratios, both
poolings, head dims 64/80/128, checkpointing on/off, LoRA on q/k/v, padded batches).
"""

import contextlib

import pytest
import torch

from tests.support.factories import TINY, cca_hf_model_from, tiny_base_model
from tests.support.triton_env import triton_device

INTERPRET, HAS_CUDA, DEVICE = triton_device("the Triton backend")


def make_model(heads, kv_heads, head_dim, g, s, pooling, layers=2, seed=0, family="llama"):
    """The model the CLI exports (the family's stock class with CCA) on a tiny random checkpoint."""
    shape = dict(TINY.get(family, {}))
    shape.update(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                 head_dim=head_dim, num_hidden_layers=layers, intermediate_size=2 * heads * head_dim, vocab_size=96,
                 max_position_embeddings=4096)
    if "layer_types" in shape:  # Gemma 3: local and global layers alternate
        shape["layer_types"] = (["sliding_attention", "full_attention"] * layers)[:layers]
    base = tiny_base_model(family, seed=seed, **shape)
    return cca_hf_model_from(base, group_size=g, local_window=s, pooling=pooling, attn_backend="reference")


def make_batch(bsz, length, pad, seed=1, vocab=96):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (bsz, length), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if pad:  # right padding (packing off): row b keeps length - 7*b real tokens
        mask = torch.ones_like(ids)
        for b in range(bsz):
            mask[b, max(2, length - 7 * b):] = 0
        batch["attention_mask"] = mask
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    return batch


def loss_and_grads(model, backend, batch, dtype, mode, checkpointing, lora):
    """One training micro-step as ``finetune/trainer.py`` runs it; returns the loss and {name: grad}."""
    import copy

    from cca_convert.finetune.config import FinetuneSection
    from cca_convert.finetune.trainer import prepare_trainable

    model = copy.deepcopy(model)
    model.config.cca_attn_backend = backend
    if mode == "pure":  # weights and compute in dtype
        model = model.to(dtype)
    torch.manual_seed(3)
    ft = FinetuneSection(method="lora" if lora else "qkv", gradient_checkpointing=checkpointing,
                         lora={"r": 4, "alpha": 8})
    model = prepare_trainable(model, ft, upcast=False)  # the finetune's own freezing / LoRA wrapping
    for name, p in model.named_parameters():  # LoRA B starts at 0: give it values so that dA is not 0
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    model.to(DEVICE)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    amp = torch.autocast(DEVICE, dtype=dtype) if mode == "autocast" else contextlib.nullcontext()
    with amp:
        loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    return loss.detach().float().cpu(), grads


def compare_training(model, batch, dtype=torch.float32, mode="pure", checkpointing=False, lora=False):
    """Triton vs reference at the same precision, both against the reference in fp32 (FlashAttention-style:
    the kernel's error is at most ~2x that of the reference run at the low precision). Asserts the loss and finite
    gradients; returns the worst gradient's error / limit and a message naming it."""
    got = loss_and_grads(model, "triton", batch, dtype, mode, checkpointing, lora)
    want = loss_and_grads(model, "reference", batch, dtype, mode, checkpointing, lora)
    exact = loss_and_grads(model, "reference", batch, torch.float32, "pure", checkpointing, lora)
    assert torch.isfinite(got[0]), f"triton loss {got[0]}"
    tol_loss = 1e-5 if dtype == torch.float32 else 2 * (want[0] - exact[0]).abs().item() + 1e-2 * exact[0].item()
    assert (got[0] - want[0]).abs().item() <= tol_loss, f"loss triton {got[0]:.6f} vs reference {want[0]:.6f}"
    worst = (0.0, "")
    for name, g_ref in want[1].items():
        g_tri, g_exact = got[1][name], exact[1][name]
        assert torch.isfinite(g_tri).all(), f"{name}: non-finite gradient"
        scale = g_exact.abs().max().item() + 1e-12
        err = (g_tri - g_exact).abs().max().item() / scale
        ref_err = (g_ref - g_exact).abs().max().item() / scale
        limit = 2e-4 if dtype == torch.float32 else 2 * ref_err + 2e-2
        if err / limit > worst[0]:
            worst = (err / limit, f"{name}: triton rel err {err:.2e} vs reference-in-{dtype} {ref_err:.2e} "
                                  f"(limit {limit:.2e})")
    return worst


def assert_same_training(model, batch, dtype=torch.float32, mode="pure", checkpointing=False, lora=False):
    ratio, message = compare_training(model, batch, dtype, mode, checkpointing, lora)
    assert ratio <= 1, message


# ---------------------------------------------------------------------------------------------------- CPU (interpreter)
@pytest.mark.skipif(not INTERPRET, reason="CPU variant: runs the kernels in Triton's interpreter")
@pytest.mark.parametrize("bsz,pad,pooling", [(2, False, "kv"), (3, True, "query")])
def test_training_step_matches_reference_interpreted(bsz, pad, pooling):
    # L = 45: not a multiple of g = 4, > s = 8, so core tokens, groups and raw windows all take part.
    model = make_model(heads=4, kv_heads=2, head_dim=16, g=4, s=8, pooling=pooling)
    assert_same_training(model, make_batch(bsz, 45, pad))


@pytest.mark.skipif(not INTERPRET, reason="CPU variant: runs the kernels in Triton's interpreter")
def test_lora_training_step_matches_reference_interpreted():
    model = make_model(heads=4, kv_heads=1, head_dim=16, g=5, s=8, pooling="kv", layers=1)
    assert_same_training(model, make_batch(2, 37, pad=False), lora=True, checkpointing=True)


@pytest.mark.skipif(not INTERPRET, reason="CPU variant: runs the kernels in Triton's interpreter")
def test_training_step_under_bf16_autocast_interpreted():
    # fp32 weights under bf16 autocast, as the finetune runs on CUDA: the family's RoPE hands the attention fp32
    # q/k beside a bf16 v (the kernels refused the mix on the GPU until the attention function unified them).
    # Only the loss is compared here: the interpreter's bf16 backward arithmetic overflows (the first releases'
    # model shows the same 1e9 gradients there); the GPU variants compare every gradient.
    model = make_model(heads=4, kv_heads=2, head_dim=16, g=4, s=8, pooling="kv")
    batch = make_batch(2, 37, pad=False)
    got = loss_and_grads(model, "triton", batch, torch.bfloat16, "autocast", False, False)[0]
    want = loss_and_grads(model, "reference", batch, torch.bfloat16, "autocast", False, False)[0]
    assert torch.isfinite(got) and (got - want).abs() <= 1e-2 * want.abs(), (got, want)


@pytest.mark.skipif(not INTERPRET, reason="CPU variant: runs the kernels in Triton's interpreter")
@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma3_text"])
def test_family_training_step_matches_reference_interpreted(family):
    # q/k-norm (Qwen3), fused qkv_proj (Phi-3), local + global layers with query_pre_attn_scalar (Gemma 3)
    model = make_model(heads=4, kv_heads=2, head_dim=16, g=4, s=8, pooling="kv", family=family)
    assert_same_training(model, make_batch(2, 41, pad=True))


# ---------------------------------------------------------------------------------------------------- GPU
GPU_SHAPES = {  # (heads, kv_heads, head_dim): GQA 4:1, MHA, 5:1 with hd 80, 7:1 (Qwen-like), hd 128
    "gqa4-d64": (8, 2, 64), "mha-d64": (4, 4, 64), "gqa5-d80": (10, 2, 80), "gqa7-d128": (7, 1, 128),
}
PRECISION = {"fp32": (torch.float32, "pure"), "bf16": (torch.bfloat16, "pure"),
             "amp-bf16": (torch.bfloat16, "autocast"), "fp16": (torch.float16, "pure")}


@pytest.mark.gpu
@pytest.mark.parametrize("bsz", [1, 2, 8])
@pytest.mark.parametrize("precision", list(PRECISION))
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("pooling", ["kv", "query"])
def test_training_step_matches_reference_gpu(bsz, precision, shape, pooling):
    heads, kv, hd = GPU_SHAPES[shape]
    dtype, mode = PRECISION[precision]
    model = make_model(heads, kv, hd, g=16, s=64, pooling=pooling)
    assert_same_training(model, make_batch(bsz, 1000, pad=False), dtype, mode)  # 1000 % 16 != 0


@pytest.mark.gpu
@pytest.mark.parametrize("bsz", [2, 8])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("pad", [False, True])
def test_training_step_finetune_modes_gpu(bsz, checkpointing, lora, pad):
    model = make_model(8, 2, 64, g=8, s=128, pooling="kv")
    assert_same_training(model, make_batch(bsz, 777, pad), torch.bfloat16, "autocast", checkpointing, lora)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "phi3", "olmo2", "gemma3_text"])
@pytest.mark.parametrize("lora", [False, True])
def test_family_training_step_gpu(family, lora):
    # Three tiny checkpoints per family, the median held to the limit: the worst gradient's error is a heavy-tailed
    # statistic here. qwen2's q/k biases and LoRA-A are sums over every position of dq/dk; over 16 checkpoints with
    # and without LoRA the Triton and the Gluon forward each went past the limit on 2-3 of the 32 (up to 1.7x), mean
    # 0.70 for both (benchmarks/gradient_sweep.py). A fault moves every checkpoint; none may pass twice the limit.
    batch = make_batch(4, 777, pad=True)
    models = (make_model(8, 2, 64, g=8, s=128, pooling="kv", family=family, seed=seed) for seed in range(3))
    results = sorted(compare_training(model, batch, torch.bfloat16, "autocast", False, lora) for model in models)
    assert results[1][0] <= 1, f"2 of 3 checkpoints past the limit; the median one: {results[1][1]}"
    assert results[2][0] <= 2, f"past twice the limit: {results[2][1]}"
