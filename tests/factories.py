"""Tiny random base checkpoints (Llama with GQA, Qwen2 with q/k/v bias) created inside tests."""

from pathlib import Path

import torch
import transformers

LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}


def tiny_config(family: str = "llama", **overrides):
    common = dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, use_cache=False,
    )
    common.update(overrides)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common)


def tiny_base_model(family: str = "llama", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    cls = transformers.Qwen2ForCausalLM if family == "qwen2" else transformers.LlamaForCausalLM
    model = cls(config).eval()
    if family == "qwen2":  # random biases, so that a dropped or misplaced bias shows
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def tiny_tokenizer(vocab_size: int = 96):
    """A character-level tokenizer whose ids fit the tiny models' vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    chars = list(" abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'-\n")
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>"] + chars[: vocab_size - 3])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def save_base(path: Path, family: str = "llama", **overrides) -> Path:
    model = tiny_base_model(family, bos_token_id=1, eos_token_id=2, **overrides)
    model.save_pretrained(path)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


def cca_config_from(base_config, **cca):
    from cca_convert import published

    fields = {k: v for k, v in base_config.to_dict().items() if k not in ("model_type", "architectures")}
    for key in ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"):
        fields.pop(key, None)
    if base_config.model_type == "qwen2":
        fields.update(attention_bias=True, attention_out_bias=False)
    return published.load("configuration_cca").CCAConfig(**fields, base_model_type=base_config.model_type, **cca)


def cca_model_from(base_model, **cca):
    from cca_convert import published

    config = cca_config_from(base_model.config, **cca)
    model = published.load("modeling_cca").CCAForCausalLM(config).eval()
    model.load_state_dict(base_model.state_dict(), strict=True)
    return model
