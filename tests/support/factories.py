"""Tiny random base checkpoints of every supported family, built from transformers' own configs inside tests."""

from pathlib import Path

import torch
import transformers

LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}


# Test-shape choices per family (sizes of a tiny checkpoint, not family rules: those live in families.py).
TINY = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "mistral": dict(sliding_window=None),
    "gemma3_text": dict(num_hidden_layers=3, sliding_window=16, layer_types=["sliding_attention", "full_attention",
                        "sliding_attention"], query_pre_attn_scalar=24, head_dim=16),
}
# Variants of a family that take a different path through the converter.
VARIANTS = {
    "llama-tied-llama3": ("llama", dict(tie_word_embeddings=True, rope_parameters=None, rope_scaling=None)),
    "mistral-swa": ("mistral", dict(sliding_window=48)),
    "qwen2-window-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    # every layer slides (as Mistral's): CCA replaces the window on every layer; Gemma 3's keep their local RoPE
    "qwen2-all-window": ("qwen2", dict(use_sliding_window=True, sliding_window=48, max_window_layers=0)),
    "gemma3-all-local": ("gemma3_text", dict(sliding_window=48, layer_types=["sliding_attention"] * 3)),
}


def family_and_overrides(name: str) -> tuple[str, dict]:
    if name in VARIANTS:
        family, extra = VARIANTS[name]
        if name == "llama-tied-llama3":
            extra = dict(tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE))
        return family, dict(TINY.get(family, {}), **extra)
    return name, dict(TINY.get(name, {}))


def tiny_config(family: str = "llama", **overrides):
    common = dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, use_cache=False,
    )
    common.update(overrides)
    config = transformers.AutoConfig.for_model(family, **common)
    if config.pad_token_id is not None and config.pad_token_id >= config.vocab_size:  # Phi-3's default: 32000
        config.pad_token_id = 0
    return config


def tiny_base_model(family: str = "llama", seed: int = 0, **overrides):
    from cca_convert.families import FAMILIES

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    config._attn_implementation = "sdpa"
    model = getattr(transformers, FAMILIES[family].causal_lm)(config).eval()
    with torch.no_grad():  # stock inits leave norms at exactly 1 and biases at 0: a dropped norm or bias must show
        for name, p in model.named_parameters():
            if p.dim() < 2 and family != "llama":  # (Llama's tests predate this and pin numbers)
                p.copy_(p + torch.randn_like(p) * 0.2)
    return model


def tiny_tokenizer(vocab_size: int = 96):
    """A character-level tokenizer whose ids fit the tiny models' vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(" abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'-\n")
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>"] + chars[: vocab_size - 3])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def save_base(path: Path, family: str = "llama", **overrides) -> Path:
    model = tiny_base_model(family, **{"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **overrides})
    model.save_pretrained(path)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


def cca_config_from(base_config, **cca):
    """A config of the first releases' model_type "cca" class (``tests/legacy``: the frozen reference)."""
    from tests.legacy import configuration_cca

    fields = {k: v for k, v in base_config.to_dict().items() if k not in ("model_type", "architectures")}
    for key in ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"):
        fields.pop(key, None)
    if base_config.model_type == "qwen2":
        fields.update(attention_bias=True, attention_out_bias=False)
    return configuration_cca.CCAConfig(**fields, base_model_type=base_config.model_type, **cca)


def cca_model_from(base_model, **cca):
    from tests.legacy import modeling_cca

    config = cca_config_from(base_model.config, **cca)
    model = modeling_cca.CCAForCausalLM(config).eval()
    model.load_state_dict(base_model.state_dict(), strict=True)
    return model


def cca_hf_model_from(base_model, **cca):
    """The model the CLI exports for ``base_model`` (its family's stock class with CCA), same weights; ``cca`` takes
    group_size / local_window / pooling / attn_backend."""
    import copy

    from cca_convert import methods, published
    from cca_convert.families import FAMILIES

    config = copy.deepcopy(base_model.config)
    for key, value in cca.items():
        setattr(config, f"cca_{key}", value)
    config._attn_implementation = "cca"
    model = published.family_class(FAMILIES[config.model_type], methods.get("cca"))(config).eval()
    model.load_state_dict(base_model.state_dict(), strict=True)
    return model


def save_sparse_checkpoint(path: Path, family: str = "llama", **config) -> Path:
    """A full-size checkpoint whose weight file has real safetensors headers and no data pages (a sparse file):
    what the preflight reads of an 8B model, in seconds and without its 16 GB. Loading it would give zeros."""
    import json
    import struct

    path.mkdir(parents=True, exist_ok=True)
    cfg = transformers.AutoConfig.for_model(family, **config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    header, offset = {}, 0
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        size = tensor.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # the data: a hole, no pages written
    cfg.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


LLAMA31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=128000, eos_token_id=128001, dtype="bfloat16",
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)


# Text for the data stages: learnable documents, a character-level tokenizer
WORDS = ("the lord spake unto moses saying speak unto the children of israel and say unto them "
         "when any man of you bring an offering unto the lord ye shall bring your offering of the cattle").split()
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]


def write_text(path: Path, n_docs: int = 6, words: int = 300, seed: int = 0) -> Path:
    """Docs separated by blank lines, drawn from a tiny bigram-ish process (learnable in a few steps)."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n_docs):
        i = int(torch.randint(len(WORDS), (1,), generator=g))
        out = []
        for _ in range(words):
            out.append(WORDS[i])
            i = (i + 1) % len(WORDS) if torch.rand(1, generator=g) < 0.9 else int(torch.randint(len(WORDS), (1,), generator=g))
        docs.append(" ".join(out) + ".")
    path.write_text("\n\n".join(docs) + "\n")
    return path


def char_tokenizer():
    """A character-level fast tokenizer (99 ids: <unk>, <s>, </s>, then printable ASCII and newline)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def sample_text(seed: int, n_chars: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    words = ["the", "grass", "light", "of", "and", "unto", "them", "said", "he", "city", "water", "stone", "day"]
    out = []
    while sum(len(w) + 1 for w in out) < n_chars:
        out.append(words[torch.randint(len(words), (1,), generator=gen).item()])
    return " ".join(out) + ".\n"


# Multimodal checkpoints (the Hub's layout) whose language model a family converts: the text family, the multimodal
# config class, its vision config (tiny) and the config's own keyword arguments.
MULTIMODAL = {
    "gemma3": ("gemma3_text", "Gemma3Config", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                   num_attention_heads=2, image_size=28, patch_size=14),
               dict(mm_tokens_per_image=4, image_token_index=95, boi_token_index=93, eoi_token_index=94)),
    "mistral3": ("mistral", "Mistral3Config", dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=1, num_attention_heads=2, image_size=28,
                                                   patch_size=14, head_dim=16),
                 dict(image_token_index=95, spatial_merge_size=2, tie_word_embeddings=False)),  # its own lm_head
}


def save_multimodal(path: Path, kind: str = "gemma3", seed: int = 0) -> Path:
    """A tiny multimodal checkpoint of ``kind`` (``MULTIMODAL``: Gemma 3 4B-27B's ``Gemma3ForConditionalGeneration``,
    Mistral Small 3.1's ``Mistral3ForConditionalGeneration``: a language model, a vision tower, a projector) with the
    tiny tokenizer; returns ``path``."""
    text_type, config_cls, vision, extra = MULTIMODAL[kind]
    torch.manual_seed(seed)
    text = tiny_config(text_type, **TINY.get(text_type, {}), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = getattr(transformers, config_cls)(text_config=text.to_dict(), vision_config=vision, **extra)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():  # as tiny_base_model: norms and biases away from their inits
        for name, p in model.named_parameters():
            if p.dim() < 2:
                p.copy_(p + torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    tiny_tokenizer(text.vocab_size).save_pretrained(path)
    return path
